"""The knowledge base on disk: chunks, vectors and KV caches, bound to one model.

A store folder holds:

- ``store.sqlite`` (the source of truth): settings; per chunk its text, token ids,
  content hash, embedding and the neighbours its fused KV was made with; which documents
  use which chunk. Tables and integrity: :mod:`fusionrag.retrieval.store_files`.
- ``index.faiss``: the vector index, checksummed in SQLite (rebuilt if it does not match).
- ``kv/``: one verified safetensors file per (chunk, kind) plus ``S``'s KV.

Opening a store with another model, or loading a cache made after another ``S``, raises
:class:`CacheIntegrityError`.

This module is data and file access only: it never runs the model. Building (ingest,
plain and fused KV, the offline stage) is :mod:`fusionrag.offline.build`; reading KV
online goes through :meth:`KnowledgeStore.kv_source` (:mod:`fusionrag.kvcache.sources`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError, StoragePermissionError, StoreMismatchError
from fusionrag.kvcache.store import DEFAULT_KV_DTYPE, KVStore, canonical_dtype
from fusionrag.models.fingerprint import same_weights
from fusionrag.models.registry import KNOWN_NAMES, LoadedModel
from fusionrag.prompt import DEFAULT_SYSTEM_PROMPT, PromptBuilder, chunk_text
from fusionrag.retrieval.chunking import DEFAULT_CHUNK_TOKENS, Chunk
from fusionrag.retrieval.embedder import Embedder, get_embedder
from fusionrag.retrieval.indexed import IndexedChunks
from fusionrag.retrieval.jobs import JobStore
from fusionrag.retrieval.store_files import (
    SCHEMA,
    bump_generation,
    connect,
    migrate_documents,
    migrate_refs,
    read_generation,
    store_is_writable,
    writer_lock,
)
from fusionrag.retrieval.store_info import DB_NAME, INDEX_NAME, KV_DIR, read_settings
from fusionrag.retrieval.stored_docs import StoredDocuments
from fusionrag.retrieval.stored_kv import StoredKV

log = logging.getLogger(__name__)

STORE_FORMAT = "fusionrag-store/1"



def model_reference(model: str) -> str:
    """What a store records to reload its model: a packaged or test model's name as it is, a local
    checkpoint folder as its resolved absolute path (so the store works from any working directory)."""
    if model in KNOWN_NAMES:
        return model
    folder = Path(model).expanduser()
    return str(folder.resolve()) if folder.is_dir() else model


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


class KnowledgeStore(IndexedChunks, StoredKV, StoredDocuments):
    """A store folder: chunks, vectors and KV files, bound to one model's fingerprint and ``S``.

    Holds no model: the model that built the store is named in its settings
    (:func:`stored_model`), and whoever runs a model (the online engine, the offline
    builder) passes it in. ``lm`` given to :meth:`create` / :meth:`open` is only checked
    against the store (fingerprint, tokenizer's ``S``), never kept.
    """

    def __init__(self, path: Path, fingerprint: str, prompt: PromptBuilder, settings: dict[str, Any],
                 db: sqlite3.Connection, embedder: Embedder | None, read_only: bool = False) -> None:
        self.path = Path(path)
        #: Opened without write access: reads work, a write raises StoragePermissionError.
        self.read_only = read_only
        self.fingerprint = fingerprint
        self.prompt = prompt
        self.settings = settings
        self._db = db
        self._embedder = embedder
        self._kv = KVStore(self.path / KV_DIR, fingerprint, self.prompt.system_hash, settings["kv_dtype"])
        self._records: dict[int, ChunkRecord] = {}
        self._lock = threading.RLock()
        self._writing = 0  # depth of writer() in this process (the file lock is taken once)
        if not read_only:
            migrate_refs(db)
            migrate_documents(db)
        self._generation = self.generation()
        self._index = self.load_index()

    # ------------------------------------------------------------ create / open

    @classmethod
    def create(cls, path, lm: LoadedModel, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, kv_dtype: str = DEFAULT_KV_DTYPE,
               embedder: Embedder | None = None, model_source: str | None = None,
               system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> KnowledgeStore:
        """A new, empty store for ``lm`` (``model_source``: what :func:`load_model` needs to reload it).

        ``system_prompt`` is the instruction in ``S``: recorded, and part of every cache's identity
        (``S``'s hash), since every chunk's KV is computed after it.

        ``S``'s KV is not computed here (that runs the model): :func:`fusionrag.offline.build.create_store`
        does both, and every build step computes it when it is missing.
        """
        path = Path(path)
        if (path / DB_NAME).exists():
            raise FusionRAGError(f"a knowledge base already exists at {path}; open it instead of creating it")
        if chunk_tokens < 8:
            raise FusionRAGError(f"chunk size must be at least 8 tokens, got {chunk_tokens}")
        kv_dtype = canonical_dtype(kv_dtype)
        embedder = embedder if embedder is not None else get_embedder(None)
        prompt = PromptBuilder(lm.tokenizer, system_prompt)
        settings = {
            "format": STORE_FORMAT,
            "model": model_reference(model_source or lm.name),
            "fingerprint": lm.fingerprint,
            "system_hash": prompt.system_hash,
            "system_tokens": len(prompt.system_token_ids),
            "system_prompt": system_prompt,
            "chunk_tokens": int(chunk_tokens),
            "kv_dtype": kv_dtype,
            "embedder": embedder.name,
            "embedding_dim": int(embedder.dim),
            "fuse": None,  # the offline stage's settings, recorded by the first fuse (offline.build)
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        path.mkdir(parents=True, exist_ok=True)
        # KV files with no metadata (e.g. store.sqlite deleted by hand) would be reused for other
        # chunks that get the same ids: they are orphans, removed before the new store starts.
        shutil.rmtree(path / KV_DIR, ignore_errors=True)
        (path / INDEX_NAME).unlink(missing_ok=True)
        # The database appears whole or not at all: made under a temporary name, then renamed, so a create
        # interrupted by a full disk leaves no settings-less store.sqlite that no later run could open.
        tmp = path / (DB_NAME + ".creating")
        for leftover in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
            leftover.unlink(missing_ok=True)
        db = connect(tmp, SCHEMA)
        try:
            with db:
                db.executemany("INSERT INTO settings(key, value) VALUES (?, ?)",
                               [(k, json.dumps(v)) for k, v in settings.items()])
        finally:
            db.close()
        os.replace(tmp, path / DB_NAME)
        db = connect(path / DB_NAME, SCHEMA)
        return cls(path, lm.fingerprint, prompt, settings, db, embedder)

    @classmethod
    def open(cls, path, lm: LoadedModel, embedder: Embedder | None = None,
             read_only: bool | None = None) -> KnowledgeStore:
        """An existing store, checked against ``lm``: another model or another ``S`` is refused.

        ``read_only`` (default: when this process cannot write the folder) opens it without writing
        anything: answering and verifying work on read-only media; a write raises a clear error."""
        path = Path(path)
        if not (path / DB_NAME).is_file():
            raise FusionRAGError(f"no knowledge base at {path} (create one with: fusionrag ingest PATH --store {path})")
        if read_only is None:
            read_only = not store_is_writable(path)
        db = connect(path / DB_NAME, None if read_only else SCHEMA, read_only=read_only)
        settings = read_settings(db)
        if settings.get("format") != STORE_FORMAT:
            raise FusionRAGError(f"{path}: unsupported store format {settings.get('format')!r}")
        if not same_weights(str(settings["fingerprint"]), lm.fingerprint):  # any compute dtype: decision 052
            raise StoreMismatchError(
                f"the knowledge base at {path} was built with model {settings['model']} ({settings['fingerprint']}); "
                f"the loaded model {lm.name} ({lm.fingerprint}) cannot reuse its caches. Use --model "
                f"{settings['model']} or build a new store."
            )
        prompt = PromptBuilder.for_store(lm.tokenizer, settings)
        if prompt.system_hash != settings["system_hash"]:
            raise StoreMismatchError(
                f"the knowledge base at {path} was built with another system prompt "
                f"({settings['system_hash']} != {prompt.system_hash}); its caches cannot be reused"
            )
        if embedder is not None and embedder.name != settings["embedder"]:
            raise FusionRAGError(
                f"the knowledge base at {path} was embedded with {settings['embedder']}, not {embedder.name}"
            )
        return cls(path, lm.fingerprint, prompt, settings, db, embedder, read_only)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> KnowledgeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def embedder(self) -> Embedder:
        """Loaded on first use: searching or ingesting needs it, loading caches does not."""
        if self._embedder is None:
            self._embedder = get_embedder(self.settings["embedder"])
        return self._embedder

    def update_settings(self, **values: Any) -> None:
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in values.items()])
        self.settings.update(values)

    # ------------------------------------------------------------ one writer, visible generations

    @contextlib.contextmanager
    def writer(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Hold the writer lock (one writing process at a time; re-entrant here); bump the generation
        on exit, which readers in other processes notice (:meth:`refresh`)."""
        if self.read_only:
            raise StoragePermissionError(f"the store at {self.path} is open read-only (read-only media or no "
                                         "write permission): it can answer and be verified, not changed")
        with self._lock:
            if self._writing:
                self._writing += 1
                try:
                    yield
                finally:
                    self._writing -= 1
                return
            with writer_lock(self.path, timeout_s):
                self.refresh()  # another process may have written since we last looked
                self._writing = 1
                try:
                    yield
                finally:
                    self._writing = 0
                    self._generation = bump_generation(self._db)

    @property
    def seen_generation(self) -> int:
        """The generation this object's chunks and index reflect (:meth:`refresh` brings it to the store's)."""
        return self._generation

    def generation(self) -> int:
        """The store's change counter (bumped by every writer), read from SQLite."""
        with self._lock:
            return read_generation(self._db)

    def refresh(self) -> bool:
        """Reload metadata and the index if another process changed the store; True if it did."""
        with self._lock:
            current = self.generation()
            if current == self._generation:
                return False
            self.settings = read_settings(self._db)
            self._records.clear()
            self._index = self.load_index()
            self._generation = current
            return True

    # ------------------------------------------------------------ chunks

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @property
    def jobs(self) -> JobStore:
        """The server's document jobs, kept in this store's database."""
        return JobStore(self._db, self._lock)

    def recorded_settings(self) -> dict[str, Any]:
        """The settings as the database holds them now (``settings`` is the copy read at open/refresh)."""
        with self._lock:
            return read_settings(self._db)

    def chunk_ids(self) -> list[int]:
        return [r[0] for r in self._query("SELECT id FROM chunks ORDER BY id")]

    def chunk(self, chunk_id: int) -> ChunkRecord:
        rec = self._records.get(int(chunk_id))
        if rec is not None:
            return rec
        rows = self._query(
            "SELECT id, doc, title, text, token_ids, n_tokens, content_hash FROM chunks WHERE id = ?", (int(chunk_id),))
        row = rows[0] if rows else None
        if row is None:
            raise UnknownChunkError(f"no chunk with id {chunk_id} in the knowledge base at {self.path}")
        rec = ChunkRecord(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5], row[6])
        if len(self._records) > 8192:
            self._records.clear()
        self._records[rec.id] = rec
        return rec

    def find_by_hash(self, content_hash: str) -> int | None:
        rows = self._query("SELECT id FROM chunks WHERE content_hash = ?", (content_hash,))
        return int(rows[0][0]) if rows else None

    def doc_groups(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for cid, doc in self._query("SELECT id, doc FROM chunks ORDER BY id"):
            groups.setdefault(doc, []).append(cid)
        return groups

    def chunk_ids_of_docs(self, docs: Sequence[str]) -> list[int]:
        """The chunks these documents use (any of them), in id order (= their order in the document)."""
        docs = [str(d) for d in docs]
        if not docs:
            return []
        rows = self._query(f"SELECT DISTINCT chunk_id FROM chunk_refs WHERE doc IN ({','.join('?' * len(docs))}) "
                           "ORDER BY chunk_id", tuple(docs))
        return [int(r[0]) for r in rows]

    def source_of(self, chunk_id: int) -> str:
        """Where a chunk came from, for citing: its document's id (an ingested file's resolved path, a
        posted id), else the name its reader gave it."""
        docs = self.documents_using([chunk_id])
        return docs[0] if docs else self.chunk(chunk_id).doc

    def retrieve(self, query: str, k: int) -> list[dict[str, Any]]:
        """The ``k`` chunks most similar to ``query`` as passages (``chunk_id, title, text, source, score``):
        what ``POST /v1/retrieve`` returns, and what a request sending them back reuses exactly."""
        out = []
        for cid, score in self.search_scored(query, k):
            rec = self.chunk(cid)
            out.append({"chunk_id": cid, "title": rec.title, "text": rec.text, "source": self.source_of(cid),
                        "score": round(float(score), 4)})
        return out

    def neighbours_of(self, chunk_id: int) -> list[int] | None:
        """The neighbour list the chunk's fused KV was computed with (None if never fused)."""
        rows = self._query("SELECT neighbours FROM chunks WHERE id = ?", (int(chunk_id),))
        return None if not rows or rows[0][0] is None else json.loads(rows[0][0])

    def record_neighbours(self, neighbours: dict[int, Sequence[int]]) -> None:
        if neighbours:
            with self._lock, self._db:
                self._db.executemany("UPDATE chunks SET neighbours = ? WHERE id = ?",
                                    [(json.dumps([int(n) for n in v]), int(k)) for k, v in neighbours.items()])

    def insert_chunks(self, chunks: Sequence[Chunk], progress: bool = False,
                      refs: Sequence[str] | None = None) -> tuple[list[int], float]:
        """Embed and add new (not yet stored, unique) chunks; returns their ids and the embedding time.

        ``refs``: the document using each chunk (default: its ``doc``, the reader's group name)."""
        if not chunks:
            return [], 0.0
        t0 = time.perf_counter()
        texts = [chunk_text(c.title, c.text) for c in chunks]
        vecs = []
        step = 256
        with tqdm(total=len(texts), unit="chunk", desc=f"embed ({self.settings['embedder']})",
                  disable=not progress) as bar:
            for i in range(0, len(texts), step):
                vecs.append(self.embedder.embed(texts[i:i + step]))
                bar.update(len(texts[i:i + step]))
        vectors = np.concatenate(vecs).astype(np.float32)
        embed_s = time.perf_counter() - t0
        with self._lock:
            with self._db:  # one transaction: all or none (SQLite is the source of truth)
                row = self._db.execute("SELECT MAX(id) FROM chunks").fetchone()
                first = 0 if row[0] is None else int(row[0]) + 1
                ids = list(range(first, first + len(chunks)))
                users = [c.doc for c in chunks] if refs is None else [str(r) for r in refs]
                self._ensure_documents(users)
                self._db.executemany("INSERT INTO chunk_refs(chunk_id, doc) VALUES (?, ?)",
                                     list(zip(ids, users, strict=True)))
                self._db.executemany(
                    "INSERT INTO chunks(id, doc, title, text, token_ids, n_tokens, content_hash, embedding) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(i, c.doc, c.title, c.text, json.dumps(list(c.token_ids)), c.n_tokens, c.content_hash,
                      vectors[j].tobytes()) for j, (i, c) in enumerate(zip(ids, chunks, strict=True))],
                )
            # A crash before this save leaves the index behind SQLite; the next open rebuilds it.
            self._index.add(ids, vectors)
            self._save_index()
        return ids, embed_s

    def add_refs(self, chunk_ids: Sequence[int], doc: str) -> None:
        """Record that document ``doc`` uses these (existing) chunks, e.g. a passage posted again."""
        with self._lock, self._db:
            self._ensure_documents([doc])
            self._db.executemany("INSERT OR IGNORE INTO chunk_refs(chunk_id, doc) VALUES (?, ?)",
                                [(int(c), doc) for c in chunk_ids])
