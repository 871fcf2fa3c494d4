"""studies/paper/summarize.py: the ratio curve is computed on the questions every complete curve cell
shares (a group stopped part-way is left out and named), paired with Full Attention, and plotted."""

import pytest

from bench_helpers import load_script


def _rec(qid, method, kv, ratio, gold, kl):
    return {"dataset": "d", "qid": qid, "run": f"{method}|{kv}|{ratio}", "method": method, "kv": kv, "ratio": ratio,
            "gold_nll": gold,
            "kl_first_c": kl, "kl_answer": kl / 2}


def test_the_curve_uses_shared_questions_and_pairs_gold_nll_with_full_attention(tmp_path):
    ps = load_script("studies/paper/summarize.py")
    recs = []
    for i in range(12):
        q = f"q{i}"
        recs += [_rec(q, "full", "none", 1.0, 1.0 + i / 10, 0.0), _rec(q, "reuse", "plain", 0.0, 1.5 + i / 10, 0.8),
                 _rec(q, "reuse", "fused", 0.0, 1.4 + i / 10, 0.6)]
        for r, extra in ((0.05, 0.3), (0.15, 0.2), (0.3, 0.1)):
            recs.append(_rec(q, "fusionrag", "fused", r, 1.0 + i / 10 + extra, extra))
            recs.append(_rec(q, "cacheblend", "plain", r, 1.0 + i / 10 + 2 * extra, 2 * extra))
    recs += [_rec(f"q{i}", "epic", "plain", 0.3, 9.0, 9.0) for i in range(5)]  # a group stopped part-way
    recs += [_rec(f"q{i}", "prophetkv", "fused", 0.3, 1.0, 0.1) for i in range(20)]  # taken further: kept
    lines, curve = ps.curve_section(ps.cells(recs), ["d"])
    d = curve["d"]
    assert d["n"] == 12 and d["left_out_partial"] == ["epic 30% (n=5)"] and "epic|plain|0.3" not in d["cells"]
    assert d["cells"]["prophetkv|fused|0.3"]["mean"]["kl_first_c"]["n"] == 12  # on the shared questions
    cell = d["cells"]["cacheblend|plain|0.05"]
    assert cell["minus_full"]["diff"] == pytest.approx(0.6) and cell["minus_full"]["resolved"]
    assert cell["fusionrag_minus"]["kl_first_c"]["diff"] == pytest.approx(-0.3)
    assert d["cells"]["fusionrag|fused|0.05"]["mean"]["kl_first_c"]["mean"] == pytest.approx(0.3)
    assert d["reference"]["Full Reuse plain"]["minus_full"]["diff"] == pytest.approx(0.5)
    path = tmp_path / "curve.png"
    ps.plot_curve(curve, path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    assert any("cacheblend plain | 5%" in line for line in lines)


def test_each_neighbour_source_is_compared_with_plain_kv_and_with_the_corpus_default(tmp_path):
    import json

    ps = load_script("studies/paper/summarize.py")
    main = [r for i in range(8) for r in (_rec(f"q{i}", "reuse", "plain", 0.0, 2.0, 0.8),
                                          _rec(f"q{i}", "query", "plain", 0.15, 1.8, 0.4),
                                          _rec(f"q{i}", "fusionrag", "fused", 0.15, 1.7 + i / 100, 0.3))]
    setting = [r for i in range(8) for r in (_rec(f"q{i}", "reuse", "fused", 0.0, 1.9, 0.5),
                                             _rec(f"q{i}", "fusionrag", "fused", 0.15, 1.5 + i / 100, 0.2))]
    for name, recs in (("paper/results", main), ("neighbours/results/question", setting)):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines, out = ps.neighbour_section(tmp_path, ps.cells(main))
    row = out["d"]["question"]
    assert row["reuse_fused_minus_plain"]["gold_nll"]["diff"] == pytest.approx(-0.1)
    assert row["fusionrag_minus_query"]["gold_nll"]["diff"] == pytest.approx(-0.3 + 0.035)
    assert row["fusionrag_minus_corpus"]["gold_nll"]["diff"] == pytest.approx(-0.2)
    assert row["fusionrag_minus_corpus"]["kl_first_c"]["diff"] == pytest.approx(-0.1)
    assert out["d"]["corpus"]["fusionrag_minus_corpus"]["gold_nll"] is None  # the default against itself
    assert any(line.startswith("| question |") and "-0.200" in line for line in lines)
