"""``fusionrag serve --engine vllm``: the vLLM server command line it becomes (no vLLM needed to check it)."""

from __future__ import annotations

import json

import pytest

from fusionrag.cli import main
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder


@pytest.fixture
def store(tmp_path, fusionrag_home):
    path = tmp_path / "kb"
    build.create_store(path, load_model("tiny-llama"), embedder=HashingEmbedder(), model_source="tiny-llama").close()
    return path


def test_serve_engine_vllm_execs_vllm_serve_with_the_connector(store, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FUSIONRAG_VLLM_PYTHON", str(fake))
    monkeypatch.setattr("fusionrag.vllm.launch.model_folder", lambda store, model: ("tiny", tmp_path))
    ran = {}
    monkeypatch.setattr("os.execvpe", lambda exe, cmd, env: ran.update(cmd=cmd, env=env))
    assert main(["serve", "--engine", "vllm", "--store", str(store), "--port", "8123", "--ratio", "0.2",
                 "--dtype", "float32", "--device", "cpu", "--", "--max-num-seqs", "8"]) == 0
    cmd = ran["cmd"]
    assert cmd[:5] == [str(fake), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path)]
    assert cmd[-2:] == ["--max-num-seqs", "8"] and "--enable-prompt-tokens-details" in cmd
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--served-model-name") + 1] == "tiny"
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "FusionRAGConnector" and config["kv_connector_module_path"] == "fusionrag.vllm"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"store": str(store.resolve()), "ratio": 0.2}
    assert "--kv-transfer-config" in capsys.readouterr().err  # the command is printed before it runs
    assert ran["env"]["VLLM_CPU_KVCACHE_SPACE"]
    assert main(["serve", "--engine", "vllm", "--store", str(store), "--ratio", "auto", "--dtype", "float32",
                 "--device", "cpu"]) == 0  # issue 50: ratio=auto reaches the connector's option as it is
    config = json.loads(ran["cmd"][ran["cmd"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["ratio"] == "auto"


def test_without_vllm_or_a_store_it_says_so_in_one_line(store, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FUSIONRAG_VLLM_PYTHON", str(tmp_path / "none"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.setattr("fusionrag.vllm.launch.beside_installation", lambda: [])
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("vLLM must not start here"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fusionrag.vllm.launch.model_folder", lambda store, model: ("tiny", tmp_path))
    assert main(["serve", "--engine", "vllm", "--store", str(store)]) == 2
    assert "needs vLLM" in capsys.readouterr().err
    assert main(["serve", "--engine", "vllm"]) == 2
    assert "give --store" in capsys.readouterr().err
    assert main(["serve", "--store", str(store), "--", "--max-num-seqs", "8"]) == 2
    assert "vLLM flags go after --" in capsys.readouterr().err


def test_a_never_preprocessed_store_is_named_once_at_start(store, tmp_path, monkeypatch, capsys):
    """As fusionrag's own server does: a store with chunks and no fused KV gets one warning before vLLM starts."""
    doc = tmp_path / "note.txt"
    doc.write_text("The old town of Velmora sits on both banks of the river Ostra.\n", encoding="utf-8")
    lm = load_model("tiny-llama")
    from fusionrag.retrieval.knowledge import KnowledgeStore

    with KnowledgeStore.open(store, lm, embedder=HashingEmbedder()) as kb:
        build.ingest(kb, lm, [doc], progress=False)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FUSIONRAG_VLLM_PYTHON", str(fake))
    monkeypatch.setattr("fusionrag.vllm.launch.model_folder", lambda store, model: ("tiny", tmp_path))
    monkeypatch.setattr("os.execvpe", lambda exe, cmd, env: None)
    assert main(["serve", "--engine", "vllm", "--store", str(store), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert err.count("never preprocessed") == 1 and "fusionrag preprocess --store" in err


def test_the_vllm_environment_is_found_beside_the_installation_from_any_folder(tmp_path, monkeypatch):
    """Issue 47: outside the checkout it said "make .venv-vllm here" although the checkout's .venv-vllm existed."""

    import fusionrag.vllm.launch as launch

    monkeypatch.delenv("FUSIONRAG_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.chdir(tmp_path)  # anywhere but the checkout
    checkout = launch.CHECKOUT
    if not (checkout / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("no .venv-vllm in this checkout (bash scripts/setup_vllm.sh makes it)")
    assert launch.vllm_python() == str(checkout / ".venv-vllm" / "bin" / "python")


def test_prompt_token_details_stay_as_the_flags_after_the_separator_say(store, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FUSIONRAG_VLLM_PYTHON", str(fake))
    monkeypatch.setattr("fusionrag.vllm.launch.model_folder", lambda store, model: ("tiny", tmp_path))
    ran = {}
    monkeypatch.setattr("os.execvpe", lambda exe, cmd, env: ran.update(cmd=cmd))
    assert main(["serve", "--engine", "vllm", "--store", str(store), "--device", "cpu", "--",
                 "--no-enable-prompt-tokens-details"]) == 0
    assert "--enable-prompt-tokens-details" not in ran["cmd"] and ran["cmd"][-1] == "--no-enable-prompt-tokens-details"
