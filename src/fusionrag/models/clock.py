"""Stage timings that are right on every device.

On CUDA, kernels run asynchronously: ``time.perf_counter()`` right after a forward reads the
time the kernels were *queued*, and their cost lands in whatever stage synchronises next (the
first token's ``argmax``). A :class:`StageClock` synchronises the model's device before each
reading, so each stage is charged its own work (on the CPU the sync is a no-op). Both the
clock and the sync are injectable: tests check the accounting with a fake clock and a sync hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_sync(device: torch.device | str | None) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


class StageClock:
    """Milliseconds per named stage, each reading taken after the device finished the stage's work."""

    def __init__(self, device: torch.device | str | None = None, *, now: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None) -> None:
        self._now = now
        self._sync = sync if sync is not None else device_sync(device)
        self._sync()
        self._start = self._last = self._now()
        self.stages: dict[str, float] = {}

    def _read(self) -> float:
        self._sync()
        return self._now()

    def lap(self, stage: str) -> float:
        """Close ``stage`` (the time since the previous lap); returns its milliseconds."""
        t = self._read()
        ms = (t - self._last) * 1000.0
        self.stages[stage] = self.stages.get(stage, 0.0) + ms
        self._last = t
        return ms

    def skip(self, stage: str) -> None:
        """Record ``stage`` as not run (0 ms), without reading the clock."""
        self.stages.setdefault(stage, 0.0)

    def total(self) -> float:
        """Milliseconds since the clock started (synchronised)."""
        return (self._read() - self._start) * 1000.0
