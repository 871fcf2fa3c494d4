"""One request's prefill as named, typed stages the scheduler advances piece by piece.

``Resolved -> Loaded -> Assembled -> Selection -> Prefilled``, each a function of the one before:

1. :func:`resolve` — the request's passages at the store's current state (the prefetch's, unless the store
   changed), the method it runs (``auto`` decides here) and the whole-context cache's entry, if any.
2. :func:`load` — each passage's KV entry: stored (verified), from the prefix cache, or computed.
3. :func:`assemble` — the prompt's one buffer: the prefix, the chunks re-positioned after it, room for the
   question.
4. :func:`choose` — the context tokens the method recomputes (the question's attention picks them for
   FusionRAG), with the gaps a client's prompt forces.
5. the prefill pass (:mod:`fusionrag.online.prefill`), in pieces of the step's token budget, then
   :func:`record` gives the request what it was served (:class:`~fusionrag.online.served.Served`).

:class:`PrefillPlan` holds the stages' results and runs the next stage when the scheduler advances it; a
prompt longer than the budget ends a piece after loading, after selecting, and after each piece of the
pass, so the scheduler decodes other requests between them (vLLM's chunked prefill). The stages
read the engine through :class:`PlanEngine`: what they use of it, nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fusionrag.kvcache.context_cache import CachedContext, ContextCache, context_keys
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.prefix_cache import AlternativePathCache
from fusionrag.models.clock import StageClock
from fusionrag.models.registry import LoadedModel
from fusionrag.online import auto
from fusionrag.online.auto_ratio import AutoRatio, Ratio, is_auto, ratio_key
from fusionrag.online.client_prompt import prefix_kv, with_forced
from fusionrag.online.kv_loading import ORIGIN, ChunkKVLoader
from fusionrag.online.methods import MethodInfo, make_policy, method_info
from fusionrag.online.policies import SelectionInput, select
from fusionrag.online.prefill import (
    Prefilled,
    assemble_context,
    prefill_full_pieces,
    prefill_reused_pieces,
    with_cut_starts,
)
from fusionrag.online.resolved import Resolved
from fusionrag.online.served import Served
from fusionrag.online.state import Request
from fusionrag.prompt import PromptBuilder


class PlanEngine(Protocol):
    """What the stages read of an engine (:class:`~fusionrag.online.prefill_engine.PrefillEngine`)."""

    lm: LoadedModel
    prompt: PromptBuilder
    prefix_cache: AlternativePathCache
    context_cache: ContextCache
    loader: ChunkKVLoader
    clock: Callable[[], StageClock]
    grammars: Any
    system_kv: KV
    prefixes: Any
    auto_ratio: AutoRatio

    def follow_store(self) -> bool: ...
    def resolve(self, request: Any) -> Resolved: ...
    def current(self, resolved: Resolved) -> bool: ...
    def resolve_method(self, method: str, context_tokens: int, ready_tokens: int | None = None) -> tuple[str, str]: ...


class Prefiller(Protocol):
    """What the scheduler needs of an engine, and all it knows of one: its model, its lock and clock, how to find
    a request's passages ahead of its prefill (``prefetch``; ``resolve`` for the length check) and how to plan
    a prefill. :class:`~fusionrag.online.prefill_engine.PrefillEngine` implements it."""

    lm: LoadedModel
    prompt: PromptBuilder
    clock: Callable[[], StageClock]

    @property
    def lock(self) -> threading.RLock: ...
    def resolve(self, request: Any) -> Resolved: ...
    def prefetch(self, request: Any) -> Resolved | None: ...
    def plan(self, request: Request, prefetched: Resolved | None, piece_tokens: int | None) -> PrefillPlan: ...


@dataclass
class Resolving:
    """Stage 1: the passages, their ids, the method the request runs and how, and a cached context if any."""

    resolved: Resolved
    system_ids: list[int]
    token_ids: list[list[int]]
    question_ids: list[int]
    method: str
    info: MethodInfo
    kv_kind: str
    ratio: Ratio  # a number, or "auto" (sized in :func:`choose`)
    note: str
    keys: list  # the whole-context cache's keys for this context (none for a method's own layout)
    cached: CachedContext | None


@dataclass
class Loaded:
    """Stage 2: each passage's KV entry, where it came from, and how many fused entries fell back to plain."""

    entries: list
    origins: list[str]
    fallbacks: int


@dataclass
class Assembled:
    """Stage 3: the prompt's buffer (context, then room for the question), the context's view, ids and spans."""

    buffer: KV
    context: KV
    context_ids: torch.Tensor
    spans: list[tuple[int, int]]


@dataclass
class Selection:
    """Stage 4: the context slots recomputed (None: none), and for ``ratio="auto"`` the share of the context's
    candidates it chose."""

    idx: torch.Tensor | None
    share: float | None = None


def resolve(engine: PlanEngine, req: Request, prefetched: Resolved | None) -> Resolving:
    """Stage 1 (see the module doc)."""
    reuse = req.reuse
    changed = engine.follow_store()
    resolved = prefetched if prefetched is not None and not changed and engine.current(prefetched) else \
        engine.resolve(reuse)
    token_ids = resolved.token_ids(engine)
    method, why = engine.resolve_method(reuse.method, sum(map(len, token_ids)), auto.ready_tokens(
        engine.prefix_cache, engine.prompt.system_hash, resolved.pieces, token_ids))
    note = resolved.note or ("" if reuse.raw else why)  # a raw prompt has no passages to reuse by design
    kv_kind, ratio = ("none", 1.0) if method == "full" else (str(reuse.kv), reuse.ratio)
    info = method_info(method)
    system_ids = resolved.system_ids(engine, reuse)
    keys = [] if info.placement is not None else context_keys(  # a method's own layout is not cached
        engine.context_cache, system_ids, token_ids, method, ratio_key(ratio, engine.auto_ratio), kv_kind,
        engine.lm.dtype)
    cached = engine.context_cache.get(keys) if keys and not reuse.skip_cache else None  # skip_cache: an A/B baseline
    return Resolving(resolved, system_ids, token_ids, resolved.question_ids(engine, reuse), method, info, kv_kind,
                     ratio, note, keys, cached)


def load(engine: PlanEngine, req: Request, r: Resolving) -> Loaded:
    """Stage 2: stored entries verified, the rest through the prefix cache (a client's gaps: zeros, recomputed)."""
    res = r.resolved
    entries, fallbacks = engine.loader.load(res.chunk_ids, res.passages, r.token_ids, r.kv_kind, res.spans,
                                            fresh=req.reuse.skip_cache, zero=res.forced)
    return Loaded(entries, [e.metadata.get(ORIGIN, "store") for e in entries], fallbacks)


def assemble(engine: PlanEngine, r: Resolving, loaded: Loaded) -> Assembled:
    """Stage 3: the prefix's KV, then each chunk's re-positioned after it, and room for the question."""
    buffer, ids, spans = assemble_context(engine.lm, prefix_kv(engine, r.system_ids), [e.kv for e in loaded.entries],
                                          r.system_ids, r.token_ids, r.info.placement,
                                          room=len(r.question_ids) if r.info.placement is None else 0)
    return Assembled(buffer, buffer.head(len(ids)), ids, spans)


def choose(engine: PlanEngine, r: Resolving, loaded: Loaded, a: Assembled) -> Selection:
    """Stage 4: the method's selection (none for a method that recomputes nothing), the first tokens of a chunk
    served from a part of it, and every gap of a client's prompt."""
    res = r.resolved
    share = None
    if r.info.recomputes_nothing:
        idx = None
    else:
        scores = (engine.loader.cachecraft_scores(res.chunk_ids, loaded.entries, r.kv_kind, res.spans)
                  if r.method == "cachecraft" else [])
        inp = SelectionInput(engine.lm, a.context, a.context_ids, a.spans, torch.tensor(r.question_ids),
                             chunk_scores=scores)
        chosen = select(make_policy(r.method), inp, r.ratio, engine.auto_ratio)
        if is_auto(r.ratio):
            share = chosen.numel() / max(1, sum(b - a for a, b in a.spans))
        idx = with_cut_starts(chosen, a.spans, res.spans)
    return Selection(with_forced(idx, a.spans, res.forced), share)


def record(engine: PlanEngine, req: Request, r: Resolving, loaded: Loaded | None, selection: Selection | None,
           pre: Prefilled, timings: dict[str, float]) -> None:
    """What the prefill served the request (:class:`Served`, written once): the prompt, its KV and first logits,
    what was reused and from where, and the ratio used (``"auto"``: the share it chose)."""
    res = r.resolved
    origins = ["context_cache"] * len(res.pieces) if r.cached is not None else \
        loaded.origins if loaded is not None else ["computed"] * len(res.pieces)
    pre.timings_ms["recompute"] = timings["recompute"]
    prompt_ids = [*r.system_ids, *(t for c in r.token_ids for t in c), *r.question_ids]
    req.served = Served(
        pre=pre, method=r.method, kv_kind=r.kv_kind,
        ratio=selection.share if selection is not None and selection.share is not None else r.ratio,
        auto_ratio=engine.auto_ratio if is_auto(r.ratio) else None, prompt_token_ids=prompt_ids,
        chunk_ids=res.chunk_ids, passages=res.passages, chunk_token_ids=r.token_ids, chunk_parts=res.spans,
        stages_ms=timings, fused_fallbacks=loaded.fallbacks if loaded is not None else 0,
        sources=[{"chunk_id": p.chunk_id, "title": p.title, "source": p.source, "score": score,
                  "stored": p.chunk_id is not None, "part": list(p.span) if p.span else None, "origin": origin}
                 for p, score, origin in zip(res.pieces, res.scores, origins, strict=True)],
        note=r.note or ("context cache: this context's KV was computed by an earlier request"
                        if r.cached is not None else ""),
        context_cache_hit=r.cached is not None, kv_origins=origins)
    req.progress.sampler.see_prompt(prompt_ids)


class PrefillPlan:
    """One request's prefill, advanced by the scheduler (module doc). ``piece_tokens``: the step's budget for it
    (None: the whole prefill in one pass)."""

    def __init__(self, engine: PlanEngine, req: Request, prefetched: Resolved | None,
                 piece_tokens: int | None = None) -> None:
        self.engine, self.req, self.piece_tokens = engine, req, piece_tokens
        self.stage = "resolve"  # resolve -> load -> select -> prefill -> prefilled
        self._prefetched = prefetched
        self._clock = engine.clock()
        self.resolving: Resolving | None = None
        self.loaded: Loaded | None = None
        self.assembled: Assembled | None = None
        self.selection: Selection | None = None
        self._pass: Generator[None, None, Prefilled] | None = None

    @property
    def done(self) -> bool:
        return self.stage == "prefilled"

    def advance(self) -> bool:
        """Run stages up to the end of the next piece; True once the request is prefilled (its fields filled)."""
        while True:
            piece_ends = getattr(self, f"_{self.stage}")()
            if self.done:
                return True
            if piece_ends:
                return False

    def close(self) -> None:
        """Drop a prefill that will not finish (cancelled, failed, the server closing)."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    # -- the stages: each runs its function, says the next stage and whether a piece ends there ----------

    def _resolve(self) -> bool:
        req = self.req
        if req.progress.sampler.constraint is None:  # the end of turn (min_tokens) and the grammar, before any prefill
            req.progress.sampler.bind(set(self.engine.lm.stop_token_ids), None if req.sampling.grammar is None else
                             self.engine.grammars.constraint(req.sampling.grammar))
        self.resolving = r = resolve(self.engine, req, self._prefetched)
        self._clock.lap("retrieve")
        if r.cached is not None or r.method == "full":
            self._clock.skip("load")
            self._clock.skip("select")
            self.stage = "prefill"
        else:
            self.stage = "load"
        return False

    def _long(self) -> bool:
        """The context is longer than the step's budget: its stages are pieces of their own."""
        assert self.assembled is not None
        return self.piece_tokens is not None and len(self.assembled.context_ids) > self.piece_tokens

    def _load(self) -> bool:
        assert self.resolving is not None
        self.loaded = load(self.engine, self.req, self.resolving)
        self.assembled = assemble(self.engine, self.resolving, self.loaded)
        self._clock.lap("load")
        self.stage = "select"
        return self._long()  # loading was a piece: a decode step may run before the selection

    def _select(self) -> bool:
        assert self.resolving is not None and self.loaded is not None and self.assembled is not None
        self.selection = choose(self.engine, self.resolving, self.loaded, self.assembled)
        self._clock.lap("select")
        self.stage = "prefill"
        return self._long() and self.selection.idx is not None  # the selection's pre-pass was a piece too

    def _prefill(self) -> bool:
        r = self.resolving
        assert r is not None
        if self._pass is None:
            self._pass = self._start_pass(r)
        try:
            next(self._pass)
            return True
        except StopIteration as stop:
            pre = stop.value
        self._pass = None
        if r.keys and r.cached is None:
            self.engine.context_cache.put(r.keys[0], CachedContext.of(pre.kv, r.system_ids, r.token_ids, pre.spans),
                                          r.resolved.chunk_ids)
        self._clock.lap("recompute")
        record(self.engine, self.req, r, self.loaded, self.selection, pre,
               {**self._clock.stages, "total": self._clock.total()})
        self.stage = "prefilled"
        return True

    def _start_pass(self, r: Resolving) -> Generator[None, None, Prefilled]:
        lm, n = self.engine.lm, self.piece_tokens
        if r.cached is not None:  # the same S + chunks computed before: only the question is prefilled
            return prefill_reused_pieces(lm, r.cached.kv, r.cached.ids, r.cached.spans, r.question_ids, piece_tokens=n)
        if r.method == "full":
            return prefill_full_pieces(lm, r.system_ids, r.token_ids, r.question_ids, n)
        a, sel = self.assembled, self.selection
        assert a is not None and sel is not None
        return prefill_reused_pieces(lm, a.context, a.context_ids, a.spans, r.question_ids, sel.idx, n,
                                     a.buffer if len(a.buffer) > len(a.context) else None)

