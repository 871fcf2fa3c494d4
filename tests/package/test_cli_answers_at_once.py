"""The command line answers ``--help``, ``--version`` and every input or state check before anything heavy loads.

Building the parser and rejecting a wrong input must not import torch, transformers, FAISS or
sentence-transformers (8-12 s of imports on a small machine before they were made lazy): each case
runs in a fresh interpreter, which then reports the heavy modules it imported. Not a timing test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "faiss", "sentence_transformers")

RUN = """
import contextlib, io, json, sys
from fusionrag.cli import build_parser, main
build_parser()
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        code = main(json.loads(sys.argv[1]))
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "err": err.getvalue()[-500:],
                  "heavy": sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)}))
"""


def _run(argv: list[str], cwd) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(argv), json.dumps(HEAVY)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, code, said", [
    (["--help"], 0, ""),
    (["--version"], 0, ""),
    (["ask", "--help"], 0, ""),
    (["ingest", "--help"], 0, ""),
    (["serve", "--help"], 0, ""),
    (["bench", "quality", "--help"], 0, ""),
    (["ask", "   ", "--store", "kb"], 2, "the question is empty"),
    (["ask", "Who?", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["ask", "Who?", "--ratio", "2"], 2, "ratio"),
    (["documents", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["store", "info", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["preprocess", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["delete", "x", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["serve", "--store", "kb-typo"], 2, "no knowledge store at 'kb-typo'"),
    (["serve", "--max-batch", "0"], 2, "invalid server setting max_batch"),
    (["ingest", "missing.txt", "--store", "kb"], 2, "missing.txt: no such file or folder"),
])
def test_help_version_and_checks_import_nothing_heavy(tmp_path, argv, code, said):
    out = _run(argv, tmp_path)
    assert out["code"] == code, out["err"]
    assert said in out["err"]
    assert out["heavy"] == [], f"{argv} imported {out['heavy']}"
    assert not (tmp_path / "kb").exists()  # a refused ingest created nothing
