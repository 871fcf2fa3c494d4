"""studies/quality/tables.py: the paired gold-F1 gap that decides whether normalised F1 means anything."""

import json
from pathlib import Path

from bench_helpers import load_script


def _write_records(folder: Path, rows: list[tuple[str, str, str, str, float]]) -> None:
    lines = [json.dumps({"dataset": d, "qid": q, "method": m, "kv": kv, "f1": f1}) for d, q, m, kv, f1 in rows]
    (folder / "records.jsonl").write_text("\n".join(lines) + "\n")


def test_gold_gap_pairs_full_with_plain_reuse_and_bolds_a_resolved_gap(tmp_path):
    rows = []
    for i in range(20):  # Full Attention always 0.5 better than plain Full Reuse: resolved
        rows += [("a", f"q{i}", "full", "none", 1.0), ("a", f"q{i}", "reuse", "plain", 0.5),
                 ("a", f"q{i}", "reuse", "fused", 0.0)]  # fused reuse must not be paired
    rows += [("b", "q0", "full", "none", 1.0), ("b", "q0", "reuse", "plain", 0.0),
             ("b", "q1", "full", "none", 0.0), ("b", "q1", "reuse", "plain", 1.0),
             ("b", "q2", "full", "none", 1.0)]  # q2 has no Full Reuse answer: dropped
    _write_records(tmp_path, rows)
    gaps = load_script("studies/quality/tables.py")._gold_gaps(tmp_path)
    assert gaps["a"] == "**+0.50 [+0.50, +0.50]**"
    assert gaps["b"].startswith("+0.00 [-1.00, +1.00]")  # mean over the two complete pairs, unresolved
