"""Answer-quality and fidelity metrics, plus bootstrap confidence intervals.

Two families, because a small model makes gold-answer metrics weak:

* **Gold metrics** (token F1, exact match, gold-contained accuracy) after SQuAD
  normalisation, max over gold aliases, as in the paper. They are computed on
  *text*: public code that scored token ids dropped or merged tokens and got F1 wrong.
* **Fidelity to Full Attention** (agreement F1 between a method's answer and Full
  Attention's, first-token KL and top-1 agreement). These measure what KV reuse
  actually changes and stay well powered where the model's answers are poor.

Normalised scores divide by a gap between two methods that can be ~0 on a small
model; they return ``None`` ("undefined") instead of dividing by zero, and callers
must report that rather than an absurd number.
"""

from __future__ import annotations

import math
import re
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

#: Below this denominator a normalised score is reported as undefined.
DEFAULT_EPS = 1e-9

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _strip_punctuation(text: str) -> str:
    # SQuAD removes ``string.punctuation``; removing every Unicode punctuation
    # character (category P*) is a superset that also catches curly quotes and
    # en dashes, which models emit and ASCII-only stripping would leave as tokens.
    return "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation and articles, collapse spaces.

    The order (punctuation before articles) follows the official SQuAD script, so
    ``"The-End"`` becomes ``"theend"`` exactly as it does there.
    """
    text = (text or "").lower()
    text = _strip_punctuation(text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    out = list(golds)
    if not out:
        raise ValueError("no gold answers given: a question without a gold answer cannot be scored")
    return out


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # Both empty means both say "nothing": agreement. One empty: no overlap possible.
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, golds: str | Sequence[str]) -> float:
    """Token F1 of ``prediction`` against the best-matching gold alias.

    F1 of two empty (after normalisation) strings is 1, of one empty string 0.
    """
    pred_tokens = normalize_answer(prediction).split()
    return max(_token_f1(pred_tokens, normalize_answer(g).split()) for g in _golds(golds))


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold alias, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golds)))


def contains_gold(prediction: str, golds: str | Sequence[str]) -> float:
    """1.0 if some normalised gold alias occurs in the normalised prediction, else 0.0.

    Verbose but correct answers ("He was born in Warsaw in 1867") score 0 on EM and
    low on F1; this accuracy credits them. The match is on whole tokens, so gold
    ``"1"`` is not found in ``"1911"``. An empty normalised gold counts only when the
    prediction is empty too (otherwise it would match every answer).
    """
    pred = normalize_answer(prediction)
    for g in _golds(golds):
        gold = normalize_answer(g)
        if not gold:
            if not pred:
                return 1.0
            continue
        if f" {gold} " in f" {pred} ":
            return 1.0
    return 0.0


def answer_scores(prediction: str, golds: str | Sequence[str]) -> dict[str, float]:
    """All gold metrics of one answer: ``{"f1", "em", "contains"}``."""
    return {
        "f1": f1(prediction, golds),
        "em": exact_match(prediction, golds),
        "contains": contains_gold(prediction, golds),
    }


def _is_missing(x: float | None) -> bool:
    return x is None or math.isnan(float(x))


def normalised_score(
    x: float | None, reuse: float | None, full: float | None, eps: float = DEFAULT_EPS
) -> float | None:
    """The paper's normalised score ``(x - reuse) / (full - reuse)``.

    0 means "no better than Full Reuse", 1 "as good as Full Attention". Returns
    ``None`` (undefined) when ``|full - reuse| < eps`` or an input is missing: with
    no gap between the two references there is nothing to recover, and a division
    by a near-zero gap would print a meaningless huge number.
    """
    if _is_missing(x) or _is_missing(reuse) or _is_missing(full):
        return None
    denom = float(full) - float(reuse)
    if abs(denom) < eps:
        return None
    return (float(x) - float(reuse)) / denom


def agreement_f1(answer: str, full_answer: str) -> float:
    """Token F1 of a method's answer against Full Attention's answer (fidelity).

    Full Attention is the method's reference output, so this measures how much of
    its answer survives KV reuse, independently of whether that answer is right.
    """
    return f1(answer, [full_answer])


def normalised_agreement(agree: float | None, agree_reuse: float | None, eps: float = DEFAULT_EPS) -> float | None:
    """``(agree - agree_reuse) / (1 - agree_reuse)``: share of Full Reuse's disagreement recovered.

    The fidelity analogue of normalised F1 (Full Attention agrees with itself
    perfectly, so its reference value is 1). ``None`` when Full Reuse already agrees
    perfectly.
    """
    return normalised_score(agree, agree_reuse, 1.0, eps=eps)


def _as_distribution_logits(logits: torch.Tensor | Sequence[float] | np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(logits).detach().to(device="cpu", dtype=torch.float64)
    t = t.squeeze()
    if t.dim() != 1:
        raise ValueError(f"expected the logits of one next-token distribution, got shape {tuple(t.shape)}")
    return t


def kl_first_token(
    full_logits: torch.Tensor | Sequence[float] | np.ndarray,
    method_logits: torch.Tensor | Sequence[float] | np.ndarray,
) -> float:
    """KL(softmax(full) || softmax(method)) of the first generated token's distribution, in nats.

    Computed in float64 from log-softmax so that near-identical distributions give
    ~0 rather than rounding noise (100% recompute matches Full Attention to ~1e-5).
    Leading singleton dimensions (``[1, V]``) are accepted.
    """
    p_log = torch.log_softmax(_as_distribution_logits(full_logits), dim=-1)
    q_log = torch.log_softmax(_as_distribution_logits(method_logits), dim=-1)
    if p_log.shape != q_log.shape:
        raise ValueError(f"vocabulary sizes differ: {p_log.shape[0]} vs {q_log.shape[0]}")
    p = p_log.exp()
    # Tokens Full Attention gives zero probability (e.g. masked to -inf) contribute
    # nothing; 0 * (-inf - x) would otherwise be NaN.
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    return max(0.0, float(terms.sum()))


def top1_agree(
    full_logits: torch.Tensor | Sequence[float] | np.ndarray,
    method_logits: torch.Tensor | Sequence[float] | np.ndarray,
) -> float:
    """1.0 if both distributions put their maximum on the same token (greedy first token agrees)."""
    full = _as_distribution_logits(full_logits)
    method = _as_distribution_logits(method_logits)
    if full.shape != method.shape:
        raise ValueError(f"vocabulary sizes differ: {full.shape[0]} vs {method.shape[0]}")
    return float(int(full.argmax()) == int(method.argmax()))


def _clean(values: Iterable[float | None]) -> np.ndarray:
    arr = np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    return arr[~np.isnan(arr)]


def _check_boot_args(n_boot: int, alpha: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def percentile_bootstrap(
    samples: Sequence[np.ndarray],
    statistic: Callable[..., np.ndarray],
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap ``1 - alpha`` interval of ``statistic`` (``scipy.stats.bootstrap``).

    ``samples`` are paired (row ``i`` of each is one question, resampled together);
    ``statistic(*samples, axis=...)`` is vectorised. Resamples where the statistic is
    undefined (NaN, e.g. a ratio over a ~0 mean) are left out of the quantiles. Resampling
    goes in batches so ``n_boot x n`` indices never need more than ~4M entries at once.
    """
    from scipy.stats import bootstrap

    _check_boot_args(n_boot, alpha)
    batch = max(1, min(n_boot, 4_000_000 // max(1, len(samples[0]))))
    with warnings.catch_warnings():  # n_boot == 1 (no standard error) and undefined resamples, handled here
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.filterwarnings("ignore", message="The BCa confidence interval cannot be calculated")
        res = bootstrap(tuple(samples), statistic, n_resamples=n_boot, batch=batch,
                        vectorized=True, paired=True, confidence_level=1 - alpha, method="percentile",
                        rng=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(lo) or math.isnan(hi):
        defined = res.bootstrap_distribution[~np.isnan(res.bootstrap_distribution)]
        if defined.size == 0:
            return (math.nan, math.nan)
        lo, hi = (float(v) for v in np.quantile(defined, [alpha / 2, 1 - alpha / 2]))
    return (lo, hi)


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis)


def _mean_difference(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a - b, axis=axis)


def bootstrap_ci(
    values: Iterable[float | None], n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap ``1 - alpha`` confidence interval: ``(mean, lo, hi)``.

    ``None``/NaN values (e.g. undefined normalised scores) are dropped, not counted
    as zero. With no values all three are NaN; with one value the interval is that
    value. The seed is fixed so reports are reproducible run to run.
    """
    _check_boot_args(n_boot, alpha)
    x = _clean(values)
    if x.size == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(x.mean())
    if x.size == 1:
        return (mean, mean, mean)
    lo, hi = percentile_bootstrap([x], _mean, n_boot, alpha, seed)
    return (mean, lo, hi)


def bootstrap_diff_ci(
    a: Sequence[float | None],
    b: Sequence[float | None],
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of the paired differences ``a[i] - b[i]`` with a bootstrap CI: ``(mean, lo, hi)``.

    Resampling *questions* (pairs), not each method separately, removes the large
    per-question variance both methods share, so a real gap between two methods run
    on the same questions is detected with far fewer questions. Pairs where either
    side is missing are dropped. An interval excluding 0 means the gap is significant.
    """
    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    _check_boot_args(n_boot, alpha)
    pairs = np.array([(float(x), float(y)) for x, y in zip(a, b, strict=True)
                      if not (_is_missing(x) or _is_missing(y))], dtype=np.float64).reshape(-1, 2)
    if pairs.shape[0] == 0:
        return (math.nan, math.nan, math.nan)
    mean = float((pairs[:, 0] - pairs[:, 1]).mean())
    if pairs.shape[0] == 1:
        return (mean, mean, mean)
    lo, hi = percentile_bootstrap([pairs[:, 0], pairs[:, 1]], _mean_difference, n_boot, alpha, seed)
    return (mean, lo, hi)
