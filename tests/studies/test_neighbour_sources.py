"""Neighbour sources produce the lists they claim (hand-built corpus), and a store fused with them uses them."""

from __future__ import annotations

import json

import pytest
from studies.harness.membership import membership
from studies.harness.stores import StudyStores
from studies.neighbours.sources import NeighbourSource, neighbour_composition, neighbour_lists

from bench_helpers import sample_data
from fusionrag.bench.datasets import QAExample, cut_passages
from fusionrag.bench.quality import QualitySpec, run_quality
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.chunking import Passage
from fusionrag.retrieval.embedder import HashingEmbedder


def _p(name: str) -> Passage:
    return Passage(name, f"{name} is a passage about {name.lower()} and its facts.")


# Three questions; B and C are retrieved by two questions each, F by none but the last.
QUESTIONS = [("q0", "ABC"), ("q1", "BDC"), ("q2", "EF")]


@pytest.fixture
def kb(tmp_path):
    lm = load_model("tiny-llama")
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder())
    examples = [QAExample(qid, "why?", ["x"], [_p(c) for c in letters], "toy") for qid, letters in QUESTIONS]
    seen = []
    for ex in examples:
        fresh = [p for p in ex.passages if p not in seen]
        seen.extend(fresh)
        build.add_passages(store, lm, [{"title": p.title, "text": p.text} for p in fresh], doc=ex.id, plain_kv=False)
    ids = {p.title: store.find_by_hash(_hash(store, p)) for p in seen}
    yield store, lm, examples, ids
    store.close()


def _hash(store, p):
    from fusionrag.retrieval.chunking import make_chunks

    return make_chunks(store.prompt, [p], int(store.settings["chunk_tokens"]))[0].content_hash


def _names(lists, ids):
    back = {v: k for k, v in ids.items()}
    return {back[c]: "".join(back[n] for n in ns) for c, ns in lists.items()}


def test_each_source_gives_the_neighbours_it_claims(kb):
    store, _lm, examples, ids = kb
    members = membership(store, examples)
    assert [[c for c in p] for p in members.prompts] == [[ids[x] for x in letters] for _, letters in QUESTIONS]
    preceding = _names(neighbour_lists(store, members, "preceding", 9), ids)
    # each chunk's first prompt: C first appears in q0 after A, B; D in q1 after B
    assert preceding == {"A": "", "B": "A", "C": "AB", "D": "B", "E": "", "F": "E"}
    question = _names(neighbour_lists(store, members, "question", 9), ids)
    assert {k: set(v) for k, v in question.items()} == {
        "A": set("BC"), "B": set("ACD"), "C": set("ABD"), "D": set("BC"), "E": set("F"), "F": set("E")}
    other = _names(neighbour_lists(store, members, "other-questions", 9), ids)
    assert {k: set(v) for k, v in other.items()} == {
        "A": set("DEF"), "B": set("EF"), "C": set("EF"), "D": set("AEF"), "E": set("ABCD"), "F": set("ABCD")}
    assert neighbour_lists(store, members, "corpus", 9) is None  # the store's own search
    capped = _names(neighbour_lists(store, members, "preceding", 1), ids)
    assert capped["C"] == "B"  # top-n of the preceding passages: the ones right before it


def test_composition_counts_same_question_and_preceding_neighbours(kb):
    store, _lm, examples, _ids = kb
    members = membership(store, examples)
    comp = neighbour_composition(store, members, neighbour_lists(store, members, "preceding", 9))
    assert comp["same_question_share"] == 1.0 and comp["preceding_share"] == 1.0
    assert comp["neighbours_per_chunk"] == pytest.approx(5 / 6)
    comp = neighbour_composition(store, members, neighbour_lists(store, members, "other-questions", 9))
    assert comp["same_question_share"] == 0.0 and comp["preceding_share"] == 0.0
    assert -1.0 <= comp["mean_similarity"] <= 1.0


def test_a_store_fused_with_given_lists_records_exactly_them(kb):
    store, lm, examples, ids = kb
    lists = neighbour_lists(store, membership(store, examples), "preceding", 9)
    report = build.fuse(store, lm, top_n=9, neighbour_lists=lists, progress=False)
    assert report.computed == len(ids) and not store.settings.get("fuse")  # explicit lists are not a setting
    for cid, neighbours in lists.items():
        assert store.load_entry(cid, "fused").extra["neighbours"] == neighbours
    again = build.fuse(store, lm, top_n=9, neighbour_lists=lists, progress=False)
    assert again.computed == 0  # resumable: the same lists are current


def test_min_similarity_keeps_only_close_neighbours(kb):
    store, lm, _examples, ids = kb
    everyone = store.neighbours(list(ids.values()), 5)
    assert all(len(v) == 5 for v in everyone.values())
    none = store.neighbours(list(ids.values()), 5, min_similarity=0.999)
    assert all(v == [] for v in none.values())  # distinct passages are never that similar
    report = build.fuse(store, lm, top_n=5, min_similarity=0.999, progress=False)
    assert report.computed == len(ids) and build.recorded_fuse_settings(store).min_similarity == 0.999
    assert all(store.load_entry(c, "fused").extra["neighbours"] == [] for c in ids.values())


def test_cut_passages_keeps_supporting_ones_then_the_earliest():
    ps = [_p(c) for c in "ABCDEFGH"]
    kept = cut_passages(ps, ["G", "C"], 4)
    assert [p.title for p in kept] == ["A", "B", "C", "G"]
    assert cut_passages(ps, [], 3) == ps[:3] and cut_passages(ps, ["A"], 20) == ps


def test_a_neighbour_source_store_is_seeded_from_the_same_knowledge_base(tmp_path, capsys):
    """Another neighbour source reuses the plain KV of the store it shares a knowledge base with, fuses
    only the evaluated chunks with its own lists, and reports its neighbour composition."""
    data = sample_data(tmp_path)
    common = dict(data=[data], model="tiny-llama", limit=2, kb_limit=3, ratios=[0.15], methods=["reuse"],
                  top_n=[2], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                  cache_dir=tmp_path / "cache", full_reference=tmp_path / "ref", decode=False,
                  kv_dtype="float16")
    run_quality(QualitySpec(out=tmp_path / "corpus", **common))
    capsys.readouterr()
    preceding = StudyStores(NeighbourSource("preceding"), fuse_only_evaluated=True)
    run_quality(QualitySpec(out=tmp_path / "pre", stores=preceding, **common))
    assert "seeded from tiny-llama-hotpotqa-n3-top2-nearest_first " in capsys.readouterr().out
    stores = sorted(p.name for p in (tmp_path / "cache" / "stores").iterdir())
    assert stores == ["tiny-llama-hotpotqa-n3-top2-nearest_first",
                      "tiny-llama-hotpotqa-n3-top2-nearest_first-nbpreceding"]
    meta = json.loads((tmp_path / "pre" / "results.json").read_text())["meta"]
    comp = meta["neighbour_composition"]["tiny-llama-hotpotqa-n3-top2-nearest_first-nbpreceding"]
    assert comp["source"] == "preceding" and comp["preceding_share"] in (1.0, None)
    recs = [json.loads(line) for line in (tmp_path / "pre" / "records.jsonl").read_text().splitlines()]
    assert {r["run"] for r in recs} == {"reuse|plain|0|0", "reuse|fused|0|2"} and all(r.get("f1") is None for r in recs)
    assert all(r["gold_nll"] > 0 and r["kl_answer"] >= 0 for r in recs)
