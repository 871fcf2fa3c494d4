"""The newest peers' section of the paper-shaped study's summary: FusionRAG against ProphetKV and APE.

Called by ``studies/paper/summarize.py`` with the study's cells (``(dataset, method, kv, ratio) ->
{qid: record}``); returns Markdown lines and the JSON part, and draws ``peers_at_15pct.png``.
Every number is a paired difference over the questions both cells answered (95% bootstrap), with n.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fusionrag.bench.records import read_records
from fusionrag.files import atomic_write_with

METRICS = ("kl_first_c", "kl_answer", "gold_nll")
LABELS = {"kl_first_c": "first-token KL", "kl_answer": "answer KL", "gold_nll": "gold NLL"}
FUSIONRAG = ("fusionrag", "fused", 0.15)
QUERY = ("query", "plain", 0.15)  # FusionRAG's selection on plain KV (the offline stage off)
#: (label, minuend cell, subtrahend cell): what each comparison asks.
COMPARISONS = [
    ("FusionRAG 15% - ProphetKV 15% (both fused KV)", FUSIONRAG, ("prophetkv", "fused", 0.15)),
    ("FusionRAG 15% - ProphetKV 15% plain", FUSIONRAG, ("prophetkv", "plain", 0.15)),
    ("FusionRAG's selection - ProphetKV's, plain KV, 15%", QUERY, ("prophetkv", "plain", 0.15)),
    ("FusionRAG 15% - APE plain (0%)", FUSIONRAG, ("ape", "plain", 0.0)),
    ("FusionRAG 15% - APE fused (0%)", FUSIONRAG, ("ape", "fused", 0.0)),
    ("APE plain - Full Reuse plain (APE's correction alone)", ("ape", "plain", 0.0), ("reuse", "plain", 0.0)),
    ("APE fused - Full Reuse fused", ("ape", "fused", 0.0), ("reuse", "fused", 0.0)),
]
CURVE = [(f"FusionRAG {r:.0%} - ProphetKV {r:.0%} ({kv} KV)", ("fusionrag" if kv == "fused" else "query", kv, r),
          ("prophetkv", kv, r)) for kv in ("fused", "plain") for r in (0.05, 0.3)]


def peers_section(cs: dict, datasets: list[str], paired: Callable, fmt: Callable, mean_cell: Callable,
                  root: Path) -> tuple[list[str], dict]:
    out: dict = {"comparisons": {}, "targets": {}}
    lines = ["## The newest peers: ProphetKV (ICML 2026) and APE (ICLR 2025)", "",
             "Same stores, questions and Full Attention reference as the cells above (`bash studies/paper/run.sh "
             "p1` / `p2`). ProphetKV: the question's attention over the reused context averaged over every layer "
             "(`fusionrag.online.policies.ProphetKV`); APE: chunks in parallel after S, its temperature 0.9 and "
             "scale 0.9 (the authors' released default), no recompute. Paired differences (**bold**: the 95% "
             "interval excludes 0; < 0 = closer to Full Attention / gold more likely for the first cell).", ""]
    for label, a, b in COMPARISONS + CURVE:
        rows = {}
        for ds in datasets:
            ca, cb = cs.get((ds, *a), {}), cs.get((ds, *b), {})
            if ca and cb:
                rows[ds] = {m: paired(ca, cb, m) for m in METRICS}
        if rows:
            out["comparisons"][label] = rows
    for metric in METRICS:
        lines += [f"### {LABELS[metric]}", "", "| comparison | " + " | ".join(datasets) + " |",
                  "|---|" + "---|" * len(datasets)]
        for label, rows in out["comparisons"].items():
            lines.append(f"| {label} | " + " | ".join(fmt(rows.get(ds, {}).get(metric)) for ds in datasets) + " |")
        lines.append("")
    lines += ["Means (first-token KL / answer KL / gold NLL, n):", ""]
    for ds in datasets:
        parts = []
        for cell in (FUSIONRAG, QUERY, ("prophetkv", "fused", 0.15), ("prophetkv", "plain", 0.15),
                     ("ape", "plain", 0.0), ("ape", "fused", 0.0), ("reuse", "plain", 0.0), ("reuse", "fused", 0.0)):
            c = cs.get((ds, *cell), {})
            if c:
                means = [mean_cell(c, m) for m in METRICS]
                parts.append(f"{cell[0]} {cell[1]} {cell[2]:.0%}: " + " / ".join(
                    "n/a" if v is None else f"{v['mean']:.3f}" for v in means) + f" (n={len(c)})")
        lines.append(f"- {ds}: " + "; ".join(parts))
    lines.append("")
    out["targets"] = targets(out["comparisons"], datasets)
    lines += ["Targets: " + "; ".join(f"{k}: {v}" for k, v in out["targets"].items()), ""]
    sec, out["ape_sweep"] = sweep_section(root / "peers" / "results" / "ape_sweep" / "records.jsonl", cs, paired, fmt,
                                          mean_cell)
    lines += sec
    plot_peers(out["comparisons"], datasets, root / "paper" / "results" / "peers_at_15pct.png")
    lines += ["Plot: `peers_at_15pct.png` (FusionRAG 15% minus each peer, per dataset, 95% intervals).", ""]
    return lines, out


def targets(comparisons: dict, datasets: list[str]) -> dict[str, str]:
    """The issue's two targets, read off the paired first-token and answer KL."""
    def below(label: str, metric: str) -> list[str]:
        rows = comparisons.get(label, {})
        return [ds for ds in datasets if rows.get(ds, {}).get(metric) and rows[ds][metric]["resolved"]
                and rows[ds][metric]["diff"] < 0]

    pk = below("FusionRAG 15% - ProphetKV 15% (both fused KV)", "kl_first_c")
    ape = {kv: {m: below(f"FusionRAG 15% - APE {kv} (0%)", m) for m in ("kl_first_c", "kl_answer")}
           for kv in ("plain", "fused")}
    ape_all = all(len(v) == len(datasets) for per in ape.values() for v in per.values())
    return {
        "FusionRAG 15% first-token KL resolved below ProphetKV 15% (same fused KV) on >= 2 of 3":
            f"{'met' if len(pk) >= 2 else 'MISSED'} ({len(pk)} of {len(datasets)}: {', '.join(pk) or 'none'})",
        "FusionRAG 15% resolved below APE (plain and fused) in first-token and answer KL on all":
            ("met" if ape_all else "MISSED") + " (" + "; ".join(
                f"APE {kv} {LABELS[m]}: {len(v)} of {len(datasets)}" for kv, per in ape.items()
                for m, v in per.items()) + ")",
    }


def sweep_section(path: Path, cs: dict, paired: Callable, fmt: Callable,
                  mean_cell: Callable) -> tuple[list[str], dict]:
    """APE's short sweep (2WikiMQA's first 20 dev questions, plain KV): each setting's means and its paired
    difference from Full Reuse on plain KV (what APE's correction alone buys)."""
    if not path.exists():
        return [], {}
    recs = list(read_records(path).values())
    by: dict[str, dict] = {}
    for r in recs:
        by.setdefault(r["method"], {})[r["qid"]] = r
    ds = recs[0]["dataset"] if recs else ""
    reuse = cs.get((ds, "reuse", "plain", 0.0), {})
    out: dict = {}
    lines = [f"### APE's sweep ({ds}, the first {max(map(len, by.values()), default=0)} questions, plain KV)", "",
             "| setting | first-token KL | answer KL | gold NLL | minus Full Reuse plain: first-token KL | "
             "answer KL | gold NLL |", "|---|---|---|---|---|---|---|"]
    for name in sorted(by):
        c = by[name]
        means = {m: mean_cell(c, m) for m in METRICS}
        diffs = {m: paired(c, reuse, m) for m in METRICS}
        out[name] = {"mean": means, "minus_reuse_plain": diffs}
        lines.append(f"| {name} | " + " | ".join("n/a" if means[m] is None else f"{means[m]['mean']:.3f}"
                                                 for m in METRICS) + " | "
                     + " | ".join(fmt(diffs[m]) for m in METRICS) + " |")
    lines.append("")
    return lines, out


def plot_peers(comparisons: dict, datasets: list[str], path: Path) -> None:
    """FusionRAG 15% minus each peer at 15% / 0%, one panel per metric, a group of bars per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _, _ in COMPARISONS[:5] if label in comparisons]
    if not labels:
        return
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5.2 * len(METRICS), 4.6), squeeze=False)
    width = 0.8 / len(labels)
    for ax, metric in zip(axes[0], METRICS, strict=True):
        for i, label in enumerate(labels):
            xs, ys, err = [], [], [[], []]
            for j, ds in enumerate(datasets):
                d = comparisons[label].get(ds, {}).get(metric)
                if d is None:
                    continue
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                ys.append(d["diff"])
                err[0].append(d["diff"] - d["ci"][0])
                err[1].append(d["ci"][1] - d["diff"])
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=label.replace("FusionRAG 15% - ", "minus "))
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel(f"FusionRAG 15% minus peer: {LABELS[metric]}")
        ax.set_title(f"{LABELS[metric]} (< 0: FusionRAG closer / better)")
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("FusionRAG 15% against ProphetKV and APE (qwen2.5-0.5b, n = 100 per dataset, paired)")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
