"""Plots: the data each figure draws (series, values, error bars, reference lines), then that it saves a PNG.

Every ``plot_*`` function saves the Figure its ``*_figure`` function builds, so the tests
read the plotted artists back and compare them with the input rows: a dropped series, a
wrong value or a missing interval fails here, not only a missing file.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from bench_helpers import assert_png, bench_ttft_rows, quality_rows, ttft_rows
from fusionrag.bench.plots import (
    fidelity_figure,
    metric_vs_ratio_figure,
    plot_fidelity_at_ratio,
    plot_metric_vs_ratio,
    plot_ttft,
    ttft_figure,
)
from fusionrag.bench.report import quality_markdown


def _axes_by_title(fig) -> dict[str, Any]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def _error_series(ax) -> dict[str, dict[str, Any]]:
    """The ratio curves of an axis: label -> x, y, (lo, hi) of each error bar, line style."""
    out = {}
    for c in ax.containers:
        line = c.lines[0]
        bars = c.lines[2][0].get_segments() if c.lines[2] else []
        out[c.get_label()] = {
            "x": list(line.get_xdata()),
            "y": list(line.get_ydata()),
            "ci": [(float(seg[0][1]), float(seg[1][1])) for seg in bars],
            "style": line.get_linestyle(),
            "marker": line.get_marker(),
        }
    return out


def _reference_lines(ax) -> dict[str, float]:
    """The dotted horizontal lines of the ratio-independent methods: label -> value."""
    return {ln.get_label(): float(ln.get_ydata()[0]) for ln in ax.get_lines() if ln.get_linestyle() == ":"}


def _grid_lines(ax) -> list[float]:
    """The unlabelled horizontal guides (``hlines``)."""
    return [float(ln.get_ydata()[0]) for ln in ax.get_lines() if ln.get_label().startswith("_child")]


def _ratio_rows(rows: Sequence[dict], ds: str, method: str, kv: str) -> list[dict]:
    return sorted((r for r in rows if (r["dataset"], r["method"], r["kv"]) == (ds, method, kv)),
                  key=lambda r: r["ratio"])  # fmt: skip


def test_metric_vs_ratio_draws_every_series_with_its_values_intervals_and_references():
    rows = quality_rows()
    fig = metric_vs_ratio_figure(rows, "agree_f1", hlines=(1.0,))
    axes = _axes_by_title(fig)
    assert list(axes) == ["musique", "2wikimqa"]
    for ds, ax in axes.items():
        series = _error_series(ax)
        assert set(series) == {"fusionrag", "fusionrag (fused KV)"}
        for label, kv, style in (("fusionrag", "plain", "-"), ("fusionrag (fused KV)", "fused", "--")):
            expected = _ratio_rows(rows, ds, "fusionrag", kv)
            assert series[label]["x"] == pytest.approx([r["ratio"] * 100 for r in expected])
            assert series[label]["y"] == pytest.approx([r["agree_f1"] for r in expected])
            np.testing.assert_allclose(series[label]["ci"], [r["agree_f1_ci"] for r in expected])
            assert series[label]["style"] == style
        full, reuse = (next(r for r in rows if r["dataset"] == ds and r["method"] == m) for m in ("full", "reuse"))
        assert _reference_lines(ax) == pytest.approx({"full": full["agree_f1"], "reuse": reuse["agree_f1"]})
        assert _grid_lines(ax) == [1.0]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["5", "15", "30"]
        assert ax.get_xlabel() == "recompute ratio (%)" and ax.get_ylabel() == "agree_f1"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["full", "reuse", "fusionrag", "fusionrag (fused KV)"]


def test_metric_vs_ratio_leaves_undefined_values_out_and_says_so():
    rows = quality_rows()  # norm_f1 is None for FusionRAG on 2wikimqa
    axes = _axes_by_title(metric_vs_ratio_figure(rows, "norm_f1", ylabel="normalised F1"))
    musique = _error_series(axes["musique"])
    assert musique["fusionrag"]["y"] == pytest.approx([0.5, 0.5, 0.5])
    assert musique["fusionrag"]["ci"] == []  # norm_f1_ci is None: no error bars invented
    assert _error_series(axes["2wikimqa"]) == {}
    assert _reference_lines(axes["2wikimqa"]) == {"full": 1.0, "reuse": 0.0}
    assert [t.get_text() for t in axes["2wikimqa"].texts] == ["norm_f1: no defined values"]
    assert axes["musique"].get_ylabel() == "normalised F1"


def test_plot_handles_all_undefined_values(tmp_path):
    rows = [dict(dataset="d", method="fusionrag", kv="plain", ratio=0.15, norm_f1=None)]
    (ax,) = metric_vs_ratio_figure(rows, "norm_f1").axes
    assert not ax.containers and not _reference_lines(ax)
    assert [t.get_text() for t in ax.texts] == ["norm_f1: no defined values"]
    assert_png(plot_metric_vs_ratio(rows, "norm_f1", tmp_path / "p.png"))


def test_quality_plot_splits_top_n_variants(tmp_path):
    rows = [
        dict(dataset="d", method="fusionrag", kv="fused", ratio=r, top_n=n, agree_f1=0.5 + r + n / 100)
        for n in (0, 2, 10)
        for r in (0.05, 0.15)
    ]
    rows.append(dict(dataset="d", method="reuse", kv="plain", ratio=0.0, top_n=0, agree_f1=0.5))
    (ax,) = metric_vs_ratio_figure(rows, "agree_f1").axes
    series = _error_series(ax)
    assert set(series) == {f"fusionrag (fused KV) top-{n}" for n in (0, 2, 10)}  # never averaged into one line
    for n in (0, 2, 10):
        assert series[f"fusionrag (fused KV) top-{n}"]["x"] == pytest.approx([5, 15])
        assert series[f"fusionrag (fused KV) top-{n}"]["y"] == pytest.approx([0.55 + n / 100, 0.65 + n / 100])
    assert len({s["marker"] for s in series.values()}) == 3
    assert _reference_lines(ax) == {"reuse": 0.5}
    assert_png(plot_metric_vs_ratio(rows, "agree_f1", tmp_path / "a.png"))
    assert "| top-n |" in quality_markdown(rows)


def _ttft_lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {ln.get_label(): ([float(x) for x in ln.get_xdata()], [float(y) for y in ln.get_ydata()])
            for ln in ax.get_lines()}  # fmt: skip


def _stacks(ax) -> list[tuple[float, list[float]]]:
    """The breakdown bars, left to right: (x, heights of the stacked parts bottom to top)."""
    stacks: dict[float, list[Any]] = {}
    for p in ax.patches:
        stacks.setdefault(round(p.get_x() + p.get_width() / 2, 6), []).append(p)
    out = []
    for x in sorted(stacks):
        parts = stacks[x]  # drawn bottom to top
        assert parts[0].get_y() == 0.0
        for lower, upper in itertools.pairwise(parts):
            assert upper.get_y() == pytest.approx(lower.get_y() + lower.get_height())  # stacked, no gaps
        out.append((x, [p.get_height() for p in parts]))
    return out


def test_ttft_figure_draws_each_tier_with_full_attention_as_its_baseline():
    rows = ttft_rows()
    fig = ttft_figure(rows)
    line_axes = _axes_by_title(fig)
    assert list(line_axes) == ["KV tier: memory", "KV tier: disk"]
    contexts = [1024.0, 2048.0, 4096.0]
    full = [r["ttft_ms"] for r in rows if r["method"] == "full"]
    bar_axes = [ax for ax in fig.axes if ax.get_ylabel() == "TTFT breakdown (ms)"]
    assert len(bar_axes) == 2
    for (title, ax), bars in zip(line_axes.items(), bar_axes, strict=True):
        tier = title.removeprefix("KV tier: ")

        def ttft(ratio, ctx, tier=tier):
            return next(r["ttft_ms"] for r in rows if r["method"] == "fusionrag" and r["ratio"] == ratio
                        and r["context_tokens"] == ctx and r["tier"] == tier)  # fmt: skip

        lines = _ttft_lines(ax)
        assert lines == {
            "full": (contexts, pytest.approx(full)),  # measured without a tier: shown in every tier
            "fusionrag 0%": (contexts, pytest.approx([ttft(0.0, c) for c in contexts])),
            "fusionrag 15%": (contexts, pytest.approx([ttft(0.15, c) for c in contexts])),
        }
        # One stack per (context, series); its parts (load, select, recompute, first token) add up to TTFT.
        stacks = _stacks(bars)
        expected = [t for c in contexts for t in (lines["full"][1][contexts.index(c)], ttft(0.0, c), ttft(0.15, c))]
        assert len(stacks) == len(expected)
        for (_, heights), total in zip(stacks, expected, strict=True):
            assert len(heights) == 4 and sum(heights) == pytest.approx(total)
        notes = [t.get_text() for t in bars.texts]
        speedups = [f"fusionrag {ratio * 100:g}%\n{r['speedup_vs_full']:.1f}x" for ratio in (0.0, 0.15)
                    for c in contexts for r in rows if r["method"] == "fusionrag" and r["ratio"] == ratio
                    and r["context_tokens"] == c and r["tier"] == tier]  # fmt: skip
        assert [n for n in notes if n != "full"] == speedups and notes.count("full") == 3
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["full", "fusionrag 0%", "fusionrag 15%", "load KV", "select tokens", "recompute", "first token"]


def test_ttft_full_baseline_shown_in_every_tier_and_grouped_by_target():
    rows = bench_ttft_rows()
    fig = ttft_figure(rows)
    line_axes = _axes_by_title(fig)
    assert list(line_axes) == ["KV tier: memory", "KV tier: disk"]
    for ax in line_axes.values():  # Full Attention was measured on the memory tier only
        assert _ttft_lines(ax) == {"full": ([1024.0, 2048.0], [900.0, 900.0]),
                                   "fusionrag (fused KV) 15%": ([1024.0, 2048.0], [300.0, 300.0])}  # fmt: skip
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1024", "2048"]  # the targets, not 1031 / 2055
    for bars in (ax for ax in fig.axes if ax.get_ylabel() == "TTFT breakdown (ms)"):
        full, fusionrag = [2.0, 0.0, 0.0, 850.0, 48.0], [2.0, 20.0, 5.0, 250.0, 23.0]  # retrieve .. first token
        np.testing.assert_allclose([h for _, h in _stacks(bars)], [full, fusionrag] * 2)
    assert "retrieve" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_plot_ttft_without_tiers(tmp_path):
    rows = [dict(method=m, ratio=0.0, context_tokens=c, ttft_ms=t, load_ms=1.0, select_ms=0.0, recompute_ms=0.0,
                 speedup_vs_full=None) for m, c, t in (("full", 512, 90.0), ("reuse", 512, 10.0))]  # fmt: skip
    repeat = dict(rows[1], ttft_ms=30.0)  # two more measurements of Full Reuse: the median is drawn
    fig = ttft_figure([*rows, repeat, dict(repeat, ttft_ms=20.0)])
    (ax,) = _axes_by_title(fig).values()
    assert ax.get_title() == "KV tier: all"
    assert _ttft_lines(ax) == {"full": ([512.0], [90.0]), "reuse 0%": ([512.0], [20.0])}
    assert_png(plot_ttft(rows, tmp_path / "t.png"))


def _fidelity_axes(fig, n_datasets: int) -> list[list[Any]]:
    """The panels as [metric row][dataset column]."""
    return [fig.axes[i * n_datasets:(i + 1) * n_datasets] for i in range(len(fig.axes) // n_datasets)]


def _bars(ax) -> tuple[list[float], list[tuple[float, float]], list[Any]]:
    """Bar values, (lo, hi) of each error bar, and the bars themselves, top to bottom."""
    (bars,) = [c for c in ax.containers if hasattr(c, "patches")]
    segments = bars.errorbar.lines[2][0].get_segments()
    return ([p.get_width() for p in bars.patches], [(float(s[0][0]), float(s[1][0])) for s in segments],
            list(bars.patches))  # fmt: skip


def test_fidelity_figure_draws_every_method_at_the_ratio_with_full_reuse_as_floor():
    rows = quality_rows()
    fig = fidelity_figure(rows, 0.15)
    panels = _fidelity_axes(fig, 2)
    assert [ax.get_title() for ax in panels[0]] == ["musique (n=3, 15%)", "2wikimqa (n=3, 15%)"]
    assert [ax.get_xlabel() for ax in (row[0] for row in panels)] == [
        "agreement F1 with FA (higher = better)",
        "first-token KL(FA || method) (lower = better)",
        "first-token top-1 agreement (higher = better)",
    ]
    labels = ["reuse", "fusionrag", "fusionrag (fused KV)"]  # Full Attention left out; other ratios too
    assert [t.get_text() for t in panels[0][0].get_yticklabels()] == labels
    assert [t.get_text() for t in panels[0][1].get_yticklabels()] == ["", "", ""]
    for col, ds in enumerate(("musique", "2wikimqa")):
        cells = [next(r for r in rows if r["dataset"] == ds and (r["method"], r["kv"]) == key and
                      (r["method"] == "reuse" or r["ratio"] == 0.15))
                 for key in (("reuse", "plain"), ("fusionrag", "plain"), ("fusionrag", "fused"))]  # fmt: skip
        for row_i, metric in enumerate(("agree_f1", "kl_first", "top1_agree")):
            values, cis, bars = _bars(panels[row_i][col])
            assert values == pytest.approx([c[metric] for c in cells])
            if metric == "agree_f1":
                np.testing.assert_allclose(cis, [c["agree_f1_ci"] for c in cells])
            else:  # no interval in the rows: a zero-width error bar, not an invented one
                np.testing.assert_allclose(cis, [(c[metric], c[metric]) for c in cells])
            assert [b.get_hatch() for b in bars] == [None, None, "//"]  # fused KV hatched


def test_fidelity_figure_hides_the_bar_of_a_missing_series():
    rows = [r for r in quality_rows() if not (r["dataset"] == "2wikimqa" and r["kv"] == "fused")]
    panels = _fidelity_axes(fidelity_figure(rows, 0.05), 2)
    values, _, bars = _bars(panels[0][1])
    assert values == pytest.approx([0.5, 0.55, 0.0]) and [b.get_visible() for b in bars] == [True, True, False]
    assert [b.get_visible() for b in _bars(panels[0][0])[2]] == [True, True, True]


def test_fidelity_plot_needs_a_method_at_its_ratio(tmp_path):
    rows = quality_rows()
    assert fidelity_figure(rows, 0.2) is None
    assert plot_fidelity_at_ratio(rows, 0.2, tmp_path / "none.png") is None  # only Full Reuse would be drawn
    assert not (tmp_path / "none.png").exists()
    assert_png(plot_fidelity_at_ratio(rows, 0.05, tmp_path / "five.png"))
    assert np.isfinite(_bars(_fidelity_axes(fidelity_figure(rows, 0.05), 2)[0][0])[0]).all()


# --------------------------------------------------------------------------- readability


def _series_per_axes(fig) -> dict[str, int]:
    """Labelled lines (curves and reference lines) of each panel, by title."""
    return {ax.get_title(): len(ax.get_legend_handles_labels()[1]) for ax in fig.axes if ax.get_title()}


def _many_methods_rows(n_methods: int = 9) -> list[dict]:
    rows = [dict(dataset=ds, method=m, kv="plain", ratio=r, agree_f1=v)
            for ds in ("musique", "triviaqa") for m, r, v in (("full", 1.0, 1.0), ("reuse", 0.0, 0.5))]
    for ds in ("musique", "triviaqa"):
        for i in range(n_methods if ds == "triviaqa" else 3):
            for kv in ("plain", "fused"):
                rows += [dict(dataset=ds, method=f"m{i}", kv=kv, ratio=r, agree_f1=0.5 + r + i / 100)
                         for r in (0.05, 0.15)]
    return rows


def _overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of titles / axis labels whose drawn boxes overlap, and any that leave the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the canvas the PNGs are drawn on
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [t for t in [fig._suptitle] if t is not None and t.get_text()]
    for ax in fig.axes:
        texts += [t for t in (ax.title, ax.xaxis.label, ax.yaxis.label) if t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    page = fig.bbox
    bad = [(name, "outside the figure") for name, b in boxes
           if b.x0 < page.x0 - 1 or b.x1 > page.x1 + 1 or b.y0 < page.y0 - 1 or b.y1 > page.y1 + 1]
    bad += [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]
    return bad


def test_ratio_panels_hold_at_most_six_series_each_and_every_series_once():
    rows = _many_methods_rows()
    fig = metric_vs_ratio_figure(rows, "agree_f1", ylabel="agreement F1 with Full Attention, a long label",
                                 title="agreement F1 with Full Attention (a model with a rather long name)")
    counts = _series_per_axes(fig)
    assert counts and max(counts.values()) <= 6, counts
    trivia = [ax for ax in fig.axes if ax.get_title().startswith("triviaqa (")]
    assert [ax.get_title() for ax in trivia] == [f"triviaqa ({i}/5)" for i in range(1, 6)]
    labels = [lbl for ax in trivia for lbl in ax.get_legend_handles_labels()[1]]
    others = [lbl for lbl in labels if lbl not in ("full", "reuse")]
    assert sorted(others) == sorted(f"m{i}" + k for i in range(9) for k in ("", " (fused KV)"))  # each once
    assert labels.count("full") == labels.count("reuse") == 5  # the anchors in every panel
    assert all(ax.get_legend() is not None for ax in fig.axes)  # split panels: a legend under each
    assert _overlapping_texts(fig) == []


def test_titles_are_wrapped_to_fit_and_never_overlap_labels():
    rows = [r for r in quality_rows() if r["dataset"] == "musique"]  # one narrow column, like top_n's study
    title = "agreement F1 with Full Attention (qwen2.5-0.5b, a long model name to wrap)"
    fig = metric_vs_ratio_figure(rows, "agree_f1", ylabel="agreement F1 with Full Attention", title=title)
    assert "\n" in fig._suptitle.get_text() and fig._suptitle.get_text().replace("\n", " ") == title
    assert _overlapping_texts(fig) == []
    assert _overlapping_texts(fidelity_figure(quality_rows(), 0.15, title=title)) == []
    assert _overlapping_texts(ttft_figure(ttft_rows(), title=title)) == []


def test_a_baseline_without_a_tier_gets_no_panel_of_its_own():
    rows = ttft_rows()
    for r in rows:
        if r["method"] == "full":
            r["tier"] = "-"  # how bench ttft writes the plain-transformers baseline
    titles = list(_axes_by_title(ttft_figure(rows)))
    assert titles == ["KV tier: memory", "KV tier: disk"]
    assert not [t for t in titles if t.endswith(": -")]
    assert all("full" in _ttft_lines(ax) for ax in _axes_by_title(ttft_figure(rows)).values())


def test_top_n_panels_pair_each_offline_setting_with_its_full_reuse_in_one_colour():
    rows = [dict(dataset="d", method="full", kv="none", ratio=1.0, top_n=0, agree_f1=1.0),
            dict(dataset="d", method="reuse", kv="plain", ratio=0.0, top_n=0, agree_f1=0.6)]
    for n in (0, 10, 15, 2, 5):  # the order a study's rows come in (sorted as text)
        rows += [dict(dataset="d", method="reuse", kv="fused", ratio=0.0, top_n=n, agree_f1=0.5 + n / 100),
                 dict(dataset="d", method="fusionrag", kv="fused", ratio=0.15, top_n=n, agree_f1=0.7 + n / 100)]
    fig = metric_vs_ratio_figure(rows, "agree_f1")
    counts = _series_per_axes(fig)
    assert counts and max(counts.values()) <= 6
    seen, colours = [], set()
    for ax in fig.axes:
        curves = _error_series(ax)
        refs = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_linestyle() == "-."}  # fused Full Reuse
        for label in curves:
            n = label.rsplit("-", 1)[1]
            seen.append(int(n))
            curve = next(c for c in ax.containers if c.get_label() == label).lines[0]
            assert refs[f"reuse (fused KV) top-{n}"].get_color() == curve.get_color()
            colours.add(str(curve.get_color()))
        assert set(_reference_lines(ax)) == {"full", "reuse"}  # the anchors, in every panel
    assert seen == [0, 2, 5, 10, 15]  # every setting once, in numeric order
    assert len(colours) == 5  # one colour per setting
