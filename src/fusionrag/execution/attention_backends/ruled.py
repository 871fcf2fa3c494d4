"""A pass over a prompt whose KV carries a read rule (:class:`~fusionrag.kvcache.kv.ReadRule`).

A method's placement may lay a prompt's chunks out other than at consecutive positions and say how
later tokens read them: the rule travels with the prompt KV (``KV.read_rule``) and every pass over
that past reads through it, whatever the backend: the visibility rule as booleans (which keys each
query sees), the rule's slots as flags, and the rule's own ``attend``. The queries after a prompt are
few (the question, an answer being scored or decoded), so the scores are written out; there is no
kernel. The decoder reads the same rule for its rows (:func:`fusionrag.execution.attention_hook.read_rules`).
"""

from __future__ import annotations

import torch

from fusionrag.execution.attention_backends.spec import SparseQuery
from fusionrag.execution.masks import visibility


def span_flags(start: int, stop: int, width: int, device: torch.device) -> torch.Tensor:
    """``[width]`` bool: slots ``start:stop`` (those of them below ``width``)."""
    flags = torch.zeros(width, dtype=torch.bool, device=device)
    flags[start: min(stop, width)] = True
    return flags


def attend(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           spec: SparseQuery, scale: float) -> torch.Tensor:
    """The sparse-pass backend for a past that carries a read rule (``spec.read_rule``)."""
    rule = spec.read_rule
    if rule is None:
        raise ValueError("a ruled pass needs spec.read_rule")
    key = ("ruled",)
    if key not in spec.memo:  # the same for every layer of the pass
        if spec.stale is not None and bool(spec.stale.any()):
            raise ValueError("a past with a read rule is read as stored: a pass recomputes none of its slots")
        span = span_flags(rule.start, rule.stop, spec.past_len, q.device)
        spec.memo[key] = (visibility(spec.past_positions(), spec.stale, spec.positions),
                          torch.cat([span, span.new_zeros(spec.positions.numel())]))
    allowed, span = spec.memo[key]
    keys = torch.cat([k_past.to(k_new.dtype), k_new], dim=1)
    values = torch.cat([v_past.to(v_new.dtype), v_new], dim=1)
    return rule.attend(q, keys, values, allowed, span, scale)
