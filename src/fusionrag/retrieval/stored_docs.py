"""The documents of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore`: identity, references, removal.

A document is an ingested file (id: its resolved absolute path, or an id the user gave), a
document posted to the server (id: the one posted, or ``api:JOB``), or a ``legacy`` name from a
store made before documents were recorded (a bare file name). Its row in ``documents`` records
the source path, a hash of the file's bytes (an unchanged file is skipped), mtime, size, title
and when it was ingested; ``chunk_refs`` says which chunks it uses. A chunk lives while some
document uses it: replacing or removing a document removes the chunks nothing else uses
(metadata, index vectors, KV files) and returns their ids, so the caller can invalidate the
online tiers and the next fuse re-fuses the neighbours whose neighbour lists changed.

:class:`Documents` owns the ``documents`` and ``chunk_refs`` tables; removing the chunks no document
uses touches the chunks, the index and the KV files too, so that is the store's
(:meth:`KnowledgeStore.remove_unreferenced <fusionrag.retrieval.knowledge.KnowledgeStore.remove_unreferenced>`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

_COLUMNS = "id, origin, source, content_hash, mtime, size, title, ingested"

#: The one set of limits on a document's identity, for every door (CLI ``--id`` and targets, the API's
#: posted ``id``/``source``, ``DELETE /v1/documents/{id}``): what one door accepts the others can name.
MAX_ID_CHARS = 1024
MAX_SOURCE_CHARS = 4096


def identity_problem(field: str, value: object) -> str | None:
    """Why ``value`` cannot be a document's ``id`` or ``source`` (one phrase), or None. Non-empty text,
    bounded in length, no control characters (a NUL, a newline or a tab cannot be typed back as an id)."""
    limit = MAX_ID_CHARS if field == "id" else MAX_SOURCE_CHARS
    if not isinstance(value, str) or not value.strip():
        return f"a document {field} must be non-empty text"
    if len(value) > limit:
        return f"a document {field} has at most {limit} characters (this one has {len(value)})"
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        return f"a document {field} cannot contain control characters ({bad!r})"
    return None


@dataclass(frozen=True)
class DocumentRecord:
    id: str
    origin: str  # 'file' (ingest), 'passages' (posted or added through the API), 'legacy'
    source: str | None = None
    content_hash: str | None = None
    mtime: float | None = None
    size: int | None = None
    title: str = ""
    ingested: float | None = None  # unix time of the last (re-)ingest
    chunks: int = 0  # chunks it uses (shared ones included)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ingested"] = None if self.ingested is None else time.strftime("%Y-%m-%dT%H:%M:%S",
                                                                          time.localtime(self.ingested))
        return d


def query_documents(db: sqlite3.Connection, doc_id: str | None = None) -> list[DocumentRecord]:
    """Documents (all, or the one ``doc_id``) with their chunk counts; stores from before the ``documents``
    table (opened read-only, so not migrated) list their ``chunk_refs`` names as legacy documents."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    where, args = ("WHERE d.id = ?", (doc_id,)) if doc_id is not None else ("", ())
    if "documents" in tables:
        rows = db.execute(f"SELECT {', '.join('d.' + c.strip() for c in _COLUMNS.split(','))}, "
                          "(SELECT COUNT(*) FROM chunk_refs r WHERE r.doc = d.id) "
                          f"FROM documents d {where} ORDER BY d.id", args).fetchall()
        return [DocumentRecord(*row) for row in rows]
    refs = "chunk_refs" if "chunk_refs" in tables else "chunks"
    col = "doc"
    rows = db.execute(f"SELECT {col}, COUNT(*) FROM {refs} d {where.replace('d.id', col)} GROUP BY {col} "
                      f"ORDER BY {col}", args).fetchall()
    return [DocumentRecord(doc, "legacy", title=doc, chunks=n) for doc, n in rows]


def lies_under(source: str | None, folder: str) -> bool:
    """Whether the file ``source`` is ``folder`` or lies below it (both resolved absolute paths)."""
    return source is not None and (source == folder or source.startswith(folder.rstrip(os.sep) + os.sep))


class Documents:
    """The store's documents and their chunk references (module docstring); ``lock`` is the store's,
    shared by its collaborators."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock) -> None:
        self._db = db
        self._lock = lock

    # -- reading ---------------------------------------------------------------------------

    def all(self) -> list[DocumentRecord]:
        with self._lock:
            return query_documents(self._db)

    def get(self, doc_id: str) -> DocumentRecord | None:
        with self._lock:
            found = query_documents(self._db, str(doc_id))
        return found[0] if found else None

    def by_source(self, source: str) -> DocumentRecord | None:
        """The ingested file's document (the first by id if several share the source)."""
        with self._lock:
            row = self._db.execute("SELECT id FROM documents WHERE source = ? AND origin = 'file' ORDER BY id "
                                   "LIMIT 1", (str(source),)).fetchone()
        return None if row is None else self.get(row[0])

    def chunks_of(self, doc_id: str) -> list[int]:
        """The chunks one document uses, in id order."""
        with self._lock:
            return [int(r[0]) for r in self._db.execute(
                "SELECT chunk_id FROM chunk_refs WHERE doc = ? ORDER BY chunk_id", (str(doc_id),))]

    def chunks_of_any(self, docs: Sequence[str]) -> list[int]:
        """The chunks these documents use (any of them), in id order (= their order in the document)."""
        docs = [str(d) for d in docs]
        if not docs:
            return []
        with self._lock:
            return [int(r[0]) for r in self._db.execute(
                f"SELECT DISTINCT chunk_id FROM chunk_refs WHERE doc IN ({','.join('?' * len(docs))}) "
                "ORDER BY chunk_id", docs)]

    def using(self, chunk_ids: Sequence[int]) -> list[str]:
        """The ids of the documents that use any of these chunks (``chunk.doc`` is the reader's group
        name, e.g. ``a.txt``; a file's document id is its resolved path)."""
        ids = [int(c) for c in chunk_ids]
        if not ids:
            return []
        with self._lock:
            return [r[0] for r in self._db.execute(
                f"SELECT DISTINCT doc FROM chunk_refs WHERE chunk_id IN ({','.join('?' * len(ids))}) ORDER BY doc",
                ids)]

    def reference_problems(self) -> tuple[list[int], list[tuple[str, int]]]:
        """The documents table against the chunks: chunks no document uses (a run stopped between changing
        references and removing chunks) and references to chunks that do not exist."""
        with self._lock:
            unused = [int(r[0]) for r in self._db.execute(
                "SELECT id FROM chunks c WHERE NOT EXISTS (SELECT 1 FROM chunk_refs r WHERE r.chunk_id = c.id) "
                "ORDER BY id")]
            dangling = [(str(r[0]), int(r[1])) for r in self._db.execute(
                "SELECT doc, chunk_id FROM chunk_refs r WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.id = "
                "r.chunk_id) ORDER BY doc, chunk_id")]
        return unused, dangling

    # -- writing (under the store's writer) --------------------------------------------------

    def drop_dangling_references(self) -> int:
        """Remove references to chunks that do not exist; how many."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM chunk_refs WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.id = "
                                    "chunk_refs.chunk_id)").rowcount

    def reference_new(self, chunk_ids: Sequence[int], docs: Sequence[str]) -> None:
        """Record that ``docs[i]`` uses the new chunk ``chunk_ids[i]``, giving every document a row (inside
        the caller's transaction, the one that adds the chunks)."""
        self._ensure(docs)
        self._db.executemany("INSERT INTO chunk_refs(chunk_id, doc) VALUES (?, ?)",
                             list(zip(chunk_ids, docs, strict=True)))

    def add_refs(self, chunk_ids: Sequence[int], doc: str) -> None:
        """Record that document ``doc`` uses these (existing) chunks, e.g. a passage posted again."""
        with self._lock, self._db:
            self._ensure([doc])
            self._db.executemany("INSERT OR IGNORE INTO chunk_refs(chunk_id, doc) VALUES (?, ?)",
                                 [(int(c), doc) for c in chunk_ids])

    def _ensure(self, docs: Iterable[str], origin: str = "passages") -> None:
        """Give every referencing document a row (inside the caller's transaction)."""
        now = time.time()
        self._db.executemany("INSERT OR IGNORE INTO documents(id, origin, title, ingested) VALUES (?, ?, '', ?)",
                             [(d, origin, now) for d in dict.fromkeys(docs)])

    def set(self, record: DocumentRecord, chunk_ids: Sequence[int]) -> None:
        """Make ``record`` the document's row and ``chunk_ids`` exactly the chunks it uses, in one transaction.
        Chunks it no longer uses stay until the store removes the unreferenced ones (other documents may
        use them)."""
        record = replace(record, ingested=record.ingested if record.ingested is not None else time.time())
        ids = sorted({int(c) for c in chunk_ids})
        with self._lock, self._db:
            self._db.execute(f"INSERT OR REPLACE INTO documents({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (record.id, record.origin, record.source, record.content_hash, record.mtime,
                              record.size, record.title, record.ingested))
            self._db.execute(f"DELETE FROM chunk_refs WHERE doc = ? AND chunk_id NOT IN ({','.join('?' * len(ids))})",
                             (record.id, *ids))
            self._db.executemany("INSERT OR IGNORE INTO chunk_refs(chunk_id, doc) VALUES (?, ?)",
                                 [(c, record.id) for c in ids])

    def drop(self, doc_ids: Iterable[str]) -> None:
        """Remove these documents' rows and references (the chunks they used stay: the store removes the
        ones no document uses)."""
        docs = [str(d) for d in doc_ids]
        if docs:
            with self._lock, self._db:
                self._db.executemany("DELETE FROM chunk_refs WHERE doc = ?", [(d,) for d in docs])
                self._db.executemany("DELETE FROM documents WHERE id = ?", [(d,) for d in docs])
