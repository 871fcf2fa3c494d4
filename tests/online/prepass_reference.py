"""The selection pre-pass before decision 048, kept as the reference the stopped pass is tested against.

The question's whole forward over the assembled context (every layer, the final norm, the LM head),
its last layer's queries rebuilt by hand from the query projection (a hook on ``q_proj``, the per-head norm,
the model's rotary embedding at the question's positions), independently of the attention-function capture
the product uses. The pass that ends where the scored layer's attention begins
(:func:`fusionrag.online.policies.question_queries`) must give the same queries, keys and selection
bit for bit (``test_selection_prepass.py``); ``benchmarks/ttft/prepass_*.py`` time the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusionrag.execution.forward import forward
from fusionrag.online.policies import QueryGuided, QuestionQueries, SelectionInput, attention_scores
from policy_helpers import queries_by_hand


def question_queries_reference(inp: SelectionInput) -> QuestionQueries:
    """The question's last-layer queries (rebuilt by hand) and keys from one whole forward."""
    lm, T = inp.lm, len(inp.context)
    q_pos = torch.arange(T, T + inp.question_token_ids.numel())
    captured: list[torch.Tensor] = []
    handle = lm.adapter.attention(-1).q_proj.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        res = forward(lm, inp.question_token_ids, q_pos, inp.context)
    finally:
        handle.remove()
    return QuestionQueries(queries_by_hand(lm, captured[-1], q_pos), res.keys[-1], q_pos)


def reference_attention(inp: SelectionInput) -> torch.Tensor:
    """Each candidate's last-layer attention from the question, through the whole forward."""
    return attention_scores(inp, question_queries_reference(inp))


@dataclass
class ReferenceQueryGuided(QueryGuided):
    """FusionRAG's selection scored through the whole forward (the last layer only)."""

    name: str = "fusionrag-reference"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return reference_attention(inp)
