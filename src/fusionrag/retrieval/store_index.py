"""The vector index of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore`, kept true to SQLite.

``index.faiss`` is derived data: SQLite (the chunks' embeddings) is the source of truth. After
every save the file's sha256 and vector count are recorded in the store's settings; loading
verifies them, and a missing, corrupted, foreign or stale index (a crash between the two writes,
an external writer) is rebuilt from the stored embeddings. A read-only store keeps a rebuilt
index in memory only.

Vectors in, chunk ids out: retrieval (:meth:`StoreIndex.search`), the offline stage's neighbour
lists (:meth:`StoreIndex.neighbours`) and embeddings (:meth:`StoreIndex.vectors`). Embedding a
question is the store's (it owns the embedder).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.chunk_table import ChunkTable
from fusionrag.retrieval.index import VectorIndex
from fusionrag.retrieval.store_files import index_digest
from fusionrag.retrieval.store_info import read_settings

log = logging.getLogger(__name__)


class StoreIndex:
    """The store's FAISS index over ``chunks``' embeddings (module docstring).

    ``record(**values)`` writes the index's digest and count into the store's settings;
    ``lock`` is the store's, shared by its collaborators."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock, chunks: ChunkTable, path: Path, dim: int,
                 record: Callable[..., None], read_only: bool = False, recorded: dict[str, Any] | None = None) -> None:
        self._db = db
        self._lock = lock
        self._chunks = chunks
        self.path = Path(path)
        self._dim = int(dim)
        self._record = record
        self._read_only = read_only
        self._index = self._load(recorded)

    def __len__(self) -> int:
        """How many chunks the index holds (equals the chunk count unless a writer is mid-way)."""
        return len(self._index)

    def reload(self, recorded: dict[str, Any] | None = None) -> None:
        """Read the index again (another process changed the store), verified like at open against the
        settings ``recorded`` (the store's, just read; read here when not given)."""
        with self._lock:
            self._index = self._load(recorded)

    def rebuild(self) -> None:
        """Drop the index file and rebuild it from the SQLite embeddings (``store verify --repair``)."""
        with self._lock:
            self.path.unlink(missing_ok=True)
            self._index = self._load()

    # -- reading ---------------------------------------------------------------------------

    def mismatch(self, recorded: dict[str, Any] | None = None) -> str | None:
        """Why the index file cannot be trusted (missing, or another digest or vector count than SQLite
        records), or None: what ``store verify`` reports and every open checks (``recorded``: the settings
        the open just read, so an open reads them once)."""
        with self._lock:
            if not self.path.is_file():
                return "missing"
            if recorded is None:
                recorded = read_settings(self._db)
            if recorded.get("index_count") != self._chunks.count() or recorded.get("index_sha256") != index_digest(
                    self.path):
                return "does not match the metadata (digest or vector count)"
        return None

    def search(self, query_vectors: np.ndarray, k: int) -> list[tuple[int, float]]:
        """``(chunk id, cosine similarity)`` ranked by similarity to the (one) query vector, at most ``k``."""
        if k <= 0 or len(self._index) == 0:
            return []
        scores, ids = self._index.search(query_vectors, min(k, len(self._index)))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def neighbours(self, chunk_ids: Sequence[int], top_n: int, among: dict[int, set[int]] | None = None,
                   min_similarity: float | None = None) -> dict[int, list[int]]:
        """Each chunk's ``top_n`` most similar chunks (never itself), optionally only ``among`` a set per
        chunk and at least ``min_similarity`` similar: what the offline stage fuses with."""
        return self._index.neighbours_many(list(chunk_ids), top_n, among=among, min_similarity=min_similarity)

    def vectors(self, chunk_ids: Sequence[int]) -> np.ndarray:
        """The chunks' unit embeddings (rows in the order given)."""
        return self._index.vectors(list(chunk_ids))

    # -- writing (after SQLite committed) ----------------------------------------------------

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add the vectors of chunks SQLite holds now, and save. A crash before the save leaves the index
        behind SQLite; the next open rebuilds it."""
        with self._lock:
            self._index.add(list(ids), vectors)
            self._save()

    def remove(self, ids: Sequence[int]) -> None:
        """Remove the vectors of chunks SQLite no longer holds, and save."""
        with self._lock:
            self._index.remove(list(ids))
            self._save()

    def _save(self) -> None:
        """Write the index and record its digest and size in SQLite (verified on the next open)."""
        if self._read_only:
            return
        self._index.save(self.path)
        self._record(index_sha256=index_digest(self.path), index_count=len(self._index))

    def _load(self, recorded: dict[str, Any] | None = None) -> VectorIndex:
        """The index file if it matches SQLite (digest and vector count), else rebuilt from the embeddings."""
        if self.mismatch(recorded) is None:
            try:
                return VectorIndex.load(self.path, self._dim)
            except FusionRAGError:
                pass
        if self.path.is_file():
            log.warning("index %s does not match the store's metadata; rebuilding it from SQLite", self.path)
        self._index = VectorIndex(self._dim)
        ids, vectors = self._chunks.embeddings()
        if ids:
            self._index.add(ids, vectors)
        self._save()
        return self._index
