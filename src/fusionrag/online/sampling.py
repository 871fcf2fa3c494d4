"""Choosing each generated token (greedy or sampled, with log-probabilities) and stop strings.

Why here and not in the decode loop: the decoder returns each row's logits; what a request
does with them (repetition penalty, temperature, min-p, top-k, top-p, its own seeded generator,
how many alternatives to report) is per request, so the scheduler applies a :class:`TokenSampler`
per row. The first token comes from the prefill's last logits through the same sampler, so a
seeded request is reproducible from its first token on. Temperature, min-p, top-k and top-p are
transformers' logits warpers, one list per request: a warper holds one value for the whole
batch it is given, so per-request values mean one list per row (docs/decisions/042).

The names and their meaning are vLLM's, and so is the order: the repetition penalty first (so a
greedy request picks the argmax of the penalised logits), then, when sampling, temperature, min-p,
top-k and top-p.

Stop strings are matched on the *text*, not on token ids: a stop string may end inside a
token or span several tokens. :class:`StopMatcher` holds back the tail of the text that
could still become a stop string, so a streamed answer never shows part of one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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

    def see_prompt(self, token_ids: list[int]) -> None:
        """The prompt's token ids, for the repetition penalty (kept only when the request has one)."""
        if self.penalised:
            self._prompt, self._seen = list(token_ids), None

    def pick(self, logits: torch.Tensor) -> Picked:
        p = self.params
        logits = logits.detach().float().reshape(-1).cpu()
        scores = self._penalise(logits) if self.penalised else logits
        token = int(torch.argmax(scores)) if self.warpers is None else self._sample(scores)
        if self._seen is not None:
            self._seen[token] = True
        if not p.logprobs:
            return Picked(token)
        logp = torch.log_softmax(logits, dim=-1)
        top: list[tuple[int, float]] = []
        if p.top_logprobs > 0:
            values, ids = torch.topk(logp, min(p.top_logprobs, logp.numel()))
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return Picked(token, float(logp[token]), top)

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(logits.numel(), dtype=torch.bool)
            ids = torch.tensor(self._prompt, dtype=torch.long)
            self._seen[ids[(ids >= 0) & (ids < logits.numel())]] = True
        return repetition_penalised(logits, self._seen, self.params.repetition_penalty)

    def _sample(self, logits: torch.Tensor) -> int:
        scores = self.warpers(_NO_INPUT_IDS, logits.unsqueeze(0))[0]
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


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

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
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
