"""Report writer: well-formed JSON with provenance, Markdown tables, and the PNGs it asks the plots for."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench_helpers import assert_png, bench_ttft_rows, quality_rows, ttft_rows
from fusionrag.bench.provenance import build_meta, read_results, to_jsonable, write_json_atomic
from fusionrag.bench.report import markdown_table, quality_markdown, replot, write_quality_report, write_ttft_report


def test_write_quality_report(tmp_path):
    data_file = tmp_path / "musique.jsonl"
    data_file.write_text('{"id": "1"}\n', encoding="utf-8")
    rows = quality_rows()
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
        assert_png(written[metric])
    assert {p.name for p in out.iterdir()} == {
        "fidelity_at_15pct.png",
        "results.json",
        "results.md",
        "norm_f1_vs_ratio.png",
        "agree_f1_vs_ratio.png",
        "norm_agree_vs_ratio.png",
    }  # no temp files left behind


def test_quality_report_overwrites_and_can_skip_plots(tmp_path):
    write_quality_report(quality_rows(), tmp_path, command="first", plots=False)
    write_quality_report(quality_rows()[:2], tmp_path, command="second", plots=False)
    meta, rows = read_results(tmp_path / "results.json")
    assert meta["command"] == "second" and len(rows) == 2
    assert not list(tmp_path.glob("*.png"))


def test_write_ttft_report(tmp_path):
    rows = ttft_rows()
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
    assert_png(written["png"])


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
    md = quality_markdown(quality_rows(), build_meta(command="cmd", model="m"))
    ds = quality_rows()[0]["dataset"]
    with_kb = quality_markdown(quality_rows(), {"knowledge_base_stores": {ds: ["m-ds-n50-top10-nearest_first"]}})
    assert f"## {ds}\n\nKnowledge base: `m-ds-n50-top10-nearest_first`" in with_kb
    assert "Command: `cmd`" in md


def test_ttft_full_baseline_shown_in_every_tier_and_grouped_by_target(tmp_path):
    rows = bench_ttft_rows()
    written = write_ttft_report(rows, tmp_path, command="c", model="m")
    assert_png(written["png"])
    md = written["md"].read_text(encoding="utf-8")
    assert "| target tokens | context tokens |" in md and "| retrieve |" in md




def test_replot_redraws_the_plots_from_the_json_alone(tmp_path):
    """A plotting change reaches committed results without a model: the JSON and Markdown stay as they were."""
    quality = write_quality_report(quality_rows(), tmp_path / "q", command="c", model="m", plots=False)
    ttft = write_ttft_report(ttft_rows(), tmp_path / "t", command="c", model="m", plots=False)
    before = {p: p.read_bytes() for p in (*quality.values(), *ttft.values())}
    drawn = replot(quality["json"])
    assert sorted(drawn) == ["agree_f1", "fidelity", "norm_agree", "norm_f1"]  # the metrics the rows have
    for path in drawn.values():
        assert_png(path)
    assert_png(replot(ttft["json"])["png"])
    assert (tmp_path / "t" / "ttft.png").is_file()
    assert {p: p.read_bytes() for p in before} == before
