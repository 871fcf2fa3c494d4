"""studies/matched_quality/summarize.py on synthetic records: agreement is with bf16 Full Attention's answers, the
smallest ratio reaching a level is read off each curve, auto is paired with the fixed ratio, and only questions
every cell answered count."""

import json

from studies.matched_quality import summarize

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)


def _rec(qid, method, kv, ratio, answer, kl, share=None, ttft=100.0):
    label = ratio if isinstance(ratio, str) else f"{ratio:g}"
    return {"dataset": "2wikimqa", "qid": qid, "run": f"{method}|{kv}|{label}|10", "method": method, "kv": kv,
            "ratio": ratio, "answer": answer, "full_answer": "fp32 answer", "f1": 0.5, "kl_first_c": kl,
            "kl_answer": kl / 2, "ctx_tokens": 1000, "recomputed_tokens": int(1000 * (share or 0)),
            "auto_share": share if isinstance(ratio, str) else None, "ttft_ms": ttft}


def test_levels_auto_and_pairing(tmp_path):
    records = []
    for i in range(10):
        q = f"q{i}"
        records.append(_rec(q, "full@bf16", "none", 1.0, "Paris", 0.001, 1.0, 1000))
        for r in RATIOS:
            # FusionRAG agrees from 30% on, ProphetKV from 70%; the KL falls with the ratio
            records.append(_rec(q, "fusionrag@bf16", "fused", r, "Paris" if r >= 0.3 else "Lyon", 0.5 - r / 2, r))
            records.append(_rec(q, "prophetkv@bf16", "fused", r, "paris." if r >= 0.7 else "Lyon", 0.6 - r / 2, r))
        records.append(_rec(q, "fusionrag@bf16", "fused", "auto", "Paris" if i < 5 else "Lyon", 0.3, 0.2, 90))
    records.append(_rec("q10", "full@bf16", "none", 1.0, "Paris", 0.0, 1.0))  # a partial question: left out
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert summarize.main(["--results", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "summary.json").read_text())["datasets"]["2wikimqa"]
    assert d["n"] == 10
    levels = {m["method"]: m for m in d["matched"]}
    assert levels["FusionRAG (fused KV)"]["agreement>=0.9"]["ratio"] == 0.3
    assert levels["ProphetKV (fused KV)"]["agreement>=0.99"]["ratio"] == 0.7  # normalised: "paris." == "Paris"
    auto = d["auto"]["auto"]
    assert auto["nearest_fixed"] == 0.2 and abs(auto["vs_fixed_15"]["agreement"][0] - 0.5) < 1e-9
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "matched_quality.png").is_file()
