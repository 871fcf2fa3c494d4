"""Chunk KV on the GPU under a byte budget, over page-locked host memory: the paper's upper tiers.

FusionRAG keeps chunk KV in GPU memory, host memory and on the SSD, and moves it by heat.
:class:`~fusionrag.kvcache.sources.MemoryTier` is one such tier boundary (budget, heat,
prefetch threads); this module gives the two placements that make a GPU deployment's upper
tiers out of it, and :func:`kv_tiers` stacks them:

- :func:`pin_entry`: the host tier keeps entries in page-locked (pinned) memory, so their copy
  to the GPU is a DMA that needs no staging copy and can run asynchronously;
- :class:`DevicePlacement`: an entry copied to the GPU on the tier's own CUDA stream, not the
  model's, so a loader thread's copies overlap the model's kernels (a queued request's chunks
  arrive while the current one computes). The loader thread waits on its copy's event, never
  on the whole device, and each copy is recorded as used by the compute stream, so an entry
  evicted while a kernel still reads it is not reused before that kernel is done.

Without CUDA there is no pinned memory and no side stream: the placement is a plain
``.to(device)`` (on a CPU, the entry itself). The tiers then still work (the tests run them on
the CPU) but say nothing about a GPU. int8 entries read from the store's files stay int8 below
the device tier (codes and fp16 scales, half of fp16's bytes in host memory and on the bus) and are
dequantised to fp16 by the placement, on the device (:mod:`fusionrag.kvcache.quant`); the same
for the shared Redis tier (any source with a ``dequantize`` switch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import torch

from fusionrag.kvcache.sources import KVSource, MemoryTier
from fusionrag.kvcache.store import KVEntry


def map_entry(entry: KVEntry, fn: Callable[[torch.Tensor], torch.Tensor]) -> KVEntry:
    """``entry`` with ``fn`` applied to each of its tensors (keys, values, Cache-Craft scores, int8 scales)."""
    kv = entry.kv
    scores = None if entry.scores is None else fn(entry.scores)
    scales = None if entry.scales is None else (fn(entry.scales[0]), fn(entry.scales[1]))
    return replace(entry, kv=replace(kv, keys=fn(kv.keys), values=fn(kv.values)), scores=scores, scales=scales)


def pin_entry(entry: KVEntry) -> KVEntry:
    """A page-locked host copy of ``entry`` where CUDA is available (else ``entry`` itself)."""
    if not torch.cuda.is_available():
        return entry
    return map_entry(entry, lambda t: t if t.is_pinned() else t.pin_memory())


class DevicePlacement:
    """Copies entries to ``device``: on CUDA from pinned memory, on a side stream (see the module doc)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def __call__(self, entry: KVEntry) -> KVEntry:
        if self._stream is None:
            return map_entry(entry, lambda t: t.to(self.device)).dequantized()
        compute = torch.cuda.default_stream(self.device)

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = t if t.is_pinned() else t.pin_memory()
            out = host.to(self.device, non_blocking=True)
            out.record_stream(compute)
            return out

        with torch.cuda.stream(self._stream):
            placed = map_entry(entry, copy).dequantized()  # int8 codes cross the bus; fp16 is made on the GPU
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # this loader thread waits for its own copies only
        return placed


def kv_tiers(lower: KVSource, device: torch.device | str, host_bytes: int | None = None,
             device_bytes: int | None = None, *, loader_threads: int = 2, **cache_options) -> KVSource:
    """``lower`` (the store's files or a shared tier) under a host tier of ``host_bytes`` (page-locked
    when ``device`` is a GPU) and a tier of ``device_bytes`` on ``device`` above it; a budget of 0 or
    ``None`` leaves that tier out. Stats name them ``host`` and ``device``."""
    source = lower
    if device_bytes and getattr(lower, "dequantize", None) is True:
        # The store's files or the shared Redis tier: the tier above dequantises, so the tiers below keep
        # int8 entries as stored (half of fp16's bytes, half the copy to the GPU). Only that tier reads
        # them; a shallow copy, so the caller's source keeps handing out fp16.
        source = copy.copy(lower)
        source.dequantize = False
    if host_bytes:
        source = MemoryTier(source, host_bytes, loader_threads=loader_threads, name="host",
                            place=pin_entry if torch.device(device).type == "cuda" else None, **cache_options)
    if device_bytes:
        source = MemoryTier(source, device_bytes, loader_threads=loader_threads, name="device",
                            place=DevicePlacement(device), **cache_options)
    return source
