"""``benchmarks/gpu/gpu_serve.py``: the serving run of the GPU check, end to end on the CPU with a tiny model
(the GPU run saves a Qwen2.5-7B-shaped checkpoint and drives 8 clients with 16K-token prompts)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import time

import pytest

from bench_helpers import assert_png, load_script


def test_the_serving_step_dry_runs_end_to_end_on_cpu(tmp_path):
    """Checkpoint on disk with the carried tokenizer, ``fusionrag ingest``, the real ``fusionrag serve`` in a
    subprocess, /v1/retrieve, a closed loop per method, the reports; the server is gone afterwards."""
    check = load_script("benchmarks/gpu/gpu_check.py")
    t0 = time.monotonic()
    assert check.main(["--dry-run", "--steps", "serve", "--out", str(tmp_path)]) == 0
    assert time.monotonic() - t0 < 90
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["serve"]
    assert step["ok"] and step["dry_run"] and step["notes"][0] == "gpu_serve: complete"
    doc = json.loads((tmp_path / "gpu_serve.json").read_text())
    assert doc["status"] == "complete" and doc["meta"]["shape"] == "tiny"
    assert list(doc["phases"]) == ["checkpoint", "corpus", "ingest", "server_start", "retrieve"]
    assert doc["phases"]["ingest"]["chunks"] >= 16 and doc["phases"]["checkpoint"]["vocab"] == 151936
    cells = {c["method"]: c for c in doc["methods"]}
    assert list(cells) == ["full", "fusionrag"]
    for c in cells.values():
        assert c["ok"] == c["sent"] > 0 and not c["errors"] and c["clients"] == 2
        assert 0 < c["ttft_ms_p50"] <= c["ttft_ms_p99"] and c["throughput_rps"] > 0 and c["throughput_tok_s"] > 0
        assert c["prompt_tokens_p50"] > 4 * 40  # 4 stored chunks of up to 64 tokens, S and the question
        assert c["warmup"]["ok"] == 2 and c["server"]["passages_computed_on_the_fly"] == 0  # all KV was stored
    assert cells["full"]["server"]["recomputed_share"] == 1.0
    assert cells["fusionrag"]["server"]["recomputed_share"] == pytest.approx(0.15, abs=0.02)
    tiers = cells["fusionrag"]["server"]["kv_tier"]  # the server's device tier over its host tier, by name
    assert any('tier="device"' in k and v > 0 for k, v in tiers.items() if k.startswith("fusionrag_kv_tier_bytes"))
    assert "--device-kv-budget-mb 32" in doc["meta"]["server_command"]
    assert set(doc["ratios"]) >= {"ttft_p50_speedup", "requests_per_s_x", "targets"}
    md = (tmp_path / "gpu_serve.md").read_text()
    assert "| fusionrag 15% |" in md and "| full |" in md and "Status: **complete**" in md
    assert_png(tmp_path / "gpu_serve.png")
    assert "serving" in (tmp_path / "gpu_serve_server.log").read_text()
    port = int(doc["meta"]["server_command"].split("--port ")[1].split()[0])
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(2)
        s.connect(("127.0.0.1", port))  # stopped


def test_a_sigterm_saves_what_finished_and_stops(tmp_path, monkeypatch):
    """The shell script's ``timeout`` sends SIGTERM: the run stops where it is and says so in its files."""
    serve = load_script("benchmarks/gpu/gpu_serve.py")

    def slow_checkpoint(*_args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    monkeypatch.setattr(serve, "save_checkpoint", slow_checkpoint)
    before = signal.getsignal(signal.SIGTERM)
    assert serve.main(["--dry-run", "--out", str(tmp_path), "--workdir", str(tmp_path / "work")]) == 1
    assert signal.getsignal(signal.SIGTERM) == before
    doc = json.loads((tmp_path / "gpu_serve.json").read_text())
    assert doc["status"].startswith("partial: interrupted (signal 15)") and doc["methods"] == []
    assert "Status: **partial: interrupted" in (tmp_path / "gpu_serve.md").read_text()


def test_a_budget_that_ends_before_the_measurements_leaves_a_partial_report(tmp_path, monkeypatch):
    serve = load_script("benchmarks/gpu/gpu_serve.py")

    def checkpoint(folder, *_args):
        shutil.copytree(serve.TOKENIZER_DIR, folder)  # the tokenizer is all the corpus needs
        time.sleep(0.2)
        return {"shape": "tiny"}

    monkeypatch.setattr(serve, "save_checkpoint", checkpoint)
    argv = ["--dry-run", "--out", str(tmp_path), "--workdir", str(tmp_path / "work"), "--budget-s", "0.1",
            "--reserve-s", "0"]
    assert serve.main(argv) == 1
    doc = json.loads((tmp_path / "gpu_serve.json").read_text())
    assert doc["status"] == "partial: the budget (0 s) ended before ingest"
    assert list(doc["phases"]) == ["checkpoint", "corpus"] and doc["phases"]["corpus"]["files"] == 3


def test_each_method_gets_its_share_of_what_is_left(monkeypatch):
    """min(--seconds, share - two rounds); no time left: the method is skipped, saying why."""
    from fusionrag.bench import loadtest

    serve = load_script("benchmarks/gpu/gpu_serve.py")
    calls = []

    def closed_loop(base_url, items, spec, clients, duration_s, n_requests, max_tokens, timeout_s):
        calls.append(duration_s)
        return {"method": spec.partition(":")[0], "sent": 2, "ok": 2, "wall_s": 0.0, "ttft_ms_p50": 1.0}

    monkeypatch.setattr(loadtest, "closed_loop", closed_loop)
    monkeypatch.setattr(serve, "scrape", lambda url: {})
    args = argparse.Namespace(clients=2, max_tokens=4, seconds=60.0, max_requests=10)
    gpu = serve.GpuMemory()
    gpu.exe = None  # no nvidia-smi here
    cell = serve.measure_method("http://127.0.0.1:9", [], "full", args, time.monotonic() + 1000, 2, gpu)
    assert calls == [None, 60.0] and cell["duration_s"] == 60.0  # warm-up (count-bounded), then the cap
    cell = serve.measure_method("http://127.0.0.1:9", [], "fusionrag:0.15", args, time.monotonic() + 20, 2, gpu)
    assert 9 < cell["duration_s"] <= 10  # half of 20 s, less two (instant) rounds
    cell = serve.measure_method("http://127.0.0.1:9", [], "full", args, time.monotonic() - 1, 1, gpu)
    assert cell["skipped"].startswith("no budget left") and cell["warmup"]["ok"] == 2


def test_ratios_against_the_issue_s_targets():
    serve = load_script("benchmarks/gpu/gpu_serve.py")
    cell = {"ok": 10, "ttft_ms_p99": 100.0, "throughput_tok_s": 10.0}
    r = serve.ratios([{**cell, "method": "full", "ttft_ms_p50": 800.0, "throughput_rps": 1.0},
                      {**cell, "method": "fusionrag", "ttft_ms_p50": 160.0, "throughput_rps": 2.5}])
    assert r["ttft_p50_speedup"] == 5.0 and r["requests_per_s_x"] == 2.5
    assert r["targets"] == {"p50 TTFT >= 4x lower": True, "requests/s >= 3x": False}
    assert serve.ratios([{**cell, "method": "full", "ttft_ms_p50": 1.0, "throughput_rps": 1.0}]) == {}


def test_server_metrics_are_read_by_their_prometheus_names():
    serve = load_script("benchmarks/gpu/gpu_serve.py")
    before = serve.parse_metrics('fusionrag_decode_steps_total{model_name="m"} 10.0\n'
                                 'fusionrag_decode_rows_total{model_name="m"} 20.0\n')
    after = serve.parse_metrics("\n".join([
        "# TYPE fusionrag_decode_steps_total counter",
        'fusionrag_decode_steps_total{model_name="m"} 20.0',
        'fusionrag_decode_rows_total{model_name="m"} 100.0',
        'fusionrag_context_tokens_total{model_name="m",method="fusionrag"} 1000.0',
        'fusionrag_recomputed_tokens_total{model_name="m",method="fusionrag"} 150.0',
        'fusionrag_context_tokens_total{model_name="m",method="full"} 500.0',
        'fusionrag_prefix_cache_lookups_total{result="computed"} 0.0',
        'fusionrag_kv_tier_bytes{tier="host"} 4096.0',
        'vllm:num_requests_running{model_name="m"} 3.0']))
    d = serve.metrics_delta(before, after, "fusionrag")
    assert d["recomputed_share"] == 0.15 and d["mean_decode_batch"] == 8.0
    assert d["passages_computed_on_the_fly"] == 0 and d["kv_tier"] == {'fusionrag_kv_tier_bytes{tier="host"}': 4096.0}


def test_the_carried_tokenizer_is_qwen2_s():
    """A few MB in the tree (the GPU image has no hub access): the real vocabulary and chat template."""
    from transformers import AutoTokenizer

    serve = load_script("benchmarks/gpu/gpu_serve.py")
    size = sum(f.stat().st_size for f in serve.TOKENIZER_DIR.iterdir())
    assert size < 6_000_000
    tok = AutoTokenizer.from_pretrained(serve.TOKENIZER_DIR)
    assert len(tok) == 151936 and tok.convert_tokens_to_ids("<|im_end|>") == serve.EOS_ID
    assert "<|im_start|>user" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    words = serve.word_list(tok, n=50)
    assert all(len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in words)
