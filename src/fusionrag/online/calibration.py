"""``fusionrag calibrate``: the store's ``ratio="auto"`` setting, measured against Full Attention on its own chunks.

No gold answers and no user questions are needed: each probe is a question made from one of the store's chunks
(``What do the documents say about "<the start of one of its sentences>"?``), answered over what retrieval finds
for it, as a user's question is. For each probe the first answer token's distribution is computed three ways:
Full Attention (the reference), FusionRAG at the fixed default ratio, and FusionRAG with ``ratio="auto"`` at each
attention mass of a grid. The setting kept is the smallest mass whose mean first-token KL to Full Attention is
at most the target: by default the fixed ratio's own KL on the same probes, so ``auto`` keeps the default's
closeness to Full Attention and recomputes per question what that takes. It is written to the store's settings
(one writer, as any store change), where every engine and the vLLM connector read it.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.online.auto_ratio import AUTO, DEFAULT_CEILING, DEFAULT_FLOOR, SETTING, AutoRatio
from fusionrag.online.request import DEFAULT_RATIO, ReuseRequest

#: The attention masses tried, lowest first (the smallest that reaches the target is kept). Steps of 0.05 where the
#: share recomputed moves fastest: on the HotpotQA study store, 0.6 missed fixed 15%'s KL by 1e-4 at 16% and the
#: next step of a 0.1 grid, 0.7, recomputed 23% (``studies/matched_quality/results/calibration_hotpotqa.json``).
MASS_GRID = (0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
DEFAULT_SAMPLES = 16
#: Words of a sentence a probe quotes: enough for retrieval to find its chunk, short of giving the answer away.
PROBE_WORDS = 8


@dataclass
class Calibration:
    """What a calibration measured: the setting it chose, and per mass the mean KL and share recomputed."""

    auto: AutoRatio
    samples: int
    target_kl: float
    fixed_kl: float
    grid: list[dict[str, float]] = field(default_factory=list)
    reached: bool = True  # False: no mass reached the target (the largest is kept)

    def summary(self) -> str:
        best = next(g for g in self.grid if g["mass"] == self.auto.mass)
        reached = "" if self.reached else " (no mass on the grid reached the target: the largest is kept)"
        return (f"ratio=auto: mass {self.auto.mass:g}{reached}, on {self.samples} probes from the store: first-token "
                f"KL {best['kl']:.4f} (target {self.target_kl:.4f}; fixed ratio {DEFAULT_RATIO:g}: "
                f"{self.fixed_kl:.4f}), recomputing {best['share']:.1%} of the context on average "
                f"(floor {self.auto.floor:g}, ceiling {self.auto.ceiling:g})")


def probe_questions(store: Any, samples: int, seed: int = 0) -> list[str]:
    """Up to ``samples`` questions, each quoting the start of a sentence of a different chunk (seeded choice)."""
    ids = store.chunk_ids()
    rng = random.Random(seed)
    rng.shuffle(ids)
    out: list[str] = []
    for cid in ids:
        words = _sentence_start(store.chunk(cid).text, rng)
        if words:
            out.append(f'What do the documents say about "{words}"?')
        if len(out) == samples:
            break
    return out


def _sentence_start(text: str, rng: random.Random) -> str:
    sentences = [s.split() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= PROBE_WORDS]
    return " ".join(rng.choice(sentences)[:PROBE_WORDS]) if sentences else ""


def first_token_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of the first-token distributions (nats), computed in float64 (``fusionrag doctor``
    reads it too)."""
    p = torch.log_softmax(reference.double().cpu().flatten(), -1)
    q = torch.log_softmax(other.double().cpu().flatten(), -1)
    return float((p.exp() * (p - q)).sum())


def calibrate(engine: Any, samples: int = DEFAULT_SAMPLES, seed: int = 0, target_kl: float | None = None,
              masses: Sequence[float] = MASS_GRID, floor: float = DEFAULT_FLOOR, ceiling: float = DEFAULT_CEILING,
              progress: bool = False, top_k: int | None = None) -> Calibration:
    """Measure the setting (module doc) with ``engine`` (a :class:`~fusionrag.online.engine.Engine` on a store),
    each probe over the ``top_k`` chunks retrieval finds for it (None: the engine's default, as a request that
    names none); nothing is written (:func:`record` does)."""
    if engine.store is None:
        raise FusionRAGError("calibration needs a store: its chunks make the probes")
    questions = probe_questions(engine.store, samples, seed)
    if not questions:
        raise FusionRAGError("the store has no chunk with a sentence of 8 words or more to make a probe from")
    masses = sorted(float(m) for m in masses)
    kept = engine.auto_ratio
    fixed: list[float] = []
    per_mass: dict[float, list[tuple[float, float]]] = {m: [] for m in masses}
    bar = _progress(len(questions) * (2 + len(masses)), progress)
    try:
        for q in questions:
            full = _first_logits(engine, q, "full", 1.0, top_k)
            bar.update(1)
            fixed.append(first_token_kl(full, _first_logits(engine, q, "fusionrag", DEFAULT_RATIO, top_k)))
            bar.update(1)
            for m in masses:
                engine.auto_ratio = AutoRatio(m, floor, ceiling)
                req = _prepared(engine, q, "fusionrag", AUTO, top_k)
                per_mass[m].append((first_token_kl(full, req.pre.last_logits), float(req.ratio)))
                bar.update(1)
    finally:
        engine.auto_ratio = kept
        bar.close()
    fixed_kl = sum(fixed) / len(fixed)
    target = fixed_kl if target_kl is None else float(target_kl)
    grid = [{"mass": m, "kl": sum(k for k, _ in v) / len(v), "share": sum(s for _, s in v) / len(v)}
            for m, v in per_mass.items()]
    chosen = next((g for g in grid if g["kl"] <= target), None)
    reached = chosen is not None
    chosen = chosen or grid[-1]
    info = {"samples": len(questions), "seed": seed, "top_k": top_k, "target_kl": target, "fixed_ratio": DEFAULT_RATIO,
            "fixed_kl": fixed_kl, "mean_kl": chosen["kl"], "mean_share": chosen["share"], "reached": reached,
            "dtype": str(engine.lm.dtype).removeprefix("torch."), "model": engine.lm.name,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "grid": grid}
    return Calibration(AutoRatio(chosen["mass"], floor, ceiling, info), len(questions), target, fixed_kl, grid,
                       reached)


def record(engine: Any, result: Calibration) -> None:
    """Write the setting into the store (under its writer lock: one writer; readers see a new generation and take
    it in on their next request) and into ``engine``."""
    with engine.store.writer():
        engine.store.update_settings(**{SETTING: result.auto.to_setting()})
    engine.auto_ratio = result.auto


def _prepared(engine: Any, question: str, method: str, ratio: float | str, top_k: int | None) -> Any:
    # skip_cache: each way is computed, never a whole context an earlier probe left in the context cache
    return engine.prepare(ReuseRequest(question, method, ratio, top_k=top_k, skip_cache=True))


def _first_logits(engine: Any, question: str, method: str, ratio: float, top_k: int | None) -> torch.Tensor:
    return _prepared(engine, question, method, ratio, top_k).pre.last_logits


def _progress(total: int, on: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="calibrate", unit="prefill", disable=not on)
