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
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionrag.kvcache.kv import KV, assemble
from fusionrag.online.auto_ratio import AutoRatio
from fusionrag.online.prefill import with_cut_starts
from fusionrag.vllm.model_view import VLLMModel
from fusionrag.vllm.passes import prefill_into, question_scores, recompute_many, slot_mapping, write_paged
from fusionrag.vllm.planning import ReqLoad


@dataclass
class LoadJob:
    """One request's load between steps: assembled (``work``), then selected, then recomputed piece by piece."""

    load: ReqLoad
    work: KV | None = None  # the request-local KV: the assembled context, the question's room after it
    selected: torch.Tensor | None = None  # the context slots to recompute, sorted (set once chosen)
    chosen: float = 0.0  # the share of the candidates selected (ratio="auto": its own)
    recomputed: int = 0  # how many of ``selected`` are refreshed so far (pieces go in position order)
    shared_passes: int = 0  # pieces that went through the model in one pass with other loads' pieces

    @property
    def left(self) -> int:
        return 0 if self.selected is None else self.selected.numel() - self.recomputed


class Loader:
    """Loads requests for one worker: its model (``vm``), the store and the tiers chunk KV is read through.

    ``load`` runs one request's whole load at once (synchronous loading: inside the step that needs it).
    ``enqueue`` + ``advance`` run queued loads first come, first served, a bounded number of tokens per step
    (asynchronous loading, decision 066): the recompute is cut into pieces in position order, which computes
    exactly what one pass does (a selected token reads fresh KV of the selected tokens before it, written by
    an earlier piece or earlier in its own), and every tensor-parallel rank cuts them alike (budgets are token
    counts, never times)."""

    def __init__(self, vm: VLLMModel, store: Any, kv_source: Any, debug_dir: str | None = None) -> None:
        self.vm = vm
        self.store = store
        self.kv_source = kv_source
        self.debug_dir = debug_dir
        self.auto = AutoRatio.from_settings(store.settings)  # how ratio="auto" is sized: the store's calibration
        self._system: dict[tuple[int, ...], KV] = {}
        self._queue: deque[LoadJob] = deque()
        #: What each load written since :meth:`take_served` recomputed, by request id (the response reports it).
        self._served: dict[str, dict[str, float | int]] = {}

    def load(self, load: ReqLoad) -> None:
        """The whole load of one request, now."""
        job = LoadJob(load)
        self._assemble(job)
        self._choose(job)
        self._recompute([(job, job.left)])
        self._write(job)

    def enqueue(self, load: ReqLoad) -> None:
        self._queue.append(LoadJob(load))

    def pending(self) -> int:
        return len(self._queue)

    def take_served(self) -> dict[str, dict[str, float | int]]:
        """What the loads written since the last call recomputed (``chosen_share``: the share of the context's
        candidates the selection chose, ``ratio="auto"``'s own; ``recomputed_tokens``: every position recomputed,
        a client's gaps included), by request id; forgotten here once taken."""
        served, self._served = self._served, {}
        return served

    def cancel(self, req_ids: set[str]) -> list[str]:
        """Drop the queued loads of requests vLLM finished (aborted): the ids whose blocks it may now free."""
        gone = [job.load.req_id for job in self._queue if job.load.req_id in req_ids]
        self._queue = deque(job for job in self._queue if job.load.req_id not in req_ids)
        return gone

    def advance(self, budget: int, min_piece: int = 32) -> list[tuple[ReqLoad, Exception | None]]:
        """Run queued loads, first come first served, until about ``budget`` tokens went through the model
        (the question's selection pass and the recomputed tokens count; reading and assembling do not). The
        recompute pieces of this call, one per load, go through the model in one pass (each load reads only its
        own KV). A piece shorter than ``min_piece`` that would go alone waits for the next call, unless it finishes
        its load.
        Returns the loads finished in this call, each with its failure (None: written into vLLM's cache)."""
        done: list[tuple[ReqLoad, Exception | None]] = []
        min_piece = min(min_piece, budget)  # a budget under it still makes progress
        pieces: list[tuple[LoadJob, int]] = []
        for job in list(self._queue):
            if budget <= 0:
                break
            try:
                if job.work is None:
                    self._assemble(job)
                if job.selected is None:
                    budget -= self._choose(job)
                if job.left and budget > 0:
                    n = min(job.left, budget)
                    if n < min(min_piece, job.left) and not pieces:  # alone, a pass this short is mostly overhead
                        break
                    pieces.append((job, n))
                    budget -= n
            except Exception as exc:  # this request falls back to vLLM's prefill; the queue goes on
                self._queue.remove(job)
                done.append((job.load, exc))
        try:
            if pieces:
                self._recompute(pieces)
        except Exception as exc:  # the pass failed: each of its loads falls back
            for job, _ in pieces:
                self._queue.remove(job)
                done.append((job.load, exc))
        for job in [j for j in self._queue if j.selected is not None and not j.left]:
            self._queue.remove(job)
            try:
                self._write(job)
                done.append((job.load, None))
            except Exception as exc:
                done.append((job.load, exc))
        return done

    def _assemble(self, job: LoadJob) -> None:
        """Read the chunks' KV and assemble the context after ``S`` in a request-local buffer (gaps: zeros)."""
        vm, load = self.vm, job.load
        try:
            entries, failure = self._read(load), None
        except Exception as exc:  # said to the other ranks first: every rank runs every pass, or none does
            entries, failure = [], exc
        if not vm.tp.all_ok(failure is None):
            raise failure or RuntimeError("another tensor-parallel rank could not read this request's chunks")
        ids, end = load.token_ids, load.end
        system = self._system_kv(tuple(ids[: load.system_len])) if load.system_len else vm.empty_kv(0)
        segments, pos = [], load.system_len
        for (_, _, start, stop, offset), kv in zip(load.chunks, entries, strict=True):
            if start > pos:  # a gap (a template's text, a separator): zeros here, recomputed below
                shape = (*kv.keys.shape[:2], start - pos, kv.keys.shape[3])
                segments.append(KV(kv.keys.new_zeros(shape), kv.values.new_zeros(shape), pos))
            segments.append(kv.slice(offset, offset + stop - start))
            pos = stop
        context, _ = assemble(system, segments, vm.inv_freq, device=vm.device, dtype=vm.dtype)
        work = vm.empty_kv(len(ids))  # the context, then room for the question
        work.keys[:, :, :end] = context.keys[:, :, :end]
        work.values[:, :, :end] = context.values[:, :, :end]
        job.work = work

    def _choose(self, job: LoadJob) -> int:
        """The question's selection pre-pass and the slots to recompute; returns the tokens it ran."""
        load, work = job.load, job.work
        assert work is not None
        question = load.token_ids[load.end:]
        candidates = torch.arange(max(load.first, load.system_len), load.end)
        selected = select(self.vm, load, question, work, candidates, self.auto)
        job.chosen = selected.numel() / max(1, candidates.numel())  # the share selected
        spans = [(start, min(stop, load.end)) for _, _, start, stop, _ in load.chunks]
        selected = with_cut_starts(selected, spans,
                                   [(offset, offset + stop - start) for _, _, start, stop, offset in load.chunks])
        gaps, pos = [], load.system_len
        for _, _, start, stop, _ in load.chunks:  # a template's text, a separator: zeros in ``work``
            gaps.extend(range(pos, start))
            pos = stop
        if gaps:  # every gap position (also before vLLM's own prefix hit: the pass reads them)
            selected = torch.cat([selected.cpu(), torch.tensor(gaps, dtype=torch.long)])
        job.selected = torch.unique(selected.cpu())  # sorted: the pieces go in position order
        return 0 if load.method == "reuse" else len(question)

    def _recompute(self, pieces: list[tuple[LoadJob, int]]) -> None:
        """The next ``n`` selected slots of each job through every layer, all in one pass."""
        batch = []
        for job, n in pieces:
            assert job.selected is not None and job.work is not None
            batch.append((job.load.token_ids[: job.load.end], job.selected[job.recomputed: job.recomputed + n],
                          job.work))
        recompute_many(self.vm, batch)
        for job, n in pieces:
            job.recomputed += n
            job.shared_passes += len(pieces) > 1

    def _write(self, job: LoadJob) -> None:
        """The context into the request's blocks of vLLM's paged cache (and the debug file, when asked)."""
        vm, load, work = self.vm, job.load, job.work
        assert work is not None and job.selected is not None
        write_paged(vm, work, load.first, load.end, slot_mapping(load.block_ids, load.block_size, load.first,
                                                                 load.end))
        job.work = None  # the request-local buffer is not kept past its load
        self._served[load.req_id] = {"chosen_share": round(job.chosen, 4), "recomputed_tokens": job.selected.numel()}
        if self.debug_dir and vm.tp.rank == 0:  # what was loaded and recomputed, one JSON per request (tests)
            from fusionrag.files import atomic_write

            atomic_write(Path(self.debug_dir) / f"{load.req_id}.json", json.dumps(
                {"first": load.first, "end": load.end, "chunks": load.chunks, "selected": job.selected.tolist(),
                 "ratio": load.ratio, "chosen_share": round(job.chosen, 6), "shared_passes": job.shared_passes,
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
