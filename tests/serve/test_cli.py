"""The CLI: JSON doctor report on a tiny model, clear errors without tracebacks."""

import json

import pytest

from fusionrag.cli import main


def test_doctor_on_tiny_model_prints_json(capsys, monkeypatch):
    """Float32 (the exactness reference) and the dtype auto chooses, both checked."""
    monkeypatch.setattr("fusionrag.models.devices.cpu_bf16_feature", lambda: "AVX512-BF16")
    assert main(["doctor", "--model", "tiny-llama", "--compact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["compute_dtype"] == "bfloat16 (auto: this CPU has AVX512-BF16)"
    assert report["float32"]["model"] == "tiny-llama" and report["float32"]["tolerances"]["logits"] == 1e-4
    bf16 = report["bfloat16"]
    assert bf16["ok"] is True and bf16["ratio1_greedy_matches_full_on_sample"] and bf16["ratio1_added_kl_mean"] < 1e-3


def test_doctor_in_float32_alone(capsys):
    assert main(["doctor", "--model", "tiny-llama", "--dtype", "float32", "--compact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compute_dtype"] == "float32 (asked for)"
    assert set(report) == {"model", "device", "compute_dtype", "ok", "family", "float32"}
    assert report["family"]["family"] == "llama" and report["family"]["exact_reuse_limit"] is None


def test_unknown_model_is_one_line_error(capsys, fusionrag_home):
    assert main(["doctor", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusionrag: error: unknown model") and "Traceback" not in err


def test_doctor_runs_on_the_device_and_backend_asked_for(capsys):
    """Every device and sparse backend can be checked: the report names the ones it ran on."""
    assert main(["doctor", "--model", "tiny-qwen2", "--device", "cpu", "--attention", "reference", "--compact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert all((r["device"], r["attention"]) == ("cpu", "reference") for k, r in report.items()
               if isinstance(r, dict) and k != "family")


def test_doctor_on_cuda_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["doctor", "--model", "tiny-llama", "--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.slow  # seconds of real subprocesses
def test_doctor_needs_no_retrieval_stack():
    """An inference-only image (a GPU host without faiss) can still check exactness: the doctor never imports it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['faiss'] = None\n"  # any `import faiss` now raises ImportError
            "from fusionrag.cli import main\n"
            "raise SystemExit(main(['doctor', '--model', 'tiny-llama', '--compact']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["ok"] is True
