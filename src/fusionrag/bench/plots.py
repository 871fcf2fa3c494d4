"""Plots of bench results: ratio curves, fidelity bars with CIs, TTFT lines and breakdowns.

Each plot is built by a ``*_figure`` function that returns the matplotlib Figure (so tests
can check the plotted data) and saved by its ``plot_*`` function, atomically through
:mod:`fusionrag.files`. They use matplotlib's object API on the Agg canvas, without pyplot's
global state, so they work headless and never switch the caller's backend; matplotlib is
imported only when a figure is drawn. The rows are described in :mod:`fusionrag.bench.rows`.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fusionrag.bench.rows import TTFT_PARTS, dataset_names, is_number, series_label, with_first_token
from fusionrag.errors import FusionRAGError
from fusionrag.files import atomic_write_with

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Methods drawn as horizontal reference lines in ratio plots: their quality does
#: not depend on the recompute ratio.
REFERENCE_METHODS = ("full", "reuse")


def require_matplotlib() -> None:
    """matplotlib is the ``bench`` extra: without it, one line that says how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise FusionRAGError("the benchmarks draw plots with matplotlib, which is not installed: "
                             "pip install 'fusionrag[bench]'") from None


def figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Figure, np.ndarray]:
    """``nrows`` x ``ncols`` panels of ``width`` x ``height`` inches each; no pyplot state (safe in threads)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def save_png(fig: Figure, path: str | Path) -> Path:
    """Through a temp file, so a reader never sees a half-written PNG."""
    return atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))


def _method_colours(methods: Iterable[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    names = [m for m in dict.fromkeys(methods) if m not in ANCHOR_COLOURS]
    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]  # never two methods in one colour
    return {**ANCHOR_COLOURS, **{m: cmap(i % cmap.N) for i, m in enumerate(names)}}


#: Full Attention and Full Reuse, the references every plot shows, in neutral colours of their own.
ANCHOR_COLOURS = {"full": "black", "reuse": "0.55"}


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
    """Save :func:`metric_vs_ratio_figure` as a PNG at ``path``."""
    fig = metric_vs_ratio_figure(rows, metric, ylabel=ylabel, title=title, ci_key=ci_key, hlines=hlines)
    return save_png(fig, path)


def metric_vs_ratio_figure(
    rows: Sequence[Mapping[str, Any]],
    metric: str,
    *,
    ylabel: str | None = None,
    title: str | None = None,
    ci_key: str | None = None,
    hlines: Sequence[float] = (),
) -> Figure:
    """``metric`` vs recompute ratio: a column per dataset, one line per method and KV kind.

    Like the paper's Figure 13. Methods whose quality does not depend on the ratio
    (:data:`REFERENCE_METHODS`) are horizontal lines (dotted; dash-dot on fused KV); fused-KV
    variants are dashed in their method's colour; ``<metric>_ci`` (or ``ci_key``) gives error
    bars. Rows with several ``top_n`` values (the offline-stage ablation) get one line per
    ``top_n``, so variants are never averaged into one zigzag line. Missing (undefined)
    values are left out rather than plotted as 0. A panel holds at most
    :data:`MAX_SERIES_PER_PANEL` series: more go to further panels below, each repeating
    Full Attention and plain Full Reuse as its anchors.
    """
    ci_key = ci_key or f"{metric}_ci"
    datasets = dataset_names(rows) or ["all"]
    colours = _method_colours(str(r.get("method")) for r in rows)
    layout = {ds: _ratio_panels([r for r in rows if str(r.get("dataset", "all")) == ds], metric) for ds in datasets}
    nrows = max(len(panels) for panels in layout.values())
    top_ns = list(dict.fromkeys(k[2] for panels in layout.values() for panel in panels for k, _ in panel))
    # one marker per top-n; with several top-n, one colour per top-n too (a method's line and its
    # Full Reuse reference at the same top-n match), the method told by the line style
    style = {"markers": {n: "osD^vP*X"[i % 8] for i, n in enumerate(top_ns)},
             "top_n_colours": _method_colours(str(n) for n in top_ns if n is not None)}
    fig, axes = figure(nrows, len(datasets), 4.2, 3.4 if nrows == 1 else 4.0)
    handles: dict[str, Any] = {}
    for col, ds in enumerate(datasets):
        ds_rows = [r for r in rows if str(r.get("dataset", "all")) == ds]
        panels = layout[ds]
        for row_i in range(len(panels), nrows):  # this dataset needs fewer panels than another
            axes[row_i][col].remove()
        ratios = sorted({float(r["ratio"]) * 100 for r in ds_rows
                         if r.get("method") not in REFERENCE_METHODS and is_number(r.get("ratio"))})
        for row_i, panel in enumerate(panels):
            ax = axes[row_i][col]
            panel_handles: dict[str, Any] = {}
            plotted = _draw_ratio_series(ax, panel, metric, ci_key, colours, style, panel_handles)
            handles.update(panel_handles)
            if nrows > 1:  # split panels: each says what it shows, right under it
                ax.legend(list(panel_handles.values()), list(panel_handles), loc="upper center", fontsize=7,
                          bbox_to_anchor=(0.5, -0.2), ncols=2, frameon=False)
            for h in hlines:
                ax.axhline(h, color="0.6", linewidth=0.8, zorder=0)
            if ratios:
                ax.set_xticks(ratios, [f"{x:g}" for x in ratios])
            if not plotted:
                # E.g. normalised F1 when Full Attention and Full Reuse score the same: say so, don't draw nothing.
                ax.text(0.5, 0.5, f"{metric}: no defined values", ha="center", va="center", transform=ax.transAxes,
                        color="0.4")
            ax.set_title(_wrap(ds if len(panels) == 1 else f"{ds} ({row_i + 1}/{len(panels)})", 3.6))
            ax.set_xlabel("recompute ratio (%)")
            ax.set_ylabel(_wrap(ylabel or metric, 2.6, 10))
            ax.grid(True, alpha=0.3)
    if nrows == 1:
        _figure_legend(fig, handles)
    _suptitle(fig, title)
    return fig


#: Most series (lines) one panel of a ratio plot shows; more go to further panels.
MAX_SERIES_PER_PANEL = 6

#: One ratio-plot series: (method, KV kind, top-n or None) and its rows.
_Series = tuple[tuple[str, str, Any], list[Mapping[str, Any]]]


def _ratio_panels(ds_rows: Sequence[Mapping[str, Any]], metric: str) -> list[list[_Series]]:
    """The series of one dataset, split into panels of at most :data:`MAX_SERIES_PER_PANEL`.

    Full Attention and plain Full Reuse (the anchors) are in every panel; the others are
    grouped by method (by top-n when top-n varies, so each panel compares one offline
    setting), a group kept in one panel where it fits. Series without a defined value
    are left out (they draw nothing)."""
    vary_top_n = len({r.get("top_n") for r in ds_rows if r.get("kv") == "fused"}) > 1
    series: dict[tuple[str, str, Any], list[Mapping[str, Any]]] = {}
    for r in ds_rows:
        kv = str(r.get("kv", "plain"))
        top_n = r.get("top_n") if vary_top_n and kv == "fused" else None
        series.setdefault((str(r.get("method")), kv, top_n), []).append(r)
    drawn = [(k, v) for k, v in series.items() if any(is_number(r.get(metric)) for r in v)]
    if len(drawn) <= MAX_SERIES_PER_PANEL:
        return [drawn]
    anchors = [s for s in drawn if s[0][0] == "full" or (s[0][0] == "reuse" and s[0][1] != "fused")]
    others = [s for s in drawn if s not in anchors]
    unit = (lambda s: (-1 if s[0][2] is None else s[0][2])) if vary_top_n else (lambda s: s[0][0])
    groups: dict[Any, list[_Series]] = {}
    for s in others:
        groups.setdefault(unit(s), []).append(s)
    room = max(1, MAX_SERIES_PER_PANEL - len(anchors))
    target = math.ceil(len(others) / math.ceil(len(others) / room))  # balanced panels
    panels: list[list[_Series]] = [[]]
    for _, group in sorted(groups.items(), key=lambda g: g[0]) if vary_top_n else groups.items():
        for i in range(0, len(group), room):
            piece = group[i:i + room]
            if panels[-1] and (len(panels[-1]) + len(piece) > room or len(panels[-1]) >= target):
                panels.append([])
            panels[-1].extend(piece)
    return [anchors + p for p in panels]


def _draw_ratio_series(ax: Any, panel: list[_Series], metric: str, ci_key: str, colours: Mapping[str, Any],
                       style: Mapping[str, Any], handles: dict[str, Any]) -> bool:
    """Draw one panel's series; True if a ratio curve (not only reference lines) was drawn."""
    plotted = False
    markers = style["markers"]
    for (method, kv, top_n), srows in panel:
        pts = [r for r in srows if is_number(r.get(metric))]
        label = series_label(method, kv) + (f" top-{top_n}" if top_n is not None else "")
        colour = colours[method] if top_n is None else style["top_n_colours"][str(top_n)]
        if method in REFERENCE_METHODS or all(r.get("ratio") is None for r in pts):
            value = float(np.mean([float(r[metric]) for r in pts]))
            dash = "-." if kv == "fused" else ":"
            handles[label] = ax.axhline(value, color=colour, linestyle=dash, linewidth=1.5, label=label)
            continue
        plotted = True
        pts = sorted((r for r in pts if is_number(r.get("ratio"))), key=lambda r: float(r["ratio"]))
        x = np.array([float(r["ratio"]) * 100 for r in pts])
        y = np.array([float(r[metric]) for r in pts])
        err = None
        cis = [r.get(ci_key) for r in pts]
        if all(isinstance(c, Sequence) and len(c) == 2 and all(is_number(v) for v in c) for c in cis):
            lo = np.array([float(c[0]) for c in cis])
            hi = np.array([float(c[1]) for c in cis])
            err = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
        handles[label] = ax.errorbar(x, y, yerr=err, color=colour, linestyle="--" if kv == "fused" else "-",
                                     marker=markers[top_n], markersize=4, capsize=3, label=label)
    return plotted


def _wrap(text: str, inches: float, points: float = 12.0) -> str:
    """A title or label broken into lines that fit ``inches`` at ``points`` (a character is ~0.6 em wide),
    so it never runs over its neighbours."""
    return textwrap.fill(text, width=max(10, int(inches * 72 / (0.6 * points))), break_long_words=False)


def _suptitle(fig: Figure, title: str | None) -> None:
    if title:
        fig.suptitle(_wrap(title, fig.get_figwidth() - 0.4))


def _figure_legend(fig: Figure, handles: Mapping[str, Any]) -> None:
    """One legend under the panels, as many columns as the figure's width holds."""
    if not handles:
        return
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // 2.6), 4))
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center", ncols=ncols)


def _median_or_none(values: Iterable[Any]) -> float | None:
    nums = [float(v) for v in values if is_number(v)]
    return statistics.median(nums) if nums else None


def plot_ttft(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """Save :func:`ttft_figure` as a PNG at ``path``."""
    return save_png(ttft_figure(rows, title=title), path)


def ttft_figure(rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> Figure:
    """TTFT vs context length (top) and its stacked breakdown with speed-ups (bottom), per KV tier.

    Like the paper's Figures 14a and 19. Full Attention loads no stored KV, so its
    rows (and rows without a tier) appear in every tier's column as its baseline.
    Rows are grouped by ``target_tokens`` (the requested size) when present, else by
    ``context_tokens``; repeated measurements of one configuration give their median.
    Breakdown parts absent from every row (e.g. ``retrieve_ms``) are left out.
    """
    rows = [with_first_token(r) for r in rows]
    for r in rows:
        r["_ctx"] = next((int(r[k]) for k in ("target_tokens", "context_tokens") if is_number(r.get(k))), None)
    parts = [p for p in TTFT_PARTS if any(is_number(r.get(p[0])) for r in rows)]
    for r in rows:  # "-" (a baseline that reads no stored KV) is no tier: shown in every tier's column
        r["_tier"] = None if r.get("tier") in (None, "", "-") else str(r["tier"])
    tiers = list(dict.fromkeys(r["_tier"] for r in rows if r["_tier"])) or ["all"]
    contexts = sorted({r["_ctx"] for r in rows if r["_ctx"] is not None})
    colours = _method_colours(str(r.get("method")) for r in rows)
    fig, axes = figure(2, len(tiers), 5.5, 3.6)
    line_handles: dict[str, Any] = {}
    for col, tier in enumerate(tiers):
        own_full = any(r.get("method") == "full" and r["_tier"] == tier for r in rows)
        tier_rows = [r for r in rows if tier == "all" or r["_tier"] in (None, tier)
                     or (r.get("method") == "full" and not own_full)]
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
            label = series_label(method, kv, ratio)
            line_handles[label] = ax_line.plot(
                xs, ys, marker="o", color=colours[method], linestyle=("--", "-", ":", "-.")[i % 4], label=label
            )[0]
        ax_line.set_xscale("log", base=2)
        ax_line.set_yscale("log")
        if contexts:
            ax_line.set_xticks(contexts, [str(c) for c in contexts])
        ax_line.set_xlabel("context tokens")
        ax_line.set_ylabel("TTFT (ms)")
        ax_line.set_title(f"KV tier: {tier}")  # "all": the rows name no tier
        ax_line.grid(True, which="both", alpha=0.3)

        width = 0.8 / max(1, len(keys))
        tallest = 0.0
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
                tallest = max(tallest, top)
                speedup = cell.get("speedup_vs_full")
                note = f"{speedup:.1f}x" if speedup is not None and key[0] != "full" else ""
                ax_bar.text(
                    x, top, f"{series_label(*key)}\n{note}".strip(), ha="center", va="bottom", fontsize=5, rotation=90
                )
        ax_bar.set_xticks(range(len(contexts)), [str(c) for c in contexts])
        ax_bar.set_xlabel("context tokens")
        ax_bar.set_ylabel("TTFT breakdown (ms)")
        if tallest > 0:  # room above the tallest bar for its rotated label, inside the frame
            ax_bar.set_ylim(0, tallest * 1.6)
        ax_bar.grid(True, axis="y", alpha=0.3)

    from matplotlib.patches import Patch

    part_handles = [Patch(color=c, label=lbl) for _, lbl, c in parts]
    handles = list(line_handles.values()) + part_handles
    labels = list(line_handles.keys()) + [p.get_label() for p in part_handles]
    _figure_legend(fig, dict(zip(labels, handles, strict=True)))
    _suptitle(fig, title)
    return fig


#: Panels of :func:`fidelity_figure`: (metric, axis label); lower is better only for KL.
FIDELITY_PANELS: tuple[tuple[str, str], ...] = (
    ("agree_f1", "agreement F1 with FA (higher = better)"),
    ("kl_first", "first-token KL(FA || method) (lower = better)"),
    ("top1_agree", "first-token top-1 agreement (higher = better)"),
)


def plot_fidelity_at_ratio(rows: Sequence[Mapping[str, Any]], ratio: float, path: str | Path,
                           *, title: str | None = None) -> Path | None:
    """Save :func:`fidelity_figure` as a PNG at ``path``; None (and no file) when it has nothing to draw."""
    fig = fidelity_figure(rows, ratio, title=title)
    return None if fig is None else save_png(fig, path)


def fidelity_figure(rows: Sequence[Mapping[str, Any]], ratio: float, *, title: str | None = None) -> Figure | None:
    """Fidelity of every method at one recompute ratio, with 95% intervals, one column per dataset.

    The study's headline picture: where the ratio curve has a single point (the usual
    case on a CPU budget), bars with error bars say more than a line plot. Full Reuse
    (ratio 0) is drawn as the floor every method should beat; Full Attention is left out
    (it is the reference: agreement 1, KL 0). Returns None when no row has ``ratio``.
    """
    def wanted(r: Mapping[str, Any]) -> bool:
        if r.get("method") == "full" or not is_number(r.get("ratio")):
            return False
        return r.get("method") == "reuse" or abs(float(r["ratio"]) - ratio) < 1e-9

    picked = [r for r in rows if wanted(r)]
    if not any(r.get("method") != "reuse" for r in picked):
        return None
    datasets = dataset_names(picked)
    colours = _method_colours(str(r.get("method")) for r in picked)
    vary_top_n = len({r.get("top_n") for r in picked if r.get("kv") == "fused"}) > 1

    def key(r: Mapping[str, Any]) -> tuple[str, str, Any]:
        return str(r["method"]), str(r.get("kv")), r.get("top_n") if vary_top_n and r.get("kv") == "fused" else None

    # One shared y axis: the same bar means the same series in every column (missing = no bar).
    order = {"reuse": 0, "fusionrag": 2}
    keys = sorted(dict.fromkeys(key(r) for r in picked),
                  key=lambda k: (order.get(k[0], 1), k[0], k[1] == "fused", -1 if k[2] is None else k[2]))
    labels = [series_label(m, kv) + (f" top-{n}" if n is not None else "") for m, kv, n in keys]
    ys = np.arange(len(keys))
    fig, axes = figure(len(FIDELITY_PANELS), len(datasets), 3.6, 0.9 + 0.28 * len(keys))
    for col, ds in enumerate(datasets):
        by_key = {key(r): r for r in picked if str(r.get("dataset")) == ds}
        n = max((int(r.get("n", 0)) for r in by_key.values()), default=0)
        for row_i, (metric, label) in enumerate(FIDELITY_PANELS):
            ax = axes[row_i][col]
            cells = [by_key.get(k, {}) for k in keys]
            vals = np.array([float(c[metric]) if is_number(c.get(metric)) else np.nan for c in cells])
            err = np.zeros((2, len(keys)))
            for i, (v, c) in enumerate(zip(vals, cells, strict=True)):
                ci = c.get(f"{metric}_ci")
                if isinstance(ci, Sequence) and len(ci) == 2 and all(is_number(x) for x in ci):
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
                ax.set_title(_wrap(f"{ds} (n={n}, {ratio * 100:g}%)", 3.2, 9), fontsize=9)
    _suptitle(fig, title)
    return fig
