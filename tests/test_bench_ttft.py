"""A tiny end-to-end ``bench ttft`` run: its report, speed-ups and the loader comparison."""

import json

from fusionrag.eval.bench_ttft import TTFTSpec, run_ttft
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def test_tiny_ttft_bench_writes_report_with_speedups_and_loader(tmp_path, fusionrag_home):
    data = tmp_path / "hotpotqa" / "mini.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()))
    spec = TTFTSpec(data=data, out=tmp_path / "ttft", model="tiny-llama", context_tokens=[400, 800], repeats=1,
                    top_n=1, loader_requests=2, loader_context=400, embedder=HashingEmbedder())
    rows = run_ttft(spec)
    doc = json.loads((tmp_path / "ttft" / "ttft.json").read_text())
    assert len(doc["rows"]) == len(rows) > 0 and (tmp_path / "ttft" / "ttft.png").is_file()
    assert {r["tier"] for r in rows} == {"memory", "disk"}
    for r in rows:
        assert r["speedup_vs_full"] > 0 and r["context_tokens"] >= 0.9 * r["target_tokens"]
        assert (r["recomputed_tokens"] == 0) == (r["ratio"] == 0.0)
    assert {"sync", "async"} <= set(doc["meta"]["loader"])
