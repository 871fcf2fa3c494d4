"""Offline KV computation: plain (Full Reuse) chunk caches and FusionRAG's fused caches.

Plain KV of a chunk: the chunk prefilled right after ``S`` (base position ``len(S)``),
only the chunk's part kept. Fused KV (the paper's similarity-guided preliminary
cross-attention): the chunk's top-n most similar other chunks, taken from their *plain*
caches and re-rotated to consecutive positions after ``S``, then the chunk prefilled on
top of them; its new KV is rotated back to ``len(S)`` and stored (one replica per chunk)
together with Cache-Craft scores (how much attention each token paid to the neighbours).

Neighbour order default: ``nearest_first``, the **most similar neighbour first, right
after** ``S`` (as the authors' code does; measured against ``nearest_last`` on TriviaQA in
decision 005). Neighbours come from the whole corpus by default, or from the chunk's
document group with ``same_document``.

:func:`plain_batch` and :func:`fuse_batch` are pure functions of their inputs (token ids,
neighbour lists, a plain-KV loader): the store-facing drivers :func:`compute_plain` and
:func:`fuse_store` only decide what to compute and write results, so a distributed engine
can map the pure part over shards of a large corpus. Which chunks to fuse with which
settings is decided in one place, :mod:`fusionrag.offline.build`.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError, StorageFullError
from fusionrag.execution.attention import prefill_with_context_attention
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.kvcache.kv import KV, assemble
from fusionrag.models.registry import LoadedModel
from fusionrag.offline.compact import keeps_plain, plain_needed
from fusionrag.offline.fuse_defaults import DEFAULT_NEIGHBOUR_ORDER, DEFAULT_TOP_N, NEIGHBOUR_ORDERS

if TYPE_CHECKING:
    from fusionrag.retrieval.knowledge import KnowledgeStore


@dataclass
class FusedKV:
    """A chunk's fused cache, at base position ``len(S)``."""

    chunk_id: int
    kv: KV
    scores: torch.Tensor  # [T] fp32: last-layer attention mass each token put on the neighbours
    neighbours: list[int]  # most similar first (whatever the order in the prefix)
    neighbour_order: str


def prefix_order(neighbours: Sequence[int], neighbour_order: str) -> list[int]:
    """Neighbours in the order they precede the chunk (input: most similar first)."""
    if neighbour_order not in NEIGHBOUR_ORDERS:
        raise FusionRAGError(f"unknown neighbour order '{neighbour_order}' (one of {', '.join(NEIGHBOUR_ORDERS)})")
    return list(reversed(neighbours)) if neighbour_order == "nearest_last" else list(neighbours)


@dataclass(frozen=True)
class FuseSettings:
    """How the offline stage fuses a chunk: what a fused entry depends on besides tokens, model and ``S``."""

    top_n: int = DEFAULT_TOP_N
    neighbour_order: str = DEFAULT_NEIGHBOUR_ORDER
    same_document: bool = False
    min_similarity: float | None = None  # keep only neighbours at least this similar (None: the top-n)

    def __post_init__(self) -> None:
        if int(self.top_n) < 0:
            raise FusionRAGError(f"top-n must be >= 0, got {self.top_n}")
        if self.min_similarity is not None and not -1.0 <= float(self.min_similarity) <= 1.0:
            raise FusionRAGError(f"min-similarity is a cosine similarity in [-1, 1], got {self.min_similarity}")
        prefix_order([], self.neighbour_order)  # validates the name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plain_batch(lm: LoadedModel, system_kv: KV, token_ids: Mapping[int, Sequence[int]]) -> dict[int, KV]:
    """Plain KV of every chunk in ``token_ids`` (``{chunk_id: ids}``), each at base ``len(S)``."""
    return {cid: chunk_kv_plain(lm, system_kv, ids) for cid, ids in token_ids.items()}


def fuse_one(lm: LoadedModel, system_kv: KV, chunk_id: int, token_ids: Sequence[int], neighbours: Sequence[int],
             load_plain: Callable[[int], KV], neighbour_order: str = DEFAULT_NEIGHBOUR_ORDER) -> FusedKV:
    """The fused KV of one chunk (see the module docstring)."""
    base = system_kv.base_position + len(system_kv)
    neighbours = [int(n) for n in neighbours]
    if chunk_id in neighbours:
        raise ValueError(f"chunk {chunk_id} is listed among its own neighbours")
    if not neighbours:
        # top-n 0: by definition the plain cache, bit for bit (no recomputation noise).
        plain = load_plain(chunk_id)
        if len(plain) != len(token_ids):
            raise ValueError(f"plain KV of chunk {chunk_id} has {len(plain)} tokens, expected {len(token_ids)}")
        return FusedKV(chunk_id, plain, torch.zeros(len(plain), dtype=torch.float32), [], neighbour_order)
    context, _ = assemble(system_kv, [load_plain(n) for n in prefix_order(neighbours, neighbour_order)], lm.inv_freq)
    context = context.to(lm.model.dtype)
    kv, scores = prefill_with_context_attention(lm, torch.tensor(list(token_ids)), past=context,
                                                context_start=len(system_kv))
    return FusedKV(chunk_id, kv.moved_to(base, lm.inv_freq), scores.float(), neighbours, neighbour_order)


def fuse_batch(lm: LoadedModel, system_kv: KV, chunk_ids: Sequence[int], token_ids: Mapping[int, Sequence[int]],
               neighbours: Mapping[int, Sequence[int]], load_plain: Callable[[int], KV],
               neighbour_order: str = DEFAULT_NEIGHBOUR_ORDER) -> dict[int, FusedKV]:
    """Fused KV of each chunk in ``chunk_ids``; a pure function of its arguments."""
    return {cid: fuse_one(lm, system_kv, cid, token_ids[cid], neighbours[cid], load_plain, neighbour_order)
            for cid in chunk_ids}


def compute_neighbours(store: KnowledgeStore, chunk_ids: Sequence[int], top_n: int,
                       same_document: bool = False, min_similarity: float | None = None) -> dict[int, list[int]]:
    """Top-``top_n`` most similar other chunks of each chunk (most similar first, never itself),
    at least ``min_similarity`` similar when given."""
    if not same_document:
        return store.neighbours(chunk_ids, top_n, min_similarity=min_similarity)
    groups = store.doc_groups()
    doc_of = {cid: doc for doc, ids in groups.items() for cid in ids}
    return store.neighbours(chunk_ids, top_n, among={c: groups[doc_of[c]] for c in chunk_ids},
                                       min_similarity=min_similarity)


class PlainCache:
    """Loader of verified plain KVs with a small LRU: similar chunks share neighbours."""

    def __init__(self, store: KnowledgeStore, size: int = 64) -> None:
        self.store = store
        self.size = size
        self._items: OrderedDict[int, KV] = OrderedDict()

    def __call__(self, chunk_id: int) -> KV:
        if chunk_id in self._items:
            self._items.move_to_end(chunk_id)
            return self._items[chunk_id]
        kv = self.store.kv.load(chunk_id, "plain").to(torch.float32)
        self._items[chunk_id] = kv
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return kv


@dataclass
class PreprocessReport:
    top_n: int
    neighbour_order: str
    same_document: bool
    chunks: int = 0  # considered
    computed: int = 0
    new: int = 0  # computed, had no fused entry before
    replaced: int = 0  # computed, replaced an entry made with other neighbours/settings
    skipped: int = 0  # already up to date (resume / unchanged neighbours)
    seconds: float = 0.0
    tokens: int = 0  # chunk tokens of the computed chunks
    neighbour_changes: list[int] = field(default_factory=list)  # ids re-fused (not new)

    changed: list[int] = field(default_factory=list)  # every chunk whose fused entry was (re)written
    removed_keys: list[tuple[int, str]] = field(default_factory=list)  # plain KV dropped afterwards (offline.compact)

    @property
    def changed_keys(self) -> list[tuple[int, str]]:
        """The store entries this run rewrote or removed: online tiers must drop their copies."""
        return [(c, "fused") for c in self.changed] + list(self.removed_keys)

    @property
    def chunks_per_s(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    @property
    def s_per_chunk(self) -> float:
        return self.seconds / self.computed if self.computed else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["changed"]
        d["plain_dropped"] = len(d.pop("removed_keys"))
        d["chunks_per_s"] = round(self.chunks_per_s, 3)
        d["s_per_chunk"] = round(self.s_per_chunk, 4)
        d["seconds"] = round(self.seconds, 3)
        return d


def fuse_key(neighbours: Sequence[int], neighbour_order: str) -> dict[str, Any]:
    """What a fused entry depends on besides the model, ``S`` and the chunk's tokens."""
    return {"neighbours": [int(n) for n in neighbours], "neighbour_order": neighbour_order}


def entry_is_current(store: KnowledgeStore, chunk_id: int, key: dict[str, Any],
                     kind: str = "fused", verify: bool = True) -> tuple[bool, bool]:
    """``(exists, current)`` for one of the chunk's entries (:meth:`StoredKV.is_current`, ``store.kv``).

    ``verify=False`` trusts the header: a server's incremental re-fuse, where reading every entry
    of the store per document job would cost more than the job.
    """
    return store.kv.is_current(chunk_id, kind, key, verify)


class LocalRunner:
    """Runs the pure batch functions in this process, one batch after another (the default).

    A runner maps batches to results and yields ``(batch, results)`` as each one completes; the
    drivers below only decide what to compute and write what comes back, so a distributed runner
    (:mod:`fusionrag.offline.distributed`, Ray) can replace this one without changing either.
    """

    def __init__(self, store: KnowledgeStore, lm: LoadedModel) -> None:
        self.store, self.lm = store, lm

    def plain(self, system_kv: KV, batches: Sequence[dict[int, Sequence[int]]]) -> Iterator[tuple[dict, dict[int, KV]]]:
        for batch in batches:
            yield batch, plain_batch(self.lm, system_kv, batch)

    def fuse(self, system_kv: KV, batches: Sequence[dict[int, Sequence[int]]], neighbours: Mapping[int, Sequence[int]],
             neighbour_order: str) -> Iterator[tuple[dict, dict[int, FusedKV]]]:
        loader = PlainCache(self.store)
        for batch in batches:
            yield batch, fuse_batch(self.lm, system_kv, list(batch), batch, {c: neighbours[c] for c in batch}, loader,
                                    neighbour_order)


def compute_plain(store: KnowledgeStore, lm: LoadedModel, system_kv: KV, chunk_ids: Sequence[int] | None = None,
                  progress: bool = True, batch_size: int = 8, runner: LocalRunner | None = None) -> tuple[int, float]:
    """Compute and store the plain KV of every chunk (of ``chunk_ids``) lacking a current one.

    Resumable: current, verified entries are skipped (missing, corrupted or foreign ones are
    recomputed), each entry is written atomically. Returns ``(computed, seconds)``.
    ``runner`` computes the batches (default: :class:`LocalRunner`); entries are written here.
    """
    ids = store.chunk_ids() if chunk_ids is None else list(chunk_ids)
    todo = [c for c in ids if not entry_is_current(store, c, {}, "plain")[1]]
    if not todo:
        return 0, 0.0
    t0 = time.perf_counter()
    with tqdm(total=len(todo), unit="chunk", desc="plain KV (S + chunk)", disable=not progress) as bar:
        batches = [{c: store.chunk(c).token_ids for c in todo[i:i + batch_size]}
                   for i in range(0, len(todo), batch_size)]
        written = 0
        for batch, kvs in (runner or LocalRunner(store, lm)).plain(system_kv, batches):
            for cid, kv in kvs.items():
                save_entry(store, cid, "plain", kv, batch[cid], left=len(todo) - written)
                written += 1
                bar.update(1)
    return len(todo), time.perf_counter() - t0


def save_entry(store: KnowledgeStore, cid: int, kind: str, kv: KV, token_ids: Sequence[int], left: int,
               **fields: Any) -> None:
    """Save one KV entry; out of disk space, say how much more the entries still to write need.

    The estimate is the mean size of the store's entries of that kind (or this entry's KV) times the
    entries left; nothing already written is lost and the same command resumes."""
    try:
        store.kv.save(cid, kind, kv, token_ids, **fields)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        sizes = [f.stat().st_size for f in store.kv.files(kind)[:64]]
        per_entry = sum(sizes) / len(sizes) if sizes else kv.nbytes
        free = shutil.disk_usage(store.kv_root if store.kv_root.exists() else store.path).free
        raise StorageFullError(
            f"out of disk space while writing the {kind} KV of chunk {cid}: about {_mib(per_entry * left)} more "
            f"are needed for the {left} entries left ({_mib(free)} free on {store.path}); nothing already "
            "written was lost: free the space and run the same command again (it resumes where it stopped)"
        ) from exc


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def stale_chunks(store: KnowledgeStore, ids: Sequence[int], settings: FuseSettings, verify: bool = True,
                 neighbour_lists: Mapping[int, Sequence[int]] | None = None,
                 ) -> tuple[dict[int, list[int]], list[int], set[int]]:
    """``(neighbours, todo, replaced)``: each chunk's neighbours now, the chunks whose fused entry is
    missing or out of date (in ``ids`` order), and which of those had an entry before.

    ``neighbour_lists`` replaces the similarity search with given lists (in prefix order; a study
    of where neighbours come from, or an application that knows which chunks go together)."""
    top_n = settings.top_n
    if neighbour_lists is not None:
        neighbours = {int(c): [int(n) for n in neighbour_lists.get(int(c), [])][:top_n] for c in ids}
    else:
        neighbours = compute_neighbours(store, ids, top_n, settings.same_document, settings.min_similarity)
    todo, replaced = [], set()
    for cid in ids:
        exists, current = entry_is_current(store, cid, fuse_key(neighbours[cid], settings.neighbour_order),
                                           verify=verify)
        if not current:
            todo.append(cid)
            if exists:
                replaced.add(cid)
    return neighbours, todo, replaced


def fuse_store(store: KnowledgeStore, lm: LoadedModel, system_kv: KV, settings: FuseSettings | None = None, *,
               chunk_ids: Sequence[int] | None = None, progress: bool = True, batch_size: int = 4,
               verify: bool = True, runner: LocalRunner | None = None,
               neighbour_lists: Mapping[int, Sequence[int]] | None = None) -> PreprocessReport:
    """Fuse every chunk (of ``chunk_ids``) whose fused entry is missing or out of date.

    Neighbours are searched in the whole store (or document group), unless ``neighbour_lists``
    gives them. A chunk is
    skipped when its entry was made with the same neighbours, order, model, ``S`` and
    tokens, so an interrupted run resumes where it stopped and an incremental ingest
    re-fuses only chunks whose neighbour lists changed.
    """
    settings = settings or FuseSettings()  # validated when it was made
    top_n, neighbour_order, same_document = settings.top_n, settings.neighbour_order, settings.same_document
    min_similarity = settings.min_similarity
    report = PreprocessReport(top_n, neighbour_order, bool(same_document))
    ids = store.chunk_ids() if chunk_ids is None else [int(c) for c in chunk_ids]
    report.chunks = len(ids)
    if not ids:
        return report
    neighbours, todo, replaced = stale_chunks(store, ids, settings, verify, neighbour_lists)
    report.skipped = len(ids) - len(todo)
    # Neighbours need plain KV: every chunk's (completes an interrupted ingest), or on a store that
    # drops plain KV only what this run reads (offline.compact).
    runner = runner or LocalRunner(store, lm)
    compute_plain(store, lm, system_kv, progress=progress, runner=runner,
                  chunk_ids=None if keeps_plain(store) else plain_needed(todo, neighbours))
    todo_set = set(todo)
    store.chunks.record_neighbours({c: neighbours[c] for c in ids if c not in todo_set})
    if not todo:
        return report
    t0 = time.perf_counter()
    try:
        with tqdm(total=len(todo), unit="chunk", desc=f"fuse (top-{top_n} neighbours)", disable=not progress) as bar:
            batches = [{c: store.chunk(c).token_ids for c in todo[i:i + batch_size]}
                       for i in range(0, len(todo), batch_size)]
            for tokens, fused in runner.fuse(system_kv, batches, neighbours, neighbour_order):
                for cid in tokens:
                    f = fused[cid]
                    extra = {**fuse_key(f.neighbours, f.neighbour_order), "top_n": top_n,
                             "same_document": bool(same_document), "min_similarity": min_similarity}
                    save_entry(store, cid, "fused", f.kv, tokens[cid], left=len(todo) - report.computed,
                               scores=f.scores, extra=extra)
                    store.chunks.record_neighbours({cid: f.neighbours})
                    report.computed += 1
                    report.changed.append(cid)
                    report.tokens += len(tokens[cid])
                    if cid in replaced:
                        report.replaced += 1
                        report.neighbour_changes.append(cid)
                    else:
                        report.new += 1
                    bar.update(1)
    finally:
        report.seconds = time.perf_counter() - t0
    return report
