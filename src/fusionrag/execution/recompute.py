"""Sparse recompute: refresh a chosen set of reused tokens, plus the question, through all layers.

Given an assembled context cache (``S + chunks``, positions ``0..T-1``, mostly reused
KV), the selected token indices ``R`` and the question tokens, one forward pass runs
``tokens[R] + question`` at their true positions. Each of them attends to every
position at or before its own: fresh KV for tokens in ``R`` (computed in this same
pass, layer by layer) and reused KV for the rest; the stale KV of ``R`` is hidden.
The fresh KV is then written into place. With ``R`` = every context token after
``S``, this is exactly Full Attention; with ``R`` empty it is Full Reuse.

The pass is sparse (:mod:`fusionrag.execution.forward`). Where the backend has an in-place
pass (the torch backends), the request's prompt KV is allocated first as a copy of the context
and each layer writes its fresh KV into it before its attention (``forward_in_place``, decision
050); otherwise the fresh KV goes to the pass's own buffer, the backend reads the context and
the stale slots are masked. Either way the shared context is never written.
Everything runs on the model's device, in its dtype; the returned prompt KV is there too.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from fusionrag.execution.forward import forward, forward_in_place_pieces, in_place_available, run_pieces
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
    return run_pieces(sparse_recompute_pieces(lm, context, context_ids, recompute_idx, suffix_ids))


def sparse_recompute_pieces(
    lm: LoadedModel,
    context: KV,
    context_ids: torch.Tensor,
    recompute_idx: torch.Tensor,
    suffix_ids: torch.Tensor,
    piece_tokens: int | None = None,
    buffer: KV | None = None,
) -> Generator[None, None, RecomputeResult]:
    """:func:`sparse_recompute` as passes of at most ``piece_tokens`` tokens (where the backend writes in place;
    otherwise one pass), each ``next()`` one of them (:func:`~fusionrag.execution.forward.forward_in_place_pieces`).

    ``buffer``: the request's own prompt KV, ``context`` in its first slots (the same memory) and room for
    the suffix after them; an in-place pass writes into it and returns it, so the context is never copied.
    Without one (a shared context, e.g. the whole-context cache's) the pass works on a copy."""
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
    if idx.numel() and (idx[0] < 0 or idx[-1] >= total):
        raise ValueError("recompute indices must lie inside the context")
    device = lm.device
    context = context.to(lm.dtype, device)
    idx = idx.to(device)
    positions = torch.cat([idx, torch.arange(total, total + suffix_ids.numel(), device=device)])
    ids = torch.cat([context_ids.to(device)[idx], suffix_ids.to(device)])
    r = idx.numel()
    if context.read_rule is None and in_place_available(lm):
        # The request's prompt KV, reused context then room for the question, is the pass's own
        # buffer: each layer writes its fresh KV over the stale slots and after the context (decision 050).
        if buffer is not None:
            if len(buffer) != total + suffix_ids.numel() or buffer.keys.data_ptr() != context.keys.data_ptr() \
                    or buffer.values.data_ptr() != context.values.data_ptr():
                raise ValueError("the buffer must hold the context in its first slots and room for the suffix")
            work = buffer  # its room is zeros (assemble's), read (masked) by a piece before the suffix's writes it
        else:
            work = KV(*(t.new_empty((*t.shape[:2], total + suffix_ids.numel(), t.shape[3]))
                        for t in (context.keys, context.values)), 0)
            for slots, reused in ((work.keys, context.keys), (work.values, context.values)):
                slots[:, :, :total] = reused
                slots[:, :, total:] = 0  # read (masked) by a piece before the question's piece writes it
        logits = yield from forward_in_place_pieces(lm, ids, positions, work, piece_tokens)
        return RecomputeResult(work, logits, r)
    stale = torch.zeros(total, dtype=torch.bool, device=device)
    stale[idx] = True
    res = forward(lm, ids, positions, context, past_hidden=stale)
    # The request's own prompt KV, written once: reused context, fresh KV in place of the stale
    # slots, the question after it (the shared ``context`` is never modified).
    out = []
    for reused, fresh in ((context.keys, res.keys), (context.values, res.values)):
        t = reused.new_empty((*reused.shape[:2], total + suffix_ids.numel(), reused.shape[3]))
        t[:, :, :total] = reused
        t[:, :, idx] = fresh[:, :, :r].to(t.dtype)
        t[:, :, total:] = fresh[:, :, r:].to(t.dtype)
        out.append(t)
    return RecomputeResult(KV(out[0], out[1], 0, context.read_rule), res.logits[-1], r)
