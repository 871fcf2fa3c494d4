"""The connector's tests, run from the main environment: in the vLLM environment ``scripts/setup.sh`` makes.

vLLM pins an older transformers than fusionrag's own environment uses, so it has its own virtual
environment (``.venv-vllm``); this test runs ``tests/vllm_connector`` there (started when collection finishes, so
they run beside the rest of the suite: ``tests/vllm_env_run.py``), so the README's one test command covers the
connector too. Where vLLM is importable here, those tests ran directly and this one steps aside.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

import vllm_env_run
from vllm_env_run import VENV


@pytest.mark.slow
def test_the_connector_tests_pass_in_the_vllm_environment():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: tests/vllm_connector ran in this interpreter")
    if not VENV.exists():
        if os.environ.get("FUSIONRAG_CI"):
            pytest.fail("no .venv-vllm in CI: scripts/setup.sh --test (scripts/setup_vllm.sh) must make it")
        pytest.skip("no .venv-vllm here (bash scripts/setup_vllm.sh makes it)")
    code, output = vllm_env_run.result(timeout_s=2400)  # started when collection finished (tests/conftest.py)
    tail = "\n".join(output.splitlines()[-25:])
    assert code == 0, f"tests/vllm_connector failed in .venv-vllm:\n{tail}"
    summary = [line for line in output.splitlines() if re.search(r"\d+ passed", line)]
    assert summary and "skipped" not in summary[-1], tail  # every connector test ran
