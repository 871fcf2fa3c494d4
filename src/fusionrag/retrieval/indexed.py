"""The vector-index operations of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore`.

A mixin, so the FAISS index stays private: retrieval (:meth:`search`), the offline stage's
neighbour lists (:meth:`neighbours`), embeddings (:meth:`vectors`), and keeping the index true
to SQLite (the source of truth: :meth:`load_index` rebuilds a missing, corrupted or stale index).
It expects ``self._db``, ``self._lock``, ``self._index``, ``self.path``, ``self.settings``,
``self.embedder`` and ``self.update_settings``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.index import VectorIndex
from fusionrag.retrieval.store_files import index_digest
from fusionrag.retrieval.store_info import INDEX_NAME, read_settings

log = logging.getLogger(__name__)


class IndexedChunks:
    """Search, neighbours and embeddings over the store's private vector index."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _index: VectorIndex
    path: Path
    settings: dict[str, Any]
    embedder: Any

    def update_settings(self, **values: Any) -> None: ...  # provided by KnowledgeStore


    def _save_index(self) -> None:
        """Write the index and record its digest and size in SQLite (verified on the next open).

        A read-only store keeps a rebuilt index in memory only."""
        if getattr(self, "read_only", False):
            return
        path = self.path / INDEX_NAME
        self._index.save(path)
        self.update_settings(index_sha256=index_digest(path), index_count=len(self._index))

    def rebuild_index(self) -> None:
        """Drop the index file and rebuild it from the SQLite embeddings (``store verify --repair``)."""
        with self._lock:
            (self.path / INDEX_NAME).unlink(missing_ok=True)
            self._index = self.load_index()

    def neighbours(self, chunk_ids: Sequence[int], top_n: int, among: dict[int, set[int]] | None = None,
                   min_similarity: float | None = None) -> dict[int, list[int]]:
        """Each chunk's ``top_n`` most similar chunks (never itself), optionally only ``among`` a set per
        chunk and at least ``min_similarity`` similar: what the offline stage fuses with."""
        return self._index.neighbours_many(list(chunk_ids), top_n, among=among, min_similarity=min_similarity)

    def indexed_chunks(self) -> int:
        """How many chunks the vector index holds (equals the chunk count unless a writer is mid-way)."""
        return len(self._index)

    def vectors(self, chunk_ids: Sequence[int]) -> np.ndarray:
        """The chunks' unit embeddings (rows in the order given)."""
        return self._index.vectors(list(chunk_ids))

    def load_index(self) -> VectorIndex:
        """The FAISS index, verified against SQLite (digest and vector count); rebuilt if it does not match.

        SQLite is the source of truth: a missing, corrupted, foreign or stale index (a crash
        between the two writes, an external writer) is rebuilt from the stored embeddings.
        """
        dim = int(self.settings["embedding_dim"])
        n = self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        path = self.path / INDEX_NAME
        recorded = read_settings(self._db)
        if path.is_file() and recorded.get("index_count") == n and recorded.get("index_sha256") == index_digest(path):
            try:
                return VectorIndex.load(path, dim)
            except FusionRAGError:
                pass
        if path.is_file():
            log.warning("index %s does not match the store's metadata; rebuilding it from SQLite", path)
        self._index = VectorIndex(dim)
        rows = self._db.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        if rows:
            self._index.add([r[0] for r in rows], np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows]))
        self._save_index()
        return self._index

    def search(self, query: str, k: int) -> list[int]:
        """Chunk ids ranked by similarity to ``query`` (at most ``k``)."""
        return [cid for cid, _ in self.search_scored(query, k)]

    def search_scored(self, query: str, k: int) -> list[tuple[int, float]]:
        """``(chunk id, cosine similarity)`` ranked by similarity to ``query`` (at most ``k``)."""
        if k <= 0 or len(self._index) == 0:
            return []
        scores, ids = self._index.search(self.embedder.embed([query]), min(k, len(self._index)))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]
