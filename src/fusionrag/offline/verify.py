"""``fusionrag store verify [--repair]``: check every file of a store, and mend what is broken.

What is checked (SQLite itself is checked when the store opens: ``PRAGMA quick_check``):
- the FAISS index against the digest and vector count recorded in SQLite;
- the instruction's KV (``kv/system.safetensors``: ``S``, which every prompt starts with), fully verified;
- every chunk's plain and fused KV entry, fully verified (checksum, model, ``S``, tokens);
  a missing plain entry is a problem (every chunk needs one), a missing fused entry only
  in a fused store;
- the documents table against the chunks (every chunk used by a document, every reference to a chunk);
- orphan KV files (no chunk with that id in SQLite) and temp files of interrupted writers.

``repair`` removes what cannot be trusted (bad entries, orphans, temp files), rebuilds the
index from SQLite if it does not match, recomputes ``S``'s KV and the plain KV that is missing and,
in a fused store, re-fuses with the recorded settings: afterwards a second ``verify`` is clean.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from fusionrag.errors import CacheIntegrityError
from fusionrag.files import remove_temp_files
from fusionrag.kvcache.store import CHUNK_KINDS, ENTRY_NAME
from fusionrag.models.registry import LoadedModel
from fusionrag.offline import build
from fusionrag.offline.compact import keeps_plain
from fusionrag.offline.preprocess import compute_plain
from fusionrag.retrieval.knowledge import KnowledgeStore


@dataclass
class Problem:
    kind: str  # "index" | "kv" | "documents" | "orphan" | "temp"
    what: str  # which file or entry
    why: str
    repaired: str | None = None


@dataclass
class VerifyReport:
    chunks: int = 0
    entries_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    repaired: bool = False

    @property
    def ok(self) -> bool:
        return not [p for p in self.problems if p.repaired is None]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_store(store: KnowledgeStore, lm: LoadedModel | None = None, repair: bool = False,
                 progress: bool = False) -> VerifyReport:
    """Check the store (see the module docstring); with ``repair`` (needs ``lm``), mend it."""
    if repair and lm is None:
        raise ValueError("repairing needs the store's model (it recomputes KV)")
    report = VerifyReport()
    ids = store.chunk_ids()
    report.chunks = len(ids)
    fused_store = build.recorded_fuse_settings(store) is not None
    with store.writer() if repair else contextlib.nullcontext():
        _check_system(store, report, repair)
        _check_documents(store, report, repair)
        _check_index(store, report, repair)
        _check_entries(store, ids, fused_store, report, repair)
        _check_files(store, set(ids), report, repair)
        if fused_store:  # after the files: an entry already reported broken is not reported stale too
            _check_stale(store, report)
        if repair and lm is not None:
            build.ensure_system_kv(store, lm)  # recomputed if it was removed above (or never stored)
            if keeps_plain(store):  # a fused-only store re-creates plain KV only where a fuse needs it
                compute_plain(store, lm, build.ensure_system_kv(store, lm), progress=progress)
            if fused_store:
                build.fuse(store, lm, progress=progress)
            for p in report.problems:
                if p.kind == "kv" and p.repaired is None:
                    p.repaired = "recomputed"
            report.repaired = True
    return report


def _check_system(store: KnowledgeStore, report: VerifyReport, repair: bool) -> None:
    """``S``'s KV: every prompt starts with it, so a damaged copy makes the store unable to answer."""
    path = store.kv_path(None, "system")
    if not store.kv.present(None, "system"):
        return  # computed when needed (and stored by the next build step); a link there is checked below
    report.entries_checked += 1
    try:
        store.load_system_kv()
    except CacheIntegrityError as exc:
        problem = Problem("kv", "system prompt KV", _short(str(exc)))
        if repair:
            path.unlink(missing_ok=True)
            problem.repaired = "recomputed"
        report.problems.append(problem)


def _check_documents(store: KnowledgeStore, report: VerifyReport, repair: bool) -> None:
    """The documents table against the chunks: every chunk used by some document, every reference to a chunk
    that exists (``repair``: unused chunks removed, dangling references dropped)."""
    unused, dangling = store.documents.reference_problems()
    if unused:
        problem = Problem("documents", f"{len(unused)} chunk(s)", "used by no document (a run stopped between its "
                          "steps)")
        if repair:
            store.remove_unreferenced()
            problem.repaired = "removed"
        report.problems.append(problem)
    if dangling:
        problem = Problem("documents", f"{len(dangling)} reference(s)", "to chunks that do not exist")
        if repair:
            store.documents.drop_dangling_references()
            problem.repaired = "dropped"
        report.problems.append(problem)


def _check_index(store: KnowledgeStore, report: VerifyReport, repair: bool) -> None:
    why = store.index.mismatch()
    if why is None:
        return
    problem = Problem("index", store.index.path.name, why)
    if repair:
        store.index.rebuild()  # from the SQLite embeddings
        problem.repaired = "rebuilt from SQLite"
    report.problems.append(problem)


def _check_entries(store: KnowledgeStore, ids: list[int], fused_store: bool, report: VerifyReport,
                   repair: bool) -> None:
    for cid in ids:
        for kind in CHUNK_KINDS:
            path = store.kv_path(cid, kind)
            if not path.exists():
                if (kind == "plain" and keeps_plain(store)) or (kind == "fused" and fused_store):
                    report.problems.append(Problem("kv", f"{kind} KV of chunk {cid}", "missing"))
                continue
            report.entries_checked += 1
            try:
                store.load_entry(cid, kind)
            except CacheIntegrityError as exc:
                report.problems.append(Problem("kv", f"{kind} KV of chunk {cid}", _short(str(exc))))
                if repair:
                    path.unlink(missing_ok=True)


def _check_stale(store: KnowledgeStore, report: VerifyReport) -> None:
    """Fused entries built on neighbours the store no longer has (a delete whose re-fuse did not finish:
    the process was killed after its commit). ``repair``'s fuse recomputes them."""
    recorded = build.recorded_fuse_settings(store)
    if recorded is None:
        return
    reported = {p.what for p in report.problems}
    for cid in build.stale_fused(store, recorded, verify=False):
        if store.kv_path(cid, "fused").exists() and f"fused KV of chunk {cid}" not in reported:
            report.problems.append(Problem("kv", f"fused KV of chunk {cid}", "stale: its neighbours changed since "
                                                                             "it was computed"))


def _check_files(store: KnowledgeStore, ids: set[int], report: VerifyReport, repair: bool) -> None:
    root = store.kv_root
    if not root.is_dir():
        return
    for path in sorted(root.glob("*/*.safetensors")):
        m = ENTRY_NAME.fullmatch(path.name)
        if m is None or int(m.group(1)) not in ids:
            problem = Problem("orphan", str(path.relative_to(store.path)), "no chunk with this id in the metadata")
            if repair:
                path.unlink(missing_ok=True)
                problem.repaired = "removed"
            report.problems.append(problem)
    temps = list(root.rglob(".*.tmp"))
    if temps:
        problem = Problem("temp", f"{len(temps)} temp file(s)", "left by an interrupted writer")
        if repair:
            remove_temp_files(root)
            problem.repaired = "removed"
        report.problems.append(problem)


def _short(message: str) -> str:
    """The reason without the file path (the table already says which entry)."""
    return re.sub(r"\s*\(/[^)]*\)", "", message).split("; delete it")[0]
