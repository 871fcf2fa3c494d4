"""The connector under vLLM's tensor parallelism: which stored KV heads a rank holds, and the few collectives
that keep every rank's load identical.

With ``tensor_parallel_size = N`` every worker process holds ``1/N`` of the attention heads and runs the
same layers on the same tokens, vLLM's TP layers exchanging partial results inside. A store keeps every KV
head of a chunk, so each rank loads only its own heads (the heads vLLM's ``QKVParallelLinear`` gives it:
consecutive blocks of ``total / N`` heads, or, when ``N`` exceeds the KV heads, head ``rank // (N / total)``
replicated). Selection must be one decision for all ranks: each rank's question attention covers only its
heads, so the per-token scores are summed over the TP group (the sum over all heads, as on one rank), and
rank 0's selection is broadcast, so ranks never recompute different tokens. Every rank must also take part in
every pass (a pass runs vLLM's collectives), so a rank that cannot load a request says so before the first
pass and all ranks fall back together (:meth:`TPLayout.all_ok`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPLayout:
    """This worker's place in the TP group and the stored KV heads it serves (``kv_heads``, a slice)."""

    rank: int
    size: int
    kv_heads: slice
    group: Any = None  # vLLM's GroupCoordinator of the TP group (None with one rank)

    def sum(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` summed over the ranks (every rank gets the same sum)."""
        if self.size == 1:
            return scores
        return self.group.all_reduce(scores.contiguous())

    def same(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (same shape and dtype everywhere)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        torch.distributed.broadcast(tensor, src=self.group.ranks[0], group=self.group.cpu_group)
        return tensor

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank can go on with a load (a collective: every rank must call it, once per load)."""
        if self.size == 1:
            return ok
        failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
        torch.distributed.all_reduce(failed, group=self.group.cpu_group)
        return int(failed.item()) == 0


def kv_heads_of(rank: int, size: int, total: int, local: int) -> slice:
    """The stored KV heads rank ``rank`` of ``size`` holds, ``local`` of ``total`` (vLLM's split), or a
    ``ValueError`` naming a layout the connector does not know."""
    if size == 1 and local == total:
        return slice(0, total)
    if total >= size and local * size == total:
        return slice(rank * local, (rank + 1) * local)
    if total < size and size % total == 0 and local == 1:
        head = rank // (size // total)  # QKVParallelLinear: shard_rank = tp_rank // num_kv_head_replicas
        return slice(head, head + 1)
    raise ValueError(f"unknown tensor-parallel layout: {local} of {total} KV heads on rank {rank} of {size}")


def tp_layout(total_kv_heads: int, local_kv_heads: int) -> TPLayout:
    """This worker's layout, read from vLLM's parallel state (initialised before a connector registers)."""
    from vllm.distributed import parallel_state as ps

    if ps.get_pp_group().world_size > 1:
        raise ValueError("pipeline parallelism is not supported: every layer must be on this worker")
    size = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    heads = kv_heads_of(rank, size, total_kv_heads, local_kv_heads)
    return TPLayout(rank, size, heads, ps.get_tp_group() if size > 1 else None)


SINGLE = TPLayout(0, 1, slice(None))
