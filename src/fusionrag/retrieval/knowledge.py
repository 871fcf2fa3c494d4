"""The knowledge base on disk: chunks, vectors and KV caches, bound to one model.

A store folder holds:

- ``store.sqlite``: settings, and per chunk its document, title, text, token ids (JSON),
  token count, content hash, embedding (float32 bytes) and the neighbour list its fused
  KV was computed with. SQLite is the source of truth.
- ``index.faiss``: the vector index (rebuilt from the SQLite embeddings if missing or
  stale, e.g. after a crash between the two writes).
- ``kv/``: one verified safetensors file per (chunk, kind) plus ``S``'s KV
  (:mod:`fusionrag.kvcache.store`).

The store records the model fingerprint and the system-prompt hash; opening it with
another model, or loading a cache made after another ``S``, raises
:class:`CacheIntegrityError`. Every step is resumable (see :mod:`fusionrag.offline.preprocess`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.store import KVEntry, KVStore, canonical_dtype
from fusionrag.models.registry import LoadedModel
from fusionrag.offline.preprocess import DEFAULT_NEIGHBOUR_ORDER
from fusionrag.prompt import PromptBuilder, chunk_text
from fusionrag.retrieval.chunking import (
    DEFAULT_CHUNK_TOKENS,
    Chunk,
    Passage,
    Problem,
    dedup,
    expand_paths,
    make_chunks,
    read_passages,
)
from fusionrag.retrieval.embedder import Embedder, get_embedder
from fusionrag.retrieval.index import VectorIndex

STORE_FORMAT = "fusionrag-store/1"
DB_NAME = "store.sqlite"
INDEX_NAME = "index.faiss"
KV_DIR = "kv"

_SCHEMA = """
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
"""


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

    @property
    def prompt_text(self) -> str:
        return chunk_text(self.title, self.text)


@dataclass
class IngestReport:
    files: int = 0
    passages: int = 0
    chunks: int = 0  # chunks cut from the input, duplicates included
    new_chunks: int = 0
    duplicates: int = 0  # within the input or already in the store
    new_ids: list[int] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    plain_computed: int = 0
    embed_seconds: float = 0.0
    plain_seconds: float = 0.0
    seconds: float = 0.0
    fuse: dict[str, Any] | None = None  # the incremental re-fuse (a PreprocessReport), if the store is preprocessed

    @property
    def plain_chunks_per_s(self) -> float:
        return self.plain_computed / self.plain_seconds if self.plain_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = [str(p) for p in self.problems]
        d["plain_chunks_per_s"] = round(self.plain_chunks_per_s, 3)
        d["plain_s_per_chunk"] = round(self.plain_seconds / self.plain_computed, 4) if self.plain_computed else 0.0
        for k in ("embed_seconds", "plain_seconds", "seconds"):
            d[k] = round(d[k], 3)
        if len(d["new_ids"]) > 50:
            d["new_ids"] = [*d["new_ids"][:50], f"... {len(self.new_ids) - 50} more"]
        return d


class KnowledgeStore:
    """Facade over a store folder, used by ``ingest``/``preprocess`` and the online engine."""

    def __init__(self, path: Path, lm: LoadedModel, settings: dict[str, Any], db: sqlite3.Connection,
                 embedder: Embedder | None) -> None:
        self.path = Path(path)
        self.lm = lm
        self.prompt = PromptBuilder(lm.tokenizer)
        self.settings = settings
        self.db = db
        self._embedder = embedder
        self.kv = KVStore(self.path / KV_DIR, lm.fingerprint, self.prompt.system_hash, settings["kv_dtype"])
        self._system_kv: KV | None = None
        self._records: dict[int, ChunkRecord] = {}
        self._lock = threading.RLock()
        self.index = self._load_index()

    # ------------------------------------------------------------ create / open

    @classmethod
    def create(cls, path, lm: LoadedModel, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, kv_dtype: str = "float16",
               embedder: Embedder | None = None, model_source: str | None = None) -> KnowledgeStore:
        """A new, empty store for ``lm`` (``model_source``: what :func:`load_model` needs to reload it)."""
        path = Path(path)
        if (path / DB_NAME).exists():
            raise FusionRAGError(f"a knowledge base already exists at {path}; open it instead of creating it")
        if chunk_tokens < 8:
            raise FusionRAGError(f"chunk size must be at least 8 tokens, got {chunk_tokens}")
        kv_dtype = canonical_dtype(kv_dtype)
        embedder = embedder if embedder is not None else get_embedder(None)
        prompt = PromptBuilder(lm.tokenizer)
        settings = {
            "format": STORE_FORMAT,
            "model": model_source or lm.name,
            "fingerprint": lm.fingerprint,
            "system_hash": prompt.system_hash,
            "system_tokens": len(prompt.system_ids),
            "chunk_tokens": int(chunk_tokens),
            "kv_dtype": kv_dtype,
            "embedder": embedder.name,
            "embedding_dim": int(embedder.dim),
            "top_n": None,  # set by the first preprocess; then ingest keeps the store fused
            "neighbour_order": DEFAULT_NEIGHBOUR_ORDER,
            "same_document": False,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        path.mkdir(parents=True, exist_ok=True)
        db = _connect(path / DB_NAME)
        with db:
            db.executemany("INSERT INTO settings(key, value) VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in settings.items()])
        store = cls(path, lm, settings, db, embedder)
        store.system_kv()
        return store

    @classmethod
    def open(cls, path, lm: LoadedModel | None = None, embedder: Embedder | None = None) -> KnowledgeStore:
        """An existing store; loads its model if ``lm`` is None, refuses a different model."""
        path = Path(path)
        if not (path / DB_NAME).is_file():
            raise FusionRAGError(f"no knowledge base at {path} (create one with: fusionrag ingest PATH --store {path})")
        db = _connect(path / DB_NAME)
        settings = read_settings(db)
        if settings.get("format") != STORE_FORMAT:
            raise FusionRAGError(f"{path}: unsupported store format {settings.get('format')!r}")
        if lm is None:
            from fusionrag.models import load_model

            lm = load_model(settings["model"])
        if lm.fingerprint != settings["fingerprint"]:
            raise CacheIntegrityError(
                f"the knowledge base at {path} was built with model {settings['model']} ({settings['fingerprint']}); "
                f"the loaded model {lm.name} ({lm.fingerprint}) cannot reuse its caches. Use --model "
                f"{settings['model']} or build a new store."
            )
        system_hash = PromptBuilder(lm.tokenizer).system_hash
        if system_hash != settings["system_hash"]:
            raise CacheIntegrityError(
                f"the knowledge base at {path} was built with another system prompt "
                f"({settings['system_hash']} != {system_hash}); its caches cannot be reused"
            )
        if embedder is not None and embedder.name != settings["embedder"]:
            raise FusionRAGError(
                f"the knowledge base at {path} was embedded with {settings['embedder']}, not {embedder.name}"
            )
        return cls(path, lm, settings, db, embedder)

    def close(self) -> None:
        with self._lock:
            self.db.close()

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
        with self._lock, self.db:
            self.db.executemany("INSERT OR REPLACE INTO settings(key, value) VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in values.items()])
        self.settings.update(values)

    # ------------------------------------------------------------ chunks

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

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

    def neighbours_of(self, chunk_id: int) -> list[int] | None:
        """The neighbour list the chunk's fused KV was computed with (None if never fused)."""
        rows = self._query("SELECT neighbours FROM chunks WHERE id = ?", (int(chunk_id),))
        return None if not rows or rows[0][0] is None else json.loads(rows[0][0])

    def record_neighbours(self, neighbours: dict[int, Sequence[int]]) -> None:
        if neighbours:
            with self._lock, self.db:
                self.db.executemany("UPDATE chunks SET neighbours = ? WHERE id = ?",
                                    [(json.dumps([int(n) for n in v]), int(k)) for k, v in neighbours.items()])

    def _insert(self, chunks: Sequence[Chunk], progress: bool = False) -> tuple[list[int], float]:
        """Embed and add new (not yet stored, unique) chunks; returns their ids and the embedding time."""
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
            with self.db:  # one transaction: all or none (SQLite is the source of truth)
                row = self.db.execute("SELECT MAX(id) FROM chunks").fetchone()
                first = 0 if row[0] is None else int(row[0]) + 1
                ids = list(range(first, first + len(chunks)))
                self.db.executemany(
                    "INSERT INTO chunks(id, doc, title, text, token_ids, n_tokens, content_hash, embedding) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(i, c.doc, c.title, c.text, json.dumps(list(c.token_ids)), c.n_tokens, c.content_hash,
                      vectors[j].tobytes()) for j, (i, c) in enumerate(zip(ids, chunks, strict=True))],
                )
            # A crash before this save leaves the index behind SQLite; the next open rebuilds it.
            self.index.add(ids, vectors)
            self.index.save(self.path / INDEX_NAME)
        return ids, embed_s

    def delete_doc(self, doc: str) -> list[int]:
        """Remove every chunk of document ``doc``: metadata, vectors and KV files. Returns the removed ids.

        Chunk ids are never reused. Fused KVs of other chunks that had a removed chunk
        among their neighbours stay valid caches; the next ``preprocess`` sees their
        neighbour lists change and re-fuses them (incremental update).
        """
        with self._lock:
            ids = [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE doc = ?", (doc,)).fetchall()]
            if not ids:
                return []
            with self.db:
                self.db.executemany("DELETE FROM chunks WHERE id = ?", [(i,) for i in ids])
            self.index.remove(ids)
            self.index.save(self.path / INDEX_NAME)
            for cid in ids:
                self._records.pop(cid, None)
                for kind in ("plain", "fused"):
                    self.kv.path(cid, kind).unlink(missing_ok=True)
        return ids

    # ------------------------------------------------------------ index

    def _load_index(self) -> VectorIndex:
        dim = int(self.settings["embedding_dim"])
        n = self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
        path = self.path / INDEX_NAME
        if path.is_file():
            try:
                index = VectorIndex.load(path, dim)
                if len(index) == n:
                    return index
            except FusionRAGError:
                pass
        # Missing, unreadable or behind SQLite (crash between the two writes): rebuild.
        index = VectorIndex(dim)
        rows = self.db.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        if rows:
            index.add([r[0] for r in rows], np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows]))
        index.save(path)
        return index

    def search(self, query: str, k: int) -> list[int]:
        """Chunk ids ranked by similarity to ``query`` (at most ``k``)."""
        if k <= 0 or len(self.index) == 0:
            return []
        _, ids = self.index.search(self.embedder.embed([query]), min(k, len(self.index)))
        return [int(i) for i in ids[0] if i >= 0]

    # ------------------------------------------------------------ KV

    def system_kv(self) -> KV:
        """KV of ``S`` (computed once, stored in fp32: it prefixes every prompt)."""
        if self._system_kv is None:
            ids = self.prompt.system_ids
            if self.kv.exists(None, "system"):
                kv = self.kv.load(None, "system", token_ids=ids).kv
            else:
                from fusionrag.execution.forward import prefill

                kv, _ = prefill(self.lm, torch.tensor(ids))
                self.kv.save(None, "system", kv, ids, dtype="float32")
            self._system_kv = kv.to(self.lm.model.dtype)
        return self._system_kv

    def has_kv(self, chunk_id: int, kind: str) -> bool:
        """Whether an entry exists (not verified; :meth:`load_kv` verifies)."""
        return self.kv.exists(chunk_id, kind)

    def load_entry(self, chunk_id: int, kind: str = "fused") -> KVEntry:
        """KV, scores and header metadata of one entry, verified."""
        return self.kv.load(chunk_id, kind, token_ids=self.chunk(chunk_id).token_ids)

    def load_kv(self, chunk_id: int, kind: str = "fused", dtype: torch.dtype | None = None) -> KV:
        """A verified chunk cache at its stored base position ``len(S)``, in the storage dtype
        unless ``dtype`` is given (``assemble`` converts to fp32 before rotating anyway)."""
        kv = self.load_entry(chunk_id, kind).kv
        return kv if dtype is None else kv.to(dtype)

    def load_scores(self, chunk_id: int) -> torch.Tensor | None:
        """Cache-Craft scores stored with the fused entry (None if it has none)."""
        if not self.has_kv(chunk_id, "fused"):
            return None
        return self.load_entry(chunk_id, "fused").scores

    # ------------------------------------------------------------ building

    def ingest(self, paths: Iterable[Path | str], progress: bool = True) -> IngestReport:
        """Read, chunk, dedup, embed and index ``paths``; plain KV for new chunks; re-fuse if preprocessed."""
        from fusionrag.offline.preprocess import run_plain, run_preprocess

        t0 = time.perf_counter()
        report = IngestReport()
        self.kv.remove_temp_files()
        files = expand_paths(paths, report.problems)
        report.files = len(files)
        passages: list[Passage] = []
        for f in tqdm(files, unit="file", desc="read", disable=not progress or len(files) < 2):
            passages.extend(read_passages(f, report.problems))
        report.passages = len(passages)
        chunks = make_chunks(self.prompt, passages, int(self.settings["chunk_tokens"]), report.problems)
        report.chunks = len(chunks)
        unique, dups = dedup(chunks)
        new = [c for c in unique if self.find_by_hash(c.content_hash) is None]
        report.duplicates = dups + len(unique) - len(new)
        report.new_ids, report.embed_seconds = self._insert(new, progress)
        report.new_chunks = len(new)
        # Every chunk lacking plain KV, not only the new ones: completes an interrupted ingest.
        report.plain_computed, report.plain_seconds = run_plain(self, progress=progress)
        if self.settings.get("top_n") is not None:
            report.fuse = run_preprocess(
                self, top_n=int(self.settings["top_n"]), neighbour_order=self.settings["neighbour_order"],
                same_document=bool(self.settings["same_document"]), progress=progress,
            ).to_dict()
        report.seconds = time.perf_counter() - t0
        return report

    def add_passages(self, passages: list[dict], doc: str = "api", plain_kv: bool = True) -> list[int]:
        """Add ``{title, text}`` passages (split if longer than a chunk); returns their chunk ids in order.

        Duplicates map to the existing ids. New chunks get plain KV (unless ``plain_kv`` is
        False: callers adding many small batches compute it once, with a progress bar, via
        ``run_plain`` or ``preprocess``), not fused KV (the next ``preprocess`` fuses them).
        """
        from fusionrag.offline.preprocess import run_plain

        items = []
        for i, p in enumerate(passages):
            if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                raise FusionRAGError(f"passage {i} must be a dict with a 'text' string (and optionally 'title')")
            items.append(Passage(str(p.get("title") or ""), p["text"], doc=str(p.get("doc") or doc)))
        chunks = make_chunks(self.prompt, items, int(self.settings["chunk_tokens"]))
        unique, _ = dedup(chunks)
        new = [c for c in unique if self.find_by_hash(c.content_hash) is None]
        self._insert(new)
        ids = [self.find_by_hash(c.content_hash) for c in chunks]
        if plain_kv:
            run_plain(self, chunk_ids=[i for i in dict.fromkeys(ids) if i is not None], progress=False)
        return [int(i) for i in ids if i is not None]

    def preprocess(self, top_n: int = 10, progress: bool = True, chunk_ids: Sequence[int] | None = None, *,
                   neighbour_order: str | None = None, same_document: bool | None = None, batch_size: int = 4):
        """Fuse chunks (all by default) with their top-n neighbours; resumable. Returns a PreprocessReport.

        ``neighbour_order`` / ``same_document`` default to the store's settings; the values
        used are saved, so later ingests keep the store fused the same way.
        """
        from fusionrag.offline.preprocess import prefix_order, run_preprocess

        order = neighbour_order or self.settings.get("neighbour_order") or DEFAULT_NEIGHBOUR_ORDER
        prefix_order([], order)
        same = bool(self.settings.get("same_document")) if same_document is None else bool(same_document)
        if top_n < 0:
            raise FusionRAGError(f"top-n must be >= 0, got {top_n}")
        self.update_settings(top_n=int(top_n), neighbour_order=order, same_document=same)
        self.kv.remove_temp_files()
        return run_preprocess(self, top_n=int(top_n), neighbour_order=order, same_document=same,
                              chunk_ids=chunk_ids, progress=progress, batch_size=batch_size)

    # ------------------------------------------------------------ reporting

    def info(self) -> dict[str, Any]:
        return store_info(self.path)


def _connect(path: Path) -> sqlite3.Connection:
    # Shared across threads (e.g. a web server's worker pool); access is serialised by the store's lock.
    db = sqlite3.connect(str(path), check_same_thread=False)
    db.executescript(_SCHEMA)
    return db


def read_settings(db: sqlite3.Connection) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM settings")}


def store_info(path) -> dict[str, Any]:
    """Summary of a store without loading its model (what ``fusionrag store info`` prints)."""
    path = Path(path)
    if not (path / DB_NAME).is_file():
        raise FusionRAGError(f"no knowledge base at {path}")
    db = sqlite3.connect(f"file:{path / DB_NAME}?mode=ro", uri=True)
    try:
        settings = read_settings(db)
        n_chunks, n_tokens = db.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM chunks").fetchone()
        n_docs = db.execute("SELECT COUNT(DISTINCT doc) FROM chunks").fetchone()[0]
    finally:
        db.close()
    kv_root = path / KV_DIR
    plain = list(kv_root.glob("*/*.plain.safetensors"))
    fused = list(kv_root.glob("*/*.fused.safetensors"))
    plain_bytes = sum(p.stat().st_size for p in plain)
    fused_bytes = sum(p.stat().st_size for p in fused)
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {
        "path": str(path),
        "model": settings.get("model"),
        "fingerprint": settings.get("fingerprint"),
        "system_hash": settings.get("system_hash"),
        "chunks": n_chunks,
        "documents": n_docs,
        "chunk_tokens_total": n_tokens,
        "plain_kv": len(plain),
        "fused_kv": len(fused),
        "plain_kv_bytes": plain_bytes,
        "fused_kv_bytes": fused_bytes,
        # per stored token, headers included (so slightly above the raw tensor size)
        "kv_bytes_per_token": round(plain_bytes / n_tokens, 1) if n_tokens and len(plain) == n_chunks else None,
        "bytes_on_disk": total,
        "settings": {k: settings.get(k) for k in (
            "top_n", "neighbour_order", "same_document", "chunk_tokens", "kv_dtype", "embedder", "embedding_dim",
            "system_tokens", "created")},
    }
