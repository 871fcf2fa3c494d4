"""Statistics over records: FusionRAG minus each baseline, paired by question."""

from fusionrag.bench.aggregate import all_comparisons, paired_comparisons
from fusionrag.bench.report import comparisons_markdown


def _rec(qid, method, kv, ratio, agree, kl, top1, dataset="hotpotqa"):
    return {"dataset": dataset, "qid": qid, "method": method, "kv": kv, "ratio": ratio, "top_n": 10 if kv == "fused"
            else 0, "agree_f1": agree, "kl_first": kl, "top1_agree": top1}  # fmt: skip


def test_paired_comparisons_pair_by_question_and_skip_unmatched_cells():
    records = []
    for i, q in enumerate("abcd"):
        records.append(_rec(q, "full", "none", 1.0, 1.0, 0.0, 1.0))
        records.append(_rec(q, "fusionrag", "fused", 0.15, 0.5 + 0.1 * i, 0.1, 1.0))
        records.append(_rec(q, "cacheblend", "plain", 0.15, 0.3 + 0.1 * i, 0.4, 1.0))  # always 0.2 worse
        records.append(_rec(q, "cacheblend", "plain", 0.3, 0.9, 0.0, 1.0))  # other ratio: not compared
        records.append(_rec(q, "reuse", "plain", 0.0, 0.5 + 0.1 * i, 0.1, float(i % 2)))  # identical but top-1
    records.append(_rec("e", "cacheblend", "plain", 0.15, 0.0, 9.0, 0.0))  # no fusionrag answer for "e"
    rows = {(c["baseline"], c["baseline_ratio"]): c for c in paired_comparisons(records)}
    # Full Attention too (gold NLL can be lower than Full Attention's); not the other ratio
    assert set(rows) == {("cacheblend", 0.15), ("reuse", 0.0), ("full", 1.0)}
    assert abs(rows[("full", 1.0)]["kl_first_diff"] - 0.1) < 1e-9
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
    records = [_rec(q, m, kv, r, 0.5, 0.2, 1.0) for q in "ab" for m, kv, r in
               (("fusionrag", "fused", 0.15), ("reuse", "plain", 0.0), ("reuse", "fused", 0.0))]  # fmt: skip
    pairs = {(c["method"], c["kv"], c["baseline"], c["baseline_kv"]) for c in all_comparisons(records)}
    assert pairs == {("fusionrag", "fused", "reuse", "plain"), ("fusionrag", "fused", "reuse", "fused"),
                     ("reuse", "fused", "reuse", "plain")}  # fmt: skip
    md = comparisons_markdown(all_comparisons(records))
    assert "## fusionrag (fused KV) minus each baseline" in md and "## reuse (fused KV) minus each baseline" in md


def test_top_n_sweep_compares_within_one_offline_setting():
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


def test_kl_recovery_is_a_ratio_of_means_paired_by_question():
    from fusionrag.bench.aggregate import aggregate

    records = []
    for q, reuse_kl in zip("abcd", (1.0, 2.0, 3.0, 2.0), strict=True):
        records.append({**_rec(q, "reuse", "plain", 0.0, 0.5, 0.1, 1.0), "kl_answer": reuse_kl, "ctx_tokens": 10,
                        "recomputed_tokens": 0})
        records.append({**_rec(q, "fusionrag", "fused", 0.15, 0.5, 0.1, 1.0), "kl_answer": reuse_kl / 4,
                        "ctx_tokens": 10, "recomputed_tokens": 2})
    rows = {(r["method"], r["kv"]): r for r in aggregate(records)}
    assert abs(rows[("fusionrag", "fused")]["kl_recovery"] - 0.75) < 1e-9
    assert rows[("reuse", "plain")]["kl_recovery"] == 0.0
    lo, hi = rows[("fusionrag", "fused")]["kl_recovery_ci"]
    assert abs(lo - 0.75) < 1e-9 and abs(hi - 0.75) < 1e-9  # the same share on every question: a tight interval
