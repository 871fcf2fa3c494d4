"""The connector's scheduler side: which context tokens of a request the connector serves, decided once.

Runs in vLLM's engine-core process (no model, no vLLM imports). A request is planned when it arrives
(``on_new_request``): ``S`` and the stored chunks are found in its ids by the store's chunk locator
(:class:`~fusionrag.retrieval.chunk_locator.ChunkLocator`, the engine's too, updated as the store changes), and
a request the connector will load is salted into its mode's prefix-cache namespace
(:mod:`fusionrag.vllm.isolation`) before vLLM looks its blocks up. At each scheduling step the plan says how
many tokens after vLLM's own prefix hit the connector provides (never the last prompt token); once vLLM
allocated the blocks, the plan becomes a :class:`ReqLoad` for the workers. The plan is kept until the request
finishes (a preempted request is looked up again) and made again only when the store changes.

What a request was served is reported back to the client in the response's ``kv_transfer_params``
(:meth:`Planner.report`): the method and ratio (``ratio: "auto"``: the share its selection chose), the context
tokens and the share of them that came from the store, and how many tokens the worker recomputed (what the
workers send back with their step's output, :meth:`Planner.served`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionrag.errors import FusionRAGError
from fusionrag.online.auto_ratio import AutoRatio, is_auto, ratio_key
from fusionrag.online.methods import default_kv
from fusionrag.online.request import ReuseRequest
from fusionrag.retrieval.token_matching import ContextMatch
from fusionrag.vllm.isolation import mode_salt, salt_request

log = logging.getLogger("fusionrag.vllm")


@dataclass
class ReqLoad:
    """What the worker needs for one request (sent to the workers' processes: plain values only)."""

    req_id: str
    token_ids: list[int]  # the prompt
    system_len: int
    chunks: list[tuple[int, str, int, int, int]]  # (chunk_id, kind, start, stop, offset): prompt positions, and
    # where they start in the chunk's ids
    first: int  # the first external token (vLLM's own prefix hit, block-aligned)
    end: int  # one past the last external token (never the last prompt token)
    block_ids: list[int]
    block_size: int
    method: str
    ratio: float | str  # a share, or "auto" (the worker sizes it with the store's calibration)
    generation: int  # the store generation planned on: a worker that sees another one does not load
    asynchronous: bool = False  # the request waits outside vLLM's step until the worker says it is loaded


@dataclass
class Plan:
    """What the connector will load for a request, decided once on arrival (again only if the store changes)."""

    match: ContextMatch
    end: int  # one past the last context token it serves (never the last prompt token)
    method: str
    ratio: float | str
    generation: int  # the store generation the match was made on (the worker loads only at that one)
    loaded_tokens: int = 0  # how many the connector computed (0: this mode's prefix-cache blocks held them)


def kind_of(method: str) -> str:
    """The stored KV a method reads: its default in the engine's registry (FusionRAG: the first chunk plain,
    the rest fused); Full Attention's chunks are found as a plain reader finds them."""
    kind = default_kv(method)
    return "plain" if kind == "none" else kind


class Planner:
    """Plans and salts requests, and hands the workers their loads (see the module doc).

    ``salting``: whether vLLM's prefix cache is on (then every loaded request gets its mode's salt);
    ``fallback(reason, exc)``: counts and logs a request vLLM prefills itself."""

    def __init__(self, store: Any, options: dict[str, Any], block_size: int, salting: bool,
                 fallback: Callable[..., None], exact_limit: int | None = None) -> None:
        self.store = store
        self.exact_limit = exact_limit  # the model's sliding window / longrope length: longer prompts not loaded
        self.options = options
        self.block_size = block_size
        self.salting = salting
        self.fallback = fallback
        self.auto = AutoRatio.from_settings(store.settings)  # what the workers read too (the store's calibration)
        t0 = time.perf_counter()  # the chunk index built at vLLM's start, not in the step loop of a first request
        indexed = len(store.locator)
        log.info("fusionrag connector: %d stored chunks indexed in %.1f s", indexed, time.perf_counter() - t0)
        self._plans: dict[str, Plan | None] = {}
        self._reasons: dict[str, str] = {}
        self._client_salts: dict[str, str | None] = {}
        self._firsts: dict[str, int] = {}
        self._ready: dict[str, tuple[Any, Plan, int]] = {}
        self._blocks: dict[str, list[int]] = {}  # an asynchronous load's blocks, as vLLM allocated them
        self._served: dict[str, dict[str, Any]] = {}  # what a worker recomputed for a loaded request (report)
        self._loads_this_step = 0
        self.asynchronous = bool(options.get("async_loads", False))

    def on_arrival(self, request: Any) -> None:
        self._client_salts[request.request_id] = request.cache_salt
        self._plan_and_salt(request)

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens after its own hit the connector provides."""
        try:
            if self.store.refresh():  # another process (ingest, delete, calibrate) changed the store: the
                self.auto = AutoRatio.from_settings(self.store.settings)  # locator follows it, and the setting
            rid = request.request_id
            stale = self._plans.get(rid) is not None and self._plans[rid].generation != self.store.seen_generation
            if rid not in self._plans or stale:
                # planned before a store change (or never seen on arrival): plan and salt again, and let vLLM
                # look the prefix cache up once more, in the namespace the request now has
                return (None, False) if self._plan_and_salt(request) is not None else (0, False)
            plan = self._plans[rid]
        except Exception as exc:  # never take the engine down: vLLM prefills the request itself
            self.fallback("matching failed", exc)
            return 0, False
        if plan is None or plan.end - num_computed_tokens < int(self.options["min_context_tokens"]):
            # nothing stored, or this mode's prefix-cache blocks hold (nearly) all of it: vLLM computes the few
            # context tokens left over them itself, sooner than a load would (a whole pass over the context)
            return 0, False
        if self.asynchronous:  # it waits for its load outside the step; the workers pace the loads in flight
            self._firsts[rid] = num_computed_tokens
            return plan.end - num_computed_tokens, True
        if self._loads_this_step >= int(self.options["max_loads_per_step"]):
            return None, False  # asked again next step
        self._loads_this_step += 1
        self._firsts[rid] = num_computed_tokens
        return plan.end - num_computed_tokens, False

    def allocated(self, request: Any, num_external_tokens: int, block_ids: Callable[[], list[int]]) -> None:
        """vLLM's ``update_state_after_alloc``: the request's blocks exist; it is loaded from this step on
        (``block_ids``: its blocks, read for an asynchronous load, which vLLM does not schedule in this step)."""
        plan = self._plans.get(request.request_id)
        first = self._firsts.pop(request.request_id, None)
        if plan is not None and first is not None and num_external_tokens > 0:
            self._ready[request.request_id] = (request, plan, first)
            if self.asynchronous:
                self._blocks[request.request_id] = block_ids()

    def served(self, by_request: dict[str, dict[str, Any]]) -> None:
        """What the workers recomputed for requests they loaded (their step's output): kept for :meth:`report`.
        A request already reported is not kept (a synchronous load of a one-token answer: vLLM finishes it in
        the step that loads it, before the step's worker output reaches the connector)."""
        self._served.update({rid: served for rid, served in by_request.items() if rid in self._plans})

    def load_failed(self, req_id: str) -> None:
        """A worker could not load the request: vLLM prefills it (when it looks it up again, nothing is served)."""
        if self._plans.get(req_id) is not None:
            self._plans[req_id] = None
            self._reasons[req_id] = "load failed"

    def loads(self, scheduler_output: Any) -> list[ReqLoad]:
        """The loads of this step (vLLM's ``build_connector_meta``), with the blocks vLLM gave each request."""
        out = []
        for new in scheduler_output.scheduled_new_reqs:
            entry = self._ready.pop(new.req_id, None)
            if entry is not None:
                out.append(self._load_of(new.req_id, *entry, list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # a preempted request admitted again: all its blocks are new
            entry = self._ready.pop(req_id, None)
            if entry is not None and cached.new_block_ids[i] is not None:
                out.append(self._load_of(req_id, *entry, list(cached.new_block_ids[i][0])))
        for req_id, entry in self._ready.items():  # asynchronous: not scheduled in this step, loaded from it on
            if req_id in self._blocks:
                out.append(self._load_of(req_id, *entry, self._blocks.pop(req_id), asynchronous=True))
        self._ready.clear()
        self._blocks.clear()
        self._firsts.clear()
        self._loads_this_step = 0
        return out

    def report(self, request_id: str) -> dict[str, Any]:
        """What the request was served, for the response's ``kv_transfer_params`` (and forgets the request)."""
        plan = self._plans.pop(request_id, None)
        reason = self._reasons.pop(request_id, None)
        served = self._served.pop(request_id, {})
        for held in (self._ready, self._firsts, self._client_salts, self._blocks):
            held.pop(request_id, None)
        if plan is None:
            return {"method": "off" if reason == "off" else "vllm", "reason": reason or "not planned"}
        context = plan.end - plan.match.system_len
        stored = plan.match.stored_tokens
        auto = {"auto_ratio": self.auto.summary()} if is_auto(plan.ratio) else {}
        ratio = served["chosen_share"] if auto and "chosen_share" in served else plan.ratio  # auto: the share chosen
        recomputed = {"recomputed_tokens": served["recomputed_tokens"]} if "recomputed_tokens" in served else {}
        return {"method": plan.method, "ratio": ratio, **auto, "context_tokens": context, "stored_tokens": stored,
                "stored_share": round(stored / context, 4) if context > 0 else 0.0,
                "chunks": len(plan.match.chunks), "loaded_tokens": plan.loaded_tokens, **recomputed}

    def _plan_and_salt(self, request: Any) -> Plan | None:
        try:
            plan = self._plan(request)
        except Exception as exc:
            self.fallback("matching failed", exc)
            self._reasons[request.request_id] = "matching failed"
            plan = None
        self._plans[request.request_id] = plan
        if plan is not None and self.salting:
            salt_request(request, self._client_salts.get(request.request_id, request.cache_salt),
                         mode_salt(plan.method, ratio_key(plan.ratio, self.auto), plan.generation))
        return plan

    def _plan(self, request: Any) -> Plan | None:
        rid = request.request_id
        params = (getattr(request, "kv_transfer_params", None) or {}).get("fusionrag", {})
        if params == "off" or (isinstance(params, dict) and params.get("off")):
            self._reasons[rid] = "off"
            return None
        ids = list(request.prompt_token_ids or [])
        if self.exact_limit and len(ids) > self.exact_limit:  # vLLM's own (windowed) prefill is the exact one
            self._reasons[rid] = f"the prompt is longer than the model's exact-reuse limit ({self.exact_limit})"
            return None
        match = self.store.locator.match(ids, kind_of(str(self.options["method"])))
        if match is None or not match.chunks:
            self.fallback("no stored chunks in the prompt")
            self._reasons[rid] = "no stored chunks in the prompt"
            return None
        end = min(match.end, len(ids) - 1)
        if match.stored_tokens < int(self.options["min_context_tokens"]) or end <= 0:
            self._reasons[rid] = f"fewer than {self.options['min_context_tokens']} stored context tokens"
            return None
        asked = params.get("ratio", self.options["ratio"]) if isinstance(params, dict) else self.options["ratio"]
        try:
            ratio = ReuseRequest("q", str(self.options["method"]), asked).fields_validated().ratio
        except FusionRAGError as exc:  # vLLM prefills it exactly: never an unasked-for ratio
            self.fallback("invalid ratio", exc)
            self._reasons[rid] = str(exc)
            return None
        return Plan(match, end, str(self.options["method"]), ratio, self.store.seen_generation)

    def _load_of(self, req_id: str, request: Any, plan: Plan, first: int, block_ids: list[int],
                 asynchronous: bool = False) -> ReqLoad:
        plan.loaded_tokens = plan.end - first
        chunks = [(c.chunk_id, c.kind, c.start, c.stop, c.offset) for c in plan.match.chunks]
        return ReqLoad(req_id, list(request.prompt_token_ids), plan.match.system_len, chunks, first, plan.end,
                       block_ids, self.block_size, plan.method, plan.ratio, plan.generation, asynchronous)
