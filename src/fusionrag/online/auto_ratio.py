"""``ratio="auto"``: each request recomputes the share of its context its own question needs.

FusionRAG scores each reused context token by the attention the question pays it (last layer, one softmax
over the whole prompt). A question that reads a few tokens is settled by recomputing those; one that spreads
its attention over many passages (a multi-hop question) needs more. ``auto`` recomputes the fewest top-scored
tokens that together hold ``mass`` of the attention the question pays the context, then clamps that count to
``[floor, ceiling]`` of the context. ``mass`` is calibrated once per model and store (``fusionrag calibrate``:
Full Attention as the reference on questions made from a sample of the store's own chunks, no gold answers;
:mod:`fusionrag.online.calibration`) and kept in the store's settings; a store never calibrated uses
:data:`DEFAULT_MASS`. What it does per question, against the fixed ratio: ``studies/matched_quality``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where counted: the doors check ``ratio`` before any model (or torch) loads
    import torch

#: The value of ``ratio`` that asks for a per-request recompute (every door accepts it).
AUTO: Literal["auto"] = "auto"
#: The methods ``ratio="auto"`` can size (it is calibrated on FusionRAG's scores; ``auto`` runs ``fusionrag``).
AUTO_METHODS = ("fusionrag", "auto")
#: The store setting that holds the calibrated :class:`AutoRatio`.
SETTING = "auto_ratio"
#: Share of the question's attention over the context the recomputed tokens hold, on a store never calibrated: what
#: ``fusionrag calibrate`` chose for qwen2.5-0.5b (bf16) on the 2WikiMQA study store, 16 probes over 10 chunks each
#: (first-token KL 0.106 against fixed 15%'s 0.115, recomputing 17.9% on average:
#: ``studies/matched_quality/results/calibration_2wikimqa.json``).
DEFAULT_MASS = 0.6
DEFAULT_FLOOR = 0.03  # a question whose attention sits on a handful of tokens still recomputes this share
DEFAULT_CEILING = 0.5  # past half of the context a full prefill is as fast (benchmarks/ttft: 50% ~ 0.8x full)

Ratio = float | Literal["auto"]


def is_auto(ratio: Any) -> bool:
    """Whether ``ratio`` asks for the per-request recompute (the string ``"auto"``, any case)."""
    return isinstance(ratio, str) and ratio.strip().lower() == AUTO


@dataclass(frozen=True)
class AutoRatio:
    """How ``ratio="auto"`` sizes one request's recompute (see the module doc)."""

    mass: float = DEFAULT_MASS
    floor: float = DEFAULT_FLOOR
    ceiling: float = DEFAULT_CEILING
    #: What calibration measured (sample size, target KL, model dtype, date); None: the default, never calibrated.
    calibration: dict | None = None

    def __post_init__(self) -> None:
        if not (0.0 < self.mass <= 1.0 and 0.0 <= self.floor <= self.ceiling <= 1.0):
            raise ValueError(f"auto ratio needs 0 < mass <= 1 and 0 <= floor <= ceiling <= 1, got mass {self.mass}, "
                             f"floor {self.floor}, ceiling {self.ceiling}")

    def count(self, scores: torch.Tensor) -> int:
        """How many of the candidates scored ``scores`` (attention each token receives) to recompute."""
        import torch

        n = int(scores.numel())
        if n == 0:
            return 0
        mass = _attention(scores)
        total = float(mass.sum())
        if total > 0.0:
            held = torch.cumsum(torch.sort(mass, descending=True).values, 0) / total
            k = int(torch.searchsorted(held, torch.tensor([self.mass - 1e-9])).item()) + 1
        else:  # no attention to go by: the floor
            k = 0
        lo, hi = budget(self.floor, n), budget(self.ceiling, n)
        return max(lo, min(k, hi, n))

    def held(self, scores: torch.Tensor, k: int) -> float:
        """Share of the attention mass the top ``k`` of ``scores`` hold."""
        import torch

        mass = _attention(scores)
        total = float(mass.sum())
        return float(torch.topk(mass, min(k, mass.numel())).values.sum()) / total if total > 0 and k > 0 else 0.0

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def summary(self) -> dict[str, Any]:
        """What a response says sized a request's recompute (``usage.fusionrag.auto_ratio``, the connector's
        report)."""
        return {"mass": self.mass, "floor": self.floor, "ceiling": self.ceiling, "calibrated": self.calibrated}

    def to_setting(self) -> dict[str, Any]:
        """What the store's :data:`SETTING` holds."""
        return asdict(self)

    @classmethod
    def from_settings(cls, settings: dict[str, Any] | None) -> AutoRatio:
        """The store's calibrated setting, or the default when it has none (or an unreadable one)."""
        rec = (settings or {}).get(SETTING)
        if not isinstance(rec, dict):
            return cls()
        try:
            return cls(float(rec["mass"]), float(rec.get("floor", DEFAULT_FLOOR)),
                       float(rec.get("ceiling", DEFAULT_CEILING)), rec.get("calibration"))
        except (KeyError, TypeError, ValueError):
            return cls()

    def with_mass(self, mass: float) -> AutoRatio:
        return replace(self, mass=float(mass))


def ratio_key(ratio: Ratio, auto: AutoRatio) -> str:
    """How caches keyed by what a ratio computes name ``ratio``: the number, or ``auto`` with its settings."""
    if is_auto(ratio):
        return f"auto:{auto.mass:.6g}:{auto.floor:.6g}:{auto.ceiling:.6g}"
    return f"{float(ratio):.6f}"


def parse_ratio(text: str) -> Ratio:
    """A command line's ``--ratio``: ``auto`` or a number (its range is checked with the request's fields)."""
    return AUTO if is_auto(text) else float(text)


def describe(ratio: Ratio, auto: Any = None) -> str:
    """``ratio`` for a person: ``0.15``; ``0.12 (auto)`` when ``auto`` (the setting that sized it) chose it."""
    text = AUTO if is_auto(ratio) else f"{float(ratio):.2f}"
    return f"{text} (auto)" if auto is not None and not is_auto(ratio) else text


def _attention(scores: torch.Tensor) -> torch.Tensor:
    """Scores as attention mass: finite, non-negative, float32 on the CPU (a ruled-out -inf counts nothing)."""
    import torch

    return torch.nan_to_num(scores.detach().float().cpu(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0)


def budget(ratio: float, context_tokens: int) -> int:
    """Number of context tokens to recompute for a numeric ``ratio`` (also the auto floor's and ceiling's)."""
    return max(0, min(context_tokens, round(ratio * context_tokens)))
