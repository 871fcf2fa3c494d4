"""studies/peers/summary.py: FusionRAG against ProphetKV and APE, paired, the issue's targets read off them."""

import json

import pytest

from bench_helpers import load_script


def _rec(qid, method, kv, ratio, kl, ds="d"):
    return {"dataset": ds, "qid": qid, "run": f"{method}|{kv}|{ratio}", "method": method, "kv": kv, "ratio": ratio,
            "gold_nll": 1.0 + kl, "kl_first_c": kl, "kl_answer": kl / 2}


def test_peers_are_paired_with_fusionrag_and_the_targets_follow(tmp_path):
    ps = load_script("studies/paper/summarize.py")
    recs = []
    for ds, gap in (("a", 0.2), ("b", 0.2), ("c", 0.0)):
        for i in range(20):
            q, wobble = f"q{i}", (i % 5) / 100
            recs += [_rec(q, "fusionrag", "fused", 0.15, 0.3 + wobble, ds),
                     _rec(q, "query", "plain", 0.15, 0.4 + wobble, ds),
                     _rec(q, "prophetkv", "fused", 0.15, 0.3 + gap + wobble, ds),
                     _rec(q, "prophetkv", "plain", 0.15, 0.6 + wobble, ds),
                     _rec(q, "ape", "plain", 0.0, 1.0 + wobble, ds), _rec(q, "ape", "fused", 0.0, 0.9 + wobble, ds),
                     _rec(q, "reuse", "plain", 0.0, 1.1 + wobble, ds)]
    sweep = tmp_path / "peers" / "results" / "ape_sweep"
    sweep.mkdir(parents=True)
    (sweep / "records.jsonl").write_text("".join(
        json.dumps(_rec(f"q{i}", "ape-t0.9-s0.9", "plain", 0.0, 1.0, "a")) + "\n" for i in range(20)))
    (tmp_path / "paper" / "results").mkdir(parents=True)
    lines, out = ps.peers_section(ps.cells(recs), ["a", "b", "c"], ps.paired, ps.fmt, ps.mean_cell, tmp_path)
    cmp = out["comparisons"]
    assert cmp["FusionRAG 15% - ProphetKV 15% (both fused KV)"]["a"]["kl_first_c"]["diff"] == pytest.approx(-0.2)
    assert cmp["FusionRAG's selection - ProphetKV's, plain KV, 15%"]["c"]["kl_first_c"]["diff"] == pytest.approx(-0.2)
    ape_alone = cmp["APE plain - Full Reuse plain (APE's correction alone)"]["b"]
    assert ape_alone["kl_answer"]["diff"] == pytest.approx(-0.05)
    targets = list(out["targets"].values())
    assert targets[0].startswith("met (2 of 3: a, b)")  # c: no gap, not resolved
    assert targets[1].startswith("met")
    assert out["ape_sweep"]["ape-t0.9-s0.9"]["minus_reuse_plain"]["kl_first_c"]["diff"] == pytest.approx(-0.12)
    png = tmp_path / "paper" / "results" / "peers_at_15pct.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert any(line.startswith("| FusionRAG 15% - APE fused (0%) |") for line in lines)
