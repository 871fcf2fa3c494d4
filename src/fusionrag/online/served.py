"""``Served``: what a request's prefill served it, written once by the prefill plan's last stage.

A :class:`~fusionrag.online.state.Request` is three things apart, each written by one stage: what its caller
asked (its :class:`~fusionrag.online.request.ReuseRequest` and sampling), what the prefill served it (this:
the prompt's KV and first logits, the method, KV kind and ratio that ran, its passages and where their KV came
from), and what it answered (:class:`~fusionrag.online.state.Answer`, the output step's). The numbers the
responses report (how many context tokens were reused, recomputed, found ready) are derived here, from what
was served, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusionrag.online.prefill import Prefilled


@dataclass
class Served:
    """What the prefill served a request (:func:`fusionrag.online.prefill_plan.record` makes it, once)."""

    pre: Prefilled  # the prompt's KV and the logits of the first answer token
    method: str  # the method that ran (method=auto's choice)
    kv_kind: str  # "plain" | "fused" | "plain-first" | "none" (Full Attention)
    #: The ratio used: the one asked, or for ``ratio="auto"`` the share it chose (``auto_ratio``: the setting).
    ratio: float | str
    auto_ratio: Any  # the AutoRatio that sized a ratio="auto" recompute (its mass, floor, ceiling), else None
    prompt_token_ids: list[int]  # S + chunks + question (a raw prompt: its own ids), as prefilled
    chunk_ids: list[int | None]  # None for request-supplied passages not in the store
    passages: list[dict]
    chunk_token_ids: list[list[int]]
    #: Per chunk, the stored chunk's tokens it holds when only part of the chunk is in the prompt (a client's own
    #: split: :attr:`fusionrag.retrieval.matching.Piece.span`); None for a whole chunk or new text.
    chunk_parts: list[tuple[int, int] | None]
    stages_ms: dict[str, float]  # retrieve / load / select / recompute / total (the first token's: the answer's)
    fused_fallbacks: int  # fused entries missing, served plain
    #: Where each chunk came from, for citing: ``{chunk_id, title, source, score, stored, part, origin}``.
    sources: list[dict]
    note: str  # why the request ran as it did when that differs from what it asked; empty otherwise
    context_cache_hit: bool  # S + chunks came from the whole-context cache: only the question was prefilled
    #: Per passage, where its KV came from: ``store`` (precomputed), ``prefix_cache`` (a passage the store does
    #: not hold, computed by an earlier request), ``context_cache`` (the whole context, earlier) or ``computed``
    #: (by this request: new text, or every passage of a Full Attention prefill).
    kv_origins: list[str]

    @property
    def prompt_tokens(self) -> int:
        return self.pre.kv.base_position + len(self.pre.kv)

    @property
    def context_tokens(self) -> int:
        return self.pre.context_tokens

    @property
    def recomputed_tokens(self) -> int:
        return self.pre.recomputed

    @property
    def first_logits(self) -> torch.Tensor:
        return self.pre.last_logits

    @property
    def selected(self) -> torch.Tensor | None:
        return self.pre.selected

    @property
    def spans(self) -> list[tuple[int, int]]:
        return self.pre.spans

    @property
    def precomputed_tokens(self) -> int:
        """Context tokens of passages whose KV came precomputed (the store or a cache), before any recompute."""
        if self.method == "full":
            return 0
        return sum(b - a for (a, b), origin in zip(self.pre.spans, self.kv_origins, strict=False)
                   if origin != "computed")

    @property
    def reused_by_origin(self) -> dict[str, int]:
        """Context tokens served from KV this request did not compute, by where it came from (``store``,
        ``prefix_cache``, ``context_cache``): those of passages that came precomputed, less the recomputed ones."""
        chosen = self.pre.selected.cpu() if self.pre.selected is not None else torch.empty(0, dtype=torch.long)
        out: dict[str, int] = {}
        for (a, b), origin in zip(self.pre.spans, self.kv_origins, strict=False):
            if origin != "computed":
                out[origin] = out.get(origin, 0) + (b - a) - int(((chosen >= a) & (chosen < b)).sum())
        return out

    @property
    def reused_tokens(self) -> int:
        """Context tokens served from KV this request did not compute (:attr:`reused_by_origin`, summed)."""
        return sum(self.reused_by_origin.values())
