"""The studies' stores (studies/harness/stores.py): a fixed larger knowledge base, seeding from a smaller
store, and fusing only the evaluated questions' chunks."""

import json

import pytest
from studies.harness.stores import StudyStores

from bench_helpers import other_file, sample_data
from fusionrag.bench.quality import QualitySpec, run_quality
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _kb_spec(tmp_path, limit, kb_limit=None, fuse_only_evaluated=False):
    return QualitySpec(data=[tmp_path / "hotpotqa" / "mini.jsonl"], out=tmp_path / "out", model="tiny-llama",
                       limit=limit, kb_limit=kb_limit, ratios=[0.15], methods=["reuse", "cachecraft", "fusionrag"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                       cache_dir=tmp_path / "cache", stores=StudyStores(fuse_only_evaluated=fuse_only_evaluated))


def test_a_larger_fixed_knowledge_base_lets_later_runs_add_questions_without_recomputing(tmp_path):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2, kb_limit=3))
    first = _lines(tmp_path / "out" / "records.jsonl")
    assert len({r["qid"] for r in first}) == 2 and len(first) == 2 * 4  # reuse plain + fused, cachecraft, fusionrag
    stores = {r["kb"] for r in first if r["kb"]}
    assert len(stores) == 1 and "-n3-top1-" in stores.pop()  # the store holds all three questions' passages
    assert all((r["kb"] is None) == (r["kv"] == "plain" and r["method"] != "cachecraft") for r in first)
    meta = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]
    assert meta["kb_limit"] == 3 and meta["knowledge_base_stores"] == {"hotpotqa": [first[1]["kb"] or first[2]["kb"]]}
    run_quality(_kb_spec(tmp_path, limit=3, kb_limit=3))
    second = _lines(tmp_path / "out" / "records.jsonl")
    assert second[: len(first)] == first  # nothing recomputed, nothing superseded
    assert len(second) == len(first) * 3 // 2  # only the third question's cells were added
    assert not (tmp_path / "out" / "records.superseded.jsonl").exists()


def test_a_larger_store_is_seeded_from_the_smaller_one_of_the_same_settings(tmp_path, capsys):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    run_quality(_kb_spec(tmp_path, limit=3))  # knowledge base grows from 2 to 3 questions' passages
    out = capsys.readouterr().out
    assert "seeded from tiny-llama-hotpotqa-n2-top1" in out and "moved to records.superseded.jsonl" in out


def test_another_file_of_the_same_dataset_never_mixes_into_records_or_stores(tmp_path, capsys):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=1))
    other = other_file(tmp_path)
    spec = _kb_spec(tmp_path, limit=2)
    spec.data = [other]
    with pytest.raises(FusionRAGError, match="another --out"):  # same records file: refused, nothing written
        run_quality(spec)
    spec.out = tmp_path / "out_other"
    run_quality(spec)  # own folder; the n1 store of the first file must not seed its n2 store
    assert "building from scratch" in capsys.readouterr().out
    recs = _lines(tmp_path / "out_other" / "records.jsonl")
    assert {r["qid"] for r in recs} == {"other-" + ex["id"] for ex in load_sample()[3:5]}


def test_kb_limit_below_limit_is_a_clear_error(tmp_path):
    sample_data(tmp_path)
    with pytest.raises(FusionRAGError, match="--kb-limit"):
        run_quality(_kb_spec(tmp_path, limit=3, kb_limit=2))


def test_plain_only_cells_on_some_questions_compute_only_those_questions_plain_kv(tmp_path):
    """A fuse-only-evaluated run of plain-KV cells reads only the evaluated questions' passages; a later
    fused run completes the plain KV its neighbours need."""
    from studies.harness.membership import membership

    from fusionrag.bench.datasets import load_questions
    from fusionrag.models import load_model
    from fusionrag.retrieval.knowledge import KnowledgeStore

    data = sample_data(tmp_path)
    spec = _kb_spec(tmp_path, limit=1, kb_limit=3, fuse_only_evaluated=True)
    spec.methods, spec.decode = ["fusionrag:plain", "epic"], False
    run_quality(spec)
    (path,) = (tmp_path / "cache" / "stores").iterdir()
    store = KnowledgeStore.open(path, load_model("tiny-llama"))
    try:
        evaluated = set(membership(store, load_questions(data, 1)).prompts[0])
        with_plain = {c for c in store.chunk_ids() if store.has_kv(c, "plain")}
        assert with_plain == evaluated and len(store.chunk_ids()) > len(evaluated)
    finally:
        store.close()
    spec.methods = ["reuse"]  # plain and fused: now the offline stage runs: every chunk's plain KV is there
    run_quality(spec)
    store = KnowledgeStore.open(path, load_model("tiny-llama"))
    try:
        assert all(store.has_kv(c, "plain") for c in store.chunk_ids())
    finally:
        store.close()
