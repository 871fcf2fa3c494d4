"""Choosing each generated token (greedy or sampled, with log-probabilities) and stop strings.

Why here and not in the decode loop: the decoder returns each row's logits; what a request
does with them (repetition penalty, temperature, min-p, top-k, top-p, its own seeded generator,
how many alternatives to report) is per request, so the scheduler applies a :class:`TokenSampler`
per row. The first token comes from the prefill's last logits through the same sampler, so a
seeded request is reproducible from its first token on. Temperature, min-p, top-k and top-p are
transformers' logits warpers, one list per request: a warper holds one value for the whole
batch it is given, so per-request values mean one list per row (docs/decisions/042).

The names and their meaning are vLLM's, and so is the order: the repetition, presence and frequency
penalties first (so a greedy request picks the argmax of the penalised logits), then ``logit_bias``, then
``min_tokens`` (the end of turn and ``stop_token_ids`` held back until that many tokens), then a structured
output's grammar (:mod:`fusionrag.online.constraints`: only tokens that continue a valid answer), then,
when sampling, temperature, min-p, top-k and top-p.

Stop strings are matched on the *text*, not on token ids: a stop string may end inside a
token or span several tokens. :class:`StopMatcher` holds back the tail of the text that
could still become a stop string, so a streamed answer never shows part of one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy (the default here)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # the k most likely tokens; 0 or -1 (vLLM's "off"): no cut
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability; 0: off
    repetition_penalty: float = 1.0  # > 1 penalises tokens of the prompt and the output so far; 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per token (needs logprobs)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the answer holds; 0: off
    frequency_penalty: float = 0.0  # subtracted once per time a token appears in the answer; 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # the end of turn and stop_token_ids are not chosen before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the answer (not part of it)
    include_stop_str_in_output: bool = False  # the stop string that ended the answer stays in it
    skip_special_tokens: bool = True  # special tokens left out of the answer's text
    grammar: Any = None  # a GrammarSpec (fusionrag.online.constraints): the answer held to it

    @property
    def greedy(self) -> bool:
        """Below 1e-5 a temperature is greedy in effect, and dividing by it would overflow the logits."""
        return self.temperature < 1e-5


@dataclass
class Picked:
    """A chosen token, with its log-probability and the top alternatives when asked for."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class TokenSampler:
    """One request's token choice from next-token logits, with its own random generator.

    Log-probabilities are those of the model's distribution (``log_softmax`` of the raw
    logits, before the penalty, temperature or truncation), as OpenAI and vLLM report them.
    The repetition penalty reads the prompt's token ids (:meth:`see_prompt`) and every token
    this sampler picked since.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        self.warpers = None if params.greedy else warpers(params)
        self.penalised = params.repetition_penalty != 1.0
        self._prompt: list[int] = []
        self._seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or picked (only with a penalty)
        self._counts: torch.Tensor | None = None  # [vocab] the answer's tokens (presence / frequency penalty)
        self.picked = 0  # tokens chosen so far
        self.stop_ids: tuple[int, ...] = tuple(params.stop_token_ids)  # held back before min_tokens
        self.constraint: Any = None  # the structured output's walk through its grammar (bind)

    def bind(self, stop_ids: set[int] | tuple[int, ...], constraint: Any = None) -> None:
        """The model's end-of-turn tokens (with the request's stop_token_ids: what ``min_tokens`` holds back) and
        the request's grammar walk (:class:`fusionrag.online.constraints.Constraint`), known once it is prepared."""
        self.stop_ids = tuple(sorted({*stop_ids, *self.params.stop_token_ids}))
        self.constraint = constraint

    def see_prompt(self, token_ids: list[int]) -> None:
        """The prompt's token ids, for the repetition penalty (kept only when the request has one)."""
        if self.penalised:
            self._prompt, self._seen = list(token_ids), None

    def pick(self, logits: torch.Tensor) -> Picked:
        p = self.params
        logits = logits.detach().float().reshape(-1).cpu()
        scores = self._penalise(logits) if self.penalised else logits
        scores = _finite(self._adjust(scores))
        token = int(torch.argmax(scores)) if self.warpers is None else self._sample(scores)
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1
        self.picked += 1
        if self.constraint is not None and token not in self.stop_ids:
            self.constraint.accept(token)
        if not p.logprobs:
            return Picked(token)
        logp = torch.log_softmax(logits, dim=-1)
        top: list[tuple[int, float]] = []
        if p.top_logprobs > 0:
            values, ids = torch.topk(logp, min(p.top_logprobs, logp.numel()))
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return Picked(token, float(logp[token]), top)

    def _adjust(self, scores: torch.Tensor) -> torch.Tensor:
        """The presence and frequency penalties, ``logit_bias``, ``min_tokens`` and the grammar, in vLLM's order."""
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            if self._counts is None:
                self._counts = torch.zeros(scores.numel(), dtype=torch.float32)
            scores = scores - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0).float()
        if p.logit_bias:
            scores = scores.clone()
            for token, bias in p.logit_bias:
                if 0 <= token < scores.numel():
                    scores[token] += bias
        if self.picked < p.min_tokens and self.stop_ids:
            scores = scores.clone()
            scores[[t for t in self.stop_ids if 0 <= t < scores.numel()]] = float("-inf")
        if self.constraint is not None:
            scores = self.constraint.mask(scores)
        return scores

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(logits.numel(), dtype=torch.bool)
            ids = torch.tensor(self._prompt, dtype=torch.long)
            self._seen[ids[(ids >= 0) & (ids < logits.numel())]] = True
        return repetition_penalised(logits, self._seen, self.params.repetition_penalty)

    def _sample(self, logits: torch.Tensor) -> int:
        scores = _finite(self.warpers(_NO_INPUT_IDS, logits.unsqueeze(0))[0])
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """Scores a distribution can be made of: an overflow (a repetition penalty of 1e-300 divides a logit to
    infinity, a small temperature divides it again) becomes the largest finite score, so the request samples
    among its top tokens instead of failing on ``inf - inf``; NaN and masked tokens stay impossible (-inf)."""
    if bool(torch.isfinite(scores).all()):
        return scores
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(scores.dtype).max, neginf=float("-inf"))


def repetition_penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's (and transformers') repetition penalty: the logit of every ``seen`` token divided by
    ``penalty`` where it is positive, multiplied by it where it is not; the other logits unchanged."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


#: The warpers below read only the scores; the token ids so far are not needed.
_NO_INPUT_IDS = torch.empty(1, 0, dtype=torch.long)


def warpers(params: SamplingParams) -> LogitsProcessorList:
    """transformers' temperature, min-p, top-k and top-p warpers for one request, in vLLM's order (min-p
    compares each probability with the most likely one's, which a top-k cut leaves as it is)."""
    out = LogitsProcessorList([TemperatureLogitsWarper(float(params.temperature))])
    if params.min_p > 0.0:
        out.append(MinPLogitsWarper(float(params.min_p)))
    if params.top_k > 0:
        out.append(TopKLogitsWarper(int(params.top_k)))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(float(params.top_p)))
    return out


class StopMatcher:
    """Text deltas in, text safe to show out; reports when a stop string has appeared.

    The emitted text never contains a stop string nor anything after it; it only holds
    back a tail that is a prefix of some stop string, released by :meth:`flush` when
    generation ends for another reason.
    """

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include  # the stop string itself stays in the text (vLLM's include_stop_str_in_output)
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        hits = [(i, i + len(s)) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            start, end = min(hits)
            return text[: end if self.include else start]
        keep = 0
        for s in self.stops:  # the longest tail of text that starts some stop string
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if s.startswith(text[-n:]):
                    keep = n
                    break
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
