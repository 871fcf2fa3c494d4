"""Selection policies: which reused context tokens to recompute for a question.

Every policy sees the same :class:`SelectionInput` (the assembled cache, its token ids,
chunk spans, the question) and returns indices into the assembled cache, only inside
chunk spans (never ``S``), without repeats, exactly ``k = round(ratio * context_tokens)``
of them (EPIC caps at 32 per chunk by definition). ``ratio >= 1`` always means Full
Attention and ``ratio <= 0`` Full Reuse, whatever the policy.

| name | signal |
|---|---|
| ``fusionrag`` / ``query`` | question's last-layer attention over each chunk (``query``: same, on plain KV) |
| ``cacheblend`` | layer-1 deviation between fresh and reused V (or K) |
| ``cachecraft`` | attention each token paid to the preceding chunks when its KV was built (stored) |
| ``epic`` | the first tokens of each chunk (attention sinks) |
| ``random`` | uniform (control) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.execution.attention import attention_probs, attention_scale, capture_last_layer_queries, finish_queries
from fusionrag.execution.forward import forward, forward_first_layers, visibility
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel
from fusionrag.models.rope import rotate_keys
from fusionrag.online.prefill import all_chunk_indices

EPIC_MAX_PER_CHUNK = 32


@dataclass
class SelectionInput:
    lm: LoadedModel
    context: KV  # S + chunks, positions 0..T-1
    context_ids: torch.Tensor  # [T]
    spans: list[tuple[int, int]]  # chunk spans in the context
    question_token_ids: torch.Tensor  # [q]
    chunk_scores: list[torch.Tensor | None] = field(default_factory=list)  # Cache-Craft, per chunk
    seed: int = 0

    @property
    def candidates(self) -> torch.Tensor:
        return all_chunk_indices(self.spans)


def budget(ratio: float, context_tokens: int) -> int:
    """Number of context tokens to recompute for ``ratio``."""
    return max(0, min(context_tokens, round(ratio * context_tokens)))


def top_k_of(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best-scoring candidates (scores aligned with candidates), sorted by position."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    best = torch.topk(scores.float().cpu(), k, sorted=False).indices  # scores may live on the GPU; indices on CPU
    return torch.sort(candidates[best]).values


class Policy(Protocol):
    name: str

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        """One score per candidate token (``inp.candidates``); higher = recompute first."""
        ...


def select(policy: Policy, inp: SelectionInput, ratio: float) -> torch.Tensor:
    """Indices (into the assembled cache) that ``policy`` recomputes at ``ratio``."""
    cand = inp.candidates
    k = budget(ratio, cand.numel())
    if k == cand.numel():
        return cand
    if k == 0:
        return torch.empty(0, dtype=torch.long)
    scores = policy.scores(inp)
    k = min(k, int(torch.isfinite(scores).sum()))  # a policy rules tokens out with -inf (EPIC's cap)
    return top_k_of(scores, cand, k)


# --- query-guided (FusionRAG) ---------------------------------------------------------


def question_attention(inp: SelectionInput, softmax: str = "global", skip_first_chunk: bool = False) -> torch.Tensor:
    """Critical score per candidate: the question's last-layer attention, summed over question tokens and heads.

    ``global`` uses the model's real attention distribution over the whole prompt (our default);
    ``per_chunk`` normalises it within each chunk against the re-positioned keys; ``authors`` is
    the public research code's scoring: softmax within each chunk against the chunk's keys at
    their **stored base position** (``len(S)``, not where the chunk sits in this prompt).
    ``skip_first_chunk`` (their Qwen2 code) never selects the first chunk's tokens.
    """
    lm, T = inp.lm, len(inp.context)
    q_pos = torch.arange(T, T + inp.question_token_ids.numel())
    with capture_last_layer_queries(lm) as captured:
        res = forward(lm, inp.question_token_ids, q_pos, inp.context)
    queries = finish_queries(lm, captured[-1], q_pos)  # [heads, q, d]
    scale = attention_scale(lm)
    if softmax == "global":
        keys = torch.cat([inp.context.keys[-1].float(), res.keys[-1]], dim=1)
        allowed = visibility(torch.arange(T), None, q_pos)
        probs = attention_probs(queries, keys, allowed, scale)  # [heads, q, T+q]
        scores = probs.sum(dim=(0, 1))[:T][inp.candidates]
    elif softmax in ("per_chunk", "authors"):
        base = inp.spans[0][0] if inp.spans else 0  # len(S): where stored chunk KV starts
        parts = []
        for a, b in inp.spans:
            keys = inp.context.keys[-1, :, a:b].float()
            if softmax == "authors":
                keys = rotate_keys(keys, base - a, lm.inv_freq)
            allowed = torch.ones(q_pos.numel(), b - a, dtype=torch.bool)
            parts.append(attention_probs(queries, keys, allowed, scale).sum(dim=(0, 1)))
        scores = torch.cat(parts) if parts else torch.empty(0)
    else:
        raise ValueError(f"unknown softmax mode {softmax!r}")
    if skip_first_chunk and inp.spans:
        a, b = inp.spans[0]
        scores = scores.clone()
        scores[: b - a] = -float("inf")  # candidates are in span order: the first chunk comes first
    return scores


@dataclass
class QueryGuided:
    """Query-guided selection. Default ``global`` softmax: measured better than ``per_chunk``
    on HotpotQA and TriviaQA (agreement with Full Attention, first-token KL, top-1; see
    docs/decisions.md), since it ranks tokens by the attention the model actually pays.
    ``authors`` (the research code's scoring) measured no different at 15% (docs/decisions.md)."""

    name: str = "fusionrag"
    softmax: str = "global"
    skip_first_chunk: bool = False

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return question_attention(inp, self.softmax, self.skip_first_chunk)


# --- CacheBlend -----------------------------------------------------------------------


def cacheblend_deviation(inp: SelectionInput, layer: int = 1, on: str = "values") -> torch.Tensor:
    """Squared deviation between fresh and reused KV at ``layer`` for each candidate.

    Fresh = the first ``layer + 1`` layers computed with full attention over the whole
    context (on top of ``S``), as CacheBlend does online.
    """
    cand = inp.candidates
    s_len = inp.spans[0][0] if inp.spans else len(inp.context)
    prefix = inp.context.slice(0, s_len)
    fresh_k, fresh_v = forward_first_layers(inp.lm, inp.context_ids[s_len:], torch.arange(s_len, len(inp.context)),
                                            prefix, layer + 1)
    fresh = fresh_v if on == "values" else fresh_k
    reused = (inp.context.values if on == "values" else inp.context.keys)[layer, :, s_len:].float()
    dev = ((fresh[layer] - reused) ** 2).sum(dim=(0, 2))  # [T - s_len]
    return dev[cand - s_len]


@dataclass
class CacheBlend:
    name: str = "cacheblend"
    layer: int = 1
    on: str = "values"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return cacheblend_deviation(inp, self.layer, self.on)


# --- Cache-Craft, EPIC, random --------------------------------------------------------


@dataclass
class CacheCraft:
    """Simplified Cache-Craft: each token's attention to the preceding chunks, recorded offline.

    The score is taken when the chunk's fused KV is built (its top-n neighbours in front
    of it), at the last layer, summed over heads; the policy recomputes the tokens that
    depended most on preceding context, since their reused KV is the stalest elsewhere.
    """

    name: str = "cachecraft"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        if not inp.chunk_scores or any(s is None for s in inp.chunk_scores):
            raise FusionRAGError(
                "cachecraft needs the inter-attention scores recorded by 'fusionrag preprocess' "
                "(top-n > 0) for every chunk of the request"
            )
        return torch.cat([s.float() for s in inp.chunk_scores])  # type: ignore[union-attr]


@dataclass
class Epic:
    """EPIC/LegoLink: recompute the first tokens of each chunk (per-chunk attention sinks)."""

    name: str = "epic"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        # Rank by offset within the chunk (earlier first); beyond the cap, never chosen.
        parts = []
        for a, b in inp.spans:
            offset = torch.arange(b - a, dtype=torch.float32)
            score = -offset
            score[EPIC_MAX_PER_CHUNK:] = -float("inf")
            parts.append(score)
        return torch.cat(parts)


@dataclass
class RandomTokens:
    name: str = "random"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        gen = torch.Generator().manual_seed(inp.seed)
        return torch.rand(inp.candidates.numel(), generator=gen)


POLICIES: dict[str, type] = {
    "fusionrag": QueryGuided,
    "query": QueryGuided,
    "cacheblend": CacheBlend,
    "cachecraft": CacheCraft,
    "epic": Epic,
    "random": RandomTokens,
}
METHODS = ["full", "reuse", *POLICIES]


def make_policy(method: str, **options) -> Policy:
    if method not in POLICIES:
        raise FusionRAGError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    if method in ("fusionrag", "query"):
        return QueryGuided(name=method, **options)
    return POLICIES[method](**options)


def epic_budget(ratio: float, spans: list[tuple[int, int]]) -> int:
    """EPIC's effective count: the ratio's budget, capped at 32 tokens per chunk."""
    n = sum(b - a for a, b in spans)
    return min(budget(ratio, n), sum(min(EPIC_MAX_PER_CHUNK, b - a) for a, b in spans))
