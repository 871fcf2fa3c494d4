"""The prefill engine: a request's passages found, their KV loaded, re-positioned, selected and recomputed.

:class:`PrefillEngine` owns what a prefill reads and keeps (the store, the KV source and its tiers, the
prefix, whole-context and prompt-prefix caches, ``S``'s KV) and finds a request's passages
(:meth:`~PrefillEngine.resolve`: retrieval, passages matched onto stored chunks, or stored chunks located in
a prompt's ids). Its prefill is a :class:`~fusionrag.online.prefill_plan.PrefillPlan` (typed stages) that a
scheduler advances; the engine never builds a scheduler: it is the
:class:`~fusionrag.online.prefill_plan.Prefiller` the scheduler is given. The Python API
(:class:`~fusionrag.online.engine.Engine`: ``answer``, ``stream``, ``prepare``) is this engine with its own
inline scheduler. Stored KV is read through one :class:`~fusionrag.kvcache.sources.KVSource` (the disk, or a
memory tier over it).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import torch

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.execution.segments import system_kv as compute_system_kv
from fusionrag.kvcache.context_cache import ContextCache
from fusionrag.kvcache.device_tier import kv_tiers
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.prefix_cache import AlternativePathCache
from fusionrag.kvcache.sources import Key, KVSource, NoStoredKV
from fusionrag.models.clock import StageClock
from fusionrag.models.fingerprint import same_weights
from fusionrag.models.registry import LoadedModel
from fusionrag.online import auto
from fusionrag.online.auto_ratio import AutoRatio
from fusionrag.online.client_prompt import PromptPrefixes, locate
from fusionrag.online.kv_loading import ChunkKVLoader
from fusionrag.online.prefill_plan import PrefillPlan
from fusionrag.online.request import DEFAULT_TOP_K, ReuseRequest, resolved_kv
from fusionrag.online.resolved import Resolved
from fusionrag.online.state import Request
from fusionrag.prompt import PromptBuilder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.matching import Piece, match_passages

log = logging.getLogger(__name__)

#: The whole-context cache's default size: ~20 contexts of 4K tokens of qwen2.5-0.5b in bf16 (50 MB each).
DEFAULT_CONTEXT_CACHE_BYTES = 1 << 30



class PrefillEngine:
    """Prefills requests over a knowledge store with a chosen KV-reuse method (module doc)."""

    def __init__(self, store: KnowledgeStore | None, lm: LoadedModel, *, kv_source: KVSource | None = None,
                 memory_budget_bytes: int | None = None, loader_threads: int = 2,
                 adhoc_cache_bytes: int | None = 2 << 30, min_reuse_tokens: int | None = None,
                 device_budget_bytes: int | None = None,
                 context_cache_bytes: int = 0) -> None:
        """``kv_source`` replaces the store's own disk reads (benchmarks' hot/cold tiers; a shared tier);
        ``memory_budget_bytes`` puts a heat-managed memory tier with an asynchronous loader of
        ``loader_threads`` threads over it (page-locked on CUDA); ``device_budget_bytes`` a tier on the
        model's device above that (:mod:`fusionrag.kvcache.device_tier`: copies on a side stream, so
        prefetches overlap the model's work). ``store`` None: no retrieval, no stored KV; passages a
        request brings are computed once and kept in the prefix cache. ``min_reuse_tokens``: the
        context length from which ``method="auto"`` reuses KV (default:
        :func:`fusionrag.online.auto.break_even_tokens`).
        ``context_cache_bytes``: the whole-context cache (:mod:`fusionrag.kvcache.context_cache`): a
        request whose ``S`` + chunks were computed before prefills only its question. Off (0) here, so
        that studies and benchmarks comparing methods on one engine measure each method; on in
        :meth:`open` and the server (:data:`DEFAULT_CONTEXT_CACHE_BYTES`), the product's defaults."""
        if store is not None and not same_weights(lm.fingerprint, store.fingerprint):
            raise FusionRAGError(f"model {lm.name} is not the model the store at {store.path} was built with")
        self.store = store
        self.lm = lm
        self.prompt = store.prompt if store is not None else PromptBuilder(lm.tokenizer)
        self.min_reuse_tokens = auto.break_even_tokens(lm) if min_reuse_tokens is None else int(min_reuse_tokens)
        #: How ``ratio="auto"`` sizes a request's recompute: the store's calibration (``fusionrag calibrate``), or
        #: the default; read again when the store changes (:meth:`follow_store`).
        self.auto_ratio = AutoRatio.from_settings(store.settings if store is not None else None)
        source = kv_source if kv_source is not None else store.kv_source() if store is not None else NoStoredKV()
        self.kv_source: KVSource = kv_tiers(source, lm.device, memory_budget_bytes, device_budget_bytes,
                                            loader_threads=loader_threads)
        self._system_kv: KV | None = None
        # KV of request-supplied passages (not in the store): a prefix cache with the alternative
        # path, so each distinct passage has one ``S + chunk`` replica whatever its position.
        self.adhoc_cache_bytes = adhoc_cache_bytes  # the cap, reported by stats() and /metrics
        self.prefix_cache = AlternativePathCache(max_bytes=adhoc_cache_bytes)
        self.context_cache = ContextCache(context_cache_bytes)
        self.prefixes = PromptPrefixes()  # KV of clients' prompt prefixes (their own system message, template)
        self._lock = threading.RLock()  # the model runs one request at a time
        self.loader = ChunkKVLoader(self)  # the load stage: stored entries, or computed through the prefix cache
        #: Makes the clock of each request's stage timings (synchronised with the model's device);
        #: replaceable, e.g. by a fake clock in tests.
        self.clock: Callable[[], StageClock] = lambda: StageClock(lm.device)

    @classmethod
    def open(cls, store_dir: str | Path | None, model: str | None = None, device: str | None = None,
             dtype: str | None = None, attention: str | None = None, **engine_options: Any) -> Self:
        """The store at ``store_dir`` with its model (``model`` overrides where the weights come from), and
        the whole-context cache on (``context_cache_bytes``, default :data:`DEFAULT_CONTEXT_CACHE_BYTES`);
        ``store_dir`` None: ``model`` without a store (plain generation, or over passages a request brings).

        ``device`` / ``dtype`` / ``attention``: where and how the model computes (defaults: CUDA
        when available; ``auto``: bf16 on a CPU with bf16 arithmetic, else float32; the device's
        sparse-attention backend); stored KV is read as stored.
        A model that cannot be the store's is refused before it is loaded (or converted).
        """
        from fusionrag.models import DEFAULT_MODEL, load_model
        from fusionrag.retrieval.store_info import check_model_matches, missing_store, stored_model

        engine_options.setdefault("context_cache_bytes", DEFAULT_CONTEXT_CACHE_BYTES)
        if store_dir is None:
            lm = load_model(model or DEFAULT_MODEL, dtype=dtype, device=device, attention=attention)
            return cls(None, lm, **engine_options)
        path = Path(store_dir)
        if not path.exists():
            raise missing_store(path)
        if model is not None:
            check_model_matches(path, model)
        lm = load_model(model or stored_model(path), dtype=dtype, device=device, attention=attention)
        return cls(KnowledgeStore.open(path, lm=lm), lm, **engine_options)

    @property
    def system_kv(self) -> KV:
        """``S``'s KV in fp32: from the store when it was computed in this engine's compute dtype, else
        computed here (not stored: building is offline's job), so that recomputing 100% is Full Attention."""
        if self._system_kv is None:
            dtype = str(self.lm.dtype).removeprefix("torch.")
            try:
                kv = self.store.load_system_kv(dtype) if self.store is not None else None
            except CacheIntegrityError as exc:  # answered around, like a damaged chunk entry
                log.error("the stored system prompt KV failed verification (%s); computing it. Run "
                          "'fusionrag store verify --repair'.", exc)
                kv = None
            if kv is None:
                kv = compute_system_kv(self.lm, self.prompt.system_token_ids)
            self._system_kv = kv.to(torch.float32)
        return self._system_kv

    @property
    def lock(self) -> threading.RLock:
        """Held while the model runs; a scheduler takes it around each forward it runs itself."""
        return self._lock

    # -- the prefill --------------------------------------------------------------------

    def plan(self, request: Request, prefetched: Resolved | None = None,
             piece_tokens: int | None = None) -> PrefillPlan:
        """``request``'s prefill as stages a scheduler advances (:class:`~fusionrag.online.prefill_plan.PrefillPlan`):
        up to the first answer token's logits, in passes of at most ``piece_tokens`` tokens (None: one). The
        passages its prefetch found (``prefetched``) are used unless the store changed since."""
        return PrefillPlan(self, request, prefetched, piece_tokens)

    def resolve_method(self, method: str, context_tokens: int, ready_tokens: int | None = None) -> tuple[str, str]:
        """The method a request runs and, when that is not the one it named, why (:func:`fusionrag.online.auto.choose`
        with this engine's :attr:`min_reuse_tokens`)."""
        return auto.choose(method, context_tokens, ready_tokens, self.min_reuse_tokens)

    @functools.cached_property
    def grammars(self) -> Any:
        """Structured outputs' compiled grammars for this model's tokenizer (:mod:`fusionrag.online.constraints`)."""
        from fusionrag.online.constraints import Grammars

        return Grammars(self.lm.tokenizer, int(self.lm.model.config.vocab_size), list(self.lm.stop_token_ids))

    # -- the KV source ----------------------------------------------------------------

    def prefetch(self, request: ReuseRequest) -> Resolved | None:
        """Asynchronous loader for a queued request: find its passages now and start loading their KV; the
        passages found are the request's (:meth:`prepare` takes them).

        Runs retrieval (embedding + index search) in the caller's thread, outside the model
        lock, so the KV reads overlap with whatever the model is computing. Best effort:
        a request that cannot be resolved here is resolved by its prefill (None).
        """
        try:
            resolved = self.resolve(request)
            if request.method != "full" and self.store is not None:
                self.prefetch_chunks(resolved.chunk_ids, resolved_kv(request.method, request.kv))
        except FusionRAGError:
            return None
        return resolved

    def resolve(self, request: ReuseRequest) -> Resolved:
        """The request's passages: matched onto stored chunks, or retrieved, at the store's current state. A
        request that places no passages keeps its prompt's ids (a client's own, or ``S`` and the question segment)
        and its stored chunks are found in them wherever they were pasted (:mod:`.client_prompt`), as the vLLM
        connector finds them: served from the store, the ids between them recomputed."""
        generation = self.store.seen_generation if self.store is not None else None
        if request.chunks is None and not request.retrieves and self.store is not None:
            located = locate(self.store, self._unplaced_ids(request), resolved_kv(request.method, request.kv),
                             self.lm.tokenizer.decode)
            if located is not None:
                return located
        pieces, scores, note = self._passages(request)
        return Resolved(pieces, scores, note, generation)

    def _unplaced_ids(self, request: ReuseRequest) -> list[int]:
        """The ids a request without passages prefills: a raw prompt's own, else ``S`` and its question segment."""
        if request.raw:
            return list(request.prompt_ids) if request.prompt_ids is not None else \
                self.prompt.raw_token_ids(request.question)
        return [*self.prompt.system_token_ids, *self.prompt.question_token_ids(request.question, request.preamble)]

    def current(self, resolved: Resolved) -> bool:
        """Whether ``resolved`` was found at the store's current generation (else it is found again)."""
        return self.store is None or resolved.generation == self.store.seen_generation

    def prefetch_chunks(self, chunk_ids: Sequence[int | None], kv: str = "plain-first") -> None:
        """Start loading these chunks' KV in the background (a no-op without a caching tier)."""
        kinds = self.kinds_for(chunk_ids, kv)
        keys = (self.loader.stored_key(c, k) for c, k in zip(chunk_ids, kinds, strict=True))
        self.kv_source.prefetch([k for k in keys if k is not None])

    def follow_store(self) -> bool:
        """Take in what another process changed in the store since this engine last looked (its index,
        chunks and KV: every cached copy is dropped); True if there was anything. Every request starts here,
        so a running server never retrieves, matches or reuses a chunk another process deleted."""
        if self.store is None or not self.store.refresh():
            return False
        self.kv_source.invalidate(None)
        self.context_cache.invalidate(None)
        self.auto_ratio = AutoRatio.from_settings(self.store.settings)  # a re-calibration is a store change too
        return True

    def invalidate(self, keys: Iterable[Key]) -> None:
        """Forget cached copies of entries a store change rewrote or removed (every tier down to disk), and
        the whole contexts computed from those chunks."""
        keys = list(keys)
        self.kv_source.invalidate(keys)
        self.context_cache.invalidate({chunk for chunk, _ in keys})

    def stats(self) -> dict[str, Any]:
        """What ``/metrics`` and benchmarks report: ``tiers`` (``{tier: TierStats}``, empty without a
        caching tier), ``prefix_cache`` (PrefixCacheStats of request-supplied passages) and
        ``adhoc_entries`` (how many such KVs are cached), ``context_cache`` (ContextCacheStats)."""
        return {"tiers": dict(self.kv_source.stats()), "prefix_cache": self.prefix_cache.stats(),
                "context_cache": self.context_cache.stats(),
                "adhoc_entries": len(self.prefix_cache), "adhoc_bytes": self.prefix_cache.nbytes,
                "adhoc_limit_bytes": self.adhoc_cache_bytes or 0, "damaged_entries": len(self.loader.damaged)}

    # -- internals --------------------------------------------------------------------

    def _passages(self, req: ReuseRequest) -> tuple[list[Piece], list[float | None], str]:
        """The request's chunks, their retrieval scores, and a note when it gets none it might expect.

        Passages the request brings are mapped onto stored chunks (:mod:`fusionrag.retrieval.matching`);
        a request that retrieves searches the store, unless there is none. Only stored chunks have a
        ``chunk_id``, so an engine without a store never reaches the store below."""
        if req.chunks is not None:
            pieces = match_passages(self.store, self.prompt, req.chunks)
            return pieces, [None] * len(pieces), ""
        if not req.retrieves:
            return [], [], ""
        if self.store is None:
            return [], [], "no store: answered without passages"
        hits = self.store.retrieve(req.question, req.top_k or DEFAULT_TOP_K)
        if not hits:
            return [], [], "the store is empty: answered without passages"
        pieces = [Piece(h["chunk_id"], h["title"], h["text"], h["source"]) for h in hits]
        return pieces, [h["score"] for h in hits], ""

    def kinds_for(self, chunk_ids: Sequence[int | None], kind: str) -> list[str]:
        """The stored KV each chunk reads (:meth:`ChunkKVLoader.kinds_for`)."""
        return self.loader.kinds_for(chunk_ids, kind)
