"""The studies' quality driver in bfloat16 (studies/bf16): records named apart from float32's, scored
against the float32 Full Attention reference, on the same float32-built store."""

import json

import pytest

from bench_helpers import sample_data
from fusionrag.bench.aggregate import aggregate
from fusionrag.bench.quality import QualitySpec, plan_runs, run_quality
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.embedder import HashingEmbedder


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_a_bf16_cell_writes_records_distinguishable_from_float32_ones(tmp_path):
    data = sample_data(tmp_path)
    out = tmp_path / "out"
    common = dict(data=[data], out=out, model="tiny-llama", limit=2, ratios=[0.15], top_n=[2], max_new_tokens=2,
                  progress=False, embedder=HashingEmbedder(), decode=False, cache_dir=tmp_path / "cache",
                  full_reference=tmp_path / "reference")
    run_quality(QualitySpec(methods=["full", "fusionrag:fused"], **common))
    fp32 = _records(out)
    rows = run_quality(QualitySpec(methods=["fusionrag:fused"], dtype="bfloat16", **common))
    bf16 = _records(out)[len(fp32):]
    # float32 records keep their names (every committed record's meaning); bf16 ones are named apart
    assert {(r["method"], r["run"], r["dtype"]) for r in fp32} == {
        ("full", "full|none|1|0", "float32"), ("fusionrag", "fusionrag|fused|0.15|2", "float32")}
    assert len(bf16) == 2
    assert {(r["method"], r["run"], r["dtype"]) for r in bf16} == {
        ("fusionrag@bf16", "fusionrag@bf16|fused|0.15|2", "bfloat16")}
    # same store (built once, in float32), same questions, scored against the float32 reference
    store_of = {r["kb"] for r in fp32 + bf16 if r["method"] != "full"}
    assert len(store_of) == 1
    assert all(r["kl_first_c"] is not None and r["kl_first_c"] >= 0 for r in bf16)
    assert {r["full_answer"] for r in bf16} <= {r["full_answer"] for r in fp32}
    # the two dtypes are separate cells of the report, never one
    cells = {(r["method"], r["kv"]): r["n"] for r in rows}
    assert cells[("fusionrag", "fused")] == 2 and cells[("fusionrag@bf16", "fused")] == 2
    assert len(aggregate(fp32 + bf16)) == 3
    # bf16 logits differ from float32's (it really computed in bfloat16)
    kl = {(r["method"], r["qid"]): r["kl_first_c"] for r in fp32 + bf16}
    assert any(kl[("fusionrag@bf16", q)] != kl[("fusionrag", q)] for q in {r["qid"] for r in bf16})
    # resumable: nothing recomputed
    run_quality(QualitySpec(methods=["fusionrag:fused"], dtype="bfloat16", **common))
    assert len(_records(out)) == len(fp32) + len(bf16)


def test_full_attention_in_bf16_is_a_cell_named_apart_from_the_float32_reference():
    """Issue 50: the exact prefill a user runs in bf16 is a cell of its own (``full@bf16``), scored against the
    float32 reference (which only a float32 ``full`` writes: the next test)."""
    runs = plan_runs(QualitySpec(data=[], out=None, ratios=[0.15], methods=["full", "fusionrag"], dtype="bfloat16"))
    assert [r.key for r in runs] == ["full@bf16|none|1|0", "fusionrag@bf16|plain-first|0.15|10"]
    with pytest.raises(FusionRAGError, match="dtype"):
        plan_runs(QualitySpec(data=[], out=None, ratios=[0.15], methods=["fusionrag"], dtype="float64"))


def test_the_study_driver_passes_dtype(monkeypatch, tmp_path):
    import fusionrag.bench.quality as quality
    from studies import quality_cli

    seen = []
    monkeypatch.setattr(quality, "run_quality", seen.append)
    argv = ["--data", str(tmp_path / "x.jsonl"), "--ratios", "0.15", "--methods", "fusionrag", "--out", str(tmp_path)]
    quality_cli.main([*argv, "--dtype", "bfloat16"])
    quality_cli.main(argv)
    assert [s.dtype for s in seen] == ["bfloat16", "float32"]
    assert [r.key for r in plan_runs(seen[0])] == ["fusionrag@bf16|fused|0.15|10"]
    assert [r.key for r in plan_runs(seen[1])] == ["fusionrag|fused|0.15|10"]


def test_a_missing_reference_is_computed_in_float32_not_in_the_cells_dtype(tmp_path):
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.full_reference import FullReference
    from fusionrag.bench.records import example_sha

    data = sample_data(tmp_path)
    common = dict(data=[data], model="tiny-llama", limit=2, ratios=[0.15], top_n=[2], max_new_tokens=2,
                  progress=False, embedder=HashingEmbedder(), decode=False, cache_dir=tmp_path / "cache")
    run_quality(QualitySpec(out=tmp_path / "bf16", methods=["fusionrag:fused"], dtype="bfloat16",
                            full_reference=tmp_path / "ref_bf16_run", **common))
    run_quality(QualitySpec(out=tmp_path / "fp32", methods=["full"], full_reference=tmp_path / "ref_fp32", **common))
    made, fp32 = (FullReference(tmp_path / name, "tiny-llama") for name in ("ref_bf16_run", "ref_fp32"))
    for ex in load_questions(data, 2, seed=0):
        a, b = (ref.get("hotpotqa", ex.id, 2, example_sha(ex)) for ref in (made, fp32))
        assert a is not None and b is not None and a.text == b.text
        assert abs(a.info["gold_nll"] - b.info["gold_nll"]) < 1e-5
