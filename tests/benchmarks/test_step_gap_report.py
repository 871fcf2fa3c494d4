"""The decode-step gap benchmark's report (``benchmarks/scheduler``) on synthetic rounds: medians, the paired
ratios against no budget, the table and a real PNG, with no engine run."""

from __future__ import annotations

import json

from bench_helpers import assert_png, load_script


def test_step_gap_report_pairs_each_budget_with_no_budget_round_by_round(tmp_path):
    gap = load_script("benchmarks/scheduler/step_gap.py")
    rows = []
    for rnd, (stall, ttft) in enumerate([(70.0, 70.0), (72.0, 71.0), (68.0, 69.0)]):
        rows.append({"round": rnd, "method": "full", "budget": 0, "max_gap_s": stall, "median_gap_s": 0.1,
                     "long_ttft_s": ttft, "pieces": 1})
        rows.append({"round": rnd, "method": "full", "budget": 512, "max_gap_s": stall / 20, "median_gap_s": 0.1,
                     "long_ttft_s": ttft * 1.1, "pieces": 17})
    summary = gap.summarise(rows, [0, 512], ["full"])
    cut = next(r for r in summary if r["budget"] == 512)
    assert abs(cut["gap_ratio"]["median"] - 20.0) < 1e-9 and cut["gap_ratio"]["n"] == 3
    assert abs(cut["ttft_ratio"]["median"] - 1.1) < 1e-9
    assert "gap_ratio" not in next(r for r in summary if r["budget"] == 0)
    meta = {"command": "step_gap.py --out x", "model": "qwen2.5-0.5b", "dtype": "bfloat16", "threads": 1,
            "rounds": 3, "context_tokens": 8192, "data": "d.jsonl", "machine": {"cpu_model": "test CPU"}}
    gap.write_report({"meta": meta, "rows": rows, "summary": summary}, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "| full | 512 | 3.50 |" in text and "20.00x [20.00, 20.00] (n=3)" in text
    assert json.loads((tmp_path / "step_gap.json").read_text())["summary"]
    assert_png(tmp_path / "step_gap.png")
