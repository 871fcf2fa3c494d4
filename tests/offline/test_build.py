"""Building a store: fuse settings decided in one place and recorded; mutations report what they changed."""

from __future__ import annotations

import pytest

from fusionrag.errors import FusionRAGError
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.offline.build import FuseSettings, recorded_fuse_settings, resolve_fuse_settings
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.store_info import store_info

PASSAGES = [{"title": t, "text": f"{t} is a word about {t.lower()} and more text."} for t in
            ("Alpha", "Beta", "Gamma", "Delta", "Epsilon")]


@pytest.fixture
def lm():
    return load_model("tiny-llama")


@pytest.fixture
def store(tmp_path, lm):
    s = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder())
    build.add_passages(s, lm, PASSAGES)
    yield s
    s.close()


def test_settings_resolve_explicit_then_recorded_then_defaults(store, lm):
    assert recorded_fuse_settings(store) is None
    assert resolve_fuse_settings(store) == FuseSettings()
    report = build.fuse(store, lm, top_n=2, neighbour_order="nearest_last", progress=False)
    assert (report.top_n, report.neighbour_order) == (2, "nearest_last")
    assert recorded_fuse_settings(store) == FuseSettings(2, "nearest_last", False)
    assert store_info(store.path)["settings"]["fuse"] == {"top_n": 2, "neighbour_order": "nearest_last",
                                                           "same_document": False, "min_similarity": None}
    assert resolve_fuse_settings(store, top_n=3) == FuseSettings(3, "nearest_last", False)
    assert build.fuse(store, lm, progress=False).computed == 0  # the recorded settings: nothing stale


def test_a_fused_store_stays_fused_and_ingest_reports_the_keys_it_rewrote(store, lm, tmp_path):
    build.fuse(store, lm, top_n=2, progress=False)
    corpus = tmp_path / "more.txt"
    corpus.write_text("Alpha and Beta and Gamma are words about alpha beta gamma.")
    report = build.ingest(store, lm, [corpus], progress=False)
    assert report.fuse is not None and report.fuse["top_n"] == 2
    assert report.changed_keys and all(kind == "fused" for _, kind in report.changed_keys)
    assert set(report.new_ids) <= {c for c, _ in report.changed_keys}


def test_a_server_can_fuse_some_chunks_without_switching_the_store_to_fused(store, lm):
    build.fuse(store, lm, top_n=2, chunk_ids=[0, 1], record=False, progress=False)
    assert recorded_fuse_settings(store) is None and store.has_kv(0, "fused") and not store.has_kv(2, "fused")


def test_stores_written_before_the_fuse_setting_keep_their_settings(store):
    store.update_settings(top_n=4, neighbour_order="nearest_last", same_document=True)
    assert recorded_fuse_settings(store) == FuseSettings(4, "nearest_last", True)


def test_bad_settings_are_clear_errors(store, lm):
    with pytest.raises(FusionRAGError, match="top-n must be >= 0"):
        build.fuse(store, lm, top_n=-1)
    with pytest.raises(FusionRAGError, match="unknown neighbour order"):
        FuseSettings(2, "sideways")


def test_delete_returns_both_kinds_of_every_removed_chunk(store, lm):
    ids = build.add_passages(store, lm, [{"title": "Z", "text": "zeta"}], doc="gone")
    assert build.delete_document(store, "gone") == [(ids[0], "plain"), (ids[0], "fused")]
    assert build.delete_document(store, "gone") == []


def test_the_cli_and_python_make_stores_of_the_same_kv_dtype(tmp_path, lm, fusionrag_home):
    """One default for the KV storage dtype, whichever door builds the store."""
    from fusionrag.cli import main
    from fusionrag.kvcache.store import DEFAULT_KV_DTYPE
    from fusionrag.retrieval.knowledge import KnowledgeStore

    doc = tmp_path / "in" / "a.txt"
    doc.parent.mkdir()
    doc.write_text("Alpha is a word about alpha and more text.")
    assert main(["ingest", str(doc.parent), "--store", str(tmp_path / "cli"), "--model", "tiny-llama",
                 "--embedder", "hashing-64", "--quiet"]) == 0
    from_python = [build.create_store(tmp_path / "py", lm, embedder=HashingEmbedder()),
                   KnowledgeStore.create(tmp_path / "py2", lm, embedder=HashingEmbedder())]
    dtypes = {store_info(tmp_path / "cli")["settings"]["kv_dtype"], *(s.settings["kv_dtype"] for s in from_python)}
    for s in from_python:
        s.close()
    assert dtypes == {DEFAULT_KV_DTYPE}
