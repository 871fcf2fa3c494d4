"""What a store holds, read without loading its model (``fusionrag store info``, ``stored_model``)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError, StoreMismatchError
from fusionrag.retrieval.store_files import connect
from fusionrag.retrieval.stored_docs import DocumentRecord, query_documents

DB_NAME = "store.sqlite"
INDEX_NAME = "index.faiss"
KV_DIR = "kv"


def read_settings(db: sqlite3.Connection) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM settings")}


def require_store(path) -> Path:
    """``path`` as a Path when a store's database is there, else the one-line error every command gives."""
    path = Path(path)
    if not (path / DB_NAME).is_file():
        raise missing_store(path)
    return path


def missing_store(path) -> FusionRAGError:
    """The one error every command and the API give for a path that holds no store."""
    return FusionRAGError(f"no knowledge store at '{path}'; create one with 'fusionrag ingest FILES --store {path}'")


def _open_read_only(path: Path) -> sqlite3.Connection:
    return connect(require_store(path) / DB_NAME, read_only=True)


def stored_model(path) -> str:
    """The model a store was built with (what :func:`fusionrag.models.load_model` needs to reload it)."""
    db = _open_read_only(Path(path))
    try:
        return str(read_settings(db)["model"])
    finally:
        db.close()


def list_documents(path) -> list[DocumentRecord]:
    """A store's documents with their chunk counts, read without loading its model (``fusionrag documents``)."""
    db = _open_read_only(Path(path))
    try:
        return query_documents(db)
    finally:
        db.close()


def preprocess_hint(path) -> str | None:
    """One sentence when the store holds chunks but was never preprocessed (no fused KV: FusionRAG then reuses
    plain KV, and usage counts ``fused_fallbacks``), else None. Read from its settings, no model loaded."""
    db = _open_read_only(Path(path))
    try:
        settings = read_settings(db)
        chunks = db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    finally:
        db.close()
    if settings.get("fuse") or settings.get("top_n") is not None or not chunks:  # top_n: older stores' record
        return None
    return (f"the store {path} was never preprocessed (no fused KV): FusionRAG reuses its plain KV instead "
            f"(usage counts them as fused_fallbacks); run 'fusionrag preprocess --store {path}' once")


def kv_chunk_ids(path) -> dict[str, set[int]]:
    """The chunk ids that have a KV file, by kind (``plain``, ``fused``): read from the file names."""
    found: dict[str, set[int]] = {"plain": set(), "fused": set()}
    for f in (Path(path) / KV_DIR).glob("*/*.safetensors"):
        cid, _, rest = f.name.partition(".")
        kind = rest.removesuffix(".safetensors")
        if cid.isdigit() and kind in found:
            found[kind].add(int(cid))
    return found


def document_kv(path) -> dict[str, dict[str, int]]:
    """Per document id: its ``chunks``, how many have KV (``with_kv``: plain or fused) and how many are ``fused``.
    A document whose chunks all have KV is complete: an interrupted ingest leaves the others without."""
    have = kv_chunk_ids(path)
    usable = have["plain"] | have["fused"]
    db = _open_read_only(Path(path))
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        rows = db.execute(f"SELECT doc, {'chunk_id' if 'chunk_refs' in tables else 'id'} FROM "
                          f"{'chunk_refs' if 'chunk_refs' in tables else 'chunks'}").fetchall()
    finally:
        db.close()
    out: dict[str, dict[str, int]] = {}
    for doc, cid in rows:
        d = out.setdefault(doc, {"chunks": 0, "with_kv": 0, "fused": 0})
        d["chunks"] += 1
        d["with_kv"] += int(cid) in usable
        d["fused"] += int(cid) in have["fused"]
    return out


def store_info(path) -> dict[str, Any]:
    """Summary of a store without loading its model (what ``fusionrag store info`` prints)."""
    path = Path(path)
    db = _open_read_only(path)
    try:
        settings = read_settings(db)
        n_chunks, n_tokens = db.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM chunks").fetchone()
        has_refs = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunk_refs'").fetchone() is not None
        n_docs = db.execute("SELECT COUNT(DISTINCT doc) FROM "  # stores made before chunk_refs: chunks.doc
                            + ("chunk_refs" if has_refs else "chunks")).fetchone()[0]
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
        "system_prompt": settings.get("system_prompt"),  # the instruction in S (rag_messages takes it)
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
        "fused_kv_bytes_per_token": round(fused_bytes / n_tokens, 1) if n_tokens and len(fused) == n_chunks else None,
        "bytes_on_disk": total,
        "settings": {k: settings.get(k) for k in (
            "fuse", "chunk_tokens", "kv_dtype", "plain_kv", "converted_from", "embedder", "embedding_dim",
            "system_tokens", "created")},
        "auto_ratio": _auto_ratio(settings.get("auto_ratio")),
    }


def _auto_ratio(setting: Any) -> dict[str, Any] | None:
    """What ``ratio="auto"`` runs with (``fusionrag calibrate``'s record, without its per-mass grid); None: never
    calibrated (the default applies)."""
    if not isinstance(setting, dict):
        return None
    calibration = {k: v for k, v in (setting.get("calibration") or {}).items() if k != "grid"}
    return {**{k: setting.get(k) for k in ("mass", "floor", "ceiling")}, "calibration": calibration}


def check_model_matches(path, model: str) -> None:
    """Refuse, before any model is loaded or converted, a ``--model`` that cannot be the store's.

    Two different short names, or a local checkpoint of another architecture than the one the
    store's fingerprint records, cannot have made its caches. Anything else (the same weights may
    sit in another folder) is checked on the loaded model's fingerprint, as always."""
    from fusionrag.models.options import KNOWN_NAMES

    db = _open_read_only(Path(path))
    try:
        settings = read_settings(db)
    finally:
        db.close()
    recorded = str(settings.get("model"))
    if model == recorded:
        return
    why = None
    if model in KNOWN_NAMES and recorded in KNOWN_NAMES:
        why = f"it was built with {recorded}"
    else:
        folder = Path(model).expanduser()
        arch = str(settings.get("fingerprint", "")).partition(":")[0]
        try:
            theirs = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            theirs = None
        if theirs and arch and theirs != arch:
            why = f"it was built with {recorded} (a {arch} model), and {model} is a {theirs} model"
    if why:
        raise StoreMismatchError(f"--model {model} cannot use the knowledge base at {path}: {why}. Leave --model "
                                 "out to use the store's model, or build a new store for this one.")
