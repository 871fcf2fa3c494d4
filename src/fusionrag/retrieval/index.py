"""Exact inner-product vector index over unit vectors (cosine similarity), keyed by chunk id.

FAISS ``IndexFlatIP`` (exact search; a knowledge base of the size we preprocess on a CPU
does not need an approximate index), wrapped in ``IndexIDMap2`` so that results are
chunk ids and a chunk's own vector can be read back for neighbour search. Saved with
``faiss.write_index`` (no pickle), through a temp file and an atomic rename.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import faiss
import numpy as np

from fusionrag.errors import FusionRAGError
from fusionrag.files import atomic_write_with


class VectorIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def __len__(self) -> int:
        return int(self.index.ntotal)

    # ------------------------------------------------------------ content

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if len(ids) != vectors.shape[0]:
            raise ValueError(f"{len(ids)} ids for {vectors.shape[0]} vectors")
        if len(ids):
            self.index.add_with_ids(vectors, np.asarray(ids, dtype=np.int64))

    def remove(self, ids: Sequence[int]) -> int:
        """Drop these chunk ids from the index; returns how many were present."""
        if not len(ids):
            return 0
        return int(self.index.remove_ids(np.asarray(list(ids), dtype=np.int64)))

    def ids(self) -> list[int]:
        return faiss.vector_to_array(self.index.id_map).astype(np.int64).tolist()

    def vector(self, chunk_id: int) -> np.ndarray:
        try:
            return self.index.reconstruct(int(chunk_id))
        except RuntimeError as exc:
            raise KeyError(chunk_id) from exc

    def vectors(self, chunk_ids: Iterable[int]) -> np.ndarray:
        ids = list(chunk_ids)
        if not ids:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self.vector(i) for i in ids])

    # ------------------------------------------------------------ queries

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, ids)``, each ``[n, k]``, best first; ids are -1 where fewer than ``k`` exist."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        k = max(0, int(k))
        if k == 0 or len(self) == 0:
            return (np.zeros((vectors.shape[0], k), dtype=np.float32),
                    np.full((vectors.shape[0], k), -1, dtype=np.int64))
        return self.index.search(vectors, k)

    def neighbours(self, chunk_id: int, n: int, among: Iterable[int] | None = None) -> list[int]:
        """The ``n`` chunks most similar to ``chunk_id``, most similar first, never itself.

        ``among`` limits the candidates (e.g. to the chunk's document group).
        """
        return self.neighbours_many([chunk_id], n, among=None if among is None else {chunk_id: among})[chunk_id]

    def neighbours_many(self, chunk_ids: Sequence[int], n: int,
                        among: dict[int, Iterable[int]] | None = None) -> dict[int, list[int]]:
        """:meth:`neighbours` for many chunks; one batched FAISS search when unrestricted.

        Ties are broken by chunk id so that the lists are reproducible (incremental
        updates compare them to decide what to re-fuse).
        """
        out: dict[int, list[int]] = {}
        if n <= 0 or not chunk_ids:
            return {int(c): [] for c in chunk_ids}
        if among is None:
            queries = self.vectors(chunk_ids)
            # A few extra hits: the chunk itself, and room to order exact ties stably.
            k = min(len(self), n + 1 + 8)
            scores, ids = self.search(queries, k)
            for row, cid in enumerate(chunk_ids):
                pairs = [(float(s), int(i)) for s, i in zip(scores[row], ids[row], strict=True)
                         if i >= 0 and int(i) != int(cid)]
                out[int(cid)] = _top(pairs, n)
            return out
        for cid in chunk_ids:
            cands = [int(c) for c in among.get(int(cid), []) if int(c) != int(cid)]
            if not cands:
                out[int(cid)] = []
                continue
            sims = self.vectors(cands) @ self.vector(cid)
            out[int(cid)] = _top(list(zip(sims.tolist(), cands, strict=True)), n)
        return out

    # ------------------------------------------------------------ persistence

    def save(self, path: Path) -> None:
        atomic_write_with(path, lambda tmp: faiss.write_index(self.index, str(tmp)))

    @classmethod
    def load(cls, path: Path, dim: int) -> VectorIndex:
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as exc:
            raise FusionRAGError(f"cannot read vector index {path}: {str(exc).splitlines()[0]}") from exc
        if index.d != dim:
            raise FusionRAGError(f"vector index {path} has dimension {index.d}, expected {dim}")
        obj = cls.__new__(cls)
        obj.dim = dim
        obj.index = faiss.downcast_index(index) if not isinstance(index, faiss.IndexIDMap2) else index
        if not isinstance(obj.index, faiss.IndexIDMap2):
            raise FusionRAGError(f"vector index {path} is not an id-mapped flat index")
        return obj


def _top(pairs: list[tuple[float, int]], n: int) -> list[int]:
    # Round the scores so float noise does not decide between equally similar chunks.
    pairs.sort(key=lambda p: (-round(p[0], 5), p[1]))
    return [i for _, i in pairs[:n]]
