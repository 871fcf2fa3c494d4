"""Selection policies: which reused context tokens to recompute for a question.

Every policy sees the same :class:`SelectionInput` (the assembled cache, its token ids,
chunk spans, the question) and returns indices into the assembled cache, only inside
chunk spans (never ``S``), without repeats, exactly ``k = round(ratio * context_tokens)``
of them (EPIC caps at 32 per chunk by definition). ``ratio >= 1`` always means Full
Attention and ``ratio <= 0`` Full Reuse, whatever the policy.

| name | signal |
|---|---|
| ``fusionrag`` | the question's last-layer attention over the whole prompt |
| ``cacheblend`` (baseline) | layer-1 deviation between fresh and reused V (or K) |
| ``cachecraft`` (baseline) | attention each token paid to the preceding chunks when its KV was built (stored) |
| ``epic`` (baseline) | the first tokens of each chunk (attention sinks) |
| ``prophetkv`` (baseline) | the question's attention over the context, averaged over every layer |

Which names exist, and which KV each reuses by default, is :mod:`fusionrag.online.methods`
(studies register their own variants there).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.execution.attention import (
    attention_probs,
    attention_scale,
    capture_queries,
)
from fusionrag.execution.forward import forward_first_layers, forward_to_attention, visibility
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel
from fusionrag.online.auto_ratio import AutoRatio, Ratio, budget, is_auto
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

    @property
    def candidates(self) -> torch.Tensor:
        return all_chunk_indices(self.spans)


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


def select(policy: Policy, inp: SelectionInput, ratio: Ratio, auto: AutoRatio | None = None) -> torch.Tensor:
    """Indices (into the assembled cache) that ``policy`` recomputes at ``ratio`` (``"auto"``: as ``auto`` sizes it)."""
    return choose_top(lambda: policy.scores(inp), inp.candidates, ratio, auto)


def choose_top(scores_of: Callable[[], torch.Tensor], candidates: torch.Tensor, ratio: Ratio,
               auto: AutoRatio | None = None) -> torch.Tensor:
    """The candidates to recompute, sorted: all at ratio >= 1, none at <= 0, else the ``round(ratio * n)`` best of
    ``scores_of()`` (one score per candidate, called only when it decides), or for ``"auto"`` as many as
    ``auto`` (the store's calibrated :class:`~fusionrag.online.auto_ratio.AutoRatio`) counts. One rule for our
    engine and the vLLM connector."""
    n = candidates.numel()
    if is_auto(ratio):
        scores = scores_of()
        k = (auto or AutoRatio()).count(scores)
    else:
        k = budget(float(ratio), n)
        if k == n or k == 0:
            return candidates if k else torch.empty(0, dtype=torch.long)
        scores = scores_of()
    k = min(k, int(torch.isfinite(scores).sum()))  # a policy rules tokens out with -inf (EPIC's cap)
    return candidates if k == n else top_k_of(scores, candidates, k)


# --- query-guided (FusionRAG) ---------------------------------------------------------


@dataclass
class QuestionQueries:
    """The question's queries at one layer over an assembled context (what query-guided scoring reads)."""

    queries: torch.Tensor  # [heads, q, d], RoPE applied at the question's positions
    question_keys: torch.Tensor  # [kv_heads, q, d] the question's own keys at that layer
    positions: torch.Tensor  # [q]
    layer: int = -1


def question_queries(inp: SelectionInput, layer: int = -1) -> QuestionQueries:
    """The question run over the assembled context up to layer ``layer``'s attention: its queries and keys there.

    The pass ends as soon as they exist (:func:`~fusionrag.execution.forward.forward_to_attention`):
    for the last layer it skips that layer's attention and MLP, the final norm and the LM head,
    which scoring never reads; the queries and keys are bit for bit those of the whole pass
    (``tests/online/prepass_reference.py``, the path before decision 048). Public so that scoring
    variants (``studies/selection``) can score the same queries differently."""
    lm, T = inp.lm, len(inp.context)
    q_pos = torch.arange(T, T + inp.question_token_ids.numel())
    with capture_queries(lm, layer) as captured:
        keys = forward_to_attention(lm, inp.question_token_ids, q_pos, inp.context, layer)
    return QuestionQueries(captured[-1], keys, q_pos, layer)


def question_attention(inp: SelectionInput, layer: int = -1) -> torch.Tensor:
    """Critical score per candidate: the question's attention at ``layer`` (the last by default), summed over
    question tokens and heads (:func:`attention_scores` of :func:`question_queries`)."""
    return attention_scores(inp, question_queries(inp, layer))


def attention_scores(inp: SelectionInput, qq: QuestionQueries) -> torch.Tensor:
    """Each candidate's attention from the question's queries ``qq``, summed over question tokens and heads.

    The model's real attention distribution over the whole prompt (one softmax over ``S``, every
    chunk and the question) at ``qq.layer``: it ranks tokens by the attention the model actually
    pays. Per-chunk normalisations (the research code's) measured no better: ``docs/decisions/``.
    """
    T = len(inp.context)
    keys = torch.cat([inp.context.keys[qq.layer].float(), qq.question_keys], dim=1)
    allowed = visibility(torch.arange(T), None, qq.positions)
    probs = attention_probs(qq.queries, keys, allowed, attention_scale(inp.lm, qq.layer))  # [heads, q, T+q]
    return probs.sum(dim=(0, 1))[:T][inp.candidates]


@dataclass
class QueryGuided:
    """FusionRAG's online selection: the tokens the question attends to most (:func:`question_attention`).

    ``layer``: the layer whose attention scores (default the last, the paper's; an earlier one
    stops the pre-pass sooner and is an option measured in decision 048, not a default)."""

    name: str = "fusionrag"
    layer: int = -1

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return question_attention(inp, self.layer)


# --- ProphetKV ------------------------------------------------------------------------


def layerwise_question_attention(inp: SelectionInput) -> torch.Tensor:
    """ProphetKV's score per candidate: the question's attention over the reused context at every layer,
    averaged over the question's tokens and heads, then over the layers (uniformly).

    One pass of the question over the assembled (stale) context, as FusionRAG's pre-pass, ended at the
    last layer's attention (:func:`~fusionrag.execution.forward.forward_to_attention`), capturing every
    layer's queries; each layer's softmax runs over the context keys only (``S`` and the chunks, not the
    question's own keys) and sums to 1, so the layer average weighs every layer alike."""
    lm, T = inp.lm, len(inp.context)
    q_pos = torch.arange(T, T + inp.question_token_ids.numel())
    with ExitStack() as stack:
        captured = [stack.enter_context(capture_queries(lm, layer)) for layer in range(lm.num_layers)]
        forward_to_attention(lm, inp.question_token_ids, q_pos, inp.context, -1)
    allowed = torch.ones(q_pos.numel(), T, dtype=torch.bool)
    total = torch.zeros(T, dtype=torch.float32, device=inp.context.keys.device)
    for layer, raw in enumerate(captured):
        queries = raw[-1]
        probs = attention_probs(queries, inp.context.keys[layer].float(), allowed, attention_scale(lm, layer))
        total += probs.mean(dim=(0, 1)).to(total.device)
    return (total / lm.num_layers)[inp.candidates.to(total.device)]


@dataclass
class ProphetKV:
    """ProphetKV (Wang et al., ICML 2026, arXiv 2602.02579): query-driven selection against the
    "crowding-out" of the budget by globally salient tokens, two stages (a scoring pass of the
    question, then one recompute of the chosen tokens at every layer).

    Its full text was not readable here; this follows the abstract and three independent ports that
    agree (notes in docs/decisions): stage I runs the question over the reused KV and scores each
    context token by its attention at every layer (softmax over the context keys only, mean over heads
    and question tokens, uniform mean over the layers, "Eq. 7"); stage II recomputes one global top-k
    set at every layer (the engine's sparse recompute). Choices left open, taken here: the scoring
    queries are the whole question segment (the question and its template: what this engine's
    prompt puts after the passages), ``S`` stays in the softmax but is never selected, and the
    budget counts chunk tokens only (as for every policy here)."""

    name: str = "prophetkv"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return layerwise_question_attention(inp)


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


def epic_budget(ratio: float, spans: list[tuple[int, int]]) -> int:
    """EPIC's effective count: the ratio's budget, capped at 32 tokens per chunk."""
    n = sum(b - a for a, b in spans)
    return min(budget(ratio, n), sum(min(EPIC_MAX_PER_CHUNK, b - a) for a, b in spans))
