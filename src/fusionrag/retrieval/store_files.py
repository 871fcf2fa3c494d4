"""The store folder's files kept trustworthy: SQLite opened safely, the index checksummed, one writer.

- **SQLite** (the source of truth) is opened in WAL mode (readers never block the writer,
  and a crash mid-transaction leaves the last committed state) and checked with
  ``PRAGMA quick_check``; a corrupted file is a clear :class:`StoreCorruptedError`, never a
  traceback.
- **The FAISS index** is derived data: after every save its sha256 and vector count are
  recorded in SQLite, and opening verifies them, so random bytes written into the file are
  detected (and the index rebuilt from SQLite) instead of silently returning wrong chunks.
- **One writer**: every mutation holds an exclusive lock on ``store.lock`` (``filelock``). A second
  writer (``fusionrag ingest`` while ``fusionrag serve`` adds documents) waits up to a
  timeout, then gets a clear error naming the holder; it never interleaves writes.
  Each committed change bumps the store's ``generation``, which readers poll to notice
  changes made by another process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fusionrag.errors import (
    FusionRAGError,
    StorageFullError,
    StorageIOError,
    StoragePermissionError,
    StoreBusyError,
    StoreCorruptedError,
)
from fusionrag.files import file_sha256

LOCK_NAME = "store.lock"

SCHEMA = """
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    doc TEXT NOT NULL,
    title TEXT NOT NULL,
    text TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    content_hash TEXT NOT NULL UNIQUE,
    embedding BLOB NOT NULL,
    neighbours TEXT
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc);
-- Which documents use a chunk: a passage posted by two jobs is one chunk with two references,
-- and deleting one document removes only chunks no other document still references.
CREATE TABLE IF NOT EXISTS chunk_refs (
    chunk_id INTEGER NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (chunk_id, doc)
);
CREATE INDEX IF NOT EXISTS chunk_refs_doc ON chunk_refs(doc);
-- Documents with identity: an ingested file (id: its resolved path, or the one given), a document
-- posted to the server, or (origin 'legacy') a name from before documents were recorded. Every
-- doc in chunk_refs has a row; content_hash (of the file's bytes) lets an unchanged file be skipped.
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    origin TEXT NOT NULL,
    source TEXT,
    content_hash TEXT,
    mtime REAL,
    size INTEGER,
    title TEXT NOT NULL DEFAULT '',
    ingested REAL
);
CREATE INDEX IF NOT EXISTS documents_source ON documents(source);
-- Document jobs of a server (POST /v1/documents), kept with the store so a restart resumes them.
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


def sqlite_fault(exc: sqlite3.Error, path: Path, doing: str = "using the store") -> FusionRAGError:
    """What a SQLite error is: out of space, read-only / permission, I/O, busy, or a corrupted file.

    Only the last says "corrupted": a full disk or a read-only mount is not a damaged store."""
    msg = str(exc).lower()
    if "full" in msg:
        return StorageFullError(f"out of disk space while {doing} ({path}): nothing committed was lost; free some "
                                "space and run the same command again (it resumes where it stopped)")
    if "readonly" in msg or "read-only" in msg or "permission" in msg or "access" in msg:
        return StoragePermissionError(f"cannot write {path} while {doing}: read-only or permission denied; "
                                      "commands that only read (ask, store info, store verify, serve) still work")
    if "unable to open" in msg:
        folder = Path(path).parent
        if not os.access(folder, os.R_OK | os.X_OK) or (Path(path).exists() and not os.access(path, os.R_OK)):
            return StoragePermissionError(f"cannot open {path}: permission denied")
        return StorageIOError(f"cannot open {path} while {doing} ({exc})")
    if "i/o" in msg:
        return StorageIOError(f"I/O error on {path} while {doing} ({exc}): the disk reported a failure; check "
                              "the device, then run 'fusionrag store verify'")
    if "locked" in msg or "busy" in msg:
        return StoreBusyError(f"{path} is locked by another process; try again when it has finished")
    return StoreCorruptedError(
        f"the store's metadata {path} is corrupted ({exc}); it is the source of truth and cannot be repaired "
        "by 'store verify --repair' (which mends KV files and the index): restore it from a backup or rebuild "
        "the store with 'fusionrag ingest'")


def store_is_writable(folder: Path) -> bool:
    """Whether this process may write the store's folder and its SQLite file (else it opens read-only)."""
    db = Path(folder) / "store.sqlite"
    return os.access(folder, os.W_OK | os.X_OK) and (not db.exists() or os.access(db, os.W_OK))


def connect(path: Path, schema: str | None = None, read_only: bool = False) -> sqlite3.Connection:
    """Open the store's SQLite file, verified; shared across threads (callers serialise access).

    ``read_only``: no write at all (read-only media, a folder without write permission); a WAL-mode
    database that cannot be opened read-only in place (its ``-shm`` file cannot be created) is opened
    as immutable, which is right for media nobody writes to."""
    try:
        if read_only:
            try:
                db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
                db.execute("PRAGMA quick_check").fetchone()
            except sqlite3.OperationalError:
                db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
        else:
            db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
        result = db.execute("PRAGMA quick_check").fetchone()
        if result is None or result[0] != "ok":
            raise sqlite3.DatabaseError(result[0] if result else "no result")
        if schema and not read_only:
            db.executescript(schema)
    except sqlite3.Error as exc:
        raise sqlite_fault(exc, path, "opening the store") from None
    return db


def create_database(path: Path, settings: dict[str, Any]) -> sqlite3.Connection:
    """A new store's SQLite file holding ``settings``, opened. It appears whole or not at all: made under a
    temporary name, then renamed, so a create interrupted by a full disk leaves no settings-less file that
    no later run could open."""
    tmp = path.with_name(path.name + ".creating")
    for leftover in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
        leftover.unlink(missing_ok=True)
    db = connect(tmp, SCHEMA)
    try:
        with db:
            db.executemany("INSERT INTO settings(key, value) VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in settings.items()])
    finally:
        db.close()
    os.replace(tmp, path)
    return connect(path, SCHEMA)


def migrate_refs(db: sqlite3.Connection) -> None:
    """Stores made before chunk references existed: each chunk is referenced by its own document."""
    has_chunks = db.execute("SELECT 1 FROM chunks LIMIT 1").fetchone() is not None
    if not has_chunks or db.execute("SELECT 1 FROM chunk_refs LIMIT 1").fetchone() is not None:
        return  # nothing to migrate: no write (a read-only store opens too)
    with db:
        if db.execute("SELECT 1 FROM chunk_refs LIMIT 1").fetchone() is None:
            db.execute("INSERT OR IGNORE INTO chunk_refs(chunk_id, doc) SELECT id, doc FROM chunks")


def migrate_documents(db: sqlite3.Connection) -> None:
    """Stores made before documents were recorded: each document name in ``chunk_refs`` (a bare file
    name, ``file#question``, ``api:job``) becomes a 'legacy' row, so it can be listed and deleted; an
    ingest of the file it came from replaces it."""
    if (db.execute("SELECT 1 FROM documents LIMIT 1").fetchone() is not None
            or db.execute("SELECT 1 FROM chunk_refs LIMIT 1").fetchone() is None):
        return  # migrated already, or nothing to migrate: no write
    with db:
        db.execute("INSERT OR IGNORE INTO documents(id, origin, source, title) "
                   "SELECT DISTINCT doc, CASE WHEN doc LIKE 'api:%' THEN 'passages' ELSE 'legacy' END, NULL, doc "
                   "FROM chunk_refs")


def read_generation(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM settings WHERE key = 'generation'").fetchone()
    return int(json.loads(row[0])) if row else 0


def bump_generation(db: sqlite3.Connection) -> int:
    """One more committed change; returns the new generation."""
    with db:
        new = read_generation(db) + 1
        db.execute("INSERT OR REPLACE INTO settings(key, value) VALUES ('generation', ?)", (json.dumps(new),))
    return new


def index_digest(path: Path) -> str:
    """What the metadata records about an index file: ``sha256`` of its bytes."""
    return file_sha256(path)


@contextlib.contextmanager
def writer_lock(folder: Path, timeout_s: float = 30.0) -> Iterator[None]:
    """Hold the store's exclusive writer lock (re-entrant within a process is the caller's job).

    The lock is ``filelock``'s (an ``flock`` on ``store.lock``, waited for up to ``timeout_s``);
    the holder writes ``pid N`` into the file, which a waiter that times out names in its error
    (filelock >= 3.30 never truncates the file before it holds the lock)."""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    lock = FileLock(path, timeout=timeout_s, poll_interval=0.05, fallback_to_soft=False)
    try:
        lock.acquire()
    except Timeout:
        try:
            holder = path.read_text().strip()
        except OSError:
            holder = ""
        raise StoreBusyError(
            f"the store at {folder} is being written by {holder or 'another process'}; only one writer at a time "
            "(wait for it to finish, or stop it)"
        ) from None
    try:
        _note_holder(path, f"pid {os.getpid()}")
        yield
    finally:
        try:
            _note_holder(path, "")
        finally:
            lock.release()


def _note_holder(path: Path, text: str) -> None:
    """Who holds the lock, for a waiter's message: best effort. On a full disk (or any write fault) the
    lock is held all the same; the operation itself then meets the fault and names it."""
    with contextlib.suppress(OSError):
        path.write_text(text)
