"""The built wheel installs beside a torch the user already has, and works there.

The wheel is built from this checkout (``python -m build --wheel``) and installed with pip
into a fresh virtual environment that already holds a *different* torch from the project's
venv. pip must keep that torch (``torch>=2.4`` is all the package asks for: the exact CPU
pin lives only in scripts/setup.sh), and ``fusionrag doctor --model tiny-qwen2`` (the
invariants on a tiny random model: reuse, RoPE shift, storage, generation) must pass with it.

Which "different torch": the project's venv has torch 2.13.0, the CPU build that
scripts/setup.sh installs. The PyTorch index that serves CPU-only builds
(download.pytorch.org) cannot be reached here, only PyPI and Debian, and every Linux x86_64
torch wheel on PyPI is a CUDA build that pulls ~2.7 GB of NVIDIA wheels (5.5 GB installed).
These machines keep torch 2.14.1 (that CUDA build, with its NVIDIA wheels) on their disk
where pip finds it (pip's configured extra index), so the fresh venv gets
``torch==2.14.1``: a real, newer release, run on the CPU (CUDA builds run without a GPU).
No older CPU build is to be had without the PyTorch index, so the "older torch" case is not
tested. Elsewhere pip downloads the same wheels from PyPI into its cache (``~/.cache/pip``
or ``$PIP_CACHE_DIR``), which later runs reuse. ``FUSIONRAG_TEST_OTHER_TORCH`` picks
another version.

Slow (about 2 minutes here: most of it is pip unpacking torch and its NVIDIA libraries);
skipped, saying why, when that torch or the build's own dependencies cannot be downloaded.
The fresh venv (5.5 GB) is removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OTHER_TORCH = os.environ.get("FUSIONRAG_TEST_OTHER_TORCH", "2.14.1")
#: What a failed pip or build says when it could not download something (not a fault of the package).
UNREACHABLE = re.compile(r"No matching distribution|Could not find a version|ConnectionError|Max retries exceeded|"
                         r"Temporary failure in name resolution|Network is unreachable|HTTPSConnectionPool",
                         re.IGNORECASE)


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clean_env(home: Path) -> dict[str, str]:
    """The environment a user's shell would have: nothing pointing back at this checkout or its venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PYTEST")}
    env["FUSIONRAG_HOME"] = str(home)
    cache = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")
    env["PIP_CACHE_DIR"] = cache  # downloads kept for the next run (and CI's, on the same machine)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _skip_if_unreachable(proc: subprocess.CompletedProcess, what: str) -> None:
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and UNREACHABLE.search(out):
        pytest.skip(f"{what} could not be downloaded here (no network or no such wheel): {out.strip()[-300:]}")


def _torch_of(python: Path, cwd: Path, env: dict[str, str]) -> dict[str, str]:
    code = "import json, torch; print(json.dumps({'version': torch.__version__, 'file': torch.__file__}))"
    proc = _run([str(python), "-c", code], cwd, 120, env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_wheel_installs_beside_another_torch_and_doctor_passes(tmp_path):
    import torch

    if torch.__version__.split("+")[0] == OTHER_TORCH:
        pytest.skip(f"the project's venv already has torch {OTHER_TORCH}: set FUSIONRAG_TEST_OTHER_TORCH")
    env = _clean_env(tmp_path / "home")
    dist = tmp_path / "dist"
    build = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)], tmp_path, 600, env)
    _skip_if_unreachable(build, "the build's own requirements (setuptools)")
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = dist.glob("fusionrag-*.whl")

    venv = tmp_path / "fresh"
    try:
        made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 300, env)
        assert made.returncode == 0, made.stderr
        python = venv / "bin" / "python"
        seeded = _run([str(python), "-m", "pip", "install", "--quiet", f"torch=={OTHER_TORCH}"], tmp_path, 1200, env)
        _skip_if_unreachable(seeded, f"torch {OTHER_TORCH}")
        assert seeded.returncode == 0, seeded.stderr[-2000:]
        before = _torch_of(python, tmp_path, env)
        assert before["version"].split("+")[0] == OTHER_TORCH and before["file"].startswith(str(venv))

        installed = _run([str(python), "-m", "pip", "install", str(wheel)], tmp_path, 1200, env)
        _skip_if_unreachable(installed, "fusionrag's dependencies")
        assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
        out = installed.stdout
        assert "Uninstalling torch" not in out
        done = next((line for line in out.splitlines() if line.startswith("Successfully installed")), "")
        assert "fusionrag-0" in done and not re.search(r"\btorch-\d", done), done  # pip kept the torch it found
        assert _torch_of(python, tmp_path, env) == before

        where = _run([str(python), "-c", "import fusionrag; print(fusionrag.__file__)"], tmp_path, 120, env)
        assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel's copy, not this checkout
        doctor = _run([str(venv / "bin" / "fusionrag"), "doctor", "--model", "tiny-qwen2"], tmp_path, 600, env)
        assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
        report = json.loads(doctor.stdout)
        assert report["ok"] is True and report["model"] == "tiny-qwen2"
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 5.5 GB: never left behind in pytest's kept tmp folders
