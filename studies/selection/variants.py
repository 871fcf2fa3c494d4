"""The selection variants the studies compare with FusionRAG's own scoring, registered as methods.

Importing this module registers them (``fusionrag.online.methods.register_policy``), so
``bench quality`` and ``Engine.prepare`` accept their names; the product's CLI and server
never list them. What each measured is in ``docs/decisions/`` (none beat the product's
``fusionrag``, which is why they live here).

| name | scoring | KV |
|---|---|---|
| ``query`` | FusionRAG's (one softmax over the whole prompt) | plain: the offline stage off |
| ``fusionrag-perchunk`` | softmax within each chunk, re-positioned keys | fused |
| ``fusionrag-authors`` | the research code's: per-chunk softmax, stored-position keys, chunk 1 skipped | fused |
| ``fusionrag-authors-all`` | the same, the first chunk scored too | fused |
| ``query-authors`` | the research code's scoring on plain KV | plain |
| ``fusionrag-plainfirst`` | FusionRAG's, under the name the studies' records carry | plain-first |
| ``random`` | uniform (a control) | plain |
| ``fusionrag-layer{K}`` | FusionRAG's, layer K's attention (the pre-pass stops there; K in 12, 15) | fused |
| ``fusionrag-otherq`` | FusionRAG's, scored by another question of the set (a whole-context cache hit) | plain-first |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusionrag.execution.attention import attention_probs, attention_scale
from fusionrag.models.rope import rotate_keys
from fusionrag.online.methods import register_policy
from fusionrag.online.policies import QueryGuided, SelectionInput, question_queries


def per_chunk_attention(inp: SelectionInput, stored_positions: bool) -> torch.Tensor:
    """The question's last-layer attention normalised within each chunk, summed over question tokens and heads.

    ``stored_positions``: score against each chunk's keys rotated back to where they were stored
    (``len(S)``), as the research code does, instead of where the chunk sits in this prompt."""
    lm = inp.lm
    qq = question_queries(inp)
    scale = attention_scale(lm)
    base = inp.spans[0][0] if inp.spans else 0  # len(S): where stored chunk KV starts
    parts = []
    for a, b in inp.spans:
        keys = inp.context.keys[-1, :, a:b].float()
        if stored_positions:
            keys = rotate_keys(keys, base - a, lm.inv_freq)
        allowed = torch.ones(qq.positions.numel(), b - a, dtype=torch.bool)
        parts.append(attention_probs(qq.queries, keys, allowed, scale).sum(dim=(0, 1)))
    return torch.cat(parts) if parts else torch.empty(0)


@dataclass
class PerChunk:
    """Per-chunk softmax (``authors``: against stored-position keys); ``skip_first_chunk`` never selects chunk 1."""

    name: str = "fusionrag-perchunk"
    authors: bool = False
    skip_first_chunk: bool = False

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        scores = per_chunk_attention(inp, self.authors)
        if self.skip_first_chunk and inp.spans:
            a, b = inp.spans[0]
            scores = scores.clone()
            scores[: b - a] = -float("inf")  # candidates are in span order: the first chunk comes first
        return scores


@dataclass
class RandomTokens:
    """Uniformly random tokens (a control), seeded."""

    name: str = "random"
    seed: int = 0

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(inp.candidates.numel(), generator=gen)


@dataclass
class OtherQuestion:
    """FusionRAG's selection made by another question over the same context: the tokens an earlier request's
    question refreshed, then this question prefilled over them (one pass here: the refreshed tokens precede
    the question and never read it, so it equals the whole-context cache's hit). The other question is
    drawn, deterministically, from ``$FUSIONRAG_OTHER_QUESTIONS`` (a data file: its questions), never this one."""

    name: str = "fusionrag-otherq"

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        import dataclasses
        import os
        import zlib

        from fusionrag.bench.datasets import load_questions
        from fusionrag.online.policies import question_attention
        from fusionrag.prompt import PromptBuilder

        questions = [ex.question for ex in load_questions(os.environ["FUSIONRAG_OTHER_QUESTIONS"])]
        pb = PromptBuilder(inp.lm.tokenizer)
        own = inp.question_token_ids.tolist()
        start = zlib.crc32(repr(own).encode()) % len(questions)
        for k in range(len(questions)):
            other = torch.tensor(pb.question_token_ids(questions[(start + k) % len(questions)]))
            if other.tolist() != own:
                return question_attention(dataclasses.replace(inp, question_token_ids=other))
        raise ValueError("no other question to score with")


#: Earlier scoring layers measured against the last one (Qwen2.5-0.5B has 24 layers).
SCORING_LAYERS = (12, 15)


def register() -> None:
    """Register every variant (idempotent)."""
    register_policy("query", lambda: QueryGuided("query"), kv="plain",
                    description="FusionRAG's selection on plain KV (the offline stage off)")
    register_policy("fusionrag-perchunk", PerChunk, kv="fused", description="per-chunk softmax")
    register_policy("fusionrag-authors", lambda: PerChunk("fusionrag-authors", True, True), kv="fused",
                    description="the research code's scoring")
    register_policy("fusionrag-authors-all", lambda: PerChunk("fusionrag-authors-all", True, False), kv="fused",
                    description="the research code's scoring, first chunk scored")
    register_policy("query-authors", lambda: PerChunk("query-authors", True, True), kv="plain",
                    description="the research code's scoring on plain KV")
    register_policy("fusionrag-plainfirst", lambda: QueryGuided("fusionrag-plainfirst"), kv="plain-first",
                    description="FusionRAG under the studies' earlier name")
    register_policy("random", RandomTokens, kv="plain", description="control: random tokens")
    register_policy("fusionrag-otherq", OtherQuestion, kv="plain-first",
                    description="FusionRAG, selection by another question (a whole-context cache hit)")
    for layer in SCORING_LAYERS:  # decision 048: an earlier scoring layer, a cheaper pre-pass
        register_policy(f"fusionrag-layer{layer}", lambda k=layer: QueryGuided(f"fusionrag-layer{k}", layer=k),
                        kv="fused", description=f"FusionRAG's selection from layer {layer}'s attention")


register()
