"""A tiny end-to-end ``bench ttft`` run: its report, speed-ups and the loader comparison."""

import json

from fusionrag.bench.ttft import TTFTSpec, run_ttft
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def test_tiny_ttft_bench_writes_report_with_speedups_and_loader(tmp_path, fusionrag_home):
    data = tmp_path / "hotpotqa" / "mini.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()))
    spec = TTFTSpec(data=data, out=tmp_path / "ttft", model="tiny-llama", context_tokens=[400, 800], repeats=1,
                    top_n=1, loader_requests=2, loader_context=400, embedder=HashingEmbedder(), dtype="float32")
    rows = run_ttft(spec)
    doc = json.loads((tmp_path / "ttft" / "ttft.json").read_text())
    assert len(doc["rows"]) == len(rows) > 0 and (tmp_path / "ttft" / "ttft.png").is_file()
    assert {r["tier"] for r in rows} == {"memory", "disk", "-"}
    for r in rows:
        assert r["speedup_vs_full"] > 0 and r["context_tokens"] >= 0.9 * r["target_tokens"]
        assert (r["recomputed_tokens"] == 0) == (r["ratio"] == 0.0)
        assert r["rounds"] == 1
    assert {"sync", "async"} <= set(doc["meta"]["loader"])
    # the plain-transformers baseline prefills the very prompt Full Attention does, and every
    # speed-up is also given against the faster of the two baselines
    for n in (400, 800):
        same = {r["method"]: r for r in rows if r["target_tokens"] == n and r["method"] in ("full", "transformers")}
        assert same["transformers"]["context_tokens"] > same["full"]["context_tokens"]  # S + chunks + Q vs S + chunks
        fastest = min(same["full"]["ttft_ms"], same["transformers"]["ttft_ms"])
        for r in (r for r in rows if r["target_tokens"] == n):
            assert abs(r["speedup_vs_baseline"] - fastest / r["ttft_ms"]) < 1e-9
            assert r["speedup_vs_baseline"] <= min(r["speedup_vs_full"], r["speedup_vs_transformers"]) + 1e-12
    backends = {b["backend"]: b for b in doc["meta"]["backends"]}  # the recompute pass on each backend
    assert set(backends) == {"reference", "blocked"} and backends["blocked"]["same_selection"]
    assert backends["blocked"]["max_abs_logit_diff"] < 1e-5 and backends["blocked"]["max_abs_kv_diff"] < 1e-5
    summary = (tmp_path / "ttft" / "speedups.md").read_text()
    assert "| transformers |" in summary and "faster baseline" in summary
    probe = doc["meta"]["machine_probe"]  # the machine's rates at the run's start and end, in the report too
    assert all(probe[w]["gemm_gflops"] > 0 and probe[w]["copy_gbs"] > 0 for w in ("start", "end"))
    assert "Machine at start / end: GEMM" in summary



def test_device_tier_rows_and_tier_names_checked_before_any_work(tmp_path, fusionrag_home):
    import pytest
    import torch

    from fusionrag.errors import FusionRAGError

    data = tmp_path / "hotpotqa" / "mini.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()))
    spec = TTFTSpec(data=data, out=tmp_path / "ttft", model="tiny-llama", context_tokens=[400], repeats=1,
                    methods=("full", "fusionrag"), ratios=(0.15,), tiers=("device", "memory"), top_n=0,
                    loader_requests=0, embedder=HashingEmbedder())
    rows = run_ttft(spec)
    assert {r["tier"] for r in rows} == {"device", "memory", "-"}
    same = {r["tier"]: r for r in rows if r["method"] == "fusionrag"}
    assert same["device"]["recomputed_tokens"] == same["memory"]["recomputed_tokens"] > 0
    with pytest.raises(FusionRAGError, match="unknown KV tier 'ssd'"):
        run_ttft(TTFTSpec(data=data, out=tmp_path / "x", model="no-such-model", tiers=("ssd",)))
    if not torch.cuda.is_available():
        with pytest.raises(FusionRAGError, match="needs a CUDA device"):
            run_ttft(TTFTSpec(data=data, out=tmp_path / "x", model="no-such-model", tiers=("pinned",)))
