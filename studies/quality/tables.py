"""The curated tables of docs/results/README.md, generated from a quality results.json.

`results.md` (written by `fusionrag bench report`) has every row; the README shows a
selection side by side (the 15% methods with TTFT speed-ups, the paired differences, the
method x ratio matrix). Generating them keeps the README's numbers equal to the JSON.

Usage: .venv/bin/python studies/quality/tables.py studies/quality/results/main > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fusionrag.bench.metrics import bootstrap_diff_ci
from fusionrag.bench.report import diff_cell

NAMES = {"triviaqa": "TriviaQA", "hotpotqa": "HotpotQA", "2wikimqa": "2WikiMQA", "musique": "MuSiQue"}
ORDER = ["triviaqa", "hotpotqa", "2wikimqa", "musique"]
AT_15 = [  # (label, method, kv, ratio)
    ("Full Reuse (plain KV)", "reuse", "plain", 0.0),
    ("Full Reuse (fused KV)", "reuse", "fused", 0.0),
    ("CacheBlend", "cacheblend", "plain", 0.15),
    ("Cache-Craft", "cachecraft", "plain", 0.15),
    ("EPIC", "epic", "plain", 0.15),
    ("query-guided on plain KV", "query", "plain", 0.15),
    ("**FusionRAG**", "fusionrag", "fused", 0.15),
    ("CacheBlend (fused KV)", "cacheblend", "fused", 0.15),
    ("Cache-Craft (fused KV)", "cachecraft", "fused", 0.15),
    ("EPIC (fused KV)", "epic", "fused", 0.15),
]
BASELINES = [  # (label, baseline, baseline_kv) for FusionRAG 15% minus ...
    ("CacheBlend", "cacheblend", "plain"),
    ("Cache-Craft", "cachecraft", "plain"),
    ("EPIC", "epic", "plain"),
    ("same selection on plain KV (offline stage off)", "query", "plain"),
    ("Full Reuse on fused KV", "reuse", "fused"),
    ("Full Reuse (plain)", "reuse", "plain"),
    ("CacheBlend on fused KV", "cacheblend", "fused"),
]
MATRIX = [("FusionRAG", "fusionrag", "fused"), ("query (plain KV)", "query", "plain"),
          ("CacheBlend", "cacheblend", "plain"), ("CacheBlend (fused)", "cacheblend", "fused"),
          ("Cache-Craft", "cachecraft", "plain"), ("Cache-Craft (fused)", "cachecraft", "fused"),
          ("EPIC", "epic", "plain"), ("EPIC (fused)", "epic", "fused")]
RATIOS = [0.05, 0.1, 0.15, 0.3]


def _ci(row: dict, key: str) -> str:
    lo, hi = row.get(f"{key}_ci") or (None, None)
    return f"{row[key]:.2f} [{lo:.2f}, {hi:.2f}]" if lo is not None else f"{row[key]:.2f}"


def _diff(c: dict, key: str) -> str:
    return diff_cell(c, key, digits=2)


def _gold_gaps(folder: Path) -> dict[str, str]:
    """Paired Full Attention minus plain Full Reuse gold F1 per dataset, from records.jsonl.

    The per-method intervals overlap everywhere; pairing by question is the test of whether
    this model's gold answers can rank methods at all (normalised F1's denominator).
    """
    f1: dict[str, dict[str, dict[str, float]]] = {}  # dataset -> qid -> side -> F1
    for line in (folder / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        side = {("full", "none"): "full", ("reuse", "plain"): "reuse"}.get((r["method"], r["kv"]))
        if side:
            f1.setdefault(r["dataset"], {}).setdefault(r["qid"], {})[side] = r["f1"]
    gaps = {}
    for d, by_qid in f1.items():
        pairs = [v for v in by_qid.values() if len(v) == 2]
        mean, lo, hi = bootstrap_diff_ci([v["full"] for v in pairs], [v["reuse"] for v in pairs])
        gaps[d] = diff_cell({"f1_diff": mean, "f1_diff_ci": [lo, hi]}, "f1", digits=2)
    return gaps


def main(folder: Path) -> None:
    doc = json.loads((folder / "results.json").read_text())
    rows, comps = doc["rows"], doc.get("comparisons", [])
    main_rows = [r for r in rows if r.get("top_n") in (0, 10)]
    by = {(r["dataset"], r["method"], r["kv"], round(r["ratio"], 3)): r for r in main_rows}
    datasets = [d for d in ORDER if any(r["dataset"] == d for r in rows)]

    gaps = _gold_gaps(folder)
    print("### Gold F1\n")
    print("| dataset (n) | FA F1 [95% CI] | Full Reuse F1 [95% CI] | FA - FR, paired | FA EM | FR EM "
          "| FusionRAG 15% F1 | CacheBlend 15% F1 | Cache-Craft 15% F1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in datasets:
        fa, fr = by[(d, "full", "none", 1.0)], by[(d, "reuse", "plain", 0.0)]
        cells = [by.get((d, m, k, 0.15)) for m, k in (("fusionrag", "fused"), ("cacheblend", "plain"),
                                                         ("cachecraft", "plain"))]
        print(f"| {NAMES[d]} ({fa['n']}) | {_ci(fa, 'f1')} | {_ci(fr, 'f1')} | {gaps.get(d, '-')} "
              f"| {fa['em']:.2f} | {fr['em']:.2f} | "
              + " | ".join(f"{c['f1']:.2f}" if c else "-" for c in cells) + " |")

    print("\n### Fidelity at 15%\n")
    print("| dataset (n, ctx tokens) | method | agree F1 [95% CI] | first-token KL [95% CI] | top-1 "
          "| TTFT (1 thread) |")
    print("|---|---|---|---|---|---|")
    for d in datasets:
        fa = by[(d, "full", "none", 1.0)]
        fa_t = fa.get("ttft_ms_median")
        first = True
        for label, m, k, ratio in AT_15:
            r = by.get((d, m, k, ratio))
            if r is None:
                continue
            head = f"{NAMES[d]} ({r['n']}, {r['ctx_tokens']:,.0f})" if first else ""
            first = False
            t = r.get("ttft_ms_median")
            ttft = f"{t / 1000:.1f} s" + (f" ({fa_t / t:.1f}x)" if fa_t and t else "") if t else "-"
            print(f"| {head} | {label} | {_ci(r, 'agree_f1')} | {_ci(r, 'kl_first')} | {r['top1_agree']:.2f} "
                  f"| {ttft} |")
        fa_txt = f"{fa_t / 1000:.1f} s (median of {fa['ttft_n']})" if fa_t else "- (all from the cache)"
        print(f"| | Full Attention | 1 | 0 | 1 | {fa_txt} |")

    print("\n### Paired: FusionRAG 15% minus each baseline\n")
    print("| dataset (n) | FusionRAG 15% minus | agree F1 | KL | top-1 |")
    print("|---|---|---|---|---|")
    for d in datasets:
        first = True
        for label, b, bk in BASELINES:
            c = next((c for c in comps if c["dataset"] == d and c["method"] == "fusionrag" and c["ratio"] == 0.15
                      and c["baseline"] == b and c["baseline_kv"] == bk and c.get("top_n", 10) == 10
                      and (b == "reuse" or c["baseline_ratio"] == 0.15)), None)
            if c is None:
                continue
            head = f"{NAMES[d]} ({c['n']})" if first else ""
            first = False
            print(f"| {head} | {label} | {_diff(c, 'agree_f1')} | {_diff(c, 'kl_first')} | {_diff(c, 'top1_agree')} |")

    print("\n### Offline stage alone: Full Reuse fused minus plain KV\n")
    print("| dataset (n) | agree F1 | KL | top-1 |")
    print("|---|---|---|---|")
    for d in datasets:
        c = next((c for c in comps if c["dataset"] == d and c["method"] == "reuse" and c["kv"] == "fused"
                  and c["baseline"] == "reuse" and c["baseline_kv"] == "plain" and c.get("top_n", 10) == 10), None)
        if c:
            print(f"| {NAMES[d]} ({c['n']}) | {_diff(c, 'agree_f1')} | {_diff(c, 'kl_first')} "
                  f"| {_diff(c, 'top1_agree')} |")

    matrices = []
    for d in datasets:
        lines = []
        for label, m, k in MATRIX:
            cells = [by.get((d, m, k, x)) for x in RATIOS]
            if sum(c is not None for c in cells) < 2:  # a single ratio is no curve
                continue
            n = min(c["n"] for c in cells if c)
            lines.append(f"| {label} | {n} | " + " | ".join(
                f"{c['agree_f1']:.2f} / {c['kl_first']:.2f}" if c else "-" for c in cells) + " |")
        if lines:
            matrices.append((d, lines))
    if matrices:
        print("\n### Method x ratio: agreement F1 / first-token KL at 5% / 10% / 15% / 30%\n")
    for d, lines in matrices:
        fr = by[(d, "reuse", "plain", 0.0)]
        frf = by.get((d, "reuse", "fused", 0.0))
        print(f"**{NAMES[d]}** (0%: Full Reuse {fr['agree_f1']:.2f} / {fr['kl_first']:.2f} plain"
              + (f", {frf['agree_f1']:.2f} / {frf['kl_first']:.2f} fused" if frf else "") + ")\n")
        print("| method | n | " + " | ".join(f"{x:.0%}" for x in RATIOS) + " |")
        print("|---|---|" + "---|" * len(RATIOS))
        print("\n".join(lines))
        print()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "studies/quality/results/main"))
