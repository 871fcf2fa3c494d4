"""Building a knowledge base: create, ingest, add passages, fuse, delete.

Everything that changes a store's contents lives here, so the questions "is this store
fused, and with which settings?" and "which cached entries did this change make stale?"
have one answer each:

- **Fuse settings** (:class:`FuseSettings`: top-n, neighbour order, same-document) are
  resolved by :func:`resolve_fuse_settings` (explicit argument > what the store recorded >
  defaults) and recorded in the store's ``fuse`` setting by :func:`fuse` (``fusionrag store
  info`` shows them). A store that was fused once stays fused: :func:`ingest` re-fuses
  with the recorded settings, and says so in its report.
- **Changed keys**: every mutation returns (or reports) the ``(chunk_id, kind)`` entries
  it rewrote or removed; the online engine's ``invalidate`` drops cached copies of them.

The store itself (:mod:`fusionrag.retrieval.knowledge`) is data and file access; the KV
computations are the pure batch functions of :mod:`fusionrag.offline.preprocess`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError
from fusionrag.execution.segments import system_kv as compute_system_kv
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.store import CHUNK_KINDS, DEFAULT_KV_DTYPE
from fusionrag.models.registry import LoadedModel
from fusionrag.offline import file_docs
from fusionrag.offline.compact import after_fuse, keeps_plain
from fusionrag.offline.preprocess import (
    DEFAULT_NEIGHBOUR_ORDER,
    FuseSettings,
    LocalRunner,
    PreprocessReport,
    compute_plain,
    fuse_store,
    stale_chunks,
)
from fusionrag.prompt import DEFAULT_SYSTEM_PROMPT
from fusionrag.retrieval.chunking import DEFAULT_CHUNK_TOKENS, Chunk, Passage, Problem, dedup, expand_paths, make_chunks
from fusionrag.retrieval.embedder import Embedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.readers import passages_from_text
from fusionrag.retrieval.stored_docs import DocumentRecord

Key = tuple[int, str]
F = TypeVar("F", bound=Callable[..., Any])


def _writes(fn: F) -> F:
    """Run a mutation under the store's writer lock (one writing process; the generation bumps after)."""

    @functools.wraps(fn)
    def wrapper(store: KnowledgeStore, *args: Any, **kwargs: Any) -> Any:
        with store.writer():
            return fn(store, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def recorded_fuse_settings(store: KnowledgeStore) -> FuseSettings | None:
    """The settings the store was last fused with (None: never fused)."""
    rec = store.settings.get("fuse")
    if rec:
        return FuseSettings(int(rec["top_n"]), rec["neighbour_order"], bool(rec["same_document"]),
                            rec.get("min_similarity"))
    if store.settings.get("top_n") is not None:  # stores written before the settings moved under "fuse"
        return FuseSettings(int(store.settings["top_n"]),
                            store.settings.get("neighbour_order") or DEFAULT_NEIGHBOUR_ORDER,
                            bool(store.settings.get("same_document")))
    return None


def resolve_fuse_settings(store: KnowledgeStore, top_n: int | None = None, neighbour_order: str | None = None,
                          same_document: bool | None = None, min_similarity: float | None = None) -> FuseSettings:
    """The one place fuse settings are decided: explicit values, else the store's recorded ones, else defaults."""
    base = recorded_fuse_settings(store) or FuseSettings()
    return FuseSettings(
        base.top_n if top_n is None else int(top_n),
        neighbour_order or base.neighbour_order,
        base.same_document if same_document is None else bool(same_document),
        base.min_similarity if min_similarity is None else float(min_similarity),
    )


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
    fuse: dict[str, Any] | None = None  # the incremental re-fuse (a PreprocessReport + settings), if the store is fused
    changed_keys: list[Key] = field(default_factory=list)  # fused entries rewritten by the re-fuse
    #: Documents by what became of them: added, updated (replaced), unchanged (skipped), removed.
    documents: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in DOCUMENT_OUTCOMES})
    removed_ids: list[int] = field(default_factory=list)  # chunks no document uses any more, removed
    removed_keys: list[Key] = field(default_factory=list)  # their entries: online tiers must drop them too

    @property
    def plain_chunks_per_s(self) -> float:
        return self.plain_computed / self.plain_seconds if self.plain_seconds > 0 else 0.0

    @property
    def failed_files(self) -> list[str]:
        """Files of which nothing was used (unreadable, broken, encrypted, unsupported, missing)."""
        return list(dict.fromkeys(p.path for p in self.problems if p.file_skipped))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["changed_keys"], d["removed_keys"]
        d["problems"] = [str(p) for p in self.problems]
        d["failed_files"] = self.failed_files
        d["documents"] = {k: _capped(v) for k, v in self.documents.items()}
        d["document_counts"] = {k: len(v) for k, v in self.documents.items()}
        d["removed_ids"] = _capped(self.removed_ids)
        d["plain_chunks_per_s"] = round(self.plain_chunks_per_s, 3)
        d["plain_s_per_chunk"] = round(self.plain_seconds / self.plain_computed, 4) if self.plain_computed else 0.0
        for k in ("embed_seconds", "plain_seconds", "seconds"):
            d[k] = round(d[k], 3)
        d["new_ids"] = _capped(self.new_ids)
        return d


DOCUMENT_OUTCOMES = ("added", "updated", "unchanged", "removed")


def _capped(items: Sequence[Any], most: int = 50) -> list[Any]:
    return list(items) if len(items) <= most else [*items[:most], f"... {len(items) - most} more"]


def _keys(chunk_ids: Iterable[int]) -> list[Key]:
    return [(cid, kind) for cid in chunk_ids for kind in CHUNK_KINDS]


def create_store(path: str | Path, lm: LoadedModel, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 kv_dtype: str = DEFAULT_KV_DTYPE, embedder: Embedder | None = None,
                 model_source: str | None = None, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> KnowledgeStore:
    """A new, empty store with ``S``'s KV computed (``system_prompt``: the instruction in ``S``)."""
    store = KnowledgeStore.create(path, lm, chunk_tokens=chunk_tokens, kv_dtype=kv_dtype, embedder=embedder,
                                  model_source=model_source, system_prompt=system_prompt)
    with store.writer():
        ensure_system_kv(store, lm)
    return store


def ensure_system_kv(store: KnowledgeStore, lm: LoadedModel) -> KV:
    """``S``'s KV from the store, computed and stored first if it is missing."""
    kv = store.load_system_kv()
    if kv is None:
        kv = compute_system_kv(lm, store.prompt.system_token_ids)
        store.kv.save_system(kv)
    return kv.to(lm.model.dtype)


@_writes
def ingest(store: KnowledgeStore, lm: LoadedModel, paths: Iterable[Path | str], progress: bool = True,
           fuse: bool | None = None, runner: LocalRunner | None = None, doc_id: str | None = None,
           sync: bool = False) -> IngestReport:
    """Read, chunk, dedup, embed and index ``paths``; plain KV for new chunks; then re-fuse.

    Each file is a document (:mod:`fusionrag.offline.file_docs`), keyed by its resolved path or
    ``doc_id`` (one file only). An unchanged file (same bytes) is skipped; a changed one replaces
    its document's chunks, and chunks no document uses any more are removed (their keys reported
    in ``removed_keys``). ``sync`` also removes the documents whose files, under the given paths,
    are gone.

    ``runner`` computes the KV batches (default in this process; ``offline.distributed`` on Ray).

    ``fuse`` None re-fuses a store that was fused before, with its recorded settings
    (new chunks get fused KV; chunks whose neighbour lists now include a new chunk, or lost a
    removed one, are re-fused); True fuses even a never-fused store with the defaults; False never fuses.
    """
    t0 = time.perf_counter()
    report = IngestReport()
    store.kv.remove_temp_files()
    given = [Path(p).expanduser() for p in paths]
    if doc_id is not None and (len(given) != 1 or given[0].is_dir()):
        raise FusionRAGError("--id names one document: give exactly one file with it")
    files = expand_paths([p for p in given if p.exists() or not sync], report.problems)
    gone = file_docs.synced_away(store, given, report.problems) if sync else []
    files = list({f.resolve(): f for f in files}.values())  # a file named twice is read once
    report.files = len(files)
    plans = [plan for f in tqdm(files, unit="file", desc="read", disable=not progress or len(files) < 2)
             if (plan := file_docs.read_document(store, f, doc_id, report.problems, report.documents)) is not None]
    report.passages = sum(plan.passages for plan in plans)
    chunks = [c for plan in plans for c in plan.chunks]
    report.chunks = len(chunks)
    unique, dups = dedup(chunks)
    first_user = {}
    for plan in plans:
        for c in plan.chunks:
            first_user.setdefault(c.content_hash, plan.record.id)
    new = [c for c in unique if store.find_by_hash(c.content_hash) is None]
    report.duplicates = dups + len(unique) - len(new)
    report.new_ids, report.embed_seconds = store.insert_chunks(new, progress,
                                                               refs=[first_user[c.content_hash] for c in new])
    report.new_chunks = len(new)
    for plan in plans:  # each document now uses exactly its new chunks (shared ones stay shared)
        store.documents.set(plan.record, [store.find_by_hash(c.content_hash) for c in plan.chunks])
        report.documents["updated" if plan.existed else "added"].append(plan.record.id)
    gone = [*gone, *file_docs.replaced_legacy(store, plans)]
    report.removed_ids = store.drop_documents(gone)  # and every chunk no document uses any more
    report.documents["removed"] = sorted(gone)
    report.removed_keys = _keys(report.removed_ids)
    system = ensure_system_kv(store, lm)
    # Every chunk lacking plain KV, not only the new ones: completes an interrupted ingest.
    # A store that drops plain KV (offline.compact) computes only what the re-fuse reads, in the re-fuse.
    report.plain_computed, report.plain_seconds = compute_plain(
        store, lm, system, progress=progress, chunk_ids=None if keeps_plain(store) else [], runner=runner)
    settings = recorded_fuse_settings(store)
    if fuse or (fuse is None and settings is not None):
        pre = _fuse(store, lm, system, settings or FuseSettings(), None, progress, batch_size=4, runner=runner)
        report.fuse = pre.to_dict()
        report.changed_keys = pre.changed_keys
    report.seconds = time.perf_counter() - t0
    return report


@_writes
def add_passages(store: KnowledgeStore, lm: LoadedModel, passages: Sequence[dict], doc: str = "api",
                 plain_kv: bool = True) -> list[int]:
    """Add ``{title, text}`` passages (split if longer than a chunk); returns their chunk ids in order.

    A passage with a ``source`` (the file path or URL its text came from) is split as ingest's reader
    of that format split the file (:func:`~fusionrag.retrieval.readers.passages_from_text`: a
    Markdown file's heading sections...), so the same text gets the same chunks either way.

    Duplicates map to the existing ids. New chunks get plain KV (unless ``plain_kv`` is
    False: callers adding many small batches compute it once, with a progress bar, via
    :func:`fuse` or :func:`compute_plain`), not fused KV (call :func:`fuse` for that).
    New chunks have new ids, so no cached entry goes stale.
    """
    items = []
    for i, p in enumerate(passages):
        if not isinstance(p, dict) or not isinstance(p.get("text"), str):
            raise FusionRAGError(f"passage {i} must be a dict with a 'text' string (and optionally 'title')")
        user = str(p.get("doc") or doc)
        if p.get("source"):
            items += [Passage(q.title, q.text, doc=user)
                      for q in passages_from_text(p["text"], str(p["source"]), str(p.get("title") or "") or None)]
        else:
            items.append(Passage(str(p.get("title") or ""), p["text"], doc=user))
    chunks = make_chunks(store.prompt, items, int(store.settings["chunk_tokens"]))
    unique, _ = dedup(chunks)
    store.insert_chunks([c for c in unique if store.find_by_hash(c.content_hash) is None])
    ids = [store.find_by_hash(c.content_hash) for c in chunks]
    _add_refs(store, chunks)  # passages already stored are used by this document too
    if plain_kv:
        compute_plain(store, lm, ensure_system_kv(store, lm),
                      chunk_ids=[i for i in dict.fromkeys(ids) if i is not None], progress=False)
    return [int(i) for i in ids if i is not None]


def _add_refs(store: KnowledgeStore, chunks: Sequence[Chunk]) -> None:
    """Reference every chunk from its document: one transaction per document, not per chunk."""
    by_doc: dict[str, list[int]] = {}
    for c in chunks:
        cid = store.find_by_hash(c.content_hash)
        if cid is not None:
            by_doc.setdefault(c.doc, []).append(cid)
    for doc, ids in by_doc.items():
        store.documents.add_refs(ids, doc)


@_writes
def fuse(store: KnowledgeStore, lm: LoadedModel, top_n: int | None = None, *, settings: FuseSettings | None = None,
         neighbour_order: str | None = None, same_document: bool | None = None,
         chunk_ids: Sequence[int] | None = None, progress: bool = True, batch_size: int = 4, record: bool = True,
         verify: bool = True, runner: LocalRunner | None = None, min_similarity: float | None = None,
         neighbour_lists: Mapping[int, Sequence[int]] | None = None) -> PreprocessReport:
    """The offline stage: fuse chunks (all by default) with their top-n neighbours; resumable.

    ``neighbour_lists`` gives each chunk's neighbours (in prefix order) instead of the similarity
    search; they are not a setting a later ingest could repeat, so such a fuse records nothing.
    Settings come whole (``settings``, e.g. from the CLI) or from :func:`resolve_fuse_settings`.
    With ``record`` (the default) they become the store's settings, so later ingests keep it
    fused the same way; a server fusing only the chunks of one request without switching the
    store to fused mode passes ``record=False``. The report's ``changed_keys`` are the entries rewritten.
    """
    if settings is None:
        settings = resolve_fuse_settings(store, top_n, neighbour_order, same_document, min_similarity)
    elif (top_n, neighbour_order, same_document, min_similarity) != (None, None, None, None):
        raise FusionRAGError("give fuse settings either whole (settings=) or as single values, not both")
    if record and neighbour_lists is None:
        store.update_settings(fuse=settings.to_dict())
    store.kv.remove_temp_files()
    return _fuse(store, lm, ensure_system_kv(store, lm), settings, chunk_ids, progress, batch_size, verify, runner,
                 neighbour_lists)


def _fuse(store: KnowledgeStore, lm: LoadedModel, system: KV, settings: FuseSettings,
          chunk_ids: Sequence[int] | None, progress: bool, batch_size: int, verify: bool = True,
          runner: LocalRunner | None = None,
          neighbour_lists: Mapping[int, Sequence[int]] | None = None) -> PreprocessReport:
    report = fuse_store(store, lm, system, settings, chunk_ids=chunk_ids, progress=progress,
                        batch_size=batch_size, verify=verify, runner=runner, neighbour_lists=neighbour_lists)
    report.removed_keys.extend(after_fuse(store))  # a fused-only store drops the plain KV fusing re-created
    return report


def stale_fused(store: KnowledgeStore, settings: FuseSettings, chunk_ids: Sequence[int] | None = None,
                verify: bool = True) -> list[int]:
    """The chunks (of ``chunk_ids``, default all) a fuse with ``settings`` would compute now: lets a
    caller cut one fuse into slices (a server interleaving a document job with chats)."""
    ids = store.chunk_ids() if chunk_ids is None else [int(c) for c in chunk_ids]
    return stale_chunks(store, ids, settings, verify)[1]


@_writes
def compute_plain_kv(store: KnowledgeStore, lm: LoadedModel, chunk_ids: Sequence[int]) -> int:
    """Plain KV of these chunks where it is missing or not current (under the writer lock); how many."""
    return compute_plain(store, lm, ensure_system_kv(store, lm), chunk_ids=chunk_ids, progress=False)[0]


@_writes
def delete_document(store: KnowledgeStore, doc: str) -> list[Key]:
    """Remove document ``doc``'s chunks; returns the entries removed (for the engine's ``invalidate``)."""
    return _keys(store.delete_doc(doc))


@_writes
def set_document(store: KnowledgeStore, doc: str, chunk_ids: Sequence[int], source: str | None = None,
                 title: str = "", digest: str | None = None) -> list[Key]:
    """Make ``chunk_ids`` exactly what document ``doc`` uses (a posted document replacing its earlier
    version) and record it; chunks no document uses any more are removed: returns their entries."""
    store.documents.set(DocumentRecord(doc, "passages", source, digest, title=title), chunk_ids)
    return _keys(store.remove_unreferenced())


@dataclass
class DeleteReport:
    documents: list[str]
    removed_ids: list[int]
    fuse: dict[str, Any] | None = None  # the incremental re-fuse of a fused store
    keys: list[Key] = field(default_factory=list)  # removed and re-fused entries: online tiers must drop them

    def to_dict(self) -> dict[str, Any]:
        return {"removed": self.documents, "chunks_removed": len(self.removed_ids),
                "removed_ids": _capped(self.removed_ids), "fuse": self.fuse}


@dataclass
class Finished:
    """What :func:`finish_interrupted` did: counts, and the KV keys it removed or rewrote (for the tiers)."""

    counts: dict[str, int]
    keys: list[Key]

    def __bool__(self) -> bool:
        return any(self.counts.values())


def finish_interrupted(store: KnowledgeStore, lm: LoadedModel, progress: bool = False) -> Finished:
    """Finish what a change killed midway left undone: chunks no document uses, KV files and index vectors
    of removed chunks, and (a fused store) the re-fuse of the chunks whose neighbours changed. Every writer
    that can (``delete``, the server at start, an API delete) runs this."""
    with store.writer():
        before = set(store.chunk_ids())
        counts = store.sweep_interrupted()
        keys = _keys(sorted(before - set(store.chunk_ids())))
        settings = recorded_fuse_settings(store)
        todo = stale_fused(store, settings, verify=False) if settings is not None else []
        if todo:
            keys += fuse(store, lm, chunk_ids=todo, progress=progress, verify=False).changed_keys
    return Finished({**counts, "refused": len(todo)}, keys)


@_writes
def delete_documents(store: KnowledgeStore, lm: LoadedModel, docs: Sequence[str], progress: bool = False,
                     runner: LocalRunner | None = None) -> DeleteReport:
    """Remove these documents and the chunks no other document uses; a fused store is then re-fused
    incrementally (the chunks that had a removed chunk among their neighbours)."""
    report = DeleteReport(list(docs), store.drop_documents(docs))
    report.keys = _keys(report.removed_ids)
    settings = recorded_fuse_settings(store)
    if settings is not None:
        pre = _fuse(store, lm, ensure_system_kv(store, lm), settings, None, progress, batch_size=4, runner=runner)
        report.fuse = pre.to_dict()
        report.keys += pre.changed_keys
    return report
