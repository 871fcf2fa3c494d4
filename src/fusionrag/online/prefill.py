"""The online prefill paths every method is built from.

- :func:`prefill_full` — Full Attention: one ordinary causal prefill of the whole prompt.
- :func:`prefill_reused` — assemble ``S`` + stored chunk KVs at consecutive positions,
  then recompute the selected tokens and the question in one sparse pass. With no
  tokens selected this is Full Reuse; with all of them, Full Attention.
Both return the prompt's KV and the logits for the first answer token, with timings. Their ``_pieces``
forms run the same pass cut in pieces of a token budget (a scheduler decodes other requests between them).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch

from fusionrag.execution.forward import forward_in_place_pieces, in_place_available, prefill, run_pieces
from fusionrag.execution.recompute import sparse_recompute_pieces
from fusionrag.kvcache.kv import KV, Placement, assemble
from fusionrag.models.registry import LoadedModel


@dataclass
class Prefilled:
    """A prompt ready to decode from."""

    kv: KV
    last_logits: torch.Tensor
    context_tokens: int  # chunk tokens (excludes S and the question)
    recomputed: int  # chunk tokens recomputed
    timings_ms: dict[str, float] = field(default_factory=dict)
    selected: torch.Tensor | None = None  # indices (into the assembled cache) that were recomputed
    spans: list[tuple[int, int]] = field(default_factory=list)  # each chunk's span in the cache


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def prefill_full(
    lm: LoadedModel, system_token_ids: Sequence[int], chunk_token_ids: Sequence[Sequence[int]],
    question_token_ids: Sequence[int],
) -> Prefilled:
    """Full Attention over ``S + chunks + Q`` (the quality reference)."""
    return run_pieces(prefill_full_pieces(lm, system_token_ids, chunk_token_ids, question_token_ids))


def prefill_full_pieces(
    lm: LoadedModel, system_token_ids: Sequence[int], chunk_token_ids: Sequence[Sequence[int]],
    question_token_ids: Sequence[int], piece_tokens: int | None = None,
) -> Generator[None, None, Prefilled]:
    """:func:`prefill_full` as passes of at most ``piece_tokens`` tokens, each ``next()`` one of them.

    One pass (the model's own causal kernel) unless the prompt is longer than ``piece_tokens``
    and the backend writes in place; then each piece writes its KV into the prompt's buffer and
    reads the pieces before it (:func:`~fusionrag.execution.forward.forward_in_place_pieces`)."""
    t0 = time.perf_counter()
    ids = torch.tensor([*system_token_ids, *(t for c in chunk_token_ids for t in c), *question_token_ids])
    if piece_tokens and len(ids) > piece_tokens and in_place_available(lm):
        shape = lm.adapter.empty_kv_shape(lm.num_layers)
        shape = (*shape[:2], len(ids), shape[3])
        kv = KV(torch.zeros(shape, dtype=lm.dtype, device=lm.device),
                torch.zeros(shape, dtype=lm.dtype, device=lm.device), 0)
        last = yield from forward_in_place_pieces(lm, ids, torch.arange(len(ids)), kv, piece_tokens)
    else:
        kv, logits = prefill(lm, ids)
        last = logits[-1]
    spans, pos = [], len(system_token_ids)
    for c in chunk_token_ids:
        spans.append((pos, pos + len(c)))
        pos += len(c)
    n_ctx = sum(len(c) for c in chunk_token_ids)
    return Prefilled(kv, last, n_ctx, n_ctx, {"recompute": _ms(t0)}, spans=spans)


def assemble_context(
    lm: LoadedModel, system_kv: KV, chunk_kvs: Sequence[KV], system_token_ids: Sequence[int],
    chunk_token_ids: Sequence[Sequence[int]], placement: Placement | None = None, room: int = 0,
) -> tuple[KV, torch.Tensor, list[tuple[int, int]]]:
    """``S`` + chunks at consecutive positions, the matching token ids, and chunk spans.

    ``room``: the KV has that many slots (zeros) after the context, for the question: the prompt's
    one buffer, which the recompute pass writes into (:func:`prefill_reused`'s ``buffer``; the
    context is its first ``len(ids)`` slots). A ``placement`` makes no room.

    Stored KV (CPU, fp16/int8/fp32) moves to the model's device here, is rotated there in
    fp32 math and cast to the compute dtype once, so the passes get KV ready to use.
    ``placement`` (a method's own layout, called as :func:`~fusionrag.kvcache.kv.assemble` is) lays the
    chunks out instead; the KV it returns may carry the read rule later tokens read it with."""
    for kv, ids in zip(chunk_kvs, chunk_token_ids, strict=True):
        if len(kv) != len(ids):
            raise ValueError(f"chunk KV has {len(kv)} tokens but its ids have {len(ids)}")
    if placement is None:
        context, spans = assemble(system_kv, chunk_kvs, lm.inv_freq, device=lm.device, dtype=lm.dtype, room=room)
    else:
        context, spans = placement(system_kv, chunk_kvs, lm.inv_freq, device=lm.device, dtype=lm.dtype)
    ids = torch.tensor([*system_token_ids, *(t for c in chunk_token_ids for t in c)], dtype=torch.long)
    return context, ids, spans


def prefill_reused(lm: LoadedModel, context: KV, context_ids: torch.Tensor, spans: list[tuple[int, int]],
                   question_token_ids: Sequence[int], recompute_idx: torch.Tensor | None = None) -> Prefilled:
    """Sparse-recompute ``recompute_idx`` (indices into ``context``) and prefill the question."""
    return run_pieces(prefill_reused_pieces(lm, context, context_ids, spans, question_token_ids, recompute_idx))


def prefill_reused_pieces(
    lm: LoadedModel,
    context: KV,
    context_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    question_token_ids: Sequence[int],
    recompute_idx: torch.Tensor | None = None,
    piece_tokens: int | None = None,
    buffer: KV | None = None,
) -> Generator[None, None, Prefilled]:
    """:func:`prefill_reused` as passes of at most ``piece_tokens`` tokens, each ``next()`` one of them.
    ``buffer``: the request's own KV holding ``context`` and room for the question (:func:`assemble_context`'s
    ``room``), written in place instead of a copy of the context."""
    t0 = time.perf_counter()
    idx = torch.empty(0, dtype=torch.long) if recompute_idx is None else recompute_idx
    res = yield from sparse_recompute_pieces(lm, context, context_ids, idx, torch.tensor(list(question_token_ids)),
                                             piece_tokens, buffer)
    n_ctx = sum(b - a for a, b in spans)
    return Prefilled(res.kv, res.last_logits, n_ctx, res.recomputed, {"recompute": _ms(t0)},
                     selected=idx, spans=spans)


def all_chunk_indices(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Every chunk token of the assembled context (everything but ``S``)."""
    if not spans:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b) for a, b in spans])


#: Tokens recomputed at the start of a part of a stored chunk (a client's split that starts inside one): their
#: stored KV read the chunk's text before the cut, which this prompt does not hold there.
CUT_START_TOKENS = 4


def with_cut_starts(idx: torch.Tensor, spans: Sequence[tuple[int, int]],
                    parts: Sequence[tuple[int, int] | None]) -> torch.Tensor:
    """``idx`` (selected context indices) and the first :data:`CUT_START_TOKENS` tokens of each chunk served from
    a part of its stored KV that starts after the chunk's first token (``parts``: each chunk's stored token
    range, None when whole), sorted, each once."""
    starts = [torch.arange(a, min(b, a + CUT_START_TOKENS)) for (a, b), part in zip(spans, parts, strict=True)
              if part is not None and part[0] > 0]
    if not starts:
        return idx
    return torch.unique(torch.cat([idx.to(torch.long).cpu(), *starts]))
