"""``FusionRAGConnector``: FusionRAG inside vLLM, as a v1 KV connector (``--kv-transfer-config``).

Scheduler side (vLLM's engine-core process): a request whose prompt ids start with the store's ``S`` and
continue with stored chunks (:mod:`fusionrag.vllm.matching`) reports those context tokens, after vLLM's
own prefix-cache hit and never the last prompt token, as available externally; anything else reports 0
and vLLM prefills as usual. Worker side (the model's process), in ``start_load_kv``, before vLLM computes
the rest of the prompt: the chunks' KV is read from the store (verified), re-positioned after ``S`` and
assembled in a request-local buffer, the question's last-layer attention selects the ``ratio`` of context
tokens it reads most, those are recomputed through vLLM's own layers (:mod:`fusionrag.vllm.passes`), and
the context is written into vLLM's paged cache. vLLM then computes the question's tokens over it and
decodes with its own scheduler, sampler and server.

A request that cannot be served this way is never lost: on the scheduler side it simply gets no external
tokens; a failure on the worker side (a missing or corrupted entry, an unreachable tier, anything) marks
its first external block invalid, and vLLM (``"kv_load_failure_policy": "recompute"``) prefills it itself.
Every fallback is counted by reason (:class:`FusionRAGStats`, in vLLM's periodic KV-connector metrics log) and
logged once per reason.

Options (``kv_connector_extra_config``): ``store`` (the store folder, required), ``ratio`` (0.15),
``method`` (``fusionrag``; ``reuse`` recomputes nothing), ``min_context_tokens`` (256: shorter contexts
are prefilled by vLLM), ``max_loads_per_step`` (1: others wait a step, so one step never computes several
contexts), ``memory_budget_mb`` (1024: chunk KV kept in host memory, heat-based), ``kv_tier`` (a Redis tier
shared by servers, ``redis://HOST:PORT``: Redis down = disk reads), ``debug_dir`` (a folder: one JSON per
loaded request, with the tokens recomputed). Per request,
``kv_transfer_params={"fusionrag": {"ratio": r}}`` or ``{"fusionrag": "off"}``.
"""

from __future__ import annotations

import gc
import json
import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from fusionrag.kvcache.kv import KV, assemble
from fusionrag.online.prefill import with_cut_starts
from fusionrag.vllm.matching import ChunkMatcher, ContextMatch
from fusionrag.vllm.passes import VLLMModel, prefill_into, question_scores, recompute, slot_mapping, write_paged

log = logging.getLogger("fusionrag.vllm")

DEFAULTS = {"ratio": 0.15, "method": "fusionrag", "min_context_tokens": 256, "max_loads_per_step": 1,
            "memory_budget_mb": 1024}


@dataclass
class ReqLoad:
    """What the worker needs for one request (pickled from the scheduler's process: plain values only)."""

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
    ratio: float


@dataclass
class FusionRAGMetadata(KVConnectorMetadata):
    loads: list[ReqLoad] = field(default_factory=list)


@dataclass
class FusionRAGStats(KVConnectorStats):
    """Counts: requests loaded by the connector, and fallbacks to vLLM's own prefill by reason."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Plan:
    match: ContextMatch
    first: int
    end: int
    method: str
    ratio: float


def _options(config: Any) -> dict[str, Any]:
    extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
    if not extra.get("store"):
        raise ValueError("FusionRAGConnector needs kv_connector_extra_config.store (a fusionrag store folder)")
    return {**DEFAULTS, **extra}


class FusionRAGConnector(KVConnectorBase_V1):
    """See the module doc."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from fusionrag.vllm.store_access import open_store

        self.options = _options(self._kv_transfer_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fallbacks: Counter[str] = Counter()
        self._warned: set[str] = set()
        self.loaded = 0
        self.store = open_store(self.options["store"], vllm_config.model_config)
        if role == KVConnectorRole.SCHEDULER:
            self.matcher = ChunkMatcher.from_store(self.store, kind=_kind(self.options["method"]))
            self._plans: dict[str, _Plan] = {}
            self._ready: dict[str, tuple[Any, _Plan]] = {}
            self._loads_this_step = 0
        else:
            from fusionrag.kvcache.device_tier import kv_tiers

            self.model: VLLMModel | None = None
            lower = self.store.shared_kv_source(self.options["kv_tier"]) if self.options.get("kv_tier") \
                else self.store.kv_source()
            self.kv_source = kv_tiers(lower, "cpu", int(self.options["memory_budget_mb"]) << 20)
            self._system: dict[tuple[int, ...], KV] = {}
            self._errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a load that does not happen is a prefill, not a lost hand-off

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            plan = self._plan(request, num_computed_tokens)
        except Exception as exc:  # never take the engine down: vLLM prefills the request itself
            self._fallback("matching failed", exc)
            return 0, False
        if plan is None:
            return 0, False
        if self._loads_this_step >= int(self.options["max_loads_per_step"]):
            return None, False  # asked again next step
        self._loads_this_step += 1
        return plan.end - plan.first, False

    def _plan(self, request: Any, local: int) -> _Plan | None:
        params = (getattr(request, "kv_transfer_params", None) or {}).get("fusionrag", {})
        if params == "off" or (isinstance(params, dict) and params.get("off")):
            return None
        if self.store.refresh():  # another process (ingest, delete) changed the store: match its chunks now
            self.matcher = ChunkMatcher.from_store(self.store, kind=_kind(self.options["method"]))
        ids = list(request.prompt_token_ids or [])
        match = self.matcher.match(ids)
        if match is None or not match.chunks:
            self.fallbacks["no stored chunks in the prompt"] += 1
            return None
        end = min(match.end, len(ids) - 1)
        if match.stored_tokens < int(self.options["min_context_tokens"]) or end <= local:
            return None
        ratio = float(params.get("ratio", self.options["ratio"])) if isinstance(params, dict) else \
            float(self.options["ratio"])
        plan = _Plan(match, local, end, str(self.options["method"]), ratio)
        self._plans[request.request_id] = plan
        return plan

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if plan is not None and num_external_tokens > 0:
            self._ready[request.request_id] = (request, plan)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = FusionRAGMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            entry = self._ready.pop(new.req_id, None)
            if entry is not None:
                meta.loads.append(self._load_of(new.req_id, entry[0], entry[1], list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # a preempted request admitted again: all its blocks are new
            entry = self._ready.pop(req_id, None)
            if entry is not None and cached.new_block_ids[i] is not None:
                meta.loads.append(self._load_of(req_id, entry[0], entry[1], list(cached.new_block_ids[i][0])))
        self._ready.clear()
        self._loads_this_step = 0
        return meta

    def _load_of(self, req_id: str, request: Any, plan: _Plan, block_ids: list[int]) -> ReqLoad:
        chunks = [(c.chunk_id, c.kind, c.start, c.stop, c.offset) for c in plan.match.chunks]
        return ReqLoad(req_id, list(request.prompt_token_ids), plan.match.system_len, chunks, plan.first, plan.end,
                       block_ids, self.block_size, plan.method, plan.ratio)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        self._ready.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.model = VLLMModel.of(find_model(self._vllm_config))
            kernel_block = int(self.model.attention[0].kv_cache.shape[2])
            if kernel_block != self.block_size:
                raise ValueError(f"kernel block size {kernel_block} != scheduler block size {self.block_size}")
            log.info("fusionrag connector: %d layers of %s, store %s", self.model.num_layers,
                     type(self.model.model).__name__, self.options["store"])
        except Exception as exc:  # the connector stays off: every planned load falls back to vLLM's prefill
            self.model = None
            self._fallback("the model cannot be driven by the connector", exc)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, FusionRAGMetadata):
            return
        for load in meta.loads:
            try:
                if self.model is None:
                    raise RuntimeError("connector disabled at start-up")
                self._load(load)
                self.loaded += 1
            except Exception as exc:  # one request falls back to vLLM's prefill; the others are served
                self._errors.add(load.block_ids[load.first // load.block_size])
                self._fallback(type(exc).__name__, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def _load(self, load: ReqLoad) -> None:
        vm = self.model
        assert vm is not None
        if self.store.refresh():  # another process rewrote entries: no cached copy of the old ones is read
            self.kv_source.invalidate(None)
        ids, end = load.token_ids, load.end
        system = self._system_kv(tuple(ids[: load.system_len])) if load.system_len else vm.empty_kv(0)
        keys = [(chunk_id, kind) for chunk_id, kind, *_ in load.chunks]
        entries = [e.dequantized() for e in self.kv_source.get_many(keys)]
        segments, gaps, pos = [], [], load.system_len
        for (_, _, start, stop, offset), entry in zip(load.chunks, entries, strict=True):
            if start > pos:  # a gap (a template's text, a separator): zeros here, recomputed below
                shape = (*entry.kv.keys.shape[:2], start - pos, entry.kv.keys.shape[3])
                segments.append(KV(entry.kv.keys.new_zeros(shape), entry.kv.values.new_zeros(shape), pos))
                gaps.extend(range(pos, start))
            segments.append(entry.kv.slice(offset, offset + stop - start))
            pos = stop
        context, _ = assemble(system, segments, vm.inv_freq, device=vm.device, dtype=vm.dtype)
        question = ids[end:]
        work = vm.empty_kv(end + len(question))
        work.keys[:, :, :end] = context.keys[:, :, :end]
        work.values[:, :, :end] = context.values[:, :, :end]
        candidates = torch.arange(max(load.first, load.system_len), end)
        selected = select(vm, load, question, work, candidates)
        selected = with_cut_starts(selected, [(start, min(stop, end)) for _, _, start, stop, _ in load.chunks],
                                   [(offset, offset + stop - start) for _, _, start, stop, offset in load.chunks])
        if gaps:  # every gap position (also before vLLM's own prefix hit: the pass reads them)
            selected = torch.unique(torch.cat([selected.cpu(), torch.tensor(gaps, dtype=torch.long)]))
        recompute(vm, ids[:end], selected, work)
        write_paged(vm, work, load.first, end, slot_mapping(load.block_ids, load.block_size, load.first, end))
        if self.options.get("debug_dir"):  # what was loaded and recomputed, one JSON per request (tests, studies)
            from fusionrag.files import atomic_write

            atomic_write(Path(self.options["debug_dir"]) / f"{load.req_id}.json", json.dumps(
                {"first": load.first, "end": end, "chunks": load.chunks, "selected": selected.tolist()}))

    def _system_kv(self, system_ids: tuple[int, ...]) -> KV:
        """``S``'s KV computed by vLLM's own layers (once per ``S``): ratio 1 then reproduces vLLM's prefill."""
        kv = self._system.get(system_ids)
        if kv is None:
            assert self.model is not None
            kv = self.model.empty_kv(len(system_ids))
            prefill_into(self.model, system_ids, 0, kv)
            self._system[system_ids] = kv
        return kv

    def _fallback(self, reason: str, exc: BaseException | None = None) -> None:
        self.fallbacks[reason] += 1  # reset by every stats report: the counts are per interval
        said = f"{reason}: {exc}"[:300]  # each distinct fault is logged once per process (the first 100)
        if said not in self._warned and len(self._warned) < 100:
            self._warned.add(said)
            log.warning("fusionrag connector: %s (%s); such requests are prefilled by vLLM (counted in vLLM's "
                        "KV-connector stats from now on)", reason, exc)

    def get_kv_connector_stats(self) -> Any:
        """Loads and fallbacks (by reason) since the last call: vLLM aggregates and logs them with its metrics."""
        counts = {"loaded": self.loaded, **{f"fallback: {k}": v for k, v in self.fallbacks.items()}}
        self.loaded, self.fallbacks = 0, Counter()
        stats = FusionRAGStats({k: v for k, v in counts.items() if v})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return FusionRAGStats(dict(data or {}))


def select(vm: VLLMModel, load: ReqLoad, question: list[int], work: KV, candidates: torch.Tensor) -> torch.Tensor:
    """The context slots to recompute: every candidate at ratio >= 1, none at <= 0 or for ``reuse``, else the
    question's most attended ``round(ratio * candidates)`` (the engine's :func:`~fusionrag.online.policies.select`)."""
    from fusionrag.online.policies import budget, top_k_of

    k = budget(load.ratio, candidates.numel())
    if load.method == "reuse" or k == 0:
        return torch.empty(0, dtype=torch.long)
    if k == candidates.numel():
        return candidates
    scores = question_scores(vm, question, load.end, work)
    return top_k_of(scores[candidates.to(scores.device)], candidates, k)


def _kind(method: str) -> str:
    """The stored KV a method reads (the engine's defaults: FusionRAG the first chunk plain, the rest fused)."""
    return "plain-first" if method == "fusionrag" else "plain"


def find_model(vllm_config: Any) -> Any:
    """vLLM's loaded model in this (worker) process: the module holding the attention layers vLLM registered.

    vLLM hands a connector its KV tensors, not its model; the attention modules of the forward context are
    the model's own, so the one module that contains them (and computes logits) is the model."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    wanted = {id(m) for m in layers.values()}
    if not wanted:
        raise RuntimeError("vLLM registered no attention layers")
    found = []
    with warnings.catch_warnings():  # hasattr on every live object wakes deprecation warnings of unrelated modules
        warnings.simplefilter("ignore")
        candidates = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    for obj in candidates:
        if hasattr(obj, "compute_logits") and hasattr(obj, "model"):
            try:
                if wanted <= {id(m) for m in obj.modules()}:
                    found.append(obj)
            except Exception:
                continue
    if len(found) != 1:
        raise RuntimeError(f"found {len(found)} models holding vLLM's attention layers, expected 1")
    return found[0]


__all__ = ["FusionRAGConnector", "FusionRAGMetadata", "ReqLoad"]
