"""Write bench results: ``results.json`` with provenance, a Markdown table and plots.

A result is only trustworthy if it can be traced and regenerated, so every JSON
file carries a ``meta`` block (command, model, data files with their SHA-256,
machine, library versions, time). Files are written atomically (temp file +
``os.replace``) so an interrupted run never leaves a truncated report that a later
run would read back. Plots use matplotlib's object API on the Agg canvas, without
pyplot's global state, so they work headless and never switch the caller's backend.

Quality rows (one per dataset x method x KV kind x ratio) have the keys::

    dataset, method, kv ("plain"/"fused"), ratio, n, f1, em, contains, norm_f1,
    agree_f1, norm_agree, kl_first, top1_agree, ctx_tokens, recomputed_tokens,
    ttft_ms_median, and optional CIs as ``<metric>_ci = [lo, hi]``.

TTFT rows (one per method x ratio x context length x tier) have the keys::

    method, ratio, context_tokens, tier ("memory"/"disk"), ttft_ms, load_ms,
    select_ms, recompute_ms, speedup_vs_full, and optionally kv, first_token_ms.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.files import atomic_write, atomic_write_with, file_sha256
from fusionrag.files import write_json_atomic as _write_json

#: Methods drawn as horizontal reference lines in ratio plots: their quality does
#: not depend on the recompute ratio.
REFERENCE_METHODS = ("full", "reuse")

#: Markdown columns of the quality table: (row key, header, format).
QUALITY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("method", "method", "s"),
    ("kv", "KV", "s"),
    ("ratio", "ratio", "pct"),
    ("top_n", "top-n", "d"),
    ("n", "n", "d"),
    ("f1", "F1", ".3f"),
    ("em", "EM", ".3f"),
    ("contains", "gold in answer", ".3f"),
    ("norm_f1", "norm. F1", ".3f"),
    ("agree_f1", "agree F1", ".3f"),
    ("norm_agree", "norm. agree", ".3f"),
    ("kl_first", "KL first tok.", ".3f"),
    ("top1_agree", "top-1 agree", ".3f"),
    ("ctx_tokens", "ctx tokens", ".0f"),
    ("recomputed_tokens", "recomputed", ".0f"),
    ("ttft_ms_median", "TTFT ms (median)", ".0f"),
)

TTFT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("target_tokens", "target tokens", "d"),
    ("context_tokens", "context tokens", "d"),
    ("tier", "KV tier", "s"),
    ("method", "method", "s"),
    ("kv", "KV", "s"),
    ("ratio", "ratio", "pct"),
    ("ttft_ms", "TTFT ms", ".1f"),
    ("retrieve_ms", "retrieve", ".1f"),
    ("load_ms", "load", ".1f"),
    ("select_ms", "select", ".1f"),
    ("recompute_ms", "recompute", ".1f"),
    ("first_token_ms", "first token", ".1f"),
    ("speedup_vs_full", "speed-up vs full", "x"),
)

#: Stacked TTFT components, bottom to top: (row key, legend label, colour).
TTFT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("retrieve_ms", "retrieve", "#8172b3"),
    ("load_ms", "load KV", "#4c72b0"),
    ("select_ms", "select tokens", "#dd8452"),
    ("recompute_ms", "recompute", "#c44e52"),
    ("first_token_ms", "first token", "#55a868"),
)

_MISSING = "n/a"


# --------------------------------------------------------------------------- JSON


def to_jsonable(obj: Any) -> Any:
    """Convert results to plain JSON: numpy/torch scalars to numbers, NaN/inf to ``null``.

    ``json`` would otherwise write ``NaN``, which is not JSON and breaks strict
    readers; an undefined metric is ``null``.
    """
    if obj is None or isinstance(obj, bool | str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Iterable):
        return [to_jsonable(v) for v in obj]
    item = getattr(obj, "item", None)  # torch scalars, without importing torch here
    if callable(item):
        return to_jsonable(item())
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON via a temp file and ``os.replace`` (never half-written)."""

    return _write_json(path, to_jsonable(obj))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` via a temp file and ``os.replace``."""
    return atomic_write(path, text)


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a file written by :func:`write_quality_report` / :func:`write_ttft_report`: ``(meta, rows)``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data.get("meta", {}), data.get("rows", [])


# --------------------------------------------------------------------------- provenance


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: timings are meaningless without the machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "fusionrag": _version("fusionrag"),
        "transformers": _version("transformers"),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
    return info


def build_meta(
    command: str | Sequence[str] | None = None,
    model: str | None = None,
    data_files: str | Path | Iterable[str | Path] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``meta`` block: command (default: this process's argv), model, data files, machine, time."""
    if command is None:
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    elif not isinstance(command, str):
        command = shlex.join(command)
    if isinstance(data_files, str | Path):  # one file given on its own, not a list
        data_files = [data_files]
    files = []
    for f in data_files:
        p = Path(f)
        files.append({"path": str(p), "sha256": file_sha256(p) if p.is_file() else None})
    meta: dict[str, Any] = {
        "command": command,
        "model": model,
        "data_files": files,
        "machine": machine_info(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if extra:
        meta.update(extra)
    return meta


# --------------------------------------------------------------------------- Markdown


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.number) and not isinstance(v, bool) and math.isfinite(float(v))


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _MISSING
    if spec == "s":
        return str(value)
    if not _is_number(value):
        return str(value)
    if spec == "pct":
        return f"{float(value) * 100:g}%"
    if spec == "x":
        return f"{float(value):.2f}x"
    if spec == "d":
        return str(round(float(value)))
    return format(float(value), spec)


def _fmt_cell(row: Mapping[str, Any], key: str, spec: str) -> str:
    text = _fmt(row.get(key), spec)
    ci = row.get(f"{key}_ci")
    if text != _MISSING and isinstance(ci, Sequence) and len(ci) == 2 and all(_is_number(c) for c in ci):
        text += f" [{_fmt(ci[0], spec)}, {_fmt(ci[1], spec)}]"
    return text


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A GitHub Markdown table; a ``<key>_ci`` pair is appended to its value as ``[lo, hi]``."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt_cell(r, k, s).replace("|", "\\|") for k, _, s in columns) + " |" for r in rows]
    return "\n".join([header, sep, *body]) + "\n"


def _datasets(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(r.get("dataset", "all")) for r in rows))


def quality_markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    """One table per dataset, rows in the given order, with the command and model on top."""
    lines = ["# Quality results", ""]
    if meta:
        if meta.get("model"):
            lines.append(f"Model: `{meta['model']}`  ")
        if meta.get("command"):
            lines.append(f"Command: `{meta['command']}`  ")
        if meta.get("timestamp"):
            lines.append(f"Time: {meta['timestamp']}")
        lines.append("")
    lines += [
        "Brackets are 95% bootstrap confidence intervals. Normalised scores are (x - reuse) / (full - reuse); "
        f"{_MISSING} where undefined (no gap between Full Attention and Full Reuse). Fidelity columns compare "
        "each method's answer and first-token distribution with Full Attention's.",
        "",
    ]
    columns = [c for c in QUALITY_COLUMNS if any(c[0] in r for r in rows)]
    stores = (meta or {}).get("knowledge_base_stores") or {}
    for ds in _datasets(rows):
        ds_rows = [r for r in rows if str(r.get("dataset", "all")) == ds]
        lines += [f"## {ds}", ""]
        if stores.get(ds):  # which knowledge base (offline store) the fused-KV rows read
            lines += ["Knowledge base: " + ", ".join(f"`{s}`" for s in stores[ds]), ""]
        lines.append(markdown_table(ds_rows, columns))
    return "\n".join(lines)


#: Columns of the paired-comparison table: (metric, header); KL is better when lower.
COMPARISON_COLUMNS: tuple[tuple[str, str], ...] = (
    ("agree_f1", "agree F1 diff"),
    ("kl_first", "KL diff (< 0: closer to FA)"),
    ("top1_agree", "top-1 diff"),
)


def diff_cell(row: Mapping[str, Any], metric: str, digits: int = 3) -> str:
    """``row[metric_diff]`` with its interval, bold where the interval excludes 0."""
    value, ci = row.get(f"{metric}_diff"), row.get(f"{metric}_diff_ci")
    if not _is_number(value):
        return _MISSING
    text = f"{float(value):+.{digits}f}"
    if isinstance(ci, Sequence) and len(ci) == 2 and all(_is_number(x) for x in ci):
        lo, hi = float(ci[0]), float(ci[1])
        text += f" [{lo:+.{digits}f}, {hi:+.{digits}f}]"
        if lo > 0 or hi < 0:  # the interval excludes 0: a difference these questions support
            text = f"**{text}**"
    return text


def comparisons_markdown(comparisons: Sequence[Mapping[str, Any]]) -> str:
    """Paired tables, one per compared method: method minus baseline, bold where the 95% CI excludes 0."""
    groups: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for c in comparisons:
        groups.setdefault((c.get("method"), c.get("kv")), []).append(c)
    lines: list[str] = []
    sweep = len({c.get("top_n") for c in comparisons}) > 1  # the top-n ablation: say which offline setting
    for (method, kv), rows in groups.items():
        lines += [
            "",
            f"## {method} ({kv} KV) minus each baseline, paired by question",
            "",
            "Each cell is the mean over the questions both methods answered of (this method - baseline), with a "
            "95% bootstrap interval that resamples questions; **bold** where the interval excludes 0. Higher is "
            "better for agreement and top-1, lower for KL.",
            "",
            "| dataset | " + ("top-n | " if sweep else "") + "ratio | baseline | n | "
            + " | ".join(h for _, h in COMPARISON_COLUMNS) + " |",
            "|---" * (4 + sweep + len(COMPARISON_COLUMNS)) + "|",
        ]
        for c in sorted(rows, key=lambda c: (str(c.get("dataset")), c.get("top_n") or 0)) if sweep else rows:
            base = _series_label(str(c.get("baseline")), c.get("baseline_kv"), c.get("baseline_ratio"))
            top_n = f"{c.get('top_n')} | " if sweep else ""
            lines.append(
                f"| {c.get('dataset')} | {top_n}{_fmt(c.get('ratio'), 'pct')} | {base} | {c.get('n')} | "
                + " | ".join(diff_cell(c, m) for m, _ in COMPARISON_COLUMNS) + " |"
            )
    return "\n".join(lines) + "\n" if lines else ""


def ttft_markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    """The TTFT table with its breakdown, sorted by context length, tier and method."""
    lines = ["# Time to first token", ""]
    if meta:
        if meta.get("model"):
            lines.append(f"Model: `{meta['model']}`  ")
        if meta.get("command"):
            lines.append(f"Command: `{meta['command']}`  ")
        lines.append("")
    lines += [
        "Times in milliseconds (tier - means no stored KV is loaded); speed-up is Full Attention's TTFT over "
        "the method's, measured in the same run.",
        "",
    ]
    rows = [{**_with_first_token(r), "tier": r.get("tier") or "-"} for r in rows]
    columns = [c for c in TTFT_COLUMNS if any(c[0] in r for r in rows)]
    ordered = sorted(
        rows,
        key=lambda r: (
            r.get("context_tokens") or 0,
            str(r.get("tier") or ""),
            str(r.get("method")),
            r.get("ratio") or 0,
        ),
    )
    lines.append(markdown_table(ordered, columns))
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def _figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, np.ndarray]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _save_png(fig: Any, path: str | Path) -> Path:
    return atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))


def _series_label(method: str, kv: Any, ratio: Any = None) -> str:
    label = str(method)
    if kv == "fused":
        label += " (fused KV)"
    if ratio is not None and method != "full":  # Full Attention has no recompute ratio to show
        label += f" {float(ratio) * 100:g}%"
    return label


def _method_colours(methods: Iterable[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(dict.fromkeys(methods))}


def plot_metric_vs_ratio(
    rows: Sequence[Mapping[str, Any]],
    metric: str,
    path: str | Path,
    *,
    ylabel: str | None = None,
    title: str | None = None,
    ci_key: str | None = None,
    hlines: Sequence[float] = (),
) -> Path:
    """``metric`` vs recompute ratio: one subplot per dataset, one line per method and KV kind.

    Like the paper's Figure 13. Methods whose quality does not depend on the ratio
    (:data:`REFERENCE_METHODS`) are horizontal dotted lines; fused-KV variants are
    dashed in their method's colour; ``<metric>_ci`` (or ``ci_key``) gives error bars.
    Rows with several ``top_n`` values (the offline-stage ablation) get one line per
    ``top_n``, so variants are never averaged into one zigzag line. Missing
    (undefined) values are left out rather than plotted as 0.
    """
    ci_key = ci_key or f"{metric}_ci"
    datasets = _datasets(rows) or ["all"]
    colours = _method_colours(str(r.get("method")) for r in rows)
    fig, axes = _figure(1, len(datasets), 4.2, 3.4)
    handles: dict[str, Any] = {}
    for ax, ds in zip(axes[0], datasets, strict=True):
        ds_rows = [r for r in rows if str(r.get("dataset", "all")) == ds]
        vary_top_n = len({r.get("top_n") for r in ds_rows if r.get("kv") == "fused"}) > 1
        series: dict[tuple[str, str, Any], list[Mapping[str, Any]]] = {}
        for r in ds_rows:
            kv = str(r.get("kv", "plain"))
            top_n = r.get("top_n") if vary_top_n and kv == "fused" else None
            series.setdefault((str(r.get("method")), kv, top_n), []).append(r)
        plotted = False
        markers = {n: "osD^vP*X"[i % 8] for i, n in enumerate(dict.fromkeys(k[2] for k in series))}
        for (method, kv, top_n), srows in series.items():
            pts = [r for r in srows if _is_number(r.get(metric))]
            if not pts:
                continue
            label = _series_label(method, kv) + (f" top-{top_n}" if top_n is not None else "")
            style = "--" if kv == "fused" else "-"
            colour = colours[method]
            if method in REFERENCE_METHODS or all(r.get("ratio") is None for r in pts):
                value = float(np.mean([float(r[metric]) for r in pts]))
                handles[label] = ax.axhline(value, color=colour, linestyle=":", linewidth=1.5, label=label)
                continue
            plotted = True
            pts = sorted((r for r in pts if _is_number(r.get("ratio"))), key=lambda r: float(r["ratio"]))
            x = np.array([float(r["ratio"]) * 100 for r in pts])
            y = np.array([float(r[metric]) for r in pts])
            err = None
            cis = [r.get(ci_key) for r in pts]
            if all(isinstance(c, Sequence) and len(c) == 2 and all(_is_number(v) for v in c) for c in cis):
                lo = np.array([float(c[0]) for c in cis])
                hi = np.array([float(c[1]) for c in cis])
                err = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
            handles[label] = ax.errorbar(
                x,
                y,
                yerr=err,
                color=colour,
                linestyle=style,
                marker=markers[top_n],
                markersize=4,
                capsize=3,
                label=label,
            )
        for h in hlines:
            ax.axhline(h, color="0.6", linewidth=0.8, zorder=0)
        ratios = sorted(
            {
                float(r["ratio"]) * 100
                for r in ds_rows
                if r.get("method") not in REFERENCE_METHODS and _is_number(r.get("ratio"))
            }
        )
        if ratios:
            ax.set_xticks(ratios, [f"{x:g}" for x in ratios])
        if not plotted:
            # E.g. normalised F1 when Full Attention and Full Reuse score the same: say so, don't draw nothing.
            ax.text(
                0.5, 0.5, f"{metric}: no defined values", ha="center", va="center", transform=ax.transAxes, color="0.4"
            )
        ax.set_title(ds)
        ax.set_xlabel("recompute ratio (%)")
        ax.set_ylabel(ylabel or metric)
        ax.grid(True, alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=min(4, len(handles)))
    if title:
        fig.suptitle(title)
    return _save_png(fig, path)


def _with_first_token(row: Mapping[str, Any]) -> dict[str, Any]:
    """Fill ``first_token_ms`` as what TTFT leaves after the other parts, if not measured."""
    out = dict(row)
    if not _is_number(out.get("first_token_ms")) and _is_number(out.get("ttft_ms")):
        parts = sum(float(out[k]) for k, _, _ in TTFT_PARTS if k != "first_token_ms" and _is_number(out.get(k)))
        out["first_token_ms"] = max(0.0, float(out["ttft_ms"]) - parts)
    return out


def _median_or_none(values: Iterable[Any]) -> float | None:
    nums = [float(v) for v in values if _is_number(v)]
    return statistics.median(nums) if nums else None


def plot_ttft(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """TTFT vs context length (top) and its stacked breakdown with speed-ups (bottom), per KV tier.

    Like the paper's Figures 14a and 19. Full Attention loads no stored KV, so its
    rows (and rows without a tier) appear in every tier's column as its baseline.
    Rows are grouped by ``target_tokens`` (the requested size) when present, else by
    ``context_tokens``; repeated measurements of one configuration give their median.
    Breakdown parts absent from every row (e.g. ``retrieve_ms``) are left out.
    """
    rows = [_with_first_token(r) for r in rows]
    for r in rows:
        r["_ctx"] = next((int(r[k]) for k in ("target_tokens", "context_tokens") if _is_number(r.get(k))), None)
    parts = [p for p in TTFT_PARTS if any(_is_number(r.get(p[0])) for r in rows)]
    tiers = list(dict.fromkeys(str(r["tier"]) for r in rows if r.get("tier"))) or ["all"]
    contexts = sorted({r["_ctx"] for r in rows if r["_ctx"] is not None})
    colours = _method_colours(str(r.get("method")) for r in rows)
    fig, axes = _figure(2, len(tiers), 5.5, 3.6)
    line_handles: dict[str, Any] = {}
    for col, tier in enumerate(tiers):
        own_full = any(r.get("method") == "full" and str(r.get("tier")) == tier for r in rows)
        tier_rows = [
            r
            for r in rows
            if tier == "all"
            or not r.get("tier")
            or str(r["tier"]) == tier
            or (r.get("method") == "full" and not own_full)
        ]
        keys = list(dict.fromkeys((str(r.get("method")), r.get("kv"), r.get("ratio")) for r in tier_rows))
        table: dict[tuple[Any, ...], dict[str, float | None]] = {}
        for key in keys:
            for ctx in contexts:
                group = [
                    r
                    for r in tier_rows
                    if (str(r.get("method")), r.get("kv"), r.get("ratio")) == key and r["_ctx"] == ctx
                ]
                if group:
                    fields = ("ttft_ms", "speedup_vs_full", *(p for p, _, _ in parts))
                    table[(*key, ctx)] = {f: _median_or_none(r.get(f) for r in group) for f in fields}

        ax_line, ax_bar = axes[0][col], axes[1][col]
        for i, key in enumerate(keys):
            method, kv, ratio = key
            xs = [c for c in contexts if (*key, c) in table and table[(*key, c)]["ttft_ms"] is not None]
            if not xs:
                continue
            ys = [table[(*key, c)]["ttft_ms"] for c in xs]
            label = _series_label(method, kv, ratio)
            line_handles[label] = ax_line.plot(
                xs, ys, marker="o", color=colours[method], linestyle=("--", "-", ":", "-.")[i % 4], label=label
            )[0]
        ax_line.set_xscale("log", base=2)
        ax_line.set_yscale("log")
        if contexts:
            ax_line.set_xticks(contexts, [str(c) for c in contexts])
        ax_line.set_xlabel("context tokens")
        ax_line.set_ylabel("TTFT (ms)")
        ax_line.set_title(f"KV tier: {tier}")
        ax_line.grid(True, which="both", alpha=0.3)

        width = 0.8 / max(1, len(keys))
        for i, key in enumerate(keys):
            for j, ctx in enumerate(contexts):
                cell = table.get((*key, ctx))
                if cell is None:
                    continue
                x = j - 0.4 + width * (i + 0.5)
                bottom = 0.0
                for part, _, colour in parts:
                    h = cell.get(part) or 0.0
                    ax_bar.bar(x, h, width * 0.9, bottom=bottom, color=colour, edgecolor="white", linewidth=0.3)
                    bottom += h
                top = cell["ttft_ms"] if cell["ttft_ms"] is not None else bottom
                speedup = cell.get("speedup_vs_full")
                note = f"{speedup:.1f}x" if speedup is not None and key[0] != "full" else ""
                ax_bar.text(
                    x, top, f"{_series_label(*key)}\n{note}".strip(), ha="center", va="bottom", fontsize=5, rotation=90
                )
        ax_bar.set_xticks(range(len(contexts)), [str(c) for c in contexts])
        ax_bar.set_xlabel("context tokens")
        ax_bar.set_ylabel("TTFT breakdown (ms)")
        ax_bar.margins(y=0.35)
        ax_bar.grid(True, axis="y", alpha=0.3)

    from matplotlib.patches import Patch

    part_handles = [Patch(color=c, label=lbl) for _, lbl, c in parts]
    handles = list(line_handles.values()) + part_handles
    labels = list(line_handles.keys()) + [p.get_label() for p in part_handles]
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(handles)))
    if title:
        fig.suptitle(title)
    return _save_png(fig, path)


#: Panels of :func:`plot_fidelity_at_ratio`: (metric, axis label); lower is better only for KL.
FIDELITY_PANELS: tuple[tuple[str, str], ...] = (
    ("agree_f1", "agreement F1 with FA (higher = better)"),
    ("kl_first", "first-token KL(FA || method) (lower = better)"),
    ("top1_agree", "first-token top-1 agreement (higher = better)"),
)


def plot_fidelity_at_ratio(rows: Sequence[Mapping[str, Any]], ratio: float, path: str | Path,
                           *, title: str | None = None) -> Path | None:
    """Fidelity of every method at one recompute ratio, with 95% intervals, one column per dataset.

    The study's headline picture: where the ratio curve has a single point (the usual
    case on a CPU budget), bars with error bars say more than a line plot. Full Reuse
    (ratio 0) is drawn as the floor every method should beat; Full Attention is left out
    (it is the reference: agreement 1, KL 0). Returns None when no row has ``ratio``.
    """
    def wanted(r: Mapping[str, Any]) -> bool:
        if r.get("method") == "full" or not _is_number(r.get("ratio")):
            return False
        return r.get("method") == "reuse" or abs(float(r["ratio"]) - ratio) < 1e-9

    picked = [r for r in rows if wanted(r)]
    if not any(r.get("method") != "reuse" for r in picked):
        return None
    datasets = _datasets(picked)
    colours = _method_colours(str(r.get("method")) for r in picked)
    vary_top_n = len({r.get("top_n") for r in picked if r.get("kv") == "fused"}) > 1

    def key(r: Mapping[str, Any]) -> tuple[str, str, Any]:
        return str(r["method"]), str(r.get("kv")), r.get("top_n") if vary_top_n and r.get("kv") == "fused" else None

    # One shared y axis: the same bar means the same series in every column (missing = no bar).
    order = {"reuse": 0, "fusionrag": 2}
    keys = sorted(dict.fromkeys(key(r) for r in picked),
                  key=lambda k: (order.get(k[0], 1), k[0], k[1] == "fused", -1 if k[2] is None else k[2]))
    labels = [_series_label(m, kv) + (f" top-{n}" if n is not None else "") for m, kv, n in keys]
    ys = np.arange(len(keys))
    fig, axes = _figure(len(FIDELITY_PANELS), len(datasets), 3.6, 0.9 + 0.28 * len(keys))
    for col, ds in enumerate(datasets):
        by_key = {key(r): r for r in picked if str(r.get("dataset")) == ds}
        n = max((int(r.get("n", 0)) for r in by_key.values()), default=0)
        for row_i, (metric, label) in enumerate(FIDELITY_PANELS):
            ax = axes[row_i][col]
            cells = [by_key.get(k, {}) for k in keys]
            vals = np.array([float(c[metric]) if _is_number(c.get(metric)) else np.nan for c in cells])
            err = np.zeros((2, len(keys)))
            for i, (v, c) in enumerate(zip(vals, cells, strict=True)):
                ci = c.get(f"{metric}_ci")
                if isinstance(ci, Sequence) and len(ci) == 2 and all(_is_number(x) for x in ci):
                    err[:, i] = [max(0.0, v - float(ci[0])), max(0.0, float(ci[1]) - v)]
            bars = ax.barh(ys, np.nan_to_num(vals), xerr=err, capsize=2, alpha=0.85,
                           color=[colours[k[0]] for k in keys])
            for bar, k, v in zip(bars, keys, vals, strict=True):
                if k[1] == "fused":  # same colour as the method, hatched: the offline stage's KV
                    bar.set_hatch("//")
                if np.isnan(v):
                    bar.set_visible(False)
            ax.set_yticks(ys, labels if col == 0 else [""] * len(ys), fontsize=7)
            ax.set_ylim(len(keys) - 0.5, -0.5)
            ax.grid(True, axis="x", alpha=0.3)
            ax.set_xlabel(label, fontsize=7)
            if row_i == 0:
                ax.set_title(f"{ds} (n={n}, {ratio * 100:g}%)", fontsize=9)
    if title:
        fig.suptitle(title)
    return _save_png(fig, path)


# --------------------------------------------------------------------------- whole reports

#: Plots of a quality report: (file name, metric, y label, reference lines).
QUALITY_PLOTS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    ("norm_f1_vs_ratio.png", "norm_f1", "normalised F1", (0.0, 1.0)),
    ("agree_f1_vs_ratio.png", "agree_f1", "agreement F1 with Full Attention", (1.0,)),
    ("norm_agree_vs_ratio.png", "norm_agree", "normalised agreement F1", (0.0, 1.0)),
)


#: The ratio of the fidelity bar chart (the paper's headline setting) and its file name.
FIDELITY_RATIO = 0.15
FIDELITY_PLOT = "fidelity_at_15pct.png"


def write_quality_report(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    *,
    comparisons: Sequence[Mapping[str, Any]] = (),
    command: str | Sequence[str] | None = None,
    model: str | None = None,
    data_files: str | Path | Iterable[str | Path] = (),
    meta: Mapping[str, Any] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write ``results.json`` (meta + rows), ``results.md`` and the ratio plots into ``out_dir``.

    ``meta`` entries are added to (and override) the generated provenance block.
    Returns the written paths by name (``json``, ``md`` and each plot's metric).
    """
    out = Path(out_dir)
    full_meta = build_meta(command, model, data_files, extra=meta)
    rows = [dict(r) for r in rows]
    written = {
        "json": write_json_atomic(out / "results.json",
                                  {"meta": full_meta, "rows": rows, "comparisons": [dict(c) for c in comparisons]}),
        "md": write_text_atomic(out / "results.md",
                                quality_markdown(rows, full_meta) + comparisons_markdown(comparisons)),
    }
    if plots:
        for name, metric, ylabel, hlines in QUALITY_PLOTS:
            written[metric] = plot_metric_vs_ratio(
                rows, metric, out / name, ylabel=ylabel, hlines=hlines, title=f"{ylabel} ({model})" if model else None
            )
        fidelity = plot_fidelity_at_ratio(rows, FIDELITY_RATIO, out / FIDELITY_PLOT,
                                          title=f"fidelity to Full Attention ({model})" if model else None)
        if fidelity is not None:
            written["fidelity"] = fidelity
    return written


def write_ttft_report(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    *,
    command: str | Sequence[str] | None = None,
    model: str | None = None,
    meta: Mapping[str, Any] | None = None,
    stem: str = "ttft",
    plots: bool = True,
) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` for ``bench ttft`` into ``out_dir``.

    A separate stem from the quality report's ``results`` lets both share one folder.
    """
    out = Path(out_dir)
    full_meta = build_meta(command, model, (), extra=meta)
    rows = [_with_first_token(r) for r in rows]
    written = {
        "json": write_json_atomic(out / f"{stem}.json", {"meta": full_meta, "rows": rows}),
        "md": write_text_atomic(out / f"{stem}.md", ttft_markdown(rows, full_meta)),
    }
    if plots:
        written["png"] = plot_ttft(rows, out / f"{stem}.png", title=f"TTFT ({model})" if model else None)
    return written
