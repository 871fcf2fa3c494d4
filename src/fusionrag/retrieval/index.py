"""Inner-product vector index over unit vectors (cosine similarity), keyed by chunk id.

The source of truth is an exact FAISS ``IndexFlatIP`` wrapped in ``IndexIDMap2`` (results are
chunk ids; a chunk's own vector can be read back for neighbour search; removal works).
Exact search is a scan of every vector: fine for the knowledge bases preprocessed here,
O(N) per query and O(N^2) for the offline stage's all-pairs neighbour lists at a million
chunks. So once the index holds ``approx_threshold`` vectors (default
:data:`APPROX_THRESHOLD`), searches go through an HNSW graph built over the same vectors
(``IndexHNSWFlat``; measured in ``benchmarks/ann/results``: recall@10 and query time at 100K and
1M against exact search). The graph is built lazily on the first search after a change
that it cannot absorb (adds are absorbed; a removal means a rebuild). Below the threshold
every result is exact, as before.

Saved with ``faiss.write_index`` (no pickle), through a temp file and an atomic rename; the
HNSW graph goes next to it (``<name>.hnsw``) so a large store does not rebuild it on open.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import faiss
import numpy as np

from fusionrag.errors import FusionRAGError
from fusionrag.files import atomic_write_with

#: Vectors from which searches use the HNSW graph instead of an exact scan (decision 017).
APPROX_THRESHOLD = 50_000
#: HNSW parameters (benchmarks/ann/results): graph degree, build and search beam widths.
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 96


class VectorIndex:
    def __init__(self, dim: int, approx_threshold: int = APPROX_THRESHOLD) -> None:
        self.dim = dim
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.approx_threshold = approx_threshold
        self._hnsw: faiss.IndexHNSWFlat | None = None  # positions follow the id map's order
        self._hnsw_ids: np.ndarray | None = None

    @property
    def approximate(self) -> bool:
        """Whether searches go through the HNSW graph (the index is at or above the threshold)."""
        return len(self) >= self.approx_threshold

    def __len__(self) -> int:
        return int(self.index.ntotal)

    # ------------------------------------------------------------ content

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if len(ids) != vectors.shape[0]:
            raise ValueError(f"{len(ids)} ids for {vectors.shape[0]} vectors")
        if len(ids):
            self.index.add_with_ids(vectors, np.asarray(ids, dtype=np.int64))
            if self._hnsw is not None:  # the graph absorbs additions
                self._hnsw.add(vectors)
                self._hnsw_ids = np.concatenate([self._hnsw_ids, np.asarray(ids, dtype=np.int64)])

    def remove(self, ids: Sequence[int]) -> int:
        """Drop these chunk ids from the index; returns how many were present."""
        if not len(ids):
            return 0
        self._hnsw = self._hnsw_ids = None  # HNSW cannot remove: rebuilt at the next search
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
        if not self.approximate:
            return self.index.search(vectors, k)
        graph, ids = self.hnsw()
        scores, pos = graph.search(vectors, k)
        return scores, np.where(pos >= 0, ids[np.clip(pos, 0, None)], -1)

    def hnsw(self) -> tuple[faiss.IndexHNSWFlat, np.ndarray]:
        """The HNSW graph over the current vectors and its position -> chunk id map (built if needed)."""
        if self._hnsw is None or self._hnsw.ntotal != len(self):
            ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
            flat = faiss.downcast_index(self.index.index)
            graph = faiss.IndexHNSWFlat(self.dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            graph.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            graph.add(faiss.rev_swig_ptr(flat.get_xb(), len(self) * self.dim).reshape(len(self), self.dim))
            self._hnsw, self._hnsw_ids = graph, ids
        self._hnsw.hnsw.efSearch = HNSW_EF_SEARCH
        return self._hnsw, self._hnsw_ids

    def neighbours(self, chunk_id: int, n: int, among: Iterable[int] | None = None) -> list[int]:
        """The ``n`` chunks most similar to ``chunk_id``, most similar first, never itself.

        ``among`` limits the candidates (e.g. to the chunk's document group).
        """
        return self.neighbours_many([chunk_id], n, among=None if among is None else {chunk_id: among})[chunk_id]

    def neighbours_many(self, chunk_ids: Sequence[int], n: int,
                        among: dict[int, Iterable[int]] | None = None,
                        min_similarity: float | None = None) -> dict[int, list[int]]:
        """:meth:`neighbours` for many chunks; one batched FAISS search when unrestricted.

        ``among`` restricts each chunk's candidates; ``min_similarity`` keeps only neighbours at
        least that similar (inner product of the normalised embeddings), so a chunk in a sparse
        region of the corpus gets fewer (even no) neighbours instead of unrelated ones.
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
                out[int(cid)] = _top(pairs, n, min_similarity)
            return out
        for cid in chunk_ids:
            cands = [int(c) for c in among.get(int(cid), []) if int(c) != int(cid)]
            if not cands:
                out[int(cid)] = []
                continue
            sims = self.vectors(cands) @ self.vector(cid)
            out[int(cid)] = _top(list(zip(sims.tolist(), cands, strict=True)), n, min_similarity)
        return out

    # ------------------------------------------------------------ persistence

    def save(self, path: Path) -> None:
        atomic_write_with(path, lambda tmp: _write_index(self.index, tmp))
        side = _hnsw_path(path)
        if self._hnsw is not None and self.approximate:
            graph = self._hnsw
            atomic_write_with(side, lambda tmp: _write_index(graph, tmp))
        else:
            side.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path, dim: int, approx_threshold: int = APPROX_THRESHOLD) -> VectorIndex:
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
        obj.approx_threshold = approx_threshold
        obj._hnsw = obj._hnsw_ids = None
        obj._load_hnsw(_hnsw_path(path))
        return obj

    def _load_hnsw(self, side: Path) -> None:
        """Adopt the saved graph if it holds exactly the saved vectors, in order (else it is rebuilt when needed).

        The graph's positions are the id map's; a crash between the two writes could leave a graph of
        other vectors, so sampled positions are compared vector for vector before it is trusted.
        """
        if not side.is_file():
            return
        try:
            graph = faiss.read_index(str(side))  # already the concrete type (a downcast copy would not own it)
        except RuntimeError:
            return
        n = len(self)
        if not isinstance(graph, faiss.IndexHNSWFlat) or graph.ntotal != n or graph.d != self.dim or n == 0:
            return
        ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        for pos in {*np.linspace(0, n - 1, 17).astype(int).tolist()}:
            if not np.array_equal(graph.reconstruct(int(pos)), self.index.reconstruct(int(ids[pos]))):
                return
        self._hnsw, self._hnsw_ids = graph, ids


def _hnsw_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".hnsw")


def _top(pairs: list[tuple[float, int]], n: int, min_similarity: float | None = None) -> list[int]:
    if min_similarity is not None:
        pairs = [p for p in pairs if p[0] >= min_similarity]
    # Round the scores so float noise does not decide between equally similar chunks.
    pairs.sort(key=lambda p: (-round(p[0], 5), p[1]))
    return [i for _, i in pairs[:n]]


def _write_index(index, tmp: Path) -> None:
    """``faiss.write_index``, its write failures raised as the OSError they are (FAISS reports a full disk
    as a RuntimeError naming strerror), so the callers' storage-fault handling names them."""
    try:
        faiss.write_index(index, str(tmp))
    except RuntimeError as exc:
        text = str(exc)
        code = errno.ENOSPC if "No space left" in text else errno.EACCES if "ermission" in text else errno.EIO
        raise OSError(code, os.strerror(code), str(tmp)) from exc
