"""Choosing each generated token (greedy or sampled, with log-probabilities) and stop strings.

Why here and not in the decode loop: the decoder returns each row's logits; what a request
does with them (temperature, top-p, top-k, its own seeded generator, how many alternatives
to report) is per request, so the scheduler applies a :class:`TokenSampler` per row. The
first token comes from the prefill's last logits through the same sampler, so a seeded
request is reproducible from its first token on. Temperature, top-k and top-p are
transformers' logits warpers, one list per request: a warper holds one value for the whole
batch it is given, so per-request values mean one list per row (docs/decisions/042).

Stop strings are matched on the *text*, not on token ids: a stop string may end inside a
token or span several tokens. :class:`StopMatcher` holds back the tail of the text that
could still become a stop string, so a streamed answer never shows part of one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy (the default here)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
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
    logits, before temperature or truncation), as OpenAI reports them.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        self.warpers = None if params.greedy else warpers(params)

    def pick(self, logits: torch.Tensor) -> Picked:
        p = self.params
        logits = logits.detach().float().reshape(-1).cpu()
        token = int(torch.argmax(logits)) if self.warpers is None else self._sample(logits)
        if not p.logprobs:
            return Picked(token)
        logp = torch.log_softmax(logits, dim=-1)
        top: list[tuple[int, float]] = []
        if p.top_logprobs > 0:
            values, ids = torch.topk(logp, min(p.top_logprobs, logp.numel()))
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return Picked(token, float(logp[token]), top)

    def _sample(self, logits: torch.Tensor) -> int:
        scores = self.warpers(_NO_INPUT_IDS, logits.unsqueeze(0))[0]
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


#: The warpers below read only the scores; the token ids so far are not needed.
_NO_INPUT_IDS = torch.empty(1, 0, dtype=torch.long)


def warpers(params: SamplingParams) -> LogitsProcessorList:
    """transformers' temperature, top-k and top-p warpers for one request, in generate()'s order."""
    out = LogitsProcessorList([TemperatureLogitsWarper(float(params.temperature))])
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
