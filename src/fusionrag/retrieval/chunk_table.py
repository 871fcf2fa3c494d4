"""The chunks of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore`: the ``chunks`` table in SQLite.

Per chunk: the reader's group name (``doc``), title, text, token ids, content hash, embedding
and the neighbour list its fused KV was made with. Ids are never reused. Reads keep a bounded
cache of records (a chunk's text and tokens never change under its id); the store clears it when
another process changed the store (:meth:`KnowledgeStore.refresh`).

Which documents use a chunk is :mod:`~fusionrag.retrieval.stored_docs`'s; the vector index over
the embeddings is :mod:`~fusionrag.retrieval.store_index`'s. Writes that span them (adding chunks,
removing the ones no document uses) are the store's, inside one transaction it opens.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.chunking import Chunk

_CACHED = 8192  # records kept in memory before the cache starts over


class UnknownChunkError(FusionRAGError, KeyError):
    """No chunk with that id in the store."""


@dataclass(frozen=True)
class ChunkRecord:
    id: int
    doc: str
    title: str
    text: str
    token_ids: list[int]
    n_tokens: int
    content_hash: str


class ChunkTable:
    """The store's chunk rows (module docstring); ``lock`` is the store's, shared by its collaborators."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock, store_path: Path) -> None:
        self._db = db
        self._lock = lock
        self._store_path = store_path  # for messages
        self._records: dict[int, ChunkRecord] = {}

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- reading ---------------------------------------------------------------------------

    def ids(self) -> list[int]:
        return [r[0] for r in self._query("SELECT id FROM chunks ORDER BY id")]

    def hashes(self) -> dict[int, str]:
        """Every chunk's content hash by id: what tells a changed chunk from the one it replaced (an id can be
        given again once the highest one was deleted)."""
        return {int(i): str(h) for i, h in self._query("SELECT id, content_hash FROM chunks")}

    def count(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM chunks")[0][0])

    def get(self, chunk_id: int) -> ChunkRecord:
        rec = self._records.get(int(chunk_id))
        if rec is not None:
            return rec
        rows = self._query(
            "SELECT id, doc, title, text, token_ids, n_tokens, content_hash FROM chunks WHERE id = ?", (int(chunk_id),))
        row = rows[0] if rows else None
        if row is None:
            raise UnknownChunkError(f"no chunk with id {chunk_id} in the knowledge base at {self._store_path}")
        rec = ChunkRecord(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5], row[6])
        if len(self._records) > _CACHED:
            self._records.clear()
        self._records[rec.id] = rec
        return rec

    def token_ids(self, chunk_id: int) -> list[int]:
        """The chunk's token ids: what every read of its KV is verified against."""
        return self.get(chunk_id).token_ids

    def find_by_hash(self, content_hash: str) -> int | None:
        rows = self._query("SELECT id FROM chunks WHERE content_hash = ?", (content_hash,))
        return int(rows[0][0]) if rows else None

    def doc_groups(self) -> dict[str, list[int]]:
        """Chunk ids by the reader's group name (``doc``), in id order."""
        groups: dict[str, list[int]] = {}
        for cid, doc in self._query("SELECT id, doc FROM chunks ORDER BY id"):
            groups.setdefault(doc, []).append(cid)
        return groups

    def embeddings(self) -> tuple[list[int], np.ndarray | None]:
        """Every chunk's id and stored embedding (rows in id order; None if there are no chunks): what the
        vector index is rebuilt from."""
        rows = self._query("SELECT id, embedding FROM chunks ORDER BY id")
        if not rows:
            return [], None
        return [r[0] for r in rows], np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])

    def neighbours_of(self, chunk_id: int) -> list[int] | None:
        """The neighbour list the chunk's fused KV was computed with (None if never fused)."""
        rows = self._query("SELECT neighbours FROM chunks WHERE id = ?", (int(chunk_id),))
        return None if not rows or rows[0][0] is None else json.loads(rows[0][0])

    def unreferenced(self) -> list[int]:
        """Chunks no document uses (no row in ``chunk_refs``), in id order."""
        return [int(r[0]) for r in self._query(
            "SELECT id FROM chunks c WHERE NOT EXISTS (SELECT 1 FROM chunk_refs r WHERE r.chunk_id = c.id) "
            "ORDER BY id")]

    def forget(self) -> None:
        """Drop the cached records (another process may have changed the table)."""
        self._records.clear()

    # -- writing ---------------------------------------------------------------------------

    def record_neighbours(self, neighbours: dict[int, Sequence[int]]) -> None:
        if neighbours:
            with self._lock, self._db:
                self._db.executemany("UPDATE chunks SET neighbours = ? WHERE id = ?",
                                     [(json.dumps([int(n) for n in v]), int(k)) for k, v in neighbours.items()])

    def next_ids(self, n: int) -> list[int]:
        """The ids ``n`` new chunks get (inside the caller's transaction). Ids are never reused, not even the
        highest one after its chunk was deleted (:meth:`delete` keeps it in ``settings``): a reader that cached a
        chunk by id (a serving tier, the chunk locator) must never see another text under it."""
        first = self._highest() + 1
        return list(range(first, first + n))

    def _highest(self) -> int:
        """The highest id ever given (-1: none)."""
        row = self._db.execute("SELECT MAX(id) FROM chunks").fetchone()
        mark = self._db.execute("SELECT value FROM settings WHERE key = 'last_chunk_id'").fetchone()
        return max(-1 if row[0] is None else int(row[0]), -1 if mark is None else int(json.loads(mark[0])))

    def insert(self, ids: Sequence[int], chunks: Sequence[Chunk], vectors: np.ndarray) -> None:
        """Add the rows (inside the caller's transaction)."""
        self._db.executemany(
            "INSERT INTO chunks(id, doc, title, text, token_ids, n_tokens, content_hash, embedding) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(i, c.doc, c.title, c.text, json.dumps(list(c.token_ids)), c.n_tokens, c.content_hash,
              vectors[j].tobytes()) for j, (i, c) in enumerate(zip(ids, chunks, strict=True))],
        )

    def delete(self, ids: Sequence[int]) -> None:
        """Remove the rows (inside the caller's transaction) and their cached records."""
        highest = self._highest()
        self._db.executemany("DELETE FROM chunks WHERE id = ?", [(int(i),) for i in ids])
        if highest in {int(i) for i in ids}:  # the highest id goes: kept, so that no new chunk gets it
            self._db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES ('last_chunk_id', ?)",
                             (json.dumps(highest),))
        for cid in ids:
            self._records.pop(int(cid), None)
