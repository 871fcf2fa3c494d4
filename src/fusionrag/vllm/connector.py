"""``FusionRAGConnector``: FusionRAG inside vLLM, as a v1 KV connector (``--kv-transfer-config``).

Scheduler side (vLLM's engine-core process, :mod:`fusionrag.vllm.planning`): a request whose prompt ids hold
stored chunks (:mod:`fusionrag.retrieval.token_matching`) is planned on arrival, salted into its mode's prefix-cache
namespace (:mod:`fusionrag.vllm.isolation`), and reports its context tokens after vLLM's own prefix-cache
hit (never the last prompt token) as available externally; anything else reports 0 and vLLM prefills as
usual. Worker side (each model process, :mod:`fusionrag.vllm.loading`), in ``start_load_kv``, before vLLM
computes the rest of the prompt: the chunks' KV (this rank's heads) is read from the store, re-positioned
and assembled, the question's attention selects the ``ratio`` of context tokens it reads most, those are
recomputed through vLLM's own layers (:mod:`fusionrag.vllm.passes`), and the context is written into vLLM's
paged cache. vLLM then computes the question's tokens over it and decodes with its own scheduler, sampler
and server. Tensor parallelism: :mod:`fusionrag.vllm.parallel`. A model or layout the connector cannot
drive stops vLLM at start with one line.

A request that cannot be served this way is never lost: on the scheduler side it simply gets no external
tokens; a failure on the worker side (a missing or corrupted entry, an unreachable tier, anything) marks
its first external block invalid, and vLLM (``"kv_load_failure_policy": "recompute"``) prefills it itself.
Every fallback is counted by reason (:class:`FusionRAGStats`, in vLLM's periodic KV-connector metrics log) and
logged once per reason.

Options (``kv_connector_extra_config``): ``store`` (the store folder, required), ``ratio`` (0.15),
``method`` (``fusionrag``; ``reuse`` recomputes nothing; ``ratio: "auto"`` sizes each request's recompute from
its question's attention, as the store's calibration says: :mod:`fusionrag.online.auto_ratio`),
``min_context_tokens`` (256: shorter contexts
are prefilled by vLLM), ``async_loads`` (true: a request waits for its load outside vLLM's step while the
others run, and the loads in flight advance ``load_tokens_per_step`` (512) tokens per step, first come first
served; false: each load runs whole inside the step that needs it, ``max_loads_per_step`` (1) per step),
``memory_budget_mb`` (1024: chunk KV kept in host memory, heat-based), ``kv_tier`` (a Redis tier
shared by servers, ``redis://HOST:PORT``: Redis down = disk reads), ``debug_dir`` (a folder: one JSON per
loaded request, with the tokens recomputed). Per request,
``kv_transfer_params={"fusionrag": {"ratio": r}}`` or ``{"fusionrag": "off"}``; the response's
``kv_transfer_params["fusionrag"]`` says what it was served (:meth:`~fusionrag.vllm.planning.Planner.report`:
for ``ratio: "auto"`` the share chosen, and the tokens recomputed, which the workers send back with their step's
output, :class:`FusionRAGServed`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from fusionrag.errors import FusionRAGError
from fusionrag.online.request import ReuseRequest
from fusionrag.vllm.isolation import can_salt
from fusionrag.vllm.loading import Loader, find_model
from fusionrag.vllm.model_view import VLLMModel
from fusionrag.vllm.parallel import tp_layout
from fusionrag.vllm.passes import check_rotation
from fusionrag.vllm.planning import Planner, ReqLoad

log = logging.getLogger("fusionrag.vllm")

DEFAULTS = {"ratio": 0.15, "method": "fusionrag", "min_context_tokens": 256, "async_loads": True,
            "load_tokens_per_step": 512, "max_loads_per_step": 1, "memory_budget_mb": 1024}


@dataclass
class FusionRAGMetadata(KVConnectorMetadata):
    loads: list[ReqLoad] = field(default_factory=list)


@dataclass
class FusionRAGServed(KVConnectorWorkerMetadata):
    """Worker -> scheduler, with a step's output: what each load written in that step recomputed, by request id
    (``chosen_share``, ``recomputed_tokens``: :meth:`~fusionrag.vllm.loading.Loader.take_served`), for the
    response's report. Tensor-parallel ranks recompute the same positions: their reports merge."""

    served: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, FusionRAGServed):
            self.served = {**other.served, **self.served}
        return self


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


def _options(config: Any) -> dict[str, Any]:
    extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
    if not extra.get("store"):
        raise ValueError("FusionRAGConnector needs kv_connector_extra_config.store (a fusionrag store folder)")
    options = {**DEFAULTS, **extra}
    if not isinstance(options["async_loads"], bool):
        raise ValueError(f"kv_connector_extra_config: 'async_loads' must be true or false, not "
                         f"{options['async_loads']!r}")
    for name in ("load_tokens_per_step", "max_loads_per_step"):
        if isinstance(options[name], bool) or not isinstance(options[name], int) or options[name] < 1:
            raise ValueError(f"kv_connector_extra_config: '{name}' must be a whole number >= 1, not "
                             f"{options[name]!r}")
    try:  # a ratio no request could run is refused at start, in one line
        options["ratio"] = ReuseRequest("q", str(options["method"]), options["ratio"]).fields_validated().ratio
    except FusionRAGError as exc:
        raise ValueError(f"kv_connector_extra_config: {exc}") from None
    return options


class FusionRAGConnector(KVConnectorBase_V1):
    """See the module doc."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from fusionrag.models.compat import check_supported, exact_context_limit
        from fusionrag.vllm.store_access import open_store

        check_supported(vllm_config.model_config.hf_config)  # a family fusionrag cannot serve: named at start
        self.options = _options(self._kv_transfer_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fallbacks: Counter[str] = Counter()
        self._warned: set[str] = set()
        self.loaded = 0
        self.store = open_store(self.options["store"], vllm_config.model_config)
        if role == KVConnectorRole.SCHEDULER:
            salting = _prefix_caching(vllm_config)
            if salting:
                from vllm.v1.request import Request

                if not can_salt(Request):
                    raise ValueError("this vLLM's requests cannot be re-salted, so the connector's approximate KV "
                                     "would enter vLLM's prefix cache under exact prompts: start vLLM with "
                                     "--no-enable-prefix-caching (enable_prefix_caching=False)")
            self.planner = Planner(self.store, self.options, self.block_size, salting, self._fallback,
                                   exact_context_limit(vllm_config.model_config.hf_config))
        else:
            from fusionrag.kvcache.device_tier import kv_tiers

            lower = self.store.shared_kv_source(self.options["kv_tier"]) if self.options.get("kv_tier") \
                else self.store.kv_source()
            self.kv_source = kv_tiers(lower, "cpu", int(self.options["memory_budget_mb"]) << 20)
            self.loader: Loader | None = None
            self._errors: set[int] = set()
            self._received: set[str] = set()  # asynchronous loads finished (written or failed) since vLLM asked
            self._failed_async: set[str] = set()  # ... of which failed

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a load that does not happen is a prefill, not a lost hand-off

    # -- scheduler side: fusionrag.vllm.planning -------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Plan the request once, on arrival, and salt it into its mode's prefix-cache namespace before vLLM
        looks its blocks up: approximate KV is never served to a request that did not ask for that mode."""
        self.planner.on_arrival(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.planner.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(request, num_external_tokens, lambda: list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return FusionRAGMetadata(self.planner.loads(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        """A failed asynchronous load: vLLM looks the request up again from scratch, and prefills it itself.
        What the workers recomputed for the loads of the step is kept for the response's report."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self.planner.load_failed(req_id)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, FusionRAGServed):
            self.planner.served(meta.served)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, {"fusionrag": self.planner.report(request.request_id)}

    # -- worker side: fusionrag.vllm.loading -----------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find and check the model this worker runs: a model or a layout the connector cannot drive stops vLLM
        at start, in one line (never a connector that silently serves nothing, or something wrong)."""
        config = self._vllm_config.model_config
        total_kv_heads = int(config.get_total_num_kv_heads())
        vm = VLLMModel.of(find_model(self._vllm_config), config.hf_config,
                          lambda local: tp_layout(total_kv_heads, local))
        kernel_block = int(vm.attention[0].kv_cache.shape[2])
        if kernel_block != self.block_size:
            raise ValueError(f"kernel block size {kernel_block} != scheduler block size {self.block_size}")
        check_model_rotation(vm, self._vllm_config)
        self.loader = Loader(vm, self.store, self.kv_source, self.options.get("debug_dir"))
        log.info("fusionrag connector: %d layers of %s, KV heads %s of %d (rank %d of %d), store %s",
                 vm.num_layers, type(vm.model).__name__, vm.tp.kv_heads, total_kv_heads, vm.tp.rank, vm.tp.size,
                 self.options["store"])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Synchronous loads: each one whole, now (vLLM computes the rest of their prompts in this step).
        Asynchronous ones (``async_loads``, decision 066): queued, and the queue advanced by
        ``load_tokens_per_step`` tokens; vLLM calls this after the step's forward, so running requests decode
        between the pieces, and a request is scheduled again once ``get_finished`` names it."""
        meta = self._connector_metadata
        if not isinstance(meta, FusionRAGMetadata):
            return
        for load in meta.loads:
            if self.loader is None:
                self._failed(load, RuntimeError("the connector has no model (register_kv_caches was not called)"))
            elif load.asynchronous:
                self.loader.enqueue(load)
            else:
                try:
                    self.loader.load(load)
                    self.loaded += 1
                except Exception as exc:  # one request falls back to vLLM's prefill; the others are served
                    self._failed(load, exc)
        if self.loader is not None and self.loader.pending():
            for load, exc in self.loader.advance(int(self.options["load_tokens_per_step"])):
                if exc is None:
                    self.loaded += 1
                else:
                    self._failed(load, exc)
                self._received.add(load.req_id)

    def _failed(self, load: ReqLoad, exc: Exception) -> None:
        """vLLM prefills the request itself: a synchronous load's first external block is reported invalid, an
        asynchronous load as a failed receive (its planner then leaves it to vLLM when it is looked up again)."""
        if load.asynchronous:
            self._failed_async.add(load.req_id)
            self._received.add(load.req_id)  # a failed receive is still a finished one (vLLM's contract)
        else:
            self._errors.add(load.block_ids[load.first // load.block_size])
        self._fallback(type(exc).__name__, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Synchronous loads that failed: their first external block, which vLLM (policy ``recompute``) prefills."""
        errors, self._errors = self._errors, set()
        return errors

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads finished since the last call (written, or failed: ``failed_recving``), and
        those of requests vLLM finished (aborted) while queued, dropped now so that vLLM frees their blocks."""
        if self.loader is not None and finished_req_ids:
            self._received.update(self.loader.cancel(set(finished_req_ids)))
        received, self._received = self._received, set()
        failed, self._failed_async = self._failed_async, set()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def build_connector_worker_meta(self) -> FusionRAGServed | None:
        """What the loads written in this step recomputed, to the scheduler side (the response reports it)."""
        served = self.loader.take_served() if self.loader is not None else {}
        return FusionRAGServed(served) if served else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- both sides ------------------------------------------------------------------------

    def _fallback(self, reason: str, exc: BaseException | None = None) -> None:
        """Count a request vLLM prefills itself; a fault (``exc``) is also logged, once per distinct fault."""
        self.fallbacks[reason] += 1  # reset by every stats report: the counts are per interval
        said = f"{reason}: {exc}"[:300]  # each distinct fault is logged once per process (the first 100)
        if exc is not None and said not in self._warned and len(self._warned) < 100:
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


def check_model_rotation(vm: VLLMModel, vllm_config: Any) -> None:
    """Stop vLLM at start, in one line, when it rotates keys otherwise than the store's model (another rope
    scaling, longrope's long factors, an interleaved rotary layout): a reused chunk would sit at the wrong
    position without a word."""
    from vllm.forward_context import set_forward_context

    from fusionrag.models.compat import exact_context_limit
    from fusionrag.models.rope import KEY_REL_TOL, REDUCED_KEY_REL_TOL

    longest = min(x for x in (int(vllm_config.model_config.max_model_len),
                              exact_context_limit(vllm_config.model_config.hf_config), 8192) if x)
    with set_forward_context(None, vllm_config):
        gap = check_rotation(vm, 1, sorted({1, min(97, longest - 1), longest - 1}))
    tolerance = KEY_REL_TOL if vm.dtype == torch.float32 else REDUCED_KEY_REL_TOL
    if not gap < tolerance:
        raise ValueError(f"vLLM rotates {vllm_config.model_config.hf_config.model_type}'s keys otherwise than the "
                         f"model the store was built with (a moved key is off by {gap:.2g} of its size, tolerance "
                         f"{tolerance:g}): check its rope scaling and max_model_len (longrope switches to its long "
                         "factors past its original length)")


def _prefix_caching(vllm_config: Any) -> bool:
    """Whether vLLM publishes blocks for reuse (its default): then each mode gets its own namespace."""
    return bool(getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True))


__all__ = ["FusionRAGConnector", "FusionRAGMetadata", "ReqLoad"]
