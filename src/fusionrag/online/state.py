"""``Request``: one request's state through the stages, from prefill to its answer.

Like vLLM's ``Request``: the engine creates it when the prompt is ready (retrieved, loaded,
selected, recomputed, the first token's logits known; :meth:`Engine.prepare`), a decoder
continues from its KV (:meth:`take_kv`), and :meth:`Engine.finish` completes the same object
with the generated tokens and text. Nothing is copied from one result type into another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from fusionrag.kvcache.kv import KV
from fusionrag.online.prefill import Prefilled


@dataclass
class Request:
    """A request's state; ``status`` is ``prepared`` until :meth:`Engine.finish` makes it ``finished``."""

    pre: Prefilled  # the prompt's KV and the logits of the first answer token
    method: str
    kv_kind: str  # "plain" | "fused" | "plain-first" | "none" (Full Attention)
    ratio: float
    chunk_ids: list[int | None]  # None for request-supplied passages not in the store
    passages: list[dict]
    chunk_token_ids: list[list[int]]
    ttft_ms: dict[str, float]  # retrieve / load / select / recompute / first_token / total
    fused_fallbacks: int = 0
    #: Where each chunk came from, for citing: ``{chunk_id, title, source, score, stored}`` (score: the
    #: retrieval similarity; None for passages the client sent).
    sources: list[dict] = field(default_factory=list)
    #: Why the request ran as it did when that differs from what it asked (``method=auto``'s choice,
    #: no passages to reuse, an empty store); empty otherwise.
    note: str = ""
    #: The prompt's ``S`` + chunks came from the whole-context cache: only the question was prefilled.
    context_cache_hit: bool = False
    #: The greedy first answer token, taken from the prefill's last logits (part of TTFT; no forward).
    first_token: int = -1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: Literal["prepared", "finished"] = "prepared"

    # -- after prefill ---------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return self.pre.kv.base_position + len(self.pre.kv)

    def take_kv(self) -> KV:
        """Hand the prompt KV to a decoder; this object stops holding it (so its memory can go)."""
        kv = self.pre.kv
        self.pre.kv = KV.empty_like(kv, kv.base_position + len(kv))
        return kv

    # -- the answer's view -----------------------------------------------------------------

    @property
    def kv(self) -> str:
        """Which stored KV the request reused (the answer's name for ``kv_kind``)."""
        return self.kv_kind

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

    def to_json(self) -> dict:
        return {
            "answer": self.text,
            "method": self.method,
            "kv": self.kv_kind,
            "ratio": self.ratio,
            "chunk_ids": self.chunk_ids,
            "context_tokens": self.context_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_tokens": len(self.token_ids),
            "ttft_ms": {k: round(v, 2) for k, v in self.ttft_ms.items()},
            "fused_fallbacks": self.fused_fallbacks,
            "sources": self.sources,
            "note": self.note,
            "context_cache_hit": self.context_cache_hit,
        }
