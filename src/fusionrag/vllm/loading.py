"""The connector's worker side: one request's FusionRAG context, computed and written into vLLM's paged cache.

Runs in each of vLLM's worker processes, inside ``start_load_kv``, before vLLM computes the rest of the
prompt. For a :class:`~fusionrag.vllm.planning.ReqLoad`: the chunks' KV is read from the store (verified,
this rank's KV heads, at the store generation the request was planned on), re-positioned after ``S`` and
assembled in a request-local buffer; the gaps between chunks (a template's text, a cut word) are zeros to be
recomputed; the question's last-layer attention selects the ``ratio`` of context tokens it reads most; those
and the gaps are recomputed through vLLM's own layers (:mod:`fusionrag.vllm.passes`); the context is written
into the request's blocks. Under tensor parallelism every rank says whether it could read before the first
pass, and all load or none do (:mod:`fusionrag.vllm.parallel`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from fusionrag.kvcache.kv import KV, assemble
from fusionrag.online.auto_ratio import AutoRatio
from fusionrag.online.prefill import with_cut_starts
from fusionrag.vllm.model_view import VLLMModel
from fusionrag.vllm.passes import prefill_into, question_scores, recompute, slot_mapping, write_paged
from fusionrag.vllm.planning import ReqLoad


class Loader:
    """Loads requests for one worker: its model (``vm``), the store and the tiers chunk KV is read through."""

    def __init__(self, vm: VLLMModel, store: Any, kv_source: Any, debug_dir: str | None = None) -> None:
        self.vm = vm
        self.store = store
        self.kv_source = kv_source
        self.debug_dir = debug_dir
        self.auto = AutoRatio.from_settings(store.settings)  # how ratio="auto" is sized: the store's calibration
        self._system: dict[tuple[int, ...], KV] = {}

    def load(self, load: ReqLoad) -> None:
        vm = self.vm
        try:
            entries, failure = self._read(load), None
        except Exception as exc:  # said to the other ranks first: every rank runs every pass, or none does
            entries, failure = [], exc
        if not vm.tp.all_ok(failure is None):
            raise failure or RuntimeError("another tensor-parallel rank could not read this request's chunks")
        ids, end = load.token_ids, load.end
        system = self._system_kv(tuple(ids[: load.system_len])) if load.system_len else vm.empty_kv(0)
        segments, gaps, pos = [], [], load.system_len
        for (_, _, start, stop, offset), kv in zip(load.chunks, entries, strict=True):
            if start > pos:  # a gap (a template's text, a separator): zeros here, recomputed below
                shape = (*kv.keys.shape[:2], start - pos, kv.keys.shape[3])
                segments.append(KV(kv.keys.new_zeros(shape), kv.values.new_zeros(shape), pos))
                gaps.extend(range(pos, start))
            segments.append(kv.slice(offset, offset + stop - start))
            pos = stop
        context, _ = assemble(system, segments, vm.inv_freq, device=vm.device, dtype=vm.dtype)
        question = ids[end:]
        work = vm.empty_kv(end + len(question))
        work.keys[:, :, :end] = context.keys[:, :, :end]
        work.values[:, :, :end] = context.values[:, :, :end]
        candidates = torch.arange(max(load.first, load.system_len), end)
        selected = select(vm, load, question, work, candidates, self.auto)
        chosen = selected.numel() / max(1, candidates.numel())  # the share selected (ratio="auto": its own)
        selected = with_cut_starts(selected, [(start, min(stop, end)) for _, _, start, stop, _ in load.chunks],
                                   [(offset, offset + stop - start) for _, _, start, stop, offset in load.chunks])
        if gaps:  # every gap position (also before vLLM's own prefix hit: the pass reads them)
            selected = torch.unique(torch.cat([selected.cpu(), torch.tensor(gaps, dtype=torch.long)]))
        recompute(vm, ids[:end], selected, work)
        write_paged(vm, work, load.first, end, slot_mapping(load.block_ids, load.block_size, load.first, end))
        if self.debug_dir and vm.tp.rank == 0:  # what was loaded and recomputed, one JSON per request (tests)
            from fusionrag.files import atomic_write

            atomic_write(Path(self.debug_dir) / f"{load.req_id}.json", json.dumps(
                {"first": load.first, "end": end, "chunks": load.chunks, "selected": selected.tolist(),
                 "ratio": load.ratio, "chosen_share": round(chosen, 6),
                 "worker": os.getpid()}))  # which replica's worker loaded it (data parallelism)

    def _read(self, load: ReqLoad) -> list[KV]:
        """The request's stored chunk KV, this rank's heads, verified, at the store generation it was planned on."""
        if self.store.refresh():  # another process rewrote entries: no cached copy of the old ones is read
            self.kv_source.invalidate(None)
            self.auto = AutoRatio.from_settings(self.store.settings)  # a re-calibration, as the planner sees it
        if self.store.seen_generation != load.generation:  # its blocks are salted with the planned generation
            raise RuntimeError(f"the store changed (generation {load.generation} -> {self.store.seen_generation}) "
                               "between planning and loading")
        keys = [(chunk_id, kind) for chunk_id, kind, *_ in load.chunks]
        return [e.dequantized().kv.kv_heads(self.vm.tp.kv_heads) for e in self.kv_source.get_many(keys)]

    def _system_kv(self, system_ids: tuple[int, ...]) -> KV:
        """``S``'s KV computed by vLLM's own layers (once per ``S``): ratio 1 then reproduces vLLM's prefill."""
        kv = self._system.get(system_ids)
        if kv is None:
            kv = self.vm.empty_kv(len(system_ids))
            prefill_into(self.vm, system_ids, 0, kv)
            self._system[system_ids] = kv
        return kv


def select(vm: VLLMModel, load: ReqLoad, question: list[int], work: KV, candidates: torch.Tensor,
           auto: AutoRatio | None = None) -> torch.Tensor:
    """The context slots to recompute: every candidate at ratio >= 1, none at <= 0 or for ``reuse``, else the
    question's most attended ``round(ratio * candidates)``, or as many as the store's calibrated ``auto`` counts
    for ``ratio="auto"`` (the engine's rule: :func:`~fusionrag.online.policies.choose_top`), one selection for
    every tensor-parallel rank."""
    from fusionrag.online.policies import choose_top

    if load.method == "reuse":
        return torch.empty(0, dtype=torch.long)

    def scores() -> torch.Tensor:
        every = question_scores(vm, question, load.end, work)
        return every[candidates.to(every.device)]

    return vm.tp.same(choose_top(scores, candidates, load.ratio, auto))


def find_model(vllm_config: Any, caller_depth: int = 8) -> Any:
    """vLLM's loaded model in this (worker) process, asked of the model runner that registers the KV caches.

    vLLM hands a connector its KV tensors (``register_kv_caches``), not its model; that call comes from the
    worker's model runner, whose ``get_model()`` is vLLM's own accessor (a runner without one, its ``model``).
    The runner is the ``self`` of one of the calling frames (up to ``caller_depth`` of them: a MultiConnector or
    a runner's KV-connector helper may sit between), and the model it gives must hold every attention layer
    vLLM registered in its forward context (``static_forward_context``): the model whose KV we write."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    wanted = {id(m) for m in layers.values()}
    if not wanted:
        raise RuntimeError("vLLM registered no attention layers")
    frame = sys._getframe(1)
    try:
        for _ in range(caller_depth):
            frame = frame.f_back
            if frame is None:
                break
            model = _runner_model(frame.f_locals.get("self"))
            if model is not None and wanted <= {id(m) for m in model.modules()}:
                return model
    finally:
        del frame  # frames hold their locals: not kept past this call
    raise RuntimeError("the connector was not registered by a vLLM model runner that gives its model "
                       "(get_model()); this vLLM version is not supported")


def _runner_model(obj: Any) -> torch.nn.Module | None:
    """A model runner's model (``get_model()``, else ``model``), or None for any other caller."""
    if obj is None or isinstance(obj, torch.nn.Module):
        return None
    getter = getattr(type(obj), "get_model", None)
    try:
        model = obj.get_model() if callable(getter) else getattr(obj, "model", None)
    except Exception:
        return None
    return model if isinstance(model, torch.nn.Module) else None
