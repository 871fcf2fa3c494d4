"""Sparse recompute: refresh a chosen set of reused tokens, plus the question, through all layers.

Given an assembled context cache (``S + chunks``, positions ``0..T-1``, mostly reused
KV), the selected token indices ``R`` and the question tokens, one forward pass runs
``tokens[R] + question`` at their true positions. Each of them attends to every
position at or before its own: fresh KV for tokens in ``R`` (computed in this same
pass, layer by layer) and reused KV for the rest; the stale KV of ``R`` is hidden.
The fresh KV is then written into place. With ``R`` = every context token after
``S``, this is exactly Full Attention; with ``R`` empty it is Full Reuse.

The pass is sparse (:mod:`fusionrag.execution.forward`): the fresh KV goes to the pass's
own buffer and the attention backend reads the shared context, which is never written.
Everything runs on the model's device, in its dtype; the returned prompt KV is there too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusionrag.execution.forward import forward
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel


@dataclass
class RecomputeResult:
    kv: KV  # context (with refreshed tokens) + question, positions 0..T+q-1
    last_logits: torch.Tensor  # [vocab] logits after the last question token
    recomputed: int  # number of context tokens recomputed


def sparse_recompute(
    lm: LoadedModel,
    context: KV,
    context_ids: torch.Tensor,
    recompute_idx: torch.Tensor,
    suffix_ids: torch.Tensor,
) -> RecomputeResult:
    """Recompute ``context`` tokens ``recompute_idx`` and append ``suffix_ids`` (see module doc)."""
    if context.base_position != 0:
        raise ValueError("sparse_recompute expects an assembled context starting at position 0")
    total = len(context)
    context_ids = torch.as_tensor(context_ids, dtype=torch.long).reshape(-1)
    suffix_ids = torch.as_tensor(suffix_ids, dtype=torch.long).reshape(-1)
    if context_ids.numel() != total:
        raise ValueError(f"{context_ids.numel()} context ids for a {total}-token cache")
    if suffix_ids.numel() == 0:
        raise ValueError("the suffix (question) must have at least one token")
    idx = torch.unique(torch.as_tensor(recompute_idx, dtype=torch.long).reshape(-1))  # sorted, no repeats
    if idx.numel() and context.parallel is not None:
        raise ValueError("a context placed in parallel (APE) is read as stored: it recomputes no tokens")
    if idx.numel() and (idx[0] < 0 or idx[-1] >= total):
        raise ValueError("recompute indices must lie inside the context")
    device = lm.device
    context = context.to(lm.dtype, device)
    idx = idx.to(device)
    stale = torch.zeros(total, dtype=torch.bool, device=device)
    stale[idx] = True
    positions = torch.cat([idx, torch.arange(total, total + suffix_ids.numel(), device=device)])
    ids = torch.cat([context_ids.to(device)[idx], suffix_ids.to(device)])
    res = forward(lm, ids, positions, context, past_hidden=stale)
    r = idx.numel()
    # The request's own prompt KV, written once: reused context, fresh KV in place of the stale
    # slots, the question after it (the shared ``context`` is never modified).
    out = []
    for reused, fresh in ((context.keys, res.keys), (context.values, res.values)):
        t = reused.new_empty((*reused.shape[:2], total + suffix_ids.numel(), reused.shape[3]))
        t[:, :, :total] = reused
        t[:, :, idx] = fresh[:, :, :r].to(t.dtype)
        t[:, :, total:] = fresh[:, :, r:].to(t.dtype)
        out.append(t)
    return RecomputeResult(KV(out[0], out[1], 0, context.parallel), res.logits[-1], r)
