"""``benchmarks/gpu/gpu_bench.py`` end to end on the CPU with a tiny configuration (the GPU run uses the 7B shape)."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # before triton is first imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from bench_helpers import load_script
from fusionrag.execution.attention_backends import triton_available


def test_gpu_bench_runs_end_to_end_on_cpu_with_a_tiny_config(tmp_path):
    bench = load_script("benchmarks/gpu/gpu_bench.py")
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


def test_each_finished_step_is_saved_before_the_next_starts(tmp_path):
    """A GPU run stopped at its time limit keeps the kernel comparison and every finished context."""
    bench = load_script("benchmarks/gpu/gpu_bench.py")
    args = bench.argparse.Namespace(config="tiny", device="cpu", dtype="float32", contexts="96,160", chunk_tokens=32,
                                    repeats=1, kernel_context=128, backends="reference,blocked", kernel_only=False,
                                    out=str(tmp_path))
    saved = []
    bench.torch.set_grad_enabled(False)
    try:
        bench.run(args, save=lambda doc: saved.append(json.loads(json.dumps(doc))))
    finally:
        bench.torch.set_grad_enabled(True)
    assert [len(d["rows"]) for d in saved] == [0, 6, 12]  # kernel first, then one context at a time
    assert all(len(d["kernel"]) == 2 for d in saved)


def test_qwen_7b_config_has_the_published_shape():
    cfg = load_script("benchmarks/gpu/gpu_bench.py").qwen_config("qwen2.5-7b")
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (28, 3584, 28, 4)
    assert cfg.intermediate_size == 18944 and cfg.vocab_size == 152064


def test_gpu_profile_runs_end_to_end_on_cpu_with_a_tiny_config(tmp_path):
    """On CPU the kernel runs under Triton's interpreter (set above where torch sees no GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not triton_available():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, triton installed): a GPU host runs "
                    "benchmarks/gpu/gpu_profile.py itself (benchmarks/gpu/gpu_check.sh)")
    profile = load_script("benchmarks/gpu/gpu_profile.py")
    assert profile.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "128",
                         "--chunk-tokens", "32", "--repeats", "1", "--backends", "reference,triton",
                         "--tiles", "16x16x4x2,32x16x4x2", "--out", str(tmp_path)]) == 0
    phases = json.loads((tmp_path / "phases_128.json").read_text())
    assert set(phases["backends"]) == {"reference", "triton"}
    assert phases["backends"]["triton"]["recomputed_tokens"] == phases["backends"]["reference"]["recomputed_tokens"] > 0
    tiles = json.loads((tmp_path / "kernel_tiles_128.json").read_text())
    assert [t["block_m"] for t in tiles["tiles"]] == [16, 32]
    assert all(t["max_abs_diff_vs_reference"] < 1e-5 for t in tiles["tiles"])  # fp32: the kernel is exact
    assert "aten::" in (tmp_path / "profile_recompute_128.txt").read_text()


def test_tiles_parse_as_block_sizes_warps_and_stages():
    assert load_script("benchmarks/gpu/gpu_profile.py").parse_tiles("64x32x4x2") == [
        {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}]
