"""Speed at matched quality (issue 50): the summary of ``studies/matched_quality/results/records.jsonl``.

For each dataset, on the questions every cell answered (paired): per method and ratio the agreement of the
greedy answer with Full Attention's (exact match of the whole answer, after the usual answer normalisation),
first-token and answer KL to the float32 reference, the share of the context recomputed and TTFT; then the
table the 2026 papers print (per method, the smallest ratio reaching each quality level, with its TTFT); then
``ratio="auto"`` against the fixed ratio (paired), and how well its signal predicts each question's distance
from Full Attention (Spearman, bootstrap interval). Agreement is with Full Attention **in bfloat16** (the exact
prefill a user runs instead); its own agreement with the float32 reference is given as the floor of the dtype.

    .venv/bin/python -m studies.matched_quality.summarize
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from fusionrag.bench.metrics import bootstrap_ci, bootstrap_diff_ci, normalize_answer
from fusionrag.bench.records import read_records
from fusionrag.files import atomic_write, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results"
FULL = ("full@bf16", "none", 1.0)
LEVELS = (0.90, 0.95, 0.99)
KL_LEVEL = 0.05
CURVES = [("fusionrag@bf16", "fused"), ("prophetkv@bf16", "fused"), ("prophetkv@bf16", "plain"),
          ("cacheblend@bf16", "plain"), ("epic@bf16", "plain")]
NAMES = {("fusionrag@bf16", "fused"): "FusionRAG (fused KV)", ("prophetkv@bf16", "fused"): "ProphetKV (fused KV)",
         ("prophetkv@bf16", "plain"): "ProphetKV (plain KV)", ("cacheblend@bf16", "plain"): "CacheBlend",
         ("epic@bf16", "plain"): "EPIC", ("reuse@bf16", "plain"): "Full Reuse (plain KV)",
         ("reuse@bf16", "fused"): "Full Reuse (fused KV)", ("full@bf16", "none"): "Full Attention (bf16)"}
N_BOOT = 2000
GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)


def _ratio(value) -> float | str:
    return value if isinstance(value, str) else float(value)


def cells(records) -> dict[str, dict[tuple, dict[str, dict]]]:
    """dataset -> (method, kv, ratio) -> qid -> record."""
    out: dict[str, dict[tuple, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        out[r["dataset"]][(r["method"], r["kv"], _ratio(r["ratio"]))][r["qid"]] = r
    return out


def complete_questions(ds: dict[tuple, dict[str, dict]]) -> list[str]:
    """Questions every cell of the dataset answered (a stopped lane leaves its last question partial)."""
    qids = None
    for per_q in ds.values():
        qids = set(per_q) if qids is None else qids & set(per_q)
    return sorted(qids or [])


def agree(a: str | None, b: str | None) -> float:
    return float(a is not None and b is not None and normalize_answer(a) == normalize_answer(b))


def share(r: dict) -> float:
    if r.get("auto_share") is not None:
        return float(r["auto_share"])
    return float(r["recomputed_tokens"]) / max(1, int(r["ctx_tokens"]))


def cell_row(per_q: dict[str, dict], full: dict[str, dict], qids: list[str]) -> dict:
    ag = [agree(per_q[q]["answer"], full[q]["answer"]) for q in qids]
    ag32 = [agree(per_q[q]["answer"], per_q[q]["full_answer"]) for q in qids]
    row = {"n": len(qids)}
    for name, values in (("agreement", ag), ("agreement_fp32", ag32), ("f1", [per_q[q].get("f1") for q in qids]),
                         ("kl_first", [per_q[q]["kl_first_c"] for q in qids]),
                         ("kl_answer", [per_q[q]["kl_answer"] for q in qids]),
                         ("share", [share(per_q[q]) for q in qids]),
                         ("ttft_ms", [per_q[q]["ttft_ms"] for q in qids])):
        mean, lo, hi = bootstrap_ci(values, n_boot=N_BOOT)
        row[name], row[f"{name}_ci"] = mean, [lo, hi]
    return row


def ratio_of_means(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) / mean(b), paired bootstrap over questions (a ratio of means, never a mean of ratios)."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(x), size=(N_BOOT, len(x)))
    boots = x[idx].mean(1) / y[idx].mean(1)
    return float(x.mean() / y.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def matched(rows: dict[tuple, dict]) -> list[dict]:
    """Per curve method, the smallest ratio reaching each agreement level, each share of Full Attention's gold F1
    (the 2026 papers' "keeps X% of full-prefill accuracy") and the first-token KL level."""
    full_f1 = rows[FULL]["f1"]
    out = []
    for method, kv in CURVES:
        curve = sorted(((k[2], r) for k, r in rows.items() if k[:2] == (method, kv) and not isinstance(k[2], str)),
                       key=lambda t: t[0])
        if not curve:
            continue
        entry = {"method": NAMES[(method, kv)]}
        for level in LEVELS:
            hit = next(((ratio, r) for ratio, r in curve if r["agreement"] >= level), None)
            entry[f"agreement>={level:g}"] = None if hit is None else {
                "ratio": hit[0], "agreement": hit[1]["agreement"], "agreement_ci": hit[1]["agreement_ci"],
                "ttft_ms": hit[1]["ttft_ms"], "ttft_ms_ci": hit[1]["ttft_ms_ci"]}
        for level in LEVELS:
            hit = next(((ratio, r) for ratio, r in curve if r["f1"] >= level * full_f1), None)
            entry[f"f1>={level:g}xFA"] = None if hit is None else {
                "ratio": hit[0], "f1": hit[1]["f1"], "f1_ci": hit[1]["f1_ci"], "full_f1": full_f1,
                "ttft_ms": hit[1]["ttft_ms"], "ttft_ms_ci": hit[1]["ttft_ms_ci"]}
        hit = next(((ratio, r) for ratio, r in curve if r["kl_first"] <= KL_LEVEL), None)
        entry[f"kl_first<={KL_LEVEL:g}"] = None if hit is None else {
            "ratio": hit[0], "kl_first": hit[1]["kl_first"], "kl_first_ci": hit[1]["kl_first_ci"],
            "ttft_ms": hit[1]["ttft_ms"], "ttft_ms_ci": hit[1]["ttft_ms_ci"]}
        out.append(entry)
    return out


def same_share(ds: dict, auto_key: tuple, qids: list[str], mean_share: float) -> dict:
    """Auto's first-token and answer KL minus the fixed ratio's at auto's mean share: each question's fixed-ratio KL
    interpolated between the two measured ratios around that share (paired, bootstrap over questions)."""
    grid = [r for r in GRID if ("fusionrag@bf16", "fused", r) in ds]
    out: dict = {"share": mean_share}
    for metric in ("kl_first_c", "kl_answer"):
        fixed = [float(np.interp(mean_share, grid, [ds[("fusionrag@bf16", "fused", r)][q][metric] for r in grid]))
                 for q in qids]
        mean, lo, hi = bootstrap_diff_ci([ds[auto_key][q][metric] for q in qids], fixed, n_boot=N_BOOT)
        out[metric] = [mean, lo, hi]
    return out


def _mean_ttft(ttft: TTFTCurves, shares: list[float], context: int) -> float | None:
    """Mean TTFT of requests recomputing these shares at ``context`` tokens (FusionRAG's measured curve)."""
    values = [ttft.at("fusionrag@bf16", x, context) for x in shares]
    return None if any(v is None for v in values) else float(np.mean(values))


def with_ttft(entries: list[dict], ttft: TTFTCurves) -> list[dict]:
    """Each reached level's ratio timed at the bench's context lengths (the curve method's own selection)."""
    method_of = {NAMES[k]: k[0] for k in CURVES}
    for e in entries:
        for hit in e.values():
            if isinstance(hit, dict):
                hit["ttft_ms_at"] = {str(c): ttft.at(method_of[e["method"]], hit["ratio"], c) for c in ttft.contexts}
    return entries


def escalation(sig: dict, ds: dict, qids: list[str], ttft: TTFTCurves, context: int) -> list[dict]:
    """Simulated from measured cells: 15% for every question, then 30% (a second pass) for the share whose first
    token moved most, against a random choice of that share and the fixed ratio of the same mean TTFT."""
    moved = {r["qid"]: r["moved"] for r in sig["rows"] if r["qid"] in qids}
    keep = [q for q in qids if q in moved]
    if len(keep) < 5:
        return []
    kl = {r: {q: ds[("fusionrag@bf16", "fused", r)][q]["kl_first_c"] for q in keep} for r in GRID}
    t15, t30 = ttft.at("fusionrag@bf16", 0.15, context), ttft.at("fusionrag@bf16", 0.3, context)
    if t15 is None or t30 is None:
        return []
    ranked = sorted(keep, key=lambda q: -moved[q])
    fixed_t = [(r, ttft.at("fusionrag@bf16", r, context)) for r in GRID]
    fixed_kl = [(r, float(np.mean(list(kl[r].values())))) for r in GRID]
    out = []
    for share_ in (0.1, 0.2, 0.3, 0.5):
        up = set(ranked[: round(share_ * len(keep))])
        mean_t = t15 + len(up) / len(keep) * t30
        ratio = float(np.interp(mean_t, [t for _, t in fixed_t], [r for r, _ in fixed_t]))
        # had the second pass recomputed only the tokens it adds (not built: the KL is then an assumption)
        inc_t = t15 + len(up) / len(keep) * (t30 - t15)
        inc_ratio = float(np.interp(inc_t, [t for _, t in fixed_t], [r for r, _ in fixed_t]))
        out.append({"share": share_, "context": context, "ttft_ms": mean_t, "n": len(keep),
                    "ttft_ms_incremental": inc_t, "fixed_ratio_incremental": inc_ratio,
                    "kl_fixed_incremental": float(np.interp(inc_ratio, [r for r, _ in fixed_kl],
                                                            [k for _, k in fixed_kl])),
                    "kl_moved": float(np.mean([kl[0.3][q] if q in up else kl[0.15][q] for q in keep])),
                    "kl_random": float(np.mean([(1 - len(up) / len(keep)) * kl[0.15][q] + len(up) / len(keep)
                                                * kl[0.3][q] for q in keep])),
                    "fixed_ratio": ratio,
                    "kl_fixed": float(np.interp(ratio, [r for r, _ in fixed_kl], [k for _, k in fixed_kl]))})
    return out


def paired_vs(a: dict[str, dict], b: dict[str, dict], full: dict[str, dict], qids: list[str]) -> dict:
    """``a`` minus ``b`` on the same questions: agreement, first-token KL, share; TTFT as a ratio of means."""
    def diff(fa, fb):
        mean, lo, hi = bootstrap_diff_ci([fa(q) for q in qids], [fb(q) for q in qids], n_boot=N_BOOT)
        return [mean, lo, hi]
    return {"n": len(qids),
            "agreement": diff(lambda q: agree(a[q]["answer"], full[q]["answer"]),
                              lambda q: agree(b[q]["answer"], full[q]["answer"])),
            "kl_first": diff(lambda q: a[q]["kl_first_c"], lambda q: b[q]["kl_first_c"]),
            "kl_answer": diff(lambda q: a[q]["kl_answer"], lambda q: b[q]["kl_answer"]),
            "share": diff(lambda q: share(a[q]), lambda q: share(b[q])),
            "ttft_ratio_b_over_a": list(ratio_of_means([b[q]["ttft_ms"] for q in qids],
                                                       [a[q]["ttft_ms"] for q in qids]))}


def spearman_ci(x: list[float], y: list[float]) -> list[float] | None:
    """Spearman's rho with a percentile bootstrap interval over questions."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(xs) < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return None  # undefined: too few questions, or one side constant
    rho = float(spearmanr(xs, ys).statistic)
    rng = np.random.default_rng(0)
    boots = []
    for _ in range(N_BOOT):
        i = rng.integers(0, len(xs), len(xs))
        if np.ptp(xs[i]) > 0 and np.ptp(ys[i]) > 0:
            boots.append(spearmanr(xs[i], ys[i]).statistic)
    if not boots:
        return None
    return [rho, float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]


#: The TTFT bench's method for each curve (the same selection and pass whatever KV it reads).
TTFT_METHOD = {"fusionrag@bf16": "fusionrag", "prophetkv@bf16": "prophetkv", "cacheblend@bf16": "cacheblend",
               "epic@bf16": "epic", "full@bf16": "full", "reuse@bf16": "fusionrag"}


class TTFTCurves:
    """TTFT at the bench's context lengths (``results/ttft``: ``fusionrag bench ttft``, one thread, interleaved),
    per method and ratio, interpolated linearly in the ratio between measured ones."""

    def __init__(self, path: Path) -> None:
        self.rows = [r for r in json.loads(path.read_text())["rows"] if r.get("tier") in ("memory", "-")] \
            if path.is_file() else []
        self.contexts = sorted({int(r["context_tokens"]) for r in self.rows if r["method"] == "full"})

    def at(self, method: str, ratio: float, context: int) -> float | None:
        name = TTFT_METHOD.get(method, method)
        if name == "full" or ratio >= 1.0:
            pts = [(1.0, r["ttft_ms"]) for r in self.rows if r["method"] == "full" and r["context_tokens"] == context]
        else:
            pts = sorted((float(r["ratio"]), r["ttft_ms"]) for r in self.rows
                         if r["method"] == name and r["context_tokens"] == context)
        if not pts:
            return None
        xs, ys = zip(*pts, strict=True)
        return float(np.interp(ratio, xs, ys))


def summarize(records: list[dict], results: Path = RESULTS) -> dict:
    """The summary of ``records``, with the TTFT bench's and the signal study's files found in ``results``."""
    ttft = TTFTCurves(results / "ttft" / "ttft.json")
    out: dict = {"datasets": {}, "ttft_contexts": ttft.contexts}
    for dataset, ds in sorted(cells(records).items()):
        if FULL not in ds:
            continue
        qids = complete_questions(ds)
        if not qids:
            continue
        full = ds[FULL]
        rows = {k: cell_row(v, full, qids) for k, v in ds.items()}
        fixed = ("fusionrag@bf16", "fused", 0.15)
        autos = sorted(k for k in ds if k[0] == "fusionrag@bf16" and isinstance(k[2], str))
        auto_vs = {}
        for k in autos:
            vs_fixed = paired_vs(ds[k], ds[fixed], full, qids)
            # the fixed ratio nearest the auto cell's mean share: quality at the same mean recompute
            near = min((r for r in GRID if ("fusionrag@bf16", "fused", r) in ds),
                       key=lambda r: abs(r - rows[k]["share"]))
            auto_vs[k[2]] = {"vs_fixed_15": vs_fixed, "nearest_fixed": near,
                             "vs_nearest_fixed": paired_vs(ds[k], ds[("fusionrag@bf16", "fused", near)], full, qids),
                             "vs_fixed_at_same_share": same_share(ds, k, qids, rows[k]["share"])}
        peers = {}
        for ratio in GRID:
            a = ds.get(("fusionrag@bf16", "fused", ratio))
            for method, kv in CURVES[1:]:
                b = ds.get((method, kv, ratio))
                if a is not None and b is not None:
                    peers[f"{NAMES[(method, kv)]} @ {ratio:g}"] = paired_vs(a, b, full, qids)
        signal = {}
        if ("fusionrag@bf16", "fused", "auto") in ds and fixed in ds:
            chosen = [share(ds[("fusionrag@bf16", "fused", "auto")][q]) for q in qids]
            signal = {"spearman_share_vs_kl_first_at_15": spearman_ci(chosen,
                                                                      [ds[fixed][q]["kl_first_c"] for q in qids]),
                      "spearman_share_vs_kl_answer_at_15": spearman_ci(chosen,
                                                                       [ds[fixed][q]["kl_answer"] for q in qids]),
                      "spearman_share_vs_disagreement_at_15": spearman_ci(
                          chosen, [1.0 - agree(ds[fixed][q]["answer"], full[q]["answer"]) for q in qids])}
        signals = results / f"signals_{dataset}.json"
        sig = json.loads(signals.read_text()) if signals.is_file() else None
        if sig and ttft.contexts:
            sig["escalation"] = escalation(sig, ds, qids, ttft, max(ttft.contexts))
        out["datasets"][dataset] = {
            "signals": sig,
            "n": len(qids), "context_tokens_median": float(np.median([full[q]["ctx_tokens"] for q in qids])),
            "cells": [{"method": k[0], "kv": k[1], "ratio": k[2], **r} for k, r in sorted(rows.items(), key=str)],
            "matched": with_ttft(matched(rows), ttft), "auto": auto_vs, "fusionrag_minus_peers": peers,
            "signal": signal, "auto_ttft": {
                k[2]: {str(c): _mean_ttft(ttft, [share(ds[k][q]) for q in qids], c) for c in ttft.contexts}
                for k in autos}
            | {"fixed 15%": {str(c): ttft.at("fusionrag@bf16", 0.15, c) for c in ttft.contexts},
               "full": {str(c): ttft.at("full@bf16", 1.0, c) for c in ttft.contexts}}}
    return out


def _pct(x) -> str:
    return "-" if x is None else (x if isinstance(x, str) else f"{100 * x:.0f}%")


def _ci(v, ci, fmt="{:.3f}") -> str:
    return f"{fmt.format(v)} [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def markdown(summary: dict) -> str:
    lines = ["# Speed at matched quality: results", "",
             "qwen2.5-0.5b, **bf16** cells (as users run it on this CPU), one thread per lane, scored against the "
             "committed **fp32** Full Attention reference; agreement = exact match (normalised) of the greedy "
             "16-token answer with **Full Attention in bf16**. Paired over the questions every cell answered; "
             "95% bootstrap intervals. TTFT: the cells' own, ~1.8K-token contexts, one thread, beside another lane.",
             ""]
    for dataset, d in summary["datasets"].items():
        lines += [f"## {dataset} (n = {d['n']}, median context {d['context_tokens_median']:.0f} tokens)", "",
                  "| method | kv | ratio | recomputed | agreement | agreement with fp32 FA | gold F1 | "
                  "first-token KL | answer KL | TTFT ms |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in d["cells"]:
            lines.append(f"| {c['method']} | {c['kv']} | {_pct(c['ratio'])} | {c['share']:.1%} | "
                         f"{_ci(c['agreement'], c['agreement_ci'], '{:.2f}')} | {c['agreement_fp32']:.2f} | "
                         f"{c['f1']:.3f} | "
                         f"{_ci(c['kl_first'], c['kl_first_ci'])} | {c['kl_answer']:.3f} | {c['ttft_ms']:.0f} |")
        full_f1 = next(c["f1"] for c in d["cells"] if (c["method"], c["kv"]) == FULL[:2])
        lines += ["", "**Smallest ratio reaching each quality level** (agreement with Full Attention's answers; gold "
                  f"F1 as a share of Full Attention's, {full_f1:.3f}; first-token KL <= {KL_LEVEL:g}), with the "
                  "TTFT there at " + " / ".join(f"{c} tokens" for c in summary["ttft_contexts"]) + " (`bench ttft`, "
                  "one thread; Full Attention: " + " / ".join(
                      f"{v / 1000:.2f}" for v in d["auto_ttft"]["full"].values() if v is not None)
                  + " s; ratios tried: 5-90%):", "",
                  "| method | " + " | ".join(f"agreement >= {lv:g}" for lv in LEVELS) + " | "
                  + " | ".join(f"F1 >= {lv:g}x FA" for lv in LEVELS) + f" | KL <= {KL_LEVEL:g} |",
                  "|---|" + "---|" * (2 * len(LEVELS) + 1)]
        for m in d["matched"]:
            cols = []
            for key in [*(f"agreement>={lv:g}" for lv in LEVELS), *(f"f1>={lv:g}xFA" for lv in LEVELS),
                        f"kl_first<={KL_LEVEL:g}"]:
                hit = m[key]
                at = "" if hit is None else " / ".join(f"{v / 1000:.2f}" for v in hit["ttft_ms_at"].values()
                                                       if v is not None)
                cols.append("not reached" if hit is None else f"{_pct(hit['ratio'])} ({at or '-'} s)")
            lines.append(f"| {m['method']} | " + " | ".join(cols) + " |")
        if d["auto"]:
            lines += ["", "**ratio=\"auto\"** (paired; `auto` = the store's calibration, `auto:M` = attention mass M):",
                      "", "| cell | mean recomputed | minus fixed 15%: agreement | first-token KL | TTFT fixed 15% / "
                      "auto | vs the fixed ratio nearest its share: agreement | first-token KL | minus the fixed "
                      "curve at its mean share: first-token KL | answer KL |",
                      "|---|---|---|---|---|---|---|---|---|"]
            rows = {(c["method"], c["kv"], c["ratio"]): c for c in d["cells"]}
            for k, a in d["auto"].items():
                v, w, x = a["vs_fixed_15"], a["vs_nearest_fixed"], a["vs_fixed_at_same_share"]
                lines.append(f"| {k} | {rows[('fusionrag@bf16', 'fused', k)]['share']:.1%} | "
                             f"{_ci(v['agreement'][0], v['agreement'][1:], '{:+.2f}')} | "
                             f"{_ci(v['kl_first'][0], v['kl_first'][1:], '{:+.3f}')} | "
                             f"{_ci(v['ttft_ratio_b_over_a'][0], v['ttft_ratio_b_over_a'][1:], '{:.2f}x')} | "
                             f"{_pct(a['nearest_fixed'])}: {_ci(w['agreement'][0], w['agreement'][1:], '{:+.2f}')} | "
                             f"{_ci(w['kl_first'][0], w['kl_first'][1:], '{:+.3f}')} | "
                             f"{_ci(x['kl_first_c'][0], x['kl_first_c'][1:], '{:+.3f}')} | "
                             f"{_ci(x['kl_answer'][0], x['kl_answer'][1:], '{:+.3f}')} |")
        if d["auto"] and summary["ttft_contexts"]:
            lines += ["", "Mean TTFT at " + " / ".join(f"{c}" for c in summary["ttft_contexts"]) + " tokens of "
                      "requests recomputing the shares each cell chose (FusionRAG's measured TTFT curve, per "
                      "question's share): " + "; ".join(
                          f"{k} " + " / ".join(f"{v / 1000:.2f}" for v in t.values() if v is not None) + " s"
                          for k, t in d["auto_ttft"].items())]
        if d["signal"]:
            s = {k.split("_vs_")[1].removesuffix("_at_15"): "undefined" if v is None else _ci(v[0], v[1:], "{:+.2f}")
                 for k, v in d["signal"].items()}
            lines += ["", "**The signal** (Spearman over questions: the share `auto` chose vs the fixed 15%'s distance "
                      f"from Full Attention on the same question): first-token KL {s['kl_first']}, answer KL "
                      f"{s['kl_answer']}, disagreement {s['disagreement']}."]
        sig = d.get("signals")
        if sig:
            r = {k: "undefined" if v is None else _ci(v[0], v[1:], "{:+.2f}")
                 for k, v in sig["spearman_vs_kl_first_at_15"].items()}
            lines += ["", f"**Signals an engine can read** (`signals.py`, n = {sig['n']}; Spearman against the fixed "
                      f"15%'s first-token KL per question): the share `auto` chose (mass {sig['store_mass']:g}) "
                      f"{r['auto_share']}; how far recomputing 15% moved the first token from Full Reuse's "
                      f"(KL(p_15 || p_reuse), a second pass online) {r['moved']}."]
            if sig.get("escalation"):
                lines += ["", "*What a settle check could buy* (simulated from the measured cells of the same "
                          "questions, not run as one policy): recompute 15%, then 30% for the share of questions "
                          "whose first token moved most; mean first-token KL with that signal choosing, with a "
                          "random choice of the same share, and the fixed ratio of the same mean TTFT at "
                          f"{sig['escalation'][0]['context']} tokens (FusionRAG's measured curve); "
                          f"n = {sig['escalation'][0]['n']}, means without intervals:", "",
                          "| escalated | mean TTFT s | KL, moved picks | KL, random picks | fixed ratio of that TTFT "
                          "| its KL | had pass 2 recomputed only what it adds: TTFT s, fixed ratio, its KL |",
                          "|---|---|---|---|---|---|---|"]
                for e in sig["escalation"]:
                    lines.append(f"| {e['share']:.0%} | {e['ttft_ms'] / 1000:.2f} | {e['kl_moved']:.3f} | "
                                 f"{e['kl_random']:.3f} | {e['fixed_ratio']:.0%} | {e['kl_fixed']:.3f} | "
                                 f"{e['ttft_ms_incremental'] / 1000:.2f}, {e['fixed_ratio_incremental']:.0%}, "
                                 f"{e['kl_fixed_incremental']:.3f} |")
        if d["fusionrag_minus_peers"]:
            lines += ["", "**FusionRAG minus each peer at the same ratio** (agreement | first-token KL):", "",
                      "| peer @ ratio | n | agreement | first-token KL |", "|---|---|---|---|"]
            for name, p in d["fusionrag_minus_peers"].items():
                lines.append(f"| {name} | {p['n']} | {_ci(p['agreement'][0], p['agreement'][1:], '{:+.2f}')} | "
                             f"{_ci(p['kl_first'][0], p['kl_first'][1:], '{:+.3f}')} |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(summary["datasets"])
    fig, axes = plt.subplots(2, len(datasets), figsize=(6.5 * len(datasets), 8.5), squeeze=False)
    for j, dataset in enumerate(datasets):
        cells_ = summary["datasets"][dataset]["cells"]
        for i, (metric, label) in enumerate((("agreement", "agreement with Full Attention (bf16)"),
                                             ("kl_first", "first-token KL to fp32 Full Attention"))):
            ax = axes[i][j]
            for method, kv in CURVES:
                pts = sorted((c for c in cells_ if (c["method"], c["kv"]) == (method, kv)
                              and not isinstance(c["ratio"], str)), key=lambda c: c["share"])
                if pts:
                    ax.plot([100 * c["share"] for c in pts], [c[metric] for c in pts], marker="o",
                            label=NAMES[(method, kv)])
            for (method, kv), marker in ((("reuse@bf16", "plain"), "x"), (("reuse@bf16", "fused"), "+")):
                ref = next((c for c in cells_ if (c["method"], c["kv"]) == (method, kv)), None)
                if ref is not None:
                    ax.plot([0], [ref[metric]], marker=marker, ms=10, ls="none", color="black",
                            label=NAMES[(method, kv)])
            autos = sorted((c for c in cells_ if c["method"] == "fusionrag@bf16" and isinstance(c["ratio"], str)),
                           key=lambda c: c["share"])
            if autos:
                ax.plot([100 * c["share"] for c in autos], [c[metric] for c in autos], marker="*", ls="--",
                        ms=10, label='FusionRAG ratio="auto" (masses)')
            ax.set_xlabel("mean share of the context recomputed (%)")
            ax.set_ylabel(label)
            ax.set_title(f"{dataset} (n = {summary['datasets'][dataset]['n']})")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle("Speed at matched quality: qwen2.5-0.5b, bf16, one thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    results = Path(args.results)
    records = list(read_records(results / "records.jsonl").values())
    summary = summarize(records, results)
    summary["command"] = ("bash studies/matched_quality/run.sh LANE; "
                          ".venv/bin/python -m studies.matched_quality.summarize")
    write_json_atomic(results / "summary.json", summary)
    atomic_write(results / "summary.md", markdown(summary))
    plot(summary, results / "matched_quality.png")
    print(f"wrote {results}/summary.json, summary.md, matched_quality.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
