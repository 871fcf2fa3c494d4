"""Shared fixtures: tiny random models (no downloads) and the bundled data location."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fusionrag.models import wrap_model
from fusionrag.models.tiny import byte_tokenizer, tiny_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

torch.set_grad_enabled(False)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

#: Folders whose tests are all ``slow``: the studies' and hardware benchmarks' scripts.
SLOW_FOLDERS = {"studies", "benchmarks"}
#: Markers that imply ``slow``: a real packaged model, a real Ray cluster.
SLOW_MARKERS = {"integration", "ray"}


def pytest_collection_modifyitems(config, items):
    """Mark the study and benchmark-script tests and those of the markers above ``slow`` (a single slow test
    carries ``@pytest.mark.slow`` itself): ``pytest -m "not slow"`` is the edit loop."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in SLOW_FOLDERS or SLOW_MARKERS & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """Start the connector's tests in ``.venv-vllm`` now when this session runs them: beside the rest."""
    import vllm_env_run

    if any(item.nodeid == vllm_env_run.TEST_ID for item in session.items):
        vllm_env_run.start()


def pytest_sessionfinish(session, exitstatus):
    import vllm_env_run

    vllm_env_run.stop()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request):
    """A tiny randomly initialised model of each family the tests must cover."""
    return wrap_model(tiny_model(request.param, seed=1), byte_tokenizer(), name=f"tiny-{request.param}")


@pytest.fixture(scope="session")
def tiny_llama():
    return wrap_model(tiny_model("llama", seed=1), byte_tokenizer(), name="tiny-llama")


@pytest.fixture
def fusionrag_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FUSIONRAG_HOME", str(home))
    return home


def shared_data_file(rel: str) -> Path:
    path = SHARED_DATA / rel
    if not path.is_file():
        pytest.skip(f"evaluation data not found at {path} (expected ../shared/data next to the repository)")
    return path


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A server app over a small preprocessed store with small limits (the route and protocol tests)."""
    from serve_helpers import small_limits_app

    return small_limits_app(tmp_path_factory)


@pytest.fixture(scope="module")
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
