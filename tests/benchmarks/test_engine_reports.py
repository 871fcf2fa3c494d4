"""The benchmark reports (``benchmarks/engines``, ``benchmarks/vllm``, ``benchmarks/readers``) on synthetic
rows: targets with their paired ratios, the tables, the first-token table and a real PNG, with no engine run."""

from __future__ import annotations

import json

from bench_helpers import assert_png, load_script

META = {"command": "engines_bench.py --out x", "model": "qwen2.5-0.5b", "rounds": 3, "threads": [1],
        "machine": {"cpu_model": "test CPU", "cpu_bf16": "AVX512-BF16"}, "machine_probe": {}, "workers": {},
        "data_files": [{"path": "d.jsonl", "sha256": "0"}]}


def row(engine, method, ttft, n, ratio=None, dtype="bfloat16", first=785, **extra):
    return {"engine": engine, "method": method, "ratio": ratio, "dtype": dtype, "threads": 1, "target_tokens": n,
            "prompt_tokens": n + 100, "ttft_s": list(ttft), "first_tokens": [first] * len(ttft), **extra}


def test_engines_report_states_each_target_with_its_paired_ratio(tmp_path):
    report = load_script("benchmarks/engines/engines_report.py")
    stages = [{"load": 40.0, "select": 400.0, "total": 5000.0}] * 3
    rows = [row("vllm", "full", [27.0, 26.0, 28.0], 4096), row("vllm", "prefix_hit", [0.4, 0.4, 0.4], 4096),
            row("fusionrag", "fusionrag", [5.0, 5.2, 5.6], 4096, ratio=0.15, stages_ms=stages),
            row("fusionrag", "prefix_hit", [0.35, 0.36, 0.37], 4096),
            row("fusionrag", "full", [28.0, 27.0, 29.0], 4096),
            row("llama.cpp", "full", [35.0] * 3, 4096, dtype="bf16")]
    found = {t["target"].split(" at ")[0]: t for t in report.targets(rows, "bfloat16")}
    fr = found["FusionRAG 15% (bfloat16) >= 5x sooner than vLLM-CPU cold full prefill"]
    assert fr["measured"]["per_round"] == [27.0 / 5.0, 26.0 / 5.2, 28.0 / 5.6] and fr["met"] is True
    assert found["fusionrag full (bf16) no slower than vLLM-CPU's full prefill"]["met"] is False  # 28 > 27 s
    share = next(t for t in found.values() if t.get("share"))
    assert abs(share["measured"]["median"] - 0.088) < 1e-9 and share["met"] is True
    report.write_report({"meta": META, "rows": rows}, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "| llama.cpp full (bf16) |" in text and "| 5.00x [5.00, 5.40] |" in text  # per-round ratios' median
    assert json.loads((tmp_path / "engines.json").read_text())["targets"]
    assert_png(tmp_path / "engines.png")


def test_the_vllm_report_names_the_connector_per_tp_and_lists_first_tokens(tmp_path):
    bench = load_script("benchmarks/vllm/vllm_bench.py")
    rows = []
    served = {"served": {"loaded_tokens": 4000, "stored_share": 0.98, "context_tokens": 4100}}
    for tp, scale in ((1, 1.0), (2, 0.6)):
        for n, full in ((2048, 10.0 * scale), (4096, 26.0 * scale)):
            vllm = f"vllm-tp{tp}"
            rows += [{**row(vllm, "full", [full] * 3, n, first=3564), "tp": tp},
                     {**row(vllm, "prefix_hit", [0.4] * 3, n, first=42), "tp": tp},
                     {**row(vllm, "fusionrag", [full / (5.5 if tp == 1 else 4.5)] * 3, n, ratio=0.15), "tp": tp,
                      "extra": [served] * 3},
                     {**row(vllm, "fusionrag-prefix_hit", [0.5] * 3, n, ratio=0.15, first=42), "tp": tp},
                     {**row(vllm, "reuse", [0.36] * 3, n, ratio=0.0), "tp": tp},
                     {**row(vllm, "fusionrag", [full * 1.1] * 3, n, ratio=1.0, first=3564), "tp": tp}]
    rows += [{**row("fusionrag", "fusionrag", [26.0 / 5.3] * 3, 4096, ratio=0.15), "tp": 1}]
    targets = bench.targets(rows)
    assert [t["met"] for t in targets if "sooner" in t["target"]] == [True, False]  # TP=1 5.5x, TP=2 4.5x
    assert all(t["met"] for t in targets if "second question" in t["target"])  # 0.5 / 0.4 = 1.25x
    doc = {"meta": {**META, "worker": {"tp1": {"vllm": "0.32.0"}}}, "rows": rows, "targets": targets}
    (tmp_path / "vllm.json").write_text(json.dumps(doc))
    assert bench.main(["--out", str(tmp_path), "--report"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| vLLM TP=2 + connector fusionrag 100% | 3564 | 3564 |" in text
    assert "| vLLM TP=1 + connector fusionrag 15% prefix_hit | 42 | 42 |" in text
    assert "98% of 4100" in text
    assert_png(tmp_path / "vllm.png")


def test_reader_budget_shapes_fit_their_limits_and_the_report_is_written(tmp_path, monkeypatch):
    budget = load_script("benchmarks/readers/reader_budget.py")
    monkeypatch.setenv("FUSIONRAG_MAX_FILE_MB", "1")
    from fusionrag.retrieval.readers import max_file_bytes

    shapes = budget.text_files() + budget.html_files()
    assert {suffix for _, suffix, _ in shapes} == {".txt", ".md", ".jsonl", ".html"}
    for name, suffix, data in shapes:
        assert max_file_bytes(suffix) // 2 < len(data) <= max_file_bytes(suffix), name
    rows = [{"shape": "html tiny tags", "suffix": ".html", "file_mb": 8.0, "limit_mb": 8.0, "wall_s": 6.6,
             "rss_above_imports_mb": 56.0, "passages": 1, "chars": 1_864_075, "problems": [], "within_budget": True},
            {"shape": "pdf too big", "suffix": ".pdf", "file_mb": 31.8, "limit_mb": 32.0, "wall_s": 0.2,
             "rss_above_imports_mb": 77.0, "passages": 0, "chars": 0, "problems": ["over the budget; skipped"],
             "within_budget": True}]
    budget.write_report(tmp_path, rows)
    table = (tmp_path / "README.md").read_text()
    assert "| html tiny tags | 8.0 MiB | 8 MiB | 6.60 s | 56 MB | 1 |" in table
    assert "(over the budget; skipped)" in table
    assert json.loads((tmp_path / "reader_budget.json").read_text())["rows"] == rows
    assert_png(tmp_path / "reader_budget.png")
