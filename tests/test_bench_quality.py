"""The ``bench quality`` driver end to end: a tiny random model, three questions, its resume and its report."""

import json

from eval_helpers import sample_data
from fusionrag.eval.bench_quality import QualitySpec, plan_runs, run_quality
from fusionrag.retrieval.embedder import HashingEmbedder


def test_plan_has_no_duplicates_and_ratio_independent_methods_once():
    spec = QualitySpec(data=[], out=None, ratios=[0, 0.1, 0.15, 1.0], kv="both", top_n=[0, 2])
    runs = plan_runs(spec)
    keys = [r.key for r in runs]
    assert len(keys) == len(set(keys))
    assert sum(r.method == "full" for r in runs) == 1
    assert {r.ratio for r in runs if r.method == "fusionrag"} == {0.1, 0.15}


def test_tiny_bench_writes_well_formed_results_and_resumes(tmp_path):
    data = sample_data(tmp_path)
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


def test_report_from_records_reaggregates_without_running(tmp_path):
    from fusionrag.eval.bench_quality import report_from_records

    data = sample_data(tmp_path)
    out = tmp_path / "out"
    spec = QualitySpec(data=[data], out=out, model="tiny-llama", limit=2, ratios=[0.15], methods=["full", "reuse"],
                       top_n=[1], max_new_tokens=2, progress=False, embedder=HashingEmbedder())
    rows = run_quality(spec)
    (out / "results.json").unlink()
    again = report_from_records(out, model="tiny-llama", data_files=[data])
    assert [(r["method"], r["kv"], r["n"]) for r in again] == [(r["method"], r["kv"], r["n"]) for r in rows]
    assert json.loads((out / "results.json").read_text())["meta"]["questions_per_dataset"] == {"hotpotqa": 2}


def test_cached_full_attention_serves_the_full_cell_without_a_ttft(tmp_path):
    data = sample_data(tmp_path)
    common = dict(data=[data], model="tiny-llama", limit=3, ratios=[0.15], methods=["full", "reuse"], top_n=[2],
                  max_new_tokens=3, progress=False, embedder=HashingEmbedder(), cache_dir=tmp_path / "cache",
                  full_reference=tmp_path / "reference")
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


def test_a_neighbour_source_store_is_seeded_from_the_same_knowledge_base(tmp_path, capsys):
    """Another neighbour source reuses the plain KV of the store it shares a knowledge base with, fuses
    only the evaluated chunks with its own lists, and reports its neighbour composition."""
    data = sample_data(tmp_path)
    common = dict(data=[data], model="tiny-llama", limit=2, kb_limit=3, ratios=[0.15], methods=["reuse"],
                  top_n=[2], max_new_tokens=2, progress=False, embedder=HashingEmbedder(),
                  cache_dir=tmp_path / "cache", full_reference=tmp_path / "ref", decode=False)
    run_quality(QualitySpec(out=tmp_path / "corpus", **common))
    capsys.readouterr()
    run_quality(QualitySpec(out=tmp_path / "pre", neighbours="preceding", fuse_only_evaluated=True, **common))
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
