"""Answer-level metrics from teacher forcing: the gold answer's likelihood and the divergence from
Full Attention along Full Attention's own answer.

Why these exist: on a 0.5B model gold F1 barely separates the methods (greedy answers are
often wrong under every method), and first-token fidelity says nothing about the rest of
the answer. Teacher forcing scores every position of a fixed continuation in one short
forward, so both metrics cost one extra pass per cell and are far better powered.

* **Gold NLL**: mean negative log-likelihood per token of the gold answer on the method's
  prefilled KV, the best over aliases and over the spellings a model writes (as given,
  lower-case, first letter capitalised: the model writes "Yes" where the gold is "yes").
  Reported without and with the end-of-turn token. Full Attention is *not* a ceiling here:
  a method can give the gold answer more probability than Full Attention does, which is why
  results are reported as paired differences, never as a ratio normalised by FA - Full Reuse.
* **KL to Full Attention** along Full Attention's greedy answer, against a compact reference:
  per position the top-``k`` log-probabilities of Full Attention plus the rest mass, so the
  reference is small enough to commit. The KL is that of the coarsened distributions
  (Full Attention's top-``k`` tokens and one "rest" bucket), a lower bound of the full KL by
  the data-processing inequality; how close it is is measured, not assumed (results README).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusionrag.execution.teacher_forcing import continuation_logprobs, sequence_nll
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel

#: Aliases scored per question (TriviaQA lists dozens; the first ones are the canonical spellings).
MAX_ALIASES = 5
#: Full Attention's top tokens kept per position in the committed reference.
REFERENCE_TOP_K = 128
#: Below this Full Reuse KL the recovery ratio is undefined (Full Reuse already equals FA).
KL_RECOVERY_EPS = 1e-6


def answer_spellings(answers: Sequence[str], max_aliases: int = MAX_ALIASES) -> list[str]:
    """Gold spellings to score: each of the first aliases as given, lower-case and capitalised."""
    out: list[str] = []
    for a in answers[:max_aliases]:
        a = a.strip()
        if not a:
            continue
        for s in (a, a.lower(), a[:1].upper() + a[1:]):
            if s not in out:
                out.append(s)
    return out


def encode_answer(tokenizer, text: str) -> list[int]:
    """Token ids of an answer as it follows the prompt's assistant tag (nothing added before it).

    The prompt ends with the assistant header (``...assistant\\n``), so the answer starts a new
    word with no leading space: encoding the text alone is how the model would write it.
    """
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class GoldNLL:
    """The best (lowest) mean NLL per token over the gold spellings, without and with end-of-turn."""

    nll: float
    nll_eot: float
    spelling: str  # the spelling that gave ``nll``


def gold_nll(lm: LoadedModel, kv: KV, last_logits: torch.Tensor, answers: Sequence[str],
             eot_id: int | None = None) -> GoldNLL:
    """Teacher-forced gold-answer NLL on a prefilled prompt (``kv``, ``last_logits``); see module doc."""
    eot = lm.stop_token_ids[0] if eot_id is None else eot_id
    best: tuple[float, str] | None = None
    best_eot: float | None = None
    for spelling in answer_spellings(answers):
        ids = encode_answer(lm.tokenizer, spelling)
        if not ids:
            continue
        nll = sequence_nll(continuation_logprobs(lm, kv, last_logits, ids), [*ids, eot])
        plain, with_eot = sum(nll[:-1]) / len(ids), sum(nll) / len(nll)
        if best is None or plain < best[0]:
            best = (plain, spelling)
        best_eot = with_eot if best_eot is None else min(best_eot, with_eot)
    if best is None or best_eot is None:
        raise ValueError(f"no gold answer to score among {list(answers)!r}")
    return GoldNLL(best[0], best_eot, best[1])


@dataclass
class TopKReference:
    """Full Attention's distributions along its own greedy answer, compactly: top-k per position.

    ``positions`` rows: one per answer token (the distribution that produced it) and, when the
    answer ended with end-of-turn, one more (the distribution that produced the end).
    """

    answer_ids: list[int]
    ended: bool  # the answer stopped at an end-of-turn token (not at max_new_tokens)
    top_ids: torch.Tensor  # [positions, k] int64
    top_logprobs: torch.Tensor  # [positions, k] float32

    @property
    def positions(self) -> int:
        return int(self.top_ids.shape[0])

    @classmethod
    def from_logprobs(cls, answer_ids: Sequence[int], ended: bool, logprobs: torch.Tensor,
                      k: int = REFERENCE_TOP_K) -> TopKReference:
        """From :func:`continuation_logprobs` rows ``[m + 1, V]`` over the answer."""
        rows = logprobs[: len(answer_ids) + (1 if ended else 0)]
        top = torch.topk(rows.float(), min(k, rows.shape[-1]), dim=-1)
        return cls([int(t) for t in answer_ids], bool(ended), top.indices.long(), top.values.float())


def coarse_kl(ref_ids: torch.Tensor, ref_logprobs: torch.Tensor, method_logprobs: torch.Tensor) -> float:
    """KL(P || Q) over the partition {each of P's top-k tokens, everything else}, in nats (float64)."""
    lp = ref_logprobs.double()
    lq = method_logprobs.double()[ref_ids]
    p_rest = max(0.0, 1.0 - float(lp.exp().sum()))
    q_rest = max(0.0, 1.0 - float(lq.exp().sum()))
    kl = float((lp.exp() * (lp - lq)).sum())
    if p_rest > 1e-6:  # below this the rest bucket is float rounding of the top-k sum, not mass
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-300)))
    return max(0.0, kl)


def kl_along_reference(ref: TopKReference, method_logprobs: torch.Tensor) -> list[float]:
    """Per-position coarsened KL(FA || method); ``method_logprobs`` from teacher forcing FA's answer."""
    return [coarse_kl(ref.top_ids[j], ref.top_logprobs[j], method_logprobs[j]) for j in range(ref.positions)]


def reference_kl(lm: LoadedModel, kv: KV, last_logits: torch.Tensor, ref: TopKReference) -> tuple[float, float]:
    """``(first-token KL, answer-level KL)`` of a prefilled prompt against Full Attention's reference."""
    per_pos = kl_along_reference(ref, continuation_logprobs(lm, kv, last_logits, ref.answer_ids))
    if not per_pos:
        return math.nan, math.nan
    return per_pos[0], sum(per_pos) / len(per_pos)


def kl_recovery(kl_method: float | None, kl_reuse: float | None, eps: float = KL_RECOVERY_EPS) -> float | None:
    """``1 - KL_method / KL_FullReuse``: the share of Full Reuse's divergence a method removes.

    1 = Full Attention's distributions, 0 = no better than Full Reuse, < 0 = worse. None
    (undefined) when either side is missing or Full Reuse's own KL is ~0 (nothing to recover).
    """
    if kl_method is None or kl_reuse is None or not math.isfinite(kl_method) or not math.isfinite(kl_reuse):
        return None
    if kl_reuse < eps:
        return None
    return 1.0 - kl_method / kl_reuse
