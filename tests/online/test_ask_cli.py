"""``fusionrag ask`` on the command line: ``--stream`` keeps the summary lines (method, TTFT, sources) on stderr,
and a store never preprocessed is said once, before the model loads."""

from __future__ import annotations

import pytest

from fusionrag.cli import main
from fusionrag.retrieval.embedder import HashingEmbedder
from store_helpers import sample_store

QUESTION = "Who discovered polonium?"


@pytest.fixture(scope="module")
def plain_store(tmp_path_factory):
    """A store ingested but never preprocessed (plain KV only)."""
    return sample_store(tmp_path_factory.mktemp("kb") / "store", passages=6, fuse=False)


def test_stream_keeps_the_summary_lines_and_a_never_preprocessed_store_is_said(plain_store, capsys, monkeypatch):
    monkeypatch.setattr("fusionrag.retrieval.embedder.get_embedder", lambda name=None: HashingEmbedder())
    argv = ["ask", QUESTION, "--store", str(plain_store), "--max-tokens", "3", "--top-k", "2"]
    assert main([*argv, "--stream"]) == 0
    streamed = capsys.readouterr()
    assert main(argv) == 0
    plain = capsys.readouterr()
    for err in (streamed.err, plain.err):
        assert err.count("was never preprocessed (no fused KV)") == 1
        assert "fusionrag preprocess --store" in err
        assert "context tokens recomputed; TTFT" in err and "  [1] " in err and "  [2] " in err
    assert streamed.out.strip() and "TTFT" not in streamed.out  # stdout: the answer alone
    # no warning where the question does not reuse the store's KV
    assert main([*argv, "--method", "full"]) == 0
    assert "never preprocessed" not in capsys.readouterr().err
