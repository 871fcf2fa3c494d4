"""The selection pre-pass before decision 048, kept as the reference the stopped pass is tested against.

The question's whole forward over the assembled context (every layer, the final norm, the LM head),
capturing its last layer's queries. The pass that ends where the scored layer's attention begins
(:func:`fusionrag.online.policies.question_queries`) must give the same queries, keys and selection
bit for bit (``test_selection_prepass.py``); ``benchmarks/ttft/prepass_*.py`` time the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusionrag.execution.attention import capture_last_layer_queries, finish_queries
from fusionrag.execution.forward import forward
from fusionrag.online.policies import QueryGuided, QuestionQueries, SelectionInput, attention_scores


def question_queries_reference(inp: SelectionInput) -> QuestionQueries:
    """The question's last-layer queries and keys from one whole forward."""
    lm, T = inp.lm, len(inp.context)
    q_pos = torch.arange(T, T + inp.question_token_ids.numel())
    with capture_last_layer_queries(lm) as captured:
        res = forward(lm, inp.question_token_ids, q_pos, inp.context)
    return QuestionQueries(finish_queries(lm, captured[-1], q_pos), res.keys[-1], q_pos)


def reference_attention(inp: SelectionInput) -> torch.Tensor:
    """Each candidate's last-layer attention from the question, through the whole forward."""
    return attention_scores(inp, question_queries_reference(inp))


@dataclass
class ReferenceQueryGuided(QueryGuided):
    """FusionRAG's selection scored through the whole forward (the last layer only)."""

    name: str = "fusionrag-reference"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return reference_attention(inp)
