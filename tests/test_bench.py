"""A tiny end-to-end ``bench quality`` run (tiny random model, three questions) and its resume."""

import json

from fusionrag.eval.bench_quality import QualitySpec, plan_runs, run_quality
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def _data(tmp_path):
    path = tmp_path / "hotpotqa" / "mini.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()[:3]))
    return path


def test_plan_has_no_duplicates_and_ratio_independent_methods_once():
    spec = QualitySpec(data=[], out=None, ratios=[0, 0.1, 0.15, 1.0], kv="both", top_n=[0, 2])
    runs = plan_runs(spec)
    keys = [r.key for r in runs]
    assert len(keys) == len(set(keys))
    assert sum(r.method == "full" for r in runs) == 1
    assert {r.ratio for r in runs if r.method == "fusionrag"} == {0.1, 0.15}


def test_tiny_bench_writes_well_formed_results_and_resumes(tmp_path):
    data = _data(tmp_path)
    out = tmp_path / "out"
    spec = QualitySpec(data=[data], out=out, model="tiny-llama", limit=3, ratios=[0.15],
                       methods=["full", "reuse", "cacheblend", "cachecraft", "query", "fusionrag"], top_n=[2],
                       max_new_tokens=3, progress=False, embedder=HashingEmbedder())
    rows = run_quality(spec)
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["model"] == "tiny-llama" and len(doc["rows"]) == len(rows)
    by = {(r["method"], r["kv"]): r for r in rows}
    assert by[("full", "none")]["agree_f1"] == 1.0 and by[("full", "none")]["kl_first"] < 1e-6
    for r in rows:
        assert r["n"] == 3 and r["dataset"] == "hotpotqa"
        for key in ("f1", "em", "agree_f1", "kl_first", "top1_agree", "ctx_tokens", "recomputed_tokens",
                    "ttft_ms_median", "f1_ci", "load_ms_median", "select_ms_median", "recompute_ms_median"):
            assert key in r
        assert r["recompute_ms_median"] is not None
    assert (out / "results.md").is_file() and (out / "norm_f1_vs_ratio.png").is_file()
    n_records = len((out / "records.jsonl").read_text().splitlines())
    run_quality(spec)  # everything cached: nothing recomputed
    assert len((out / "records.jsonl").read_text().splitlines()) == n_records


def test_tiny_ttft_bench_writes_report_with_speedups_and_loader(tmp_path, fusionrag_home):
    from fusionrag.eval.bench_ttft import TTFTSpec, run_ttft

    data = tmp_path / "hotpotqa" / "mini.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()))
    spec = TTFTSpec(data=data, out=tmp_path / "ttft", model="tiny-llama", context_tokens=[400, 800], repeats=1,
                    top_n=1, loader_requests=2, loader_context=400, embedder=HashingEmbedder())
    rows = run_ttft(spec)
    doc = json.loads((tmp_path / "ttft" / "ttft.json").read_text())
    assert len(doc["rows"]) == len(rows) > 0 and (tmp_path / "ttft" / "ttft.png").is_file()
    assert {r["tier"] for r in rows} == {"memory", "disk"}
    for r in rows:
        assert r["speedup_vs_full"] > 0 and r["context_tokens"] >= 0.9 * r["target_tokens"]
        assert (r["recomputed_tokens"] == 0) == (r["ratio"] == 0.0)
    assert {"sync", "async"} <= set(doc["meta"]["loader"])


def test_report_from_records_reaggregates_without_running(tmp_path):
    from fusionrag.eval.bench_quality import report_from_records

    data = _data(tmp_path)
    out = tmp_path / "out"
    spec = QualitySpec(data=[data], out=out, model="tiny-llama", limit=2, ratios=[0.15], methods=["full", "reuse"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder())
    rows = run_quality(spec)
    (out / "results.json").unlink()
    again = report_from_records(out, model="tiny-llama", data_files=[data])
    assert [(r["method"], r["kv"], r["n"]) for r in again] == [(r["method"], r["kv"], r["n"]) for r in rows]
    assert json.loads((out / "results.json").read_text())["meta"]["questions_per_dataset"] == {"hotpotqa": 2}


def test_cached_full_attention_serves_the_full_cell_without_a_ttft(tmp_path):
    data = _data(tmp_path)
    common = dict(data=[data], model="tiny-llama", limit=3, ratios=[0.15], methods=["full", "reuse"], top_n=[2],
                  max_new_tokens=3, progress=False, embedder=HashingEmbedder(), cache_dir=tmp_path / "cache")
    first = {r["method"]: r for r in run_quality(QualitySpec(out=tmp_path / "a", **common))}
    second = {r["method"]: r for r in run_quality(QualitySpec(out=tmp_path / "b", reuse_full_cache=True, **common))}
    recs = [json.loads(line) for line in (tmp_path / "b" / "records.jsonl").read_text().splitlines()]
    full = [r for r in recs if r["method"] == "full"]
    assert len(full) == 3 and all(r["full_from_cache"] and r["ttft_ms"] is None for r in full)
    assert all(r["recomputed_tokens"] == r["ctx_tokens"] > 0 for r in full)
    # same answers as the measured run; the TTFT of the cache-served cell is absent, not invented
    assert second["full"]["agree_f1"] == 1.0 and second["full"]["f1"] == first["full"]["f1"]
    assert second["full"]["ttft_ms_median"] is None and second["full"]["ttft_n"] == 0
    assert first["full"]["ttft_n"] == 3 and second["reuse"]["ttft_n"] == 3


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _kb_spec(tmp_path, limit, kb_limit=None):
    return QualitySpec(data=[tmp_path / "hotpotqa" / "mini.jsonl"], out=tmp_path / "out", model="tiny-llama",
                       limit=limit, kb_limit=kb_limit, ratios=[0.15], methods=["reuse", "cachecraft", "fusionrag"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                       cache_dir=tmp_path / "cache")


def test_a_larger_fixed_knowledge_base_lets_later_runs_add_questions_without_recomputing(tmp_path):
    _data(tmp_path)
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
    _data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    before = _lines(tmp_path / "out" / "records.jsonl")
    run_quality(_kb_spec(tmp_path, limit=3))  # knowledge base grows from 2 to 3 questions' passages
    out = capsys.readouterr().out
    assert "seeded from tiny-llama-hotpotqa-n2-top1" in out and "moved to records.superseded.jsonl" in out
    moved = _lines(tmp_path / "out" / "records.superseded.jsonl")
    assert moved and all(r["kb"].endswith("-n2-top1-nearest_first") for r in moved)
    assert len(moved) == sum(r["kb"] is not None for r in before)
    after = _lines(tmp_path / "out" / "records.jsonl")
    keys = [(r["qid"], r["run"]) for r in after]
    assert len(keys) == len(set(keys)) == 3 * 4  # every cell once, none from the old knowledge base
    for r in after:
        assert r["kb"] is None or r["kb"].endswith("-n3-top1-nearest_first")
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
    import pytest

    from fusionrag.errors import FusionRAGError

    _data(tmp_path)
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
    import pytest

    from fusionrag.errors import FusionRAGError

    _data(tmp_path)
    run_quality(_kb_spec(tmp_path, limit=2))
    spec = _kb_spec(tmp_path, limit=2)
    spec.data, spec.out = [_other_file(tmp_path)], tmp_path / "out_other"
    with pytest.raises(FusionRAGError, match="not passages of this run"):  # same store name, other passages
        run_quality(spec)


def test_full_attention_cache_is_verified_against_the_question_and_passages(tmp_path):
    import dataclasses

    import torch

    from fusionrag.eval.bench_quality import FullCache, example_sha
    from fusionrag.eval.datasets import load_questions

    ex = load_questions(_data(tmp_path))[0]
    cache = FullCache(tmp_path / "cache", "m")
    cache.put("hotpotqa", ex.id, 4, "answer", torch.zeros(3), {"input_sha": example_sha(ex)})
    assert cache.get("hotpotqa", ex.id, 4, example_sha(ex))[0] == "answer"
    other = dataclasses.replace(ex, passages=ex.passages[:-1])  # same id, other input: a miss, not a wrong reference
    assert cache.get("hotpotqa", ex.id, 4, example_sha(other)) is None


def test_kb_limit_below_limit_is_a_clear_error(tmp_path):
    import pytest

    from fusionrag.errors import FusionRAGError

    _data(tmp_path)
    with pytest.raises(FusionRAGError, match="--kb-limit"):
        run_quality(_kb_spec(tmp_path, limit=3, kb_limit=2))


def _rec(qid, method, kv, ratio, agree, kl, top1, dataset="hotpotqa"):
    return {"dataset": dataset, "qid": qid, "method": method, "kv": kv, "ratio": ratio, "top_n": 10 if kv == "fused"
            else 0, "agree_f1": agree, "kl_first": kl, "top1_agree": top1}  # fmt: skip


def test_paired_comparisons_pair_by_question_and_skip_unmatched_cells():
    from fusionrag.eval.bench_quality import paired_comparisons
    from fusionrag.eval.report import comparisons_markdown

    records = []
    for i, q in enumerate("abcd"):
        records.append(_rec(q, "full", "none", 1.0, 1.0, 0.0, 1.0))
        records.append(_rec(q, "fusionrag", "fused", 0.15, 0.5 + 0.1 * i, 0.1, 1.0))
        records.append(_rec(q, "cacheblend", "plain", 0.15, 0.3 + 0.1 * i, 0.4, 1.0))  # always 0.2 worse
        records.append(_rec(q, "cacheblend", "plain", 0.3, 0.9, 0.0, 1.0))  # other ratio: not compared
        records.append(_rec(q, "reuse", "plain", 0.0, 0.5 + 0.1 * i, 0.1, float(i % 2)))  # identical but top-1
    records.append(_rec("e", "cacheblend", "plain", 0.15, 0.0, 9.0, 0.0))  # no fusionrag answer for "e"
    rows = {(c["baseline"], c["baseline_ratio"]): c for c in paired_comparisons(records)}
    assert set(rows) == {("cacheblend", 0.15), ("reuse", 0.0)}  # not Full Attention, not the other ratio
    cb = rows[("cacheblend", 0.15)]
    assert cb["n"] == 4
    assert abs(cb["agree_f1_diff"] - 0.2) < 1e-9 and cb["agree_f1_diff_ci"][0] > 0.19  # a constant gap: tight CI
    assert abs(cb["kl_first_diff"] + 0.3) < 1e-9 and cb["top1_agree_diff"] == 0.0
    reuse = rows[("reuse", 0.0)]
    assert reuse["agree_f1_diff"] == 0.0 and reuse["top1_agree_diff"] == 0.5
    md = comparisons_markdown(list(rows.values()))
    assert "| hotpotqa | 15% | cacheblend 15% | 4 | **+0.200 [+0.200, +0.200]** |" in md
    assert "+0.000 [+0.000, +0.000] |" in md  # a zero interval is not bold
    assert comparisons_markdown([]) == ""


def test_all_comparisons_add_the_offline_stage_alone():
    from fusionrag.eval.bench_quality import all_comparisons
    from fusionrag.eval.report import comparisons_markdown

    records = [_rec(q, m, kv, r, 0.5, 0.2, 1.0) for q in "ab" for m, kv, r in
               (("fusionrag", "fused", 0.15), ("reuse", "plain", 0.0), ("reuse", "fused", 0.0))]  # fmt: skip
    pairs = {(c["method"], c["kv"], c["baseline"], c["baseline_kv"]) for c in all_comparisons(records)}
    assert pairs == {("fusionrag", "fused", "reuse", "plain"), ("fusionrag", "fused", "reuse", "fused"),
                     ("reuse", "fused", "reuse", "plain")}  # fmt: skip
    md = comparisons_markdown(all_comparisons(records))
    assert "## fusionrag (fused KV) minus each baseline" in md and "## reuse (fused KV) minus each baseline" in md


def test_top_n_sweep_compares_within_one_offline_setting():
    from fusionrag.eval.bench_quality import paired_comparisons
    from fusionrag.eval.report import comparisons_markdown

    records = []
    for n in (2, 10):
        for q in "ab":
            records.append({**_rec(q, "fusionrag", "fused", 0.15, 0.5, 0.2, 1.0), "top_n": n})
            records.append({**_rec(q, "reuse", "fused", 0.0, 0.4, 0.3, 1.0), "top_n": n})
    records += [_rec(q, "reuse", "plain", 0.0, 0.3, 0.5, 1.0) for q in "ab"]
    comps = paired_comparisons(records)
    assert sorted((c["top_n"], c["baseline_kv"], c["baseline_top_n"]) for c in comps) == [
        (2, "fused", 2), (2, "plain", 0), (10, "fused", 10), (10, "plain", 0)]  # fmt: skip
    assert "| dataset | top-n | ratio |" in comparisons_markdown(comps)


def test_plain_only_cells_build_no_fused_kv_and_a_later_fused_run_adds_it(tmp_path):
    from fusionrag.retrieval.knowledge import store_info

    _data(tmp_path)
    spec = _kb_spec(tmp_path, limit=2)
    spec.methods = ["query", "epic"]  # plain KV only: the offline stage is not needed
    spec.kv = "default"
    run_quality(spec)
    (store,) = (tmp_path / "cache" / "stores").iterdir()
    info = store_info(store)
    assert info["plain_kv"] == info["chunks"] > 0 and info["fused_kv"] == 0
    run_quality(_kb_spec(tmp_path, limit=2))  # fused cells: the same store is fused now
    info = store_info(store)
    assert info["fused_kv"] == info["chunks"]
