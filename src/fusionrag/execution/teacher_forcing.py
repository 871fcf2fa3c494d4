"""Teacher forcing: the model's next-token distributions along a given continuation of a prompt.

Quality metrics tied to an answer (the gold answer's likelihood, the divergence from Full
Attention along Full Attention's own answer) need the distribution at every position of a
fixed continuation, not only the first token. One forward pass over the continuation on top
of the prompt's KV gives them all; the prompt KV is read, never modified, so the same
prefilled prompt can be scored against several continuations and still be decoded from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionrag.execution.forward import forward
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel


def continuation_logprobs(lm: LoadedModel, kv: KV, last_logits: torch.Tensor,
                          token_ids: Sequence[int]) -> torch.Tensor:
    """Log-probabilities ``[m + 1, V]`` (float32, CPU) at each position of a continuation.

    Row 0 is the distribution of the first token (from ``last_logits``, the prompt's own
    prefill); row ``j`` the distribution after ``token_ids[:j]``; row ``m`` the one after the
    whole continuation (where an end-of-turn token would go). ``kv`` is the prompt's KV.
    """
    rows = [last_logits.reshape(-1).float().cpu()]
    ids = [int(t) for t in token_ids]
    if ids:
        start = kv.base_position + len(kv)
        res = forward(lm, torch.tensor(ids), torch.arange(start, start + len(ids)), kv, logits_to_keep=len(ids))
        logits = res.logits.reshape(-1, res.logits.shape[-1])[-len(ids):]
        rows.extend(logits.float().cpu().unbind(0))
    return torch.log_softmax(torch.stack(rows), dim=-1)


def sequence_nll(logprobs: torch.Tensor, token_ids: Sequence[int]) -> list[float]:
    """Negative log-likelihood of each token of a continuation from :func:`continuation_logprobs`' rows.

    ``token_ids`` may be one longer than the continuation the rows were computed for only by
    the end-of-turn token scored from the last row; any longer is an error.
    """
    ids = [int(t) for t in token_ids]
    if len(ids) > logprobs.shape[0]:
        raise ValueError(f"{len(ids)} tokens but only {logprobs.shape[0]} positions")
    return [-float(logprobs[j, t]) for j, t in enumerate(ids)]
