"""``benchmarks/gpu/gpu_bench.py`` end to end on the CPU with a tiny configuration (the GPU run uses the 7B shape)."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # before triton is first imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from bench_helpers import ROOT, load_script
from fusionrag.execution.attention_backends import triton_available


def test_gpu_bench_runs_end_to_end_on_cpu_with_a_tiny_config(tmp_path):
    bench = load_script("benchmarks/gpu/gpu_bench.py")
    out = tmp_path / "gpu"
    assert bench.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "96,160",
                       "--chunk-tokens", "32", "--repeats", "1", "--kernel-contexts", "128",
                       "--backends", "reference,blocked", "--out", str(out)]) == 0
    doc = json.loads((out / "gpu_bench.json").read_text())
    methods = {"transformers", "full", "full_reuse", "fusionrag_15_reference", "fusionrag_15_blocked", "cacheblend_15",
               "fusionrag_15_pinned", "fusionrag_15_disk"}  # the last two: chunk KV from host memory / disk
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
                                    repeats=1, kernel_contexts="128", backends="reference,blocked", kernel_only=False,
                                    out=str(tmp_path))
    saved = []
    bench.torch.set_grad_enabled(False)
    try:
        bench.run(args, save=lambda doc: saved.append(json.loads(json.dumps(doc))))
    finally:
        bench.torch.set_grad_enabled(True)
    assert [len(d["rows"]) for d in saved] == [0, 8, 16]  # kernel first, then one context at a time
    assert all(len(d["kernel"]) == 2 for d in saved)


def test_qwen_7b_and_3b_configs_have_the_published_shapes():
    bench = load_script("benchmarks/gpu/gpu_bench.py")
    cfg = bench.qwen_config("qwen2.5-7b")
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (28, 3584, 28, 4)
    assert cfg.intermediate_size == 18944 and cfg.vocab_size == 152064
    cfg = bench.qwen_config("qwen2.5-3b")  # gpu_serve.py's fallback
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (36, 2048, 16, 2) and cfg.hidden_size // cfg.num_attention_heads == 128
    assert cfg.intermediate_size == 11008 and cfg.vocab_size == 151936 and cfg.tie_word_embeddings


def test_gpu_profile_runs_end_to_end_on_cpu_with_a_tiny_config(tmp_path):
    """On CPU the kernel runs under Triton's interpreter (set above where torch sees no GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not triton_available():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, triton installed): a GPU host runs "
                    "benchmarks/gpu/gpu_profile.py itself (benchmarks/gpu/gpu_check.sh)")
    profile = load_script("benchmarks/gpu/gpu_profile.py")
    assert profile.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "128",
                         "--chunk-tokens", "32", "--repeats", "1", "--backends", "reference,triton",
                         "--tiles", "16x16x4x2,32x16x4x2", "--packed-tiles", "16x16x1x1",
                         "--out", str(tmp_path)]) == 0
    phases = json.loads((tmp_path / "phases_128.json").read_text())
    assert set(phases["backends"]) == {"reference", "triton"}
    assert phases["backends"]["triton"]["recomputed_tokens"] == phases["backends"]["reference"]["recomputed_tokens"] > 0
    tiles = json.loads((tmp_path / "kernel_tiles_128.json").read_text())
    assert [(t["kernel"], t.get("block_m", t.get("block_r"))) for t in tiles["tiles"]] == [
        ("triton", 16), ("triton", 32), ("triton-packed", 16)]
    assert all(t["max_abs_diff_vs_reference"] < 1e-5 for t in tiles["tiles"])  # fp32: the kernel is exact
    assert "aten::" in (tmp_path / "profile_recompute_128.txt").read_text()


def test_tiles_parse_as_block_sizes_warps_and_stages():
    profile = load_script("benchmarks/gpu/gpu_profile.py")
    assert profile.parse_tiles("64x32x4x2") == [{"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}]
    assert profile.parse_tiles("128x64x8x3", rows="block_r") == [
        {"block_r": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}]


def test_the_gpu_run_s_python_steps_dry_run_on_cpu(tmp_path):
    """``gpu_check.py --dry-run``: every step of the GPU run (doctor on every backend, kernels alone at two
    contexts, TTFT, assembly, profile) with tiny shapes on the CPU, the Triton kernels interpreted; the
    serving step's dry run has its own test (tests/benchmarks/test_gpu_serve.py)."""
    from fusionrag.execution.attention_backends import NAMES

    check = load_script("benchmarks/gpu/gpu_check.py")
    kernel_steps = [s for s in check.STEPS if s != "serve"]
    assert check.main(["--dry-run", "--steps", ",".join(kernel_steps), "--out", str(tmp_path)]) == 0
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert list(steps) == kernel_steps and all(s["ok"] and s["dry_run"] for s in steps.values())
    doctor = [json.loads(line) for line in (tmp_path / "doctor.jsonl").read_text().splitlines()]
    kernels = {b for b in NAMES if triton_available() or not b.startswith("triton")}
    assert {d["attention"] for d in doctor} == kernels and all(d["ok"] for d in doctor)
    bench = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert sorted({k["context"] for k in bench["kernel"]}) == [128, 192]
    if triton_available():
        assert {k["backend"] for k in bench["kernel"]} == {"reference", "triton", "triton-packed"}
        assert all(k["max_abs_diff_vs_reference"] < 1e-5 for k in bench["kernel"])  # fp32: exact
        assert "TRITON_INTERPRET" in " ".join(steps["bench"]["notes"])  # the timings are not measurements
        assert bench["packed_autotune"]
    assert all(e["max_abs_logit_diff_ratio1_vs_full"] < 1e-4 for e in bench["exactness"])
    assemble = json.loads((tmp_path / "assemble_bench.json").read_text())
    assert {r["variant"]: r["max_abs_diff_vs_per_chunk"] for r in assemble["rows"]} == {
        "per_chunk": 0.0, "batched": 0.0, "batched_stacked": 0.0}
    assert (tmp_path / "phases_128.json").is_file()


def test_a_step_that_fails_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    check = load_script("benchmarks/gpu/gpu_check.py")

    def run_step(step, out, dry_run, budget_s=None):
        if step == "doctor":
            raise RuntimeError("no GPU after all")
        return True, []

    monkeypatch.setattr(check, "run_step", run_step)
    assert check.main(["--dry-run", "--steps", "doctor,assemble", "--out", str(tmp_path)]) == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert not steps["doctor"]["ok"] and "no GPU after all" in steps["doctor"]["error"]
    assert steps["assemble"]["ok"]


def test_both_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """ptxas from the Triton wheel: the tiles a GPU run will time compile for sm_90 (a fresh process: the
    interpreter, set in this one, cannot compile)."""
    import subprocess
    import sys

    if not triton_available():
        pytest.skip("Triton is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/kernel_compile.py", "--out", str(tmp_path),
                           "--packed-tiles", "128x64x8x2", "--head-dim", "64", "--groups", "7"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "kernel_compile.json").read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["triton", "triton-packed"]
    assert all(r["registers"] > 0 and r["shared_bytes"] > 0 for r in rows)
