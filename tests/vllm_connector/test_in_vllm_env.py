"""The connector's tests, run from the main environment: in the vLLM environment ``scripts/setup.sh`` makes.

vLLM pins an older transformers than fusionrag's own environment uses, so it has its own virtual
environment (``.venv-vllm``); this test runs ``tests/vllm_connector`` there, so the README's one test command covers
the connector too. Where vLLM is importable here, those tests ran directly and this one steps aside.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
def test_the_connector_tests_pass_in_the_vllm_environment():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: tests/vllm_connector ran in this interpreter")
    if not VENV.exists():
        if os.environ.get("FUSIONRAG_CI"):
            pytest.fail("no .venv-vllm in CI: scripts/setup.sh (scripts/setup_vllm.sh) must make it")
        pytest.skip("no .venv-vllm here (bash scripts/setup_vllm.sh makes it)")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([str(VENV), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_connector",
                           "--ignore=tests/vllm_connector/test_in_vllm_env.py"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
    assert done.returncode == 0, f"tests/vllm_connector failed in .venv-vllm:\n{tail}"
    assert " passed" in done.stdout and "skipped" not in done.stdout, tail
