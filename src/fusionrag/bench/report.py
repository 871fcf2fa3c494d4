"""Write bench results: ``results.json`` with provenance, Markdown tables, and the plots of :mod:`.plots`.

A result is only trustworthy if it can be traced and regenerated, so every JSON
file carries a ``meta`` block (command, model, data files with their SHA-256,
machine, library versions, time). Files are written atomically (temp file +
``os.replace``) so an interrupted run never leaves a truncated report that a later
run would read back (through :mod:`fusionrag.files`). The plots are drawn by
:mod:`fusionrag.bench.plots`, which imports matplotlib only when a figure is drawn, so
reading or tabulating results never loads it. The rows' keys are described in
:mod:`fusionrag.bench.rows`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionrag.bench.plots import plot_fidelity_at_ratio, plot_metric_vs_ratio, plot_ttft
from fusionrag.bench.provenance import build_meta, read_results, write_json_atomic, write_text_atomic
from fusionrag.bench.rows import dataset_names, is_number, series_label, with_first_token

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
    ("gold_nll", "gold NLL", ".3f"),
    ("gold_nll_eot", "gold NLL +EOT", ".3f"),
    ("kl_first_c", "KL first (top-128)", ".3f"),
    ("kl_answer", "KL answer", ".3f"),
    ("kl_recovery", "KL recovery", ".2f"),
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

_MISSING = "n/a"


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _MISSING
    if spec == "s":
        return str(value)
    if not is_number(value):
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
    if text != _MISSING and isinstance(ci, Sequence) and len(ci) == 2 and all(is_number(c) for c in ci):
        text += f" [{_fmt(ci[0], spec)}, {_fmt(ci[1], spec)}]"
    return text


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A GitHub Markdown table; a ``<key>_ci`` pair is appended to its value as ``[lo, hi]``."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt_cell(r, k, s).replace("|", "\\|") for k, _, s in columns) + " |" for r in rows]
    return "\n".join([header, sep, *body]) + "\n"


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
    for ds in dataset_names(rows):
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
    ("gold_nll", "gold NLL diff (< 0: more likely gold)"),
    ("kl_answer", "answer KL diff"),
)


def diff_cell(row: Mapping[str, Any], metric: str, digits: int = 3) -> str:
    """``row[metric_diff]`` with its interval, bold where the interval excludes 0."""
    value, ci = row.get(f"{metric}_diff"), row.get(f"{metric}_diff_ci")
    if not is_number(value):
        return _MISSING
    text = f"{float(value):+.{digits}f}"
    if isinstance(ci, Sequence) and len(ci) == 2 and all(is_number(x) for x in ci):
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
            base = series_label(str(c.get("baseline")), c.get("baseline_kv"), c.get("baseline_ratio"))
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
    rows = [{**with_first_token(r), "tier": r.get("tier") or "-"} for r in rows]
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


# --------------------------------------------------------------------------- whole reports

#: Plots of a quality report: (file name, metric, y label, reference lines).
QUALITY_PLOTS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    ("norm_f1_vs_ratio.png", "norm_f1", "normalised F1", (0.0, 1.0)),
    ("agree_f1_vs_ratio.png", "agree_f1", "agreement F1 with Full Attention", (1.0,)),
    ("norm_agree_vs_ratio.png", "norm_agree", "normalised agreement F1", (0.0, 1.0)),
    # The paper's Figure 13 in teacher-forced metrics (Full Attention and Full Reuse as reference lines).
    ("gold_nll_vs_ratio.png", "gold_nll", "gold-answer NLL per token (nats)", ()),
    ("kl_first_vs_ratio.png", "kl_first_c", "first-token KL to Full Attention (top-128)", ()),
    ("kl_answer_vs_ratio.png", "kl_answer", "answer-level KL to Full Attention (top-128)", ()),
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
        written.update(write_quality_plots(rows, out, model))
    return written


def write_quality_plots(rows: Sequence[Mapping[str, Any]], out_dir: str | Path,
                        model: str | None = None) -> dict[str, Path]:
    """The plots of a quality report (the ratio curves and the fidelity bars) into ``out_dir``, by name."""
    out = Path(out_dir)
    written: dict[str, Path] = {}
    for name, metric, ylabel, hlines in QUALITY_PLOTS:
        if not any(metric in r for r in rows):  # e.g. an older study without teacher-forced metrics
            continue
        written[metric] = plot_metric_vs_ratio(
            rows, metric, out / name, ylabel=ylabel, hlines=hlines, title=f"{ylabel} ({model})" if model else None
        )
    fidelity = plot_fidelity_at_ratio(rows, FIDELITY_RATIO, out / FIDELITY_PLOT,
                                      title=f"fidelity to Full Attention ({model})" if model else None)
    if fidelity is not None:
        written["fidelity"] = fidelity
    return written


def replot(results: str | Path) -> dict[str, Path]:
    """Redraw the plots of a written report from its JSON (``results.json`` or ``<stem>.json`` of bench ttft),
    beside it, without touching the JSON or the Markdown: a plotting change reaches committed results
    without rerunning a model."""
    path = Path(results)
    meta, rows = read_results(path)
    model = meta.get("model")
    if path.name == "results.json":
        return write_quality_plots(rows, path.parent, model)
    return {"png": plot_ttft([with_first_token(r) for r in rows], path.with_suffix(".png"),
                             title=f"TTFT ({model})" if model else None)}


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
    rows = [with_first_token(r) for r in rows]
    written = {
        "json": write_json_atomic(out / f"{stem}.json", {"meta": full_meta, "rows": rows}),
        "md": write_text_atomic(out / f"{stem}.md", ttft_markdown(rows, full_meta)),
    }
    if plots:
        written["png"] = plot_ttft(rows, out / f"{stem}.png", title=f"TTFT ({model})" if model else None)
    return written
