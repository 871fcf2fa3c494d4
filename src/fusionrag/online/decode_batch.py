"""The requests decoding together: rows of one shared decoder, joining between steps, leaving when they end.

Decoding one token is dominated by reading the weights, so B rows cost little more than one: every request
past its prefill is a row of one :class:`~fusionrag.execution.decoder.BatchDecoder`, which takes over its
prompt KV when it joins (the request stops holding it). The scheduler (:mod:`fusionrag.online.scheduler`)
decides who joins and leaves and what each row's logits become; this is the batch's bookkeeping and its
forward.
"""

from __future__ import annotations

import threading

import torch

from fusionrag.execution.decoder import BatchDecoder
from fusionrag.models.registry import LoadedModel
from fusionrag.online.scheduled import SchedulerStats
from fusionrag.online.state import Request


class DecodeBatch:
    """The decoding requests: ``rows`` (in the decoder, by request id) and ``joining`` (at the next step)."""

    def __init__(self, lm: LoadedModel, stats: SchedulerStats) -> None:
        self._decoder = BatchDecoder(lm)
        self._stats = stats
        self.rows: dict[str, Request] = {}
        self.joining: list[Request] = []
        self._gone: list[str] = []  # rows released since the last settle

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    def requests(self) -> list[Request]:
        return [*self.rows.values(), *self.joining]

    def ids(self) -> list[str]:
        return [r.id for r in self.requests()]

    def add(self, req: Request) -> None:
        """``req`` (prefilled, its first token sent) joins at the next step."""
        self.joining.append(req)

    def seat(self) -> list[Request]:
        """Seat the joining requests (the decoder holds the only copy of their prompt KV from now on); the
        cancelled rows, which should leave before a forward is spent on them."""
        for req in self.joining:
            self._decoder.join(req.id, req.take_kv())
            self.rows[req.id] = req
        self.joining = []
        return [r for r in self.rows.values() if r.cancelled]

    def step(self, lock: threading.RLock) -> dict[str, torch.Tensor]:
        """One forward: each row's last token at its own position; each row's next-token logits."""
        with lock:
            logits = self._decoder.step({rid: r.progress.last_token for rid, r in self.rows.items()})
        self._stats.decode_steps += 1
        self._stats.decode_rows += len(self.rows)
        self._stats.max_batch_seen = max(self._stats.max_batch_seen, len(self.rows))
        return logits

    def release(self, req: Request) -> None:
        """``req`` leaves the batch (it ended); its decoder row goes at the next :meth:`settle`."""
        if self.rows.pop(req.id, None) is not None:
            self._gone.append(req.id)
        self.joining = [r for r in self.joining if r is not req]

    def settle(self) -> None:
        """Drop the decoder rows of the requests that left (at once: one re-pack at most)."""
        if not self._gone:
            return
        before = self._decoder.compactions
        self._decoder.drop(self._gone)
        self._stats.compactions += self._decoder.compactions - before
        self._gone = []

    def clear(self) -> None:
        self.rows, self.joining, self._gone = {}, [], []
        self._decoder.clear()
