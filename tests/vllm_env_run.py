"""``tests/vllm_connector`` in the vLLM environment, started as soon as the session knows it will run them.

vLLM pins an older transformers than fusionrag's own environment, so the connector's tests run in
``.venv-vllm`` as a subprocess. They take several minutes of mostly one core; started when collection
finishes (``tests/conftest.py``), they run beside the rest of the suite on the machine's other core, and
``test_in_vllm_env.py`` waits for their result.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm" / "bin" / "python"
TEST_ID = "tests/vllm_connector/test_in_vllm_env.py::test_the_connector_tests_pass_in_the_vllm_environment"

_run: tuple[subprocess.Popen, Path] | None = None


def wanted() -> bool:
    """Whether the connector's tests must run in ``.venv-vllm`` (vLLM is not importable here, and it exists)."""
    return importlib.util.find_spec("vllm") is None and VENV.exists()


def start() -> None:
    """Start them (once); their output goes to a temporary file."""
    global _run
    if _run is not None or not wanted():
        return
    out = Path(tempfile.mkstemp(prefix="fusionrag-vllm-tests-", suffix=".log")[1])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with out.open("wb") as sink:
        proc = subprocess.Popen([str(VENV), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_connector",
                                 "--ignore=tests/vllm_connector/test_in_vllm_env.py"], cwd=ROOT, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
    _run = (proc, out)


def result(timeout_s: float) -> tuple[int, str]:
    """Their exit code and output (started now if they were not yet)."""
    start()
    assert _run is not None
    proc, out = _run
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = -9
    return code, out.read_text(errors="replace")


def stop() -> None:
    """End them if the session ends first (an interrupted run leaves no vLLM behind)."""
    if _run is not None and _run[0].poll() is None:
        _run[0].kill()
        _run[0].wait()
