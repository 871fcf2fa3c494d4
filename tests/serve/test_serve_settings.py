"""Server settings: flags over FUSIONRAG_* variables over a YAML file over the defaults; --help lists them."""

from __future__ import annotations

import argparse

import pytest

from fusionrag.errors import FusionRAGError
from fusionrag.serve.launch import add_server_args, settings_from_args
from fusionrag.serve.settings import ServerSettings, load_settings


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    return p.parse_args(argv)


def test_flags_override_environment_override_yaml(tmp_path, monkeypatch):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("max_batch: 4\nport: 9001\ndefault_ratio: 0.3\nstall_after_s: 5\n")
    monkeypatch.setenv("FUSIONRAG_MAX_BATCH", "6")
    monkeypatch.setenv("FUSIONRAG_DEFAULT_METHOD", "cacheblend")
    s = settings_from_args(parse(["--config", str(cfg), "--ratio", "0.5"]))
    assert s.max_batch == 6  # environment over the file
    assert s.port == 9001 and s.stall_after_s == 5  # the file over the defaults
    assert s.default_ratio == 0.5  # the flag over the file
    assert s.default_method == "cacheblend"
    assert settings_from_args(parse(["--max-batch", "2"])).max_batch == 2  # the flag over the environment
    monkeypatch.delenv("FUSIONRAG_MAX_BATCH")
    assert settings_from_args(parse([])).max_batch == ServerSettings().max_batch


def test_constructing_settings_directly_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("FUSIONRAG_MAX_BATCH", "6")
    assert ServerSettings().max_batch == 8


@pytest.mark.parametrize(("text", "fragment"), [("max_bach: 4\n", "unknown settings max_bach"),
                                                ("- 1\n- 2\n", "must be a mapping"),
                                                ("max_batch: many\n", "invalid server setting max_batch")])
def test_bad_config_files_are_one_clear_error(tmp_path, text, fragment):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(FusionRAGError, match=fragment):
        load_settings(cfg)


def test_help_lists_every_setting_and_its_variable():
    p = argparse.ArgumentParser()
    add_server_args(p)
    text = p.format_help()
    for name in ServerSettings.model_fields:
        assert f"FUSIONRAG_{name.upper()}" in text, name


def test_a_kv_tier_password_never_reaches_logs():
    s = ServerSettings(kv_tier="redis://user:secret@10.0.0.5:6379/0")
    assert s.to_json()["kv_tier"] == "redis://***@10.0.0.5:6379/0"
    assert ServerSettings(kv_tier="unix:///tmp/r.sock").to_json()["kv_tier"] == "unix:///tmp/r.sock"


@pytest.mark.parametrize("flags, named", [({"max_batch": -1}, "max_batch"), ({"port": 99999}, "port"),
                                          ({"memory_budget_mb": -5}, "memory_budget_mb"),
                                          ({"default_method": "bogus"}, "default_method"),
                                          ({"default_ratio": 5.0}, "default_ratio"),
                                          ({"adhoc_cache_mb": -1}, "adhoc_cache_mb")])
def test_settings_are_checked_before_anything_loads(flags, named):
    """Before: 'serve --method bogus --ratio 5' started and blamed every client with a 400; --max-batch -1,
    --port 99999 and --memory-budget-mb -5 were tracebacks after the model had loaded."""
    from fusionrag.errors import FusionRAGError
    from fusionrag.serve.settings import load_settings

    with pytest.raises(FusionRAGError, match=f"invalid server setting {named}"):
        load_settings(**flags)


def test_the_client_passage_cache_cap_is_a_setting_shown_in_help_and_metrics(client):
    """Before: a hard-coded 2 GiB cap, separate from --memory-budget-mb and not in 'serve --help'."""
    from fusionrag.serve.settings import settings_help

    assert "adhoc_cache_mb" in settings_help() and "shutdown_timeout_s" in settings_help()
    text = client.get("/metrics").text
    assert "fusionrag_adhoc_kv_limit_bytes" in text and "fusionrag_adhoc_kv_bytes" in text


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_timeout_that_is_not_finite_is_refused_in_one_line(monkeypatch, value):
    """Issue 47: ``SHUTDOWN_TIMEOUT_S=inf`` was accepted (a shutdown that never ends)."""
    monkeypatch.setenv("FUSIONRAG_SHUTDOWN_TIMEOUT_S", value)
    with pytest.raises(FusionRAGError, match="shutdown_timeout_s: Input should be a finite number"):
        load_settings()


def test_a_prompt_limit_beyond_the_models_context_is_refused_at_start_or_lowered_when_default(monkeypatch):
    """Issue 47: ``FUSIONRAG_MAX_PROMPT_TOKENS=10^9`` on an 8,192-token model was accepted and a 9,017-token prompt
    served without a word. Asked for: one line at start; the default: lowered to the model's context."""
    from types import SimpleNamespace

    from fusionrag.serve.launch import fit_prompt_limit

    lm = SimpleNamespace(name="tiny", config=SimpleNamespace(max_position_embeddings=4096))
    scheduler = SimpleNamespace(max_prompt_tokens=8192)
    default = load_settings()
    fit_prompt_limit(default, scheduler, lm)
    assert default.max_prompt_tokens == scheduler.max_prompt_tokens == 4096
    monkeypatch.setenv("FUSIONRAG_MAX_PROMPT_TOKENS", str(10 ** 9))
    with pytest.raises(FusionRAGError, match="beyond tiny's context of 4096 tokens"):
        fit_prompt_limit(load_settings(), scheduler, lm)
    fit_prompt_limit(load_settings(max_prompt_tokens=2048), scheduler, lm)  # within it: kept
