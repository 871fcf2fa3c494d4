"""``prompt_logprobs`` (vLLM's field) and ``echo`` with ``logprobs``: each prompt token's log-probability under
the model, given the tokens before it.

What the request itself prefilled does not hold these: with FusionRAG most prompt positions were never
computed (their KV came precomputed), and no prefill keeps logits past the last position. They are computed
here by one Full Attention forward of the prompt, as vLLM computes them (the answer it came with is
untouched), the LM head applied a slice of positions at a time so a long prompt does not hold a
``[tokens, vocabulary]`` matrix at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Prompt positions the LM head is applied to at once.
SLICE = 256


@torch.no_grad()
def prompt_logprobs(lm: Any, ids: Sequence[int], top: int, decode: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first token, then per token a dict of token id (a string)
    -> ``{"logprob", "rank", "decoded_token"}``, the token itself and the ``top`` most likely ones."""
    model = lm.model
    tokens = torch.tensor([list(ids)], device=lm.device)
    hidden = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    scale = float(getattr(model.config, "logits_scaling", 1.0) or 1.0)  # Granite divides its logits
    out: list[dict | None] = [None]
    for start in range(0, len(ids) - 1, SLICE):
        logp = torch.log_softmax(head(hidden[start:start + SLICE]).float() / scale, dim=-1)
        for row, pos in enumerate(range(start, min(start + SLICE, len(ids) - 1))):
            token = int(ids[pos + 1])
            entry = {token: float(logp[row, token])}
            if top:
                values, best = torch.topk(logp[row], top)
                entry.update({int(t): float(v) for t, v in zip(best, values, strict=True)})
            ranks = {t: int((logp[row] > v).sum()) + 1 for t, v in entry.items()}
            out.append({str(t): {"logprob": v, "rank": ranks[t], "decoded_token": decode(t)} for t, v in entry.items()})
    return out
