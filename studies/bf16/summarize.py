"""Summary of the bf16 study: FusionRAG 15% computed in bfloat16 minus float32, first-token KL to
the float32 Full Attention reference, paired by question.

Reads studies/bf16/results/records.jsonl (the `fusionrag@bf16` cells and the float32 control run on the same
store and code) and studies/paper/results/records.jsonl (the committed float32 `fusionrag` cells); writes
studies/bf16/results/summary.json, summary.md and bf16_minus_fp32.png. Every difference is paired by
question (bootstrap over questions, 95%: fusionrag.bench.metrics.bootstrap_diff_ci); resolved = the
interval excludes 0.

    .venv/bin/python studies/bf16/summarize.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fusionrag.bench.metrics import bootstrap_ci, bootstrap_diff_ci
from fusionrag.bench.records import read_records
from fusionrag.files import atomic_write, atomic_write_with, write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
#: The cells compared: (label, records folder key, method name in the records).
BF16 = ("bf16", "fusionrag@bf16")
FP32 = ("fp32", "fusionrag")  # the float32 control: same store, same code, same run
COMMITTED = ("fp32 committed", "fusionrag")  # studies/paper's committed float32 records
KV, RATIO = "fused", 0.15
METRICS = ("kl_first_c", "top1_agree", "kl_answer")
LABELS = {"kl_first_c": "first-token KL to fp32 FA (top-128)", "top1_agree": "same first token as FA",
          "kl_answer": "KL along FA's answer"}


def cell(records: dict, method: str) -> dict[str, dict[str, dict]]:
    """Per dataset, the records of ``method`` on fused KV at 15%, by question."""
    out: dict[str, dict[str, dict]] = {}
    for r in records.values():
        if r["method"] == method and r["kv"] == KV and abs(float(r["ratio"]) - RATIO) < 1e-9:
            out.setdefault(r["dataset"], {})[r["qid"]] = r
    return out


def mean(c: dict[str, dict], metric: str, qids: list[str]) -> dict | None:
    vals = [c[q][metric] for q in qids if q in c and c[q].get(metric) is not None]
    if not vals:
        return None
    m, lo, hi = bootstrap_ci(vals)
    return {"mean": m, "ci": [lo, hi], "n": len(vals)}


def paired(a: dict[str, dict], b: dict[str, dict], metric: str, qids: list[str]) -> dict | None:
    qs = [q for q in qids if q in a and q in b and a[q].get(metric) is not None and b[q].get(metric) is not None]
    if not qs:
        return None
    diff, lo, hi = bootstrap_diff_ci([a[q][metric] for q in qs], [b[q][metric] for q in qs])
    return {"diff": diff, "ci": [lo, hi], "n": len(qs), "resolved": bool(lo > 0 or hi < 0)}


def per_question(by: dict[str, dict[str, dict]], qids: list[str]) -> dict:
    """How far single questions move: |bf16 - fp32| first-token KL (median, max), first tokens that flip, and
    the reproduction's largest gap; the cells' median TTFT (niced runs on a shared core: not a timing study)."""
    import statistics

    bf, fp, old = by[BF16[0]], by[FP32[0]], by[COMMITTED[0]]

    def gaps(a: dict, b: dict) -> list[float]:
        return [abs(a[q]["kl_first_c"] - b[q]["kl_first_c"]) for q in qids if q in a and q in b
                and a[q].get("kl_first_c") is not None and b[q].get("kl_first_c") is not None]

    bf_fp = gaps(bf, fp)
    repro = gaps(fp, old)

    def ttft(c: dict) -> float | None:
        vals = [c[q]["ttft_ms"] for q in qids if q in c and c[q].get("ttft_ms") is not None]
        return statistics.median(vals) if vals else None

    return {"kl_first_c_abs_bf16_minus_fp32_median": statistics.median(bf_fp) if bf_fp else None,
            "kl_first_c_abs_bf16_minus_fp32_max": max(bf_fp) if bf_fp else None,
            "top1_agree_flips_bf16_vs_fp32": sum(bf[q]["top1_agree"] != fp[q]["top1_agree"]
                                                 for q in qids if q in bf and q in fp),
            "kl_first_c_abs_fp32_minus_fp32_committed_max": max(repro) if repro else None,
            "ttft_ms_median": {k: ttft(c) for k, c in by.items()}}


def fmt_mean(d: dict | None, digits: int = 4) -> str:
    return "n/a" if d is None else f"{d['mean']:.{digits}f} [{d['ci'][0]:.{digits}f}, {d['ci'][1]:.{digits}f}]"


def fmt_diff(d: dict | None, digits: int = 4) -> str:
    if d is None:
        return "n/a"
    text = f"{d['diff']:+.{digits}f} [{d['ci'][0]:+.{digits}f}, {d['ci'][1]:+.{digits}f}]"
    return f"**{text}**" if d["resolved"] else text


def summarize(bf16_dir: Path, paper_dir: Path) -> dict:
    mine = read_records(bf16_dir / "records.jsonl")
    paper = read_records(paper_dir / "records.jsonl")
    cells = {BF16[0]: cell(mine, BF16[1]), FP32[0]: cell(mine, FP32[1]), COMMITTED[0]: cell(paper, COMMITTED[1])}
    datasets: dict[str, dict] = {}
    groups = {ds: sorted(cells[BF16[0]][ds]) for ds in sorted(cells[BF16[0]])}
    for ds, qids in [*groups.items(), ("pooled", None)]:
        if qids is None:  # both datasets, each question once (ids are per dataset)
            if len(groups) < 2:
                continue
            by = {k: {f"{d}/{q}": r for d in groups for q, r in v.get(d, {}).items()} for k, v in cells.items()}
            qids = sorted(by[BF16[0]])
        else:
            by = {k: v.get(ds, {}) for k, v in cells.items()}
        row: dict = {"n": len(qids), "questions": qids if ds != "pooled" else None}
        for m in METRICS:
            row[m] = {k: mean(c, m, qids) for k, c in by.items()}
            row[f"{m}_bf16_minus_fp32"] = paired(by[BF16[0]], by[FP32[0]], m, qids)
            row[f"{m}_bf16_minus_fp32_committed"] = paired(by[BF16[0]], by[COMMITTED[0]], m, qids)
            row[f"{m}_fp32_minus_fp32_committed"] = paired(by[FP32[0]], by[COMMITTED[0]], m, qids)
        row["per_question"] = per_question(by, qids)
        datasets[ds] = row
    return {"question": "FusionRAG 15% in bfloat16 minus float32: first-token KL to the float32 Full Attention "
                        "reference, paired by question",
            "cell": {"method": "fusionrag (fused KV, corpus top-10 neighbours)", "ratio": RATIO,
                     "model": "qwen2.5-0.5b", "kv_dtype": "float16"},
            "datasets": datasets}


def markdown(summary: dict) -> list[str]:
    lines = ["# bf16 minus fp32: FusionRAG 15%, first-token KL to the fp32 Full Attention reference", "",
             "qwen2.5-0.5b, FusionRAG 15% on fused KV (corpus top-10 neighbours, float16 store KV built in float32), "
             "the first 50 questions of each dataset, 10 passages per question, a 100-question knowledge base. "
             "`bf16` = the cells computed in bfloat16 (`fusionrag@bf16`), `fp32` = the same cells in float32 "
             "on the same store and code (this folder), `fp32 committed` = studies/paper's float32 records of the "
             "same questions. Means with 95% bootstrap intervals; differences paired by question (bootstrap "
             "over questions, 95%); **bold** = resolved (the interval excludes 0).", ""]
    ds_rows = summary["datasets"]
    for m in METRICS:
        lines += [f"## {LABELS[m]} (`{m}`)", "",
                  "| dataset | n | fp32 committed | fp32 | bf16 | bf16 - fp32 | bf16 - fp32 committed | "
                  "fp32 - fp32 committed |", "|---|---|---|---|---|---|---|---|"]
        for ds, row in ds_rows.items():
            means = row[m]
            lines.append(f"| {ds} | {row['n']} | {fmt_mean(means[COMMITTED[0]])} | {fmt_mean(means[FP32[0]])} | "
                         f"{fmt_mean(means[BF16[0]])} | {fmt_diff(row[f'{m}_bf16_minus_fp32'])} | "
                         f"{fmt_diff(row[f'{m}_bf16_minus_fp32_committed'])} | "
                         f"{fmt_diff(row[f'{m}_fp32_minus_fp32_committed'])} |")
        lines.append("")
    verdicts = []
    for ds, row in ds_rows.items():
        for key, against in (("kl_first_c_bf16_minus_fp32", "fp32"),
                             ("kl_first_c_bf16_minus_fp32_committed", "fp32 committed")):
            d = row[key]
            if d is None:
                continue
            word = ("resolved loss" if d["diff"] > 0 else "resolved gain") if d["resolved"] else "not resolved"
            verdicts.append(f"- {ds}, bf16 - {against}: {fmt_diff(d)} (n={d['n']}): {word}")
    lines += ["## Target: no resolved loss in first-token KL, or the loss with its interval", "",
              *verdicts, "", "## Single questions", "",
              "| dataset | n | median / max \\|bf16 - fp32\\| first-token KL | questions whose same-first-token-as-FA "
              "flips (bf16 vs fp32) | max \\|fp32 - fp32 committed\\| | median TTFT ms fp32 committed / fp32 / bf16 |",
              "|---|---|---|---|---|---|"]
    for ds, row in ds_rows.items():
        pq = row["per_question"]
        t = pq["ttft_ms_median"]
        ttft = " / ".join("n/a" if t[k] is None else f"{t[k]:.0f}" for k in (COMMITTED[0], FP32[0], BF16[0]))
        lines.append(f"| {ds} | {row['n']} | {_num(pq['kl_first_c_abs_bf16_minus_fp32_median'])} / "
                     f"{_num(pq['kl_first_c_abs_bf16_minus_fp32_max'])} | {pq['top1_agree_flips_bf16_vs_fp32']} | "
                     f"{_num(pq['kl_first_c_abs_fp32_minus_fp32_committed_max'], '.1e')} | {ttft} |")
    lines += ["", "TTFTs: one thread, niced, on a core other jobs shared at times; the committed cells ran in "
              "a separate, earlier run. Not a timing study (benchmarks/engines is).", ""]
    return lines


def _num(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds_rows = summary["datasets"]
    names = list(ds_rows)
    series = (("_bf16_minus_fp32", "bf16 - fp32 (same store, same code)", "tab:blue", "o"),
              ("_bf16_minus_fp32_committed", "bf16 - fp32 committed (studies/paper)", "tab:orange", "s"),
              ("_fp32_minus_fp32_committed", "fp32 - fp32 committed (reproduction)", "tab:grey", "^"))
    panels = (("kl_first_c", "first-token KL to fp32 FA\n(paired difference, nats)"),
              ("top1_agree", "same first token as FA\n(paired difference, share)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.4))
    for ax, (metric, ylabel) in zip(axes, panels, strict=True):
        for i, (suffix, label, colour, marker) in enumerate(series):
            xs, ys, lo, hi = [], [], [], []
            for j, ds in enumerate(names):
                d = ds_rows[ds].get(metric + suffix)
                if d is None:
                    continue
                xs.append(j + (i - 1) * 0.18)
                ys.append(d["diff"])
                lo.append(d["diff"] - d["ci"][0])
                hi.append(d["ci"][1] - d["diff"])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, color=colour, capsize=4, markersize=6, label=label)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{ds}\n(n={ds_rows[ds]['n']}; fp32 mean {_level(ds_rows[ds], metric)})" for ds in names],
                           fontsize=9)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle("FusionRAG 15%, qwen2.5-0.5b: bfloat16 minus float32, paired by question (95% bootstrap)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def _level(row: dict, metric: str) -> str:
    m = row[metric][FP32[0]] or row[metric][COMMITTED[0]]
    return "n/a" if m is None else f"{m['mean']:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "studies" / "bf16" / "results")
    p.add_argument("--paper", type=Path, default=ROOT / "studies" / "paper" / "results")
    args = p.parse_args(argv)
    summary = summarize(args.results, args.paper)
    if not summary["datasets"]:
        print(f"no fusionrag@bf16 records in {args.results}", file=sys.stderr)
        return 1
    write_json_atomic(args.results / "summary.json", summary)
    atomic_write(args.results / "summary.md", "\n".join(markdown(summary)))
    plot(summary, args.results / "bf16_minus_fp32.png")
    print("\n".join(markdown(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
