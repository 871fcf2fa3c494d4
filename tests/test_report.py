"""Report writer: well-formed JSON with provenance, Markdown tables and PNG plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fusionrag.eval.report import (
    build_meta,
    markdown_table,
    plot_fidelity_at_ratio,
    plot_metric_vs_ratio,
    plot_ttft,
    quality_markdown,
    read_results,
    to_jsonable,
    write_json_atomic,
    write_quality_report,
    write_ttft_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _quality_rows() -> list[dict]:
    rows = []
    for ds in ("musique", "2wikimqa"):
        rows.append(dict(dataset=ds, method="full", kv="plain", ratio=1.0, n=3, f1=0.4, em=0.0, contains=0.67,
                         norm_f1=1.0, agree_f1=1.0, norm_agree=1.0, kl_first=0.0, top1_agree=1.0,
                         ctx_tokens=1500.0, recomputed_tokens=1500.0, ttft_ms_median=4800.0,
                         f1_ci=[0.2, 0.6], agree_f1_ci=[1.0, 1.0]))  # fmt: skip
        rows.append(dict(dataset=ds, method="reuse", kv="plain", ratio=0.0, n=3, f1=0.3, em=0.0, contains=0.33,
                         norm_f1=0.0, agree_f1=0.5, norm_agree=0.0, kl_first=0.6, top1_agree=0.6,
                         ctx_tokens=1500.0, recomputed_tokens=0.0, ttft_ms_median=380.0,
                         f1_ci=[0.1, 0.5], agree_f1_ci=[0.3, 0.7]))  # fmt: skip
        for kv in ("plain", "fused"):
            for ratio in (0.05, 0.15, 0.3):
                agree = 0.5 + ratio + (0.1 if kv == "fused" else 0.0)
                rows.append(
                    dict(dataset=ds, method="fusionrag", kv=kv, ratio=ratio, n=3, f1=0.35, em=0.0, contains=0.5,
                         norm_f1=0.5 if ds == "musique" else None,  # undefined on one dataset
                         agree_f1=agree, norm_agree=(agree - 0.5) / 0.5, kl_first=0.3, top1_agree=0.8,
                         ctx_tokens=1500.0, recomputed_tokens=1500 * ratio, ttft_ms_median=1500.0,
                         f1_ci=[0.2, 0.5], agree_f1_ci=[agree - 0.1, min(1.0, agree + 0.1)],
                         norm_f1_ci=None)
                )  # fmt: skip
    return rows


def _ttft_rows() -> list[dict]:
    rows = []
    for ctx in (1024, 2048, 4096):
        full = ctx * 2.0
        rows.append(dict(method="full", ratio=1.0, context_tokens=ctx, tier=None, ttft_ms=full, load_ms=0.0,
                         select_ms=0.0, recompute_ms=full * 0.95, speedup_vs_full=1.0))  # fmt: skip
        for tier, load in (("memory", 5.0), ("disk", 40.0)):
            for ratio in (0.0, 0.15):
                recompute = full * ratio
                ttft = load + 10.0 + recompute + 20.0
                rows.append(dict(method="fusionrag", ratio=ratio, context_tokens=ctx, tier=tier, ttft_ms=ttft,
                                 load_ms=load, select_ms=10.0, recompute_ms=recompute,
                                 speedup_vs_full=full / ttft))  # fmt: skip
    return rows


def _assert_png(path):
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_write_quality_report(tmp_path):
    data_file = tmp_path / "musique.jsonl"
    data_file.write_text('{"id": "1"}\n', encoding="utf-8")
    rows = _quality_rows()
    rows[0]["kl_first"] = float("nan")  # must become null, not the invalid JSON token NaN
    rows[1]["n"] = np.int64(3)
    written = write_quality_report(
        rows,
        tmp_path / "out",
        command=["fusionrag", "bench", "quality", "--limit", "3"],
        model="tiny-llama",
        data_files=[data_file],
        meta={"seed": 0},
    )
    out = tmp_path / "out"
    assert written["json"] == out / "results.json"

    text = written["json"].read_text(encoding="utf-8")
    assert "NaN" not in text
    data = json.loads(text)
    meta = data["meta"]
    assert meta["command"] == "fusionrag bench quality --limit 3"
    assert meta["model"] == "tiny-llama"
    assert meta["seed"] == 0
    assert meta["data_files"][0]["path"] == str(data_file)
    assert len(meta["data_files"][0]["sha256"]) == 64
    for key in ("platform", "python", "cpu_count", "torch"):
        assert key in meta["machine"]
    assert meta["timestamp"].endswith("+00:00")
    assert len(data["rows"]) == len(rows)
    assert data["rows"][0]["kl_first"] is None
    assert data["rows"][1]["n"] == 3
    assert data["rows"][0]["f1_ci"] == [0.2, 0.6]
    assert read_results(written["json"]) == (meta, data["rows"])

    md = written["md"].read_text(encoding="utf-8")
    assert "## musique" in md and "## 2wikimqa" in md
    assert "`tiny-llama`" in md
    assert "| method | KV | ratio | n | F1 |" in md
    assert "0.400 [0.200, 0.600]" in md  # value with its CI
    assert "| fusionrag | fused | 15% |" in md
    assert "n/a" in md  # the undefined normalised F1 and the NaN KL
    table_lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table_lines}) == 1  # consistent columns

    for metric in ("norm_f1", "agree_f1", "norm_agree", "fidelity"):
        _assert_png(written[metric])
    assert {p.name for p in out.iterdir()} == {
        "fidelity_at_15pct.png",
        "results.json",
        "results.md",
        "norm_f1_vs_ratio.png",
        "agree_f1_vs_ratio.png",
        "norm_agree_vs_ratio.png",
    }  # no temp files left behind


def test_fidelity_plot_needs_a_method_at_its_ratio(tmp_path):
    rows = _quality_rows()
    assert plot_fidelity_at_ratio(rows, 0.2, tmp_path / "none.png") is None  # only Full Reuse would be drawn
    assert not (tmp_path / "none.png").exists()
    _assert_png(plot_fidelity_at_ratio(rows, 0.05, tmp_path / "five.png"))


def test_quality_report_overwrites_and_can_skip_plots(tmp_path):
    write_quality_report(_quality_rows(), tmp_path, command="first", plots=False)
    write_quality_report(_quality_rows()[:2], tmp_path, command="second", plots=False)
    meta, rows = read_results(tmp_path / "results.json")
    assert meta["command"] == "second" and len(rows) == 2
    assert not list(tmp_path.glob("*.png"))


def test_plot_handles_all_undefined_values(tmp_path):
    rows = [dict(dataset="d", method="fusionrag", kv="plain", ratio=0.15, norm_f1=None)]
    _assert_png(plot_metric_vs_ratio(rows, "norm_f1", tmp_path / "p.png"))


def test_write_ttft_report(tmp_path):
    rows = _ttft_rows()
    written = write_ttft_report(rows, tmp_path, command="fusionrag bench ttft", model="tiny-qwen2")
    meta, back = read_results(tmp_path / "ttft.json")
    assert meta["model"] == "tiny-qwen2"
    assert len(back) == len(rows)
    # The first-token share is derived when not measured separately.
    full_1024 = next(r for r in back if r["method"] == "full" and r["context_tokens"] == 1024)
    assert full_1024["first_token_ms"] == pytest.approx(2048 * 0.05)
    md = written["md"].read_text(encoding="utf-8")
    assert "speed-up vs full" in md and "x |" in md
    assert md.index("| 1024 |") < md.index("| 4096 |")
    _assert_png(written["png"])


def test_plot_ttft_without_tiers(tmp_path):
    rows = [dict(method=m, ratio=0.0, context_tokens=c, ttft_ms=t, load_ms=1.0, select_ms=0.0, recompute_ms=0.0,
                 speedup_vs_full=None) for m, c, t in (("full", 512, 90.0), ("reuse", 512, 10.0))]  # fmt: skip
    _assert_png(plot_ttft(rows, tmp_path / "t.png"))


def test_json_helpers(tmp_path):
    assert to_jsonable({"a": (1, np.float32(0.5)), "b": math.inf, 3: np.array([1, 2])}) == {
        "a": [1, 0.5],
        "b": None,
        "3": [1, 2],
    }
    with pytest.raises(TypeError):
        to_jsonable(object())
    path = write_json_atomic(tmp_path / "sub" / "x.json", {"v": float("nan")})
    assert json.loads(path.read_text()) == {"v": None}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_failed_write_keeps_previous_file(tmp_path):
    path = write_json_atomic(tmp_path / "x.json", {"v": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_markdown_helpers():
    table = markdown_table([{"a": "x|y", "b": 0.12345, "b_ci": [0.1, 0.2]}], [("a", "A", "s"), ("b", "B", ".2f")])
    assert table.splitlines() == ["| A | B |", "|---|---|", "| x\\|y | 0.12 [0.10, 0.20] |"]
    md = quality_markdown(_quality_rows(), build_meta(command="cmd", model="m"))
    ds = _quality_rows()[0]["dataset"]
    with_kb = quality_markdown(_quality_rows(), {"knowledge_base_stores": {ds: ["m-ds-n50-top10-nearest_first"]}})
    assert f"## {ds}\n\nKnowledge base: `m-ds-n50-top10-nearest_first`" in with_kb
    assert "Command: `cmd`" in md


def test_ttft_full_baseline_shown_in_every_tier_and_grouped_by_target(tmp_path):
    # As bench ttft writes them: Full Attention measured once (memory tier), actual
    # context sizes differ from the requested ones, retrieval timed separately.
    rows = []
    for target in (1024, 2048):
        rows.append(dict(method="full", ratio=0.0, kv="plain", tier="memory", target_tokens=target,
                         context_tokens=target + 7, ttft_ms=900.0, retrieve_ms=2.0, load_ms=0.0, select_ms=0.0,
                         recompute_ms=850.0, first_token_ms=48.0, speedup_vs_full=1.0))  # fmt: skip
        for tier in ("memory", "disk"):
            rows.append(dict(method="fusionrag", ratio=0.15, kv="fused", tier=tier, target_tokens=target,
                             context_tokens=target + 7, ttft_ms=300.0, retrieve_ms=2.0, load_ms=20.0, select_ms=5.0,
                             recompute_ms=250.0, first_token_ms=23.0, speedup_vs_full=3.0))  # fmt: skip
    written = write_ttft_report(rows, tmp_path, command="c", model="m")
    _assert_png(written["png"])
    md = written["md"].read_text(encoding="utf-8")
    assert "| target tokens | context tokens |" in md and "| retrieve |" in md


def test_quality_plot_splits_top_n_variants(tmp_path):
    rows = [
        dict(dataset="d", method="fusionrag", kv="fused", ratio=r, top_n=n, agree_f1=0.5 + r + n / 100)
        for n in (0, 2, 10)
        for r in (0.05, 0.15)
    ]
    rows.append(dict(dataset="d", method="reuse", kv="plain", ratio=0.0, top_n=0, agree_f1=0.5))
    _assert_png(plot_metric_vs_ratio(rows, "agree_f1", tmp_path / "a.png"))
    assert "| top-n |" in quality_markdown(rows)
