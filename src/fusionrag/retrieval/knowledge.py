"""The knowledge base on disk: chunks, vectors and KV caches, bound to one model.

A store folder holds:

- ``store.sqlite`` (the source of truth): settings; per chunk its text, token ids,
  content hash, embedding and the neighbours its fused KV was made with; which documents
  use which chunk. Tables and integrity: :mod:`fusionrag.retrieval.store_files`.
- ``index.faiss``: the vector index, checksummed in SQLite (rebuilt if it does not match).
- ``kv/``: one verified safetensors file per (chunk, kind) plus ``S``'s KV.

Opening a store with another model, or loading a cache made after another ``S``, raises
:class:`CacheIntegrityError`.

:class:`KnowledgeStore` opens the folder (settings, the writer lock, the generation readers follow)
and owns one collaborator per responsibility, each given the connection, the store's lock and the
paths it needs: ``chunks`` (:mod:`~fusionrag.retrieval.chunk_table`: the chunk rows), ``index``
(:mod:`~fusionrag.retrieval.store_index`: the vector index, kept true to SQLite), ``kv``
(:mod:`~fusionrag.retrieval.stored_kv`: the KV files, verified against the chunks' tokens),
``documents`` (:mod:`~fusionrag.retrieval.stored_docs`: documents and the chunks they use) and
``jobs`` (:mod:`~fusionrag.retrieval.jobs`). What spans them is the store's: adding chunks,
removing those no document uses, searching by text (it owns the embedder), converting the KV dtype.
The reads the engine, the server, ``bench`` and the studies use are the store's methods too.

This module is data and file access only: it never runs the model. Building (ingest,
plain and fused KV, the offline stage) is :mod:`fusionrag.offline.build`; reading KV
online goes through :meth:`KnowledgeStore.kv_source` (:mod:`fusionrag.kvcache.sources`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.errors import FusionRAGError, StoragePermissionError
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.sources import ColdDiskSource, DiskSource
from fusionrag.kvcache.store import DEFAULT_KV_DTYPE, KVEntry, canonical_dtype
from fusionrag.models.registry import LoadedModel
from fusionrag.prompt import DEFAULT_SYSTEM_PROMPT, PromptBuilder, chunk_text
from fusionrag.retrieval.chunk_locator import ChunkLocator
from fusionrag.retrieval.chunk_table import ChunkRecord, ChunkTable
from fusionrag.retrieval.chunking import DEFAULT_CHUNK_TOKENS, Chunk
from fusionrag.retrieval.embedder import Embedder, embed_all, get_embedder
from fusionrag.retrieval.jobs import JobStore
from fusionrag.retrieval.store_files import (
    SCHEMA,
    bump_generation,
    connect,
    create_database,
    migrate_documents,
    migrate_refs,
    read_generation,
    store_is_writable,
    writer_lock,
)
from fusionrag.retrieval.store_index import StoreIndex
from fusionrag.retrieval.store_info import DB_NAME, INDEX_NAME, KV_DIR, missing_store, read_settings
from fusionrag.retrieval.store_settings import check_usable, new_settings
from fusionrag.retrieval.stored_docs import Documents
from fusionrag.retrieval.stored_kv import StoredKV

log = logging.getLogger(__name__)

class KnowledgeStore:
    """A store folder: chunks, vectors and KV files, bound to one model's fingerprint and ``S``.

    Holds no model: the model that built the store is named in its settings
    (:func:`stored_model`), and whoever runs a model (the online engine, the offline
    builder) passes it in. ``lm`` given to :meth:`create` / :meth:`open` is only checked
    against the store (fingerprint, tokenizer's ``S``), never kept.

    Owns ``chunks``, ``index``, ``kv``, ``documents`` and ``jobs`` (module docstring); they share its
    database connection and its lock.
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
        self._lock = threading.RLock()
        self._writing = 0  # depth of writer() in this process (the file lock is taken once)
        if not read_only:
            migrate_refs(db)
            migrate_documents(db)
        self._generation = self.generation()
        self.chunks = ChunkTable(db, self._lock, self.path)
        self.documents = Documents(db, self._lock)
        self.jobs = JobStore(db, self._lock)  #: the server's document jobs, kept in this store's database
        self.kv = StoredKV(self.path / KV_DIR, fingerprint, prompt, settings["kv_dtype"], self.chunks.token_ids,
                           store_id=f"{self.path.name}|{settings.get('created')}")
        self.index = StoreIndex(db, self._lock, self.chunks, self.path / INDEX_NAME, settings["embedding_dim"],
                                record=self.update_settings, read_only=read_only, recorded=settings)
        #: Where the chunks are in a prompt's ids or a passage's text (both engines'; follows the generation).
        self.locator = ChunkLocator(self)

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
        settings = new_settings(lm, prompt, chunk_tokens, kv_dtype, embedder, model_source)
        path.mkdir(parents=True, exist_ok=True)
        # KV files with no metadata (e.g. store.sqlite deleted by hand) would be reused for other
        # chunks that get the same ids: they are orphans, removed before the new store starts.
        shutil.rmtree(path / KV_DIR, ignore_errors=True)
        (path / INDEX_NAME).unlink(missing_ok=True)
        db = create_database(path / DB_NAME, settings)
        return cls(path, lm.fingerprint, prompt, settings, db, embedder)

    @classmethod
    def open(cls, path, lm: LoadedModel, embedder: Embedder | None = None,
             read_only: bool | None = None) -> KnowledgeStore:
        """An existing store, checked against ``lm``: another model or another ``S`` is refused.

        ``read_only`` (default: when this process cannot write the folder) opens it without writing
        anything: answering and verifying work on read-only media; a write raises a clear error."""
        path = Path(path)
        if not (path / DB_NAME).is_file():
            raise missing_store(path)
        if read_only is None:
            read_only = not store_is_writable(path)
        db = connect(path / DB_NAME, None if read_only else SCHEMA, read_only=read_only)
        settings = read_settings(db)
        prompt = check_usable(path, settings, lm, embedder)
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
            self.chunks.forget()
            self.index.reload(self.settings)
            self._generation = current
            return True

    def recorded_settings(self) -> dict[str, Any]:
        """The settings as the database holds them now (``settings`` is the copy read at open/refresh)."""
        with self._lock:
            return read_settings(self._db)

    # ------------------------------------------------------------ reading: chunks and search

    def chunk_ids(self) -> list[int]:
        return self.chunks.ids()

    def chunk(self, chunk_id: int) -> ChunkRecord:
        return self.chunks.get(chunk_id)

    def find_by_hash(self, content_hash: str) -> int | None:
        return self.chunks.find_by_hash(content_hash)

    def doc_groups(self) -> dict[str, list[int]]:
        return self.chunks.doc_groups()

    def chunk_ids_of_docs(self, docs: Sequence[str]) -> list[int]:
        """The chunks these documents use (any of them), in id order (= their order in the document)."""
        return self.documents.chunks_of_any(docs)

    def source_of(self, chunk_id: int) -> str:
        """Where a chunk came from, for citing: its document's id (an ingested file's resolved path, a
        posted id), else the name its reader gave it."""
        docs = self.documents.using([chunk_id])
        return docs[0] if docs else self.chunk(chunk_id).doc

    def search(self, query: str, k: int) -> list[int]:
        """Chunk ids ranked by similarity to ``query`` (at most ``k``)."""
        return [cid for cid, _ in self.search_scored(query, k)]

    def search_scored(self, query: str, k: int) -> list[tuple[int, float]]:
        """``(chunk id, cosine similarity)`` ranked by similarity to ``query`` (at most ``k``)."""
        if k <= 0 or len(self.index) == 0:
            return []
        return self.index.search(self.embedder.embed([query]), k)

    def search_each(self, queries: Sequence[str], k: int) -> list[int]:
        """Chunk ids near any of ``queries`` (each one's ``k`` nearest, in query order, no repeats), embedded in
        one batch: the windows of a text too long for one embedding."""
        if k <= 0 or len(self.index) == 0 or not queries:
            return []
        vectors = self.embedder.embed(list(queries))
        found = (cid for i in range(len(queries)) for cid, _ in self.index.search(vectors[i:i + 1], k))
        return list(dict.fromkeys(found))

    def retrieve(self, query: str, k: int) -> list[dict[str, Any]]:
        """The ``k`` chunks most similar to ``query`` as passages (``chunk_id, title, text, source, score``):
        what ``POST /v1/retrieve`` returns, and what a request sending them back reuses exactly."""
        out = []
        for cid, score in self.search_scored(query, k):
            rec = self.chunk(cid)
            out.append({"chunk_id": cid, "title": rec.title, "text": rec.text, "source": self.source_of(cid),
                        "score": round(float(score), 4)})
        return out

    def neighbours(self, chunk_ids: Sequence[int], top_n: int, among: dict[int, set[int]] | None = None,
                   min_similarity: float | None = None) -> dict[int, list[int]]:
        """Each chunk's ``top_n`` most similar chunks (:meth:`StoreIndex.neighbours`)."""
        return self.index.neighbours(chunk_ids, top_n, among=among, min_similarity=min_similarity)

    def vectors(self, chunk_ids: Sequence[int]) -> np.ndarray:
        """The chunks' unit embeddings (rows in the order given)."""
        return self.index.vectors(chunk_ids)

    # ------------------------------------------------------------ reading: KV files (store.kv)

    def has_kv(self, chunk_id: int, kind: str) -> bool:
        return self.kv.has(chunk_id, kind)

    def kv_path(self, chunk_id: int | None, kind: str) -> Path:
        return self.kv.path(chunk_id, kind)

    @property
    def kv_root(self) -> Path:
        return self.kv.root

    @property
    def kv_dtype(self) -> str:
        return self.kv.dtype

    def load_system_kv(self, dtype: str | None = None) -> KV | None:
        return self.kv.load_system(dtype)

    def load_entry(self, chunk_id: int, kind: str = "fused") -> KVEntry:
        return self.kv.load_entry(chunk_id, kind)

    def kv_source(self) -> DiskSource:
        """The store's KV files as a :class:`~fusionrag.kvcache.sources.KVSource` (verified reads)."""
        return self.kv.source()

    def cold_kv_source(self) -> ColdDiskSource:
        return self.kv.cold_source()

    def shared_kv_source(self, url: str) -> Any:
        return self.kv.shared_source(url)

    # ------------------------------------------------------------ writing what spans the collaborators

    def insert_chunks(self, chunks: Sequence[Chunk], progress: bool = False,
                      refs: Sequence[str] | None = None) -> tuple[list[int], float]:
        """Embed and add new (not yet stored, unique) chunks; returns their ids and the embedding time.

        ``refs``: the document using each chunk (default: its ``doc``, the reader's group name)."""
        if not chunks:
            return [], 0.0
        t0 = time.perf_counter()
        vectors = embed_all(self.embedder, [chunk_text(c.title, c.text) for c in chunks], progress)
        embed_s = time.perf_counter() - t0
        with self._lock:
            with self._db:  # one transaction: all or none (SQLite is the source of truth)
                ids = self.chunks.next_ids(len(chunks))
                self.documents.reference_new(ids, [c.doc for c in chunks] if refs is None else [str(r) for r in refs])
                self.chunks.insert(ids, chunks, vectors)
            self.index.add(ids, vectors)
        return ids, embed_s

    def remove_unreferenced(self) -> list[int]:
        """Remove every chunk no document uses (metadata, vectors, KV files); returns their ids. Also mends
        a run stopped between changing references and removing chunks."""
        with self._lock:
            with self._db:
                ids = self.chunks.unreferenced()
                self.chunks.delete(ids)
            if ids:
                self.index.remove(ids)
            self.kv.remove_chunks(ids)
        return ids

    def drop_documents(self, doc_ids: Iterable[str]) -> list[int]:
        """Remove these documents (rows and references) and every chunk no other document uses;
        returns the removed chunk ids."""
        self.documents.drop(doc_ids)
        return self.remove_unreferenced()

    def delete_doc(self, doc: str) -> list[int]:
        """Remove document ``doc``: its references, and every chunk no other document still uses
        (metadata, vectors and KV files). Returns the removed chunk ids.

        Chunk ids are never reused. Fused KVs of other chunks that had a removed chunk
        among their neighbours stay valid caches; the next fuse sees their neighbour
        lists change and re-fuses them (incremental update). Online tiers holding the
        removed entries must be told: :func:`fusionrag.offline.build.delete_document`
        returns their keys.
        """
        return self.drop_documents([doc]) if self.documents.chunks_of(doc) or self.documents.get(doc) else []

    def sweep_interrupted(self) -> dict[str, int]:
        """Finish what a removal killed midway left (the caller holds the writer lock): chunks no document
        uses, KV files of chunks that are gone, an index that no longer counts the chunks. Counts of each."""
        removed = self.remove_unreferenced()
        orphans = self.kv.orphans(self.chunk_ids())
        for path in orphans:
            path.unlink(missing_ok=True)
        stale_index = self.recorded_settings().get("index_count") != len(self.chunk_ids())
        if stale_index:
            self.index.rebuild()
        return {"chunks_removed": len(removed), "kv_files_removed": len(orphans), "index_rebuilt": int(stale_index)}

    def convert_kv_dtype(self, dtype: str) -> list[tuple[int, str]]:
        """Re-encode every chunk entry in ``dtype`` (no model run) and record it; returns the rewritten keys
        (:meth:`StoredKV.convert`: each entry verified first; interrupted, running it again finishes)."""
        dtype = canonical_dtype(dtype)
        old = self.kv.dtype
        if dtype == old:
            return []
        self.update_settings(kv_dtype=dtype, converted_from=old)
        return self.kv.convert(dtype, self.chunk_ids())
