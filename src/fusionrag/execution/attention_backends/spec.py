"""What a sparse pass tells its attention backend besides the tensors (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusionrag.kvcache.kv import ReadRule


@dataclass(frozen=True)
class SparseQuery:
    """Where a pass's queries sit and which past slots are stale (the same for every layer)."""

    positions: torch.Tensor  # [n] long, strictly ascending, on the compute device
    past_base: int  # position of past slot 0
    past_len: int
    stale: torch.Tensor | None = None  # [past_len] bool, on the compute device
    memo: dict = field(default_factory=dict, compare=False)  # per-pass precomputation of a backend
    #: The past is a prompt whose KV carries a read rule: read through it, whatever the backend (``ruled``).
    read_rule: ReadRule | None = None

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.positions.numel() == 0:
            raise ValueError("a sparse pass needs a non-empty 1-D list of query positions")
        if self.positions.numel() > 1 and not bool((self.positions[1:] > self.positions[:-1]).all()):
            raise ValueError("query positions must be strictly ascending")
        if self.stale is not None and self.stale.numel() != self.past_len:
            raise ValueError(f"stale flags for {self.stale.numel()} slots, past has {self.past_len}")

    def past_positions(self) -> torch.Tensor:
        return torch.arange(self.past_base, self.past_base + self.past_len, device=self.positions.device)
