"""The knowledge-base stores a quality run reads: supersession when the knowledge base changes, refusing
foreign stores, and plain-KV-only runs (the studies' store variants: tests/studies/test_study_stores.py)."""

import json

import pytest

from bench_helpers import other_file, sample_data
from fusionrag.bench.quality import QualitySpec, run_quality
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.embedder import HashingEmbedder


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _kb_spec(tmp_path, limit):
    return QualitySpec(data=[tmp_path / "hotpotqa" / "mini.jsonl"], out=tmp_path / "out", model="tiny-llama",
                       limit=limit, ratios=[0.15], methods=["reuse", "cachecraft", "fusionrag"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                       cache_dir=tmp_path / "cache")


def test_a_changed_knowledge_base_supersedes_only_the_cells_that_read_the_store(tmp_path, capsys):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    before = _lines(tmp_path / "out" / "records.jsonl")
    run_quality(_kb_spec(tmp_path, limit=3))  # knowledge base grows from 2 to 3 questions' passages
    out = capsys.readouterr().out
    assert "moved to records.superseded.jsonl" in out
    moved = _lines(tmp_path / "out" / "records.superseded.jsonl")
    assert moved and all(r["kb"].endswith("-n2-top1-nearest_first-int8") for r in moved)
    assert len(moved) == sum(r["kb"] is not None for r in before)
    after = _lines(tmp_path / "out" / "records.jsonl")
    keys = [(r["qid"], r["run"]) for r in after]
    assert len(keys) == len(set(keys)) == 3 * 4  # every cell once, none from the old knowledge base
    for r in after:
        assert r["kb"] is None or r["kb"].endswith("-n3-top1-nearest_first-int8")
    plain = [r for r in before if r["kb"] is None]
    assert all(r in after for r in plain)  # plain-KV cells do not depend on the knowledge base: kept


def test_a_store_of_another_file_is_refused_not_extended(tmp_path):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    spec = _kb_spec(tmp_path, limit=2)
    spec.data, spec.out = [other_file(tmp_path)], tmp_path / "out_other"
    with pytest.raises(FusionRAGError, match="not passages of this run"):  # same store name, other passages
        run_quality(spec)


def test_plain_only_cells_build_no_fused_kv_and_a_later_fused_run_adds_it(tmp_path):
    from fusionrag.retrieval.store_info import store_info

    sample_data(tmp_path)
    spec = _kb_spec(tmp_path, limit=2)
    spec.methods = ["fusionrag:plain", "epic"]  # plain KV only: the offline stage is not needed
    run_quality(spec)
    (store,) = (tmp_path / "cache" / "stores").iterdir()
    info = store_info(store)
    assert info["plain_kv"] == info["chunks"] > 0 and info["fused_kv"] == 0
    run_quality(_kb_spec(tmp_path, limit=2))  # fused cells: the same store is fused now
    info = store_info(store)
    assert info["fused_kv"] == info["chunks"]
