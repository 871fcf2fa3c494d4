"""The ``bench quality`` driver end to end: a tiny random model, three questions, its resume and its report."""

import json

import pytest

from bench_helpers import sample_data
from fusionrag.bench.quality import QualitySpec, plan_runs, run_quality
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.embedder import HashingEmbedder


def test_plan_has_no_duplicates_and_ratio_independent_methods_once():
    spec = QualitySpec(data=[], out=None, ratios=[0, 0.1, 0.15, 1.0], top_n=[0, 2],
                       methods=["full", "reuse", "cacheblend", "cacheblend:fused", "fusionrag", "fusionrag:fused"])
    runs = plan_runs(spec)
    keys = [r.key for r in runs]
    assert len(keys) == len(set(keys))
    assert sum(r.method == "full" for r in runs) == 1
    assert {r.ratio for r in runs if r.method == "fusionrag"} == {0.1, 0.15}
    assert {r.kv for r in runs if r.method == "cacheblend"} == {"plain", "fused"}


def test_bench_quality_runs_fusionrag_on_the_kv_the_server_and_ask_reuse():
    """One meaning of ``fusionrag``: bench quality's cells reuse the KV kind a served request reuses."""
    from fusionrag.online.request import ReuseRequest
    from fusionrag.serve.protocol import parse_chat
    from fusionrag.serve.settings import ServerSettings

    runs = plan_runs(QualitySpec(data=[], out=None, ratios=[0.15], methods=["fusionrag"]))
    served, _ = parse_chat({"messages": [{"role": "user", "content": "q?"}], "method": "fusionrag"}, ServerSettings())
    asked = ReuseRequest("q?", "fusionrag").validated()
    assert {r.kv for r in runs} == {served.reuse.validated().kv} == {asked.kv} == {"plain-first"}


def test_a_method_spelled_with_its_kv_and_unknown_names_are_checked_before_anything_runs():
    import pytest

    from fusionrag.errors import FusionRAGError

    runs = plan_runs(QualitySpec(data=[], out=None, ratios=[0.15], methods=["epic:fused"], top_n=[3]))
    assert [(r.method, r.kv, r.top_n) for r in runs] == [("epic", "fused", 3)]
    for bad in (["fusionrag:warm"], ["magic"], ["full:plain"]):
        with pytest.raises(FusionRAGError):
            plan_runs(QualitySpec(data=[], out=None, ratios=[0.15], methods=bad))
    with pytest.raises(FusionRAGError):
        plan_runs(QualitySpec(data=[], out=None, ratios=[1.5], methods=["fusionrag"]))


def test_tiny_bench_writes_well_formed_results_and_resumes(tmp_path):
    data = sample_data(tmp_path)
    out = tmp_path / "out"
    spec = QualitySpec(data=[data], out=out, model="tiny-llama", limit=3, ratios=[0.15],
                       methods=["full", "reuse", "cacheblend", "cachecraft", "fusionrag:plain", "fusionrag"], top_n=[2],
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
    from fusionrag.bench.quality import report_from_records

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




def test_auto_ratios_run_fusionrag_with_the_stores_or_a_given_mass_and_record_the_share(tmp_path):
    """Issue 50: ``--ratios 0.15,auto,auto:0.9`` puts ratio="auto" on the curve (fusionrag only; a bf16 ``full``
    is a cell scored against the float32 reference, never written into it)."""
    with pytest.raises(FusionRAGError, match="auto:MASS"):
        plan_runs(QualitySpec(data=[], out=None, ratios=["auto:2"], methods=["fusionrag"]))
    data = sample_data(tmp_path)
    spec = QualitySpec(data=[data], out=tmp_path / "out", model="tiny-llama", limit=2, ratios=["auto", "auto:0.9"],
                       methods=["full", "fusionrag", "cacheblend"], top_n=[2], max_new_tokens=2, progress=False,
                       embedder=HashingEmbedder(), dtype="bfloat16", full_reference=tmp_path / "ref")
    run_quality(spec)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert sorted({r["run"] for r in records}) == ["full@bf16|none|1|0", "fusionrag@bf16|plain-first|auto:0.9|2",
                                                   "fusionrag@bf16|plain-first|auto|2"]
    for r in records:
        assert (r["auto_share"] is None) == r["run"].startswith("full")
        assert r["kl_first_c"] >= 0 and r["answer"] is not None
    full = [r for r in records if r["method"] == "full@bf16"]
    assert all(0 <= r["kl_first_c"] < 0.05 for r in full)  # bf16 Full Attention against the float32 reference
