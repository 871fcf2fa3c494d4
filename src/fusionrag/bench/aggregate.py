"""Statistics over per-question records: per-cell means with bootstrap CIs, and paired differences.

Pure functions of the records (no model, no files), so the report can be re-aggregated from
``records.jsonl`` at any time and scripts can reuse the same definitions.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence

from fusionrag.bench import metrics


def aggregate(records: Iterable[dict]) -> list[dict]:
    """Per (dataset, method, kv, ratio, top_n): means with bootstrap CIs and normalised scores."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["method"], r["kv"], r["ratio"], r.get("top_n", 0))].append(r)
    rows = []
    for (dataset, method, kv, ratio, top_n), recs in sorted(groups.items(), key=lambda kv_: str(kv_[0])):
        row = {"dataset": dataset, "method": method, "kv": kv, "ratio": ratio, "top_n": top_n, "n": len(recs)}
        for m in CELL_METRICS:
            if m in TEACHER_FORCED and all(r.get(m) is None for r in recs):  # a study made before they existed
                continue
            mean, lo, hi = metrics.bootstrap_ci([r.get(m) for r in recs])
            row[m], row[f"{m}_ci"] = mean, [lo, hi]
        row["ctx_tokens"] = statistics.fmean(r["ctx_tokens"] for r in recs)
        row["recomputed_tokens"] = statistics.fmean(r["recomputed_tokens"] for r in recs)
        ttfts = [r["ttft_ms"] for r in recs if r.get("ttft_ms") is not None]
        row["ttft_ms_median"] = statistics.median(ttfts) if ttfts else None
        row["ttft_n"] = len(ttfts)
        for part in ("retrieve", "load", "select", "recompute", "first_token"):
            vals = [r["ttft_breakdown_ms"][part] for r in recs if part in r.get("ttft_breakdown_ms", {})]
            row[f"{part}_ms_median"] = statistics.median(vals) if vals else None
        rows.append(row)
    _add_kl_recovery(rows, groups)
    # normalisation against Full Attention and plain Full Reuse of the same dataset
    by = {(r["dataset"], r["method"], r["kv"]): r for r in rows if r["method"] in ("full", "reuse")}
    for row in rows:
        full, reuse = by.get((row["dataset"], "full", "none")), by.get((row["dataset"], "reuse", "plain"))
        row["norm_f1"] = metrics.normalised_score(row["f1"], reuse and reuse["f1"], full and full["f1"])
        row["norm_agree"] = metrics.normalised_agreement(row["agree_f1"], reuse and reuse["agree_f1"])
    return rows


def _add_kl_recovery(rows: list[dict], groups: dict[tuple, list[dict]]) -> None:
    """``kl_recovery`` = 1 - mean KL_method / mean KL_FullReuse(plain), over the questions both have,
    with a paired bootstrap interval (resampling questions; a ratio of means, never a mean of ratios)."""
    import numpy as np

    from fusionrag.bench.likelihood import KL_RECOVERY_EPS

    def recovery(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        kl_reuse = b.mean(axis=axis)
        undefined = kl_reuse < KL_RECOVERY_EPS  # Full Reuse already ~ Full Attention: nothing to recover
        return np.where(undefined, np.nan, 1.0 - a.mean(axis=axis) / np.where(undefined, 1.0, kl_reuse))

    for row in rows:
        reuse = groups.get((row["dataset"], "reuse", "plain", 0.0, 0), [])
        mine = groups[(row["dataset"], row["method"], row["kv"], row["ratio"], row["top_n"])]
        base = {r["qid"]: r.get("kl_answer") for r in reuse}
        pairs = [(r["kl_answer"], base[r["qid"]]) for r in mine
                 if r.get("kl_answer") is not None and base.get(r["qid"]) is not None]
        if not pairs:
            continue
        row["kl_recovery"], row["kl_recovery_ci"] = None, [None, None]
        a, b = np.array(pairs, dtype=np.float64).T
        row["kl_recovery"] = metrics_recovery(a.mean(), b.mean())
        if len(pairs) == 1:
            lo = hi = row["kl_recovery"]
        else:
            lo, hi = metrics.percentile_bootstrap([a, b], recovery)
        if lo is not None and not (math.isnan(lo) or math.isnan(hi)):
            row["kl_recovery_ci"] = [lo, hi]


def metrics_recovery(kl_method: float, kl_reuse: float) -> float | None:
    from fusionrag.bench.likelihood import kl_recovery

    return kl_recovery(float(kl_method), float(kl_reuse))


#: Per-cell metrics: gold (text), fidelity (first token, full vocabulary), and teacher-forced
#: (gold NLL without / with end-of-turn; KL to Full Attention's top-k reference at the first
#: token and along its answer).
CELL_METRICS = ("f1", "em", "contains", "agree_f1", "kl_first", "top1_agree",
                "gold_nll", "gold_nll_eot", "kl_first_c", "kl_answer")
TEACHER_FORCED = ("gold_nll", "gold_nll_eot", "kl_first_c", "kl_answer")
#: Metrics compared question by question between FusionRAG and each baseline.
COMPARE_METRICS = ("agree_f1", "kl_first", "top1_agree", "gold_nll", "gold_nll_eot", "kl_first_c", "kl_answer")


def paired_comparisons(records: Iterable[dict], method: str = "fusionrag", kv: str = "fused") -> list[dict]:
    """``method`` on ``kv`` minus each baseline, paired by question, with bootstrap CIs.

    The per-method intervals of :func:`aggregate` are wide because questions differ a lot
    in difficulty; every method answers the same questions, so resampling *questions* and
    looking at the difference removes that shared variance (``metrics.bootstrap_diff_ci``).
    Baselines: every other method at the same ratio and Full Reuse (ratio 0, plain and fused);
    only questions both sides answered are paired. Full Attention is compared too: for the gold
    NLL it is a baseline a method can beat (for the fidelity metrics the difference is the metric).
    """
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        cells[(r["dataset"], r["method"], r["kv"], r["ratio"], r.get("top_n", 0))][r["qid"]] = r
    out = []
    ordered = sorted(cells.items(), key=lambda kv_: str(kv_[0]))
    for (ds, m, k, ratio, top_n), mine in ordered:
        if (m, k) != (method, kv):
            continue
        for (ds2, m2, k2, ratio2, top_n2), theirs in ordered:
            if ds2 != ds or (m2, k2) == (method, kv) or (m2 not in ("reuse", "full") and ratio2 != ratio):
                continue
            if k2 == kv == "fused" and top_n2 != top_n:  # top-n sweep: compare within one offline setting
                continue
            qids = sorted(set(mine) & set(theirs))
            if not qids:
                continue
            row = {"dataset": ds, "method": m, "kv": k, "ratio": ratio, "top_n": top_n, "baseline": m2,
                   "baseline_kv": k2, "baseline_ratio": ratio2, "baseline_top_n": top_n2, "n": len(qids)}
            for metric in COMPARE_METRICS:
                diff, lo, hi = metrics.bootstrap_diff_ci([mine[q].get(metric) for q in qids],
                                                         [theirs[q].get(metric) for q in qids])
                row[f"{metric}_diff"], row[f"{metric}_diff_ci"] = diff, [lo, hi]
            out.append(row)
    return out


def all_comparisons(records: Sequence[dict]) -> list[dict]:
    """FusionRAG against every baseline, then the offline stage alone (Full Reuse on fused vs plain KV),
    then the authors' selection against every other cell (plain vs fused KV under their scoring)."""
    out = paired_comparisons(records) + paired_comparisons(records, method="reuse", kv="fused")
    return out + paired_comparisons(records, method="fusionrag-authors", kv="fused")


def knowledge_base_stores(records: Sequence[dict]) -> dict[str, list[str]]:
    """Per dataset, the stores (knowledge base + offline settings) its store-reading records used."""
    stores: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.get("kb"):
            stores[r["dataset"]].add(r["kb"])
    return {d: sorted(v) for d, v in sorted(stores.items())}
