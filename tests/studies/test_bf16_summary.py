"""studies/bf16/summarize.py on synthetic records: the bf16 and float32 cells are paired by question, never mixed."""

import json
import random

from studies.bf16 import summarize


def _write(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _rec(ds, qid, method, kl, top1=1.0):
    return {"dataset": ds, "qid": qid, "run": f"{method}|fused|0.15|10", "method": method, "kv": "fused",
            "ratio": 0.15, "top_n": 10, "kl_first_c": kl, "top1_agree": top1, "kl_answer": kl / 2}


def test_summary_pairs_bf16_with_both_float32_cells(tmp_path):
    rng = random.Random(0)
    paper, mine = [], []
    for ds in ("2wikimqa", "hotpotqa"):
        for i in range(30):
            kl = rng.uniform(0.1, 0.5)
            paper.append(_rec(ds, f"q{i}", "fusionrag", kl))
            paper.append(_rec(ds, f"q{i}", "cacheblend", kl + 1))  # another method: never read
            if i < 20:  # the study's questions: a prefix of the paper's
                mine.append(_rec(ds, f"q{i}", "fusionrag", kl + 1e-5))
                mine.append(_rec(ds, f"q{i}", "fusionrag@bf16", kl + (0.05 if ds == "hotpotqa" else 0.0),
                                 top1=0.0 if i == 0 else 1.0))
    _write(tmp_path / "paper", paper)
    _write(tmp_path / "bf16", mine)
    assert summarize.main(["--results", str(tmp_path / "bf16"), "--paper", str(tmp_path / "paper")]) == 0
    doc = json.loads((tmp_path / "bf16" / "summary.json").read_text())["datasets"]
    assert set(doc) == {"2wikimqa", "hotpotqa", "pooled"}
    assert doc["hotpotqa"]["n"] == 20 and doc["pooled"]["n"] == 40
    hot = doc["hotpotqa"]["kl_first_c_bf16_minus_fp32_committed"]
    assert hot["n"] == 20 and abs(hot["diff"] - 0.05) < 1e-9 and hot["resolved"]
    wiki = doc["2wikimqa"]["kl_first_c_bf16_minus_fp32"]
    assert abs(wiki["diff"] + 1e-5) < 1e-9
    assert doc["2wikimqa"]["kl_first_c"]["fp32 committed"]["n"] == 20  # only the study's questions
    assert doc["2wikimqa"]["top1_agree"]["bf16"]["mean"] == 0.95
    assert (tmp_path / "bf16" / "bf16_minus_fp32.png").stat().st_size > 10_000
    assert "resolved loss" in (tmp_path / "bf16" / "summary.md").read_text()
