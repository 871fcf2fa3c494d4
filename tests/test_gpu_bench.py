"""``scripts/gpu_bench.py`` end to end on the CPU with a tiny configuration (the GPU run uses the 7B shape)."""

from __future__ import annotations

import json

from eval_helpers import load_script


def test_gpu_bench_runs_end_to_end_on_cpu_with_a_tiny_config(tmp_path):
    bench = load_script("gpu_bench")
    out = tmp_path / "gpu"
    assert bench.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "96,160",
                       "--chunk-tokens", "32", "--repeats", "1", "--kernel-context", "128",
                       "--backends", "reference,blocked", "--out", str(out)]) == 0
    doc = json.loads((out / "gpu_bench.json").read_text())
    methods = {"transformers", "full", "full_reuse", "fusionrag_15_reference", "fusionrag_15_blocked", "cacheblend_15"}
    assert {r["method"] for r in doc["rows"]} == methods
    assert sorted({r["context_tokens"] for r in doc["rows"]}) == [96, 160]  # S + chunks (the last ragged) + Q
    assert all(r["ttft_ms"] > 0 and len(r["samples_ms"]) == 1 for r in doc["rows"])
    kernel = {k["backend"]: k for k in doc["kernel"]}
    assert kernel["reference"]["speedup_vs_masked_sdpa"] == 1.0
    assert kernel["blocked"]["max_abs_diff_vs_reference"] < 1e-5
    assert kernel["blocked"]["queries"] == int(0.15 * 128) + bench.QUESTION_TOKENS
    # ratio 1 equals Full Attention on every backend, here in fp32
    assert all(e["max_abs_logit_diff_ratio1_vs_full"] < 1e-4 for e in doc["exactness"])
    assert "| fusionrag_15_blocked |" in (out / "gpu_bench.md").read_text()


def test_qwen_7b_config_has_the_published_shape():
    cfg = load_script("gpu_bench").qwen_config("qwen2.5-7b")
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (28, 3584, 28, 4)
    assert cfg.intermediate_size == 18944 and cfg.vocab_size == 152064
