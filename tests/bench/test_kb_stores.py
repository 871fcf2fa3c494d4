"""The knowledge-base stores a study reads: a fixed larger store, seeding, supersession, and refusing foreign stores."""

import json

import pytest

from bench_helpers import sample_data
from fusionrag.bench.quality import QualitySpec, run_quality
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _kb_spec(tmp_path, limit, kb_limit=None):
    return QualitySpec(data=[tmp_path / "hotpotqa" / "mini.jsonl"], out=tmp_path / "out", model="tiny-llama",
                       limit=limit, kb_limit=kb_limit, ratios=[0.15], methods=["reuse", "cachecraft", "fusionrag"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                       cache_dir=tmp_path / "cache")


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


def test_a_changed_knowledge_base_supersedes_only_the_cells_that_read_the_store(tmp_path, capsys):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    before = _lines(tmp_path / "out" / "records.jsonl")
    run_quality(_kb_spec(tmp_path, limit=3))  # knowledge base grows from 2 to 3 questions' passages
    out = capsys.readouterr().out
    assert "seeded from tiny-llama-hotpotqa-n2-top1" in out and "moved to records.superseded.jsonl" in out
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


def _other_file(tmp_path):
    """Another HotpotQA file (same dataset name): the sample's last two questions, renamed."""
    path = tmp_path / "other" / "hotpotqa_other.jsonl"
    path.parent.mkdir()
    rows = [{**ex, "id": f"other-{ex['id']}"} for ex in load_sample()[3:5]]
    path.write_text("".join(json.dumps(ex) + "\n" for ex in rows))
    return path


def test_another_file_of_the_same_dataset_never_mixes_into_records_or_stores(tmp_path, capsys):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=1))
    other = _other_file(tmp_path)
    spec = _kb_spec(tmp_path, limit=2)
    spec.data = [other]
    with pytest.raises(FusionRAGError, match="another --out"):  # same records file: refused, nothing written
        run_quality(spec)
    spec.out = tmp_path / "out_other"
    run_quality(spec)  # own folder; the n1 store of the first file must not seed its n2 store
    assert "building from scratch" in capsys.readouterr().out
    recs = _lines(tmp_path / "out_other" / "records.jsonl")
    assert {r["qid"] for r in recs} == {"other-" + ex["id"] for ex in load_sample()[3:5]}


def test_a_store_of_another_file_is_refused_not_extended(tmp_path):
    sample_data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    spec = _kb_spec(tmp_path, limit=2)
    spec.data, spec.out = [_other_file(tmp_path)], tmp_path / "out_other"
    with pytest.raises(FusionRAGError, match="not passages of this run"):  # same store name, other passages
        run_quality(spec)


def test_kb_limit_below_limit_is_a_clear_error(tmp_path):
    sample_data(tmp_path)
    with pytest.raises(FusionRAGError, match="--kb-limit"):
        run_quality(_kb_spec(tmp_path, limit=3, kb_limit=2))


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


def test_plain_only_cells_on_some_questions_compute_only_those_questions_plain_kv(tmp_path):
    """A --fuse-only-evaluated run of plain-KV cells reads only the evaluated questions' passages; a later
    fused run completes the plain KV its neighbours need."""
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.membership import membership
    from fusionrag.models import load_model
    from fusionrag.retrieval.knowledge import KnowledgeStore

    data = sample_data(tmp_path)
    spec = _kb_spec(tmp_path, limit=1, kb_limit=3)
    spec.methods, spec.fuse_only_evaluated, spec.decode = ["fusionrag:plain", "epic"], True, False
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
