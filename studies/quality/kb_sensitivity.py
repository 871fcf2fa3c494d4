"""How much do store-reading results move when only the knowledge base grows?

When a dataset's knowledge base is enlarged (``python -m studies.quality_cli --kb-limit``), the run moves the
old store-reading records to ``records.superseded.jsonl`` and recomputes them. The same
questions answered with the same method, ratio and model, differing only in which other
passages the offline stage could pick as neighbours, give a paired measure of how
sensitive fused KV is to the knowledge base. Writes ``kb_sensitivity.md`` next to the records.

Usage: .venv/bin/python studies/quality/kb_sensitivity.py studies/quality/results/main
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from fusionrag.bench.aggregate import COMPARE_METRICS
from fusionrag.bench.metrics import bootstrap_diff_ci
from fusionrag.bench.report import diff_cell


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(folder: Path) -> int:
    current = [r for r in _load(folder / "records.jsonl") if r.get("kb")]
    old = _load(folder / "records.superseded.jsonl")
    by_key: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(lambda: {"new": {}, "old": {}})
    # (superseded twice, the latest old knowledge base wins: records are read in file order)
    kbs: dict[tuple, dict[str, str]] = defaultdict(dict)
    for side, recs in (("new", current), ("old", old)):
        for r in recs:
            key = (r["dataset"], r["method"], r["kv"], r["ratio"])
            by_key[key][side][r["qid"]] = r
            kbs[key][side] = r["kb"]
    lines = [
        "# Knowledge-base sensitivity", "",
        "Same questions, method, ratio and model; only the knowledge base the offline stage drew "
        "neighbours from differs (new minus old; 95% bootstrap interval over questions; bold = excludes 0). "
        f"Made by `.venv/bin/python studies/quality/kb_sensitivity.py {folder}`.", "",
        "| dataset | method | KV | ratio | old store | new store | n | agree F1 | KL | top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(by_key, key=str):
        new, prev = by_key[key]["new"], by_key[key]["old"]
        qids = sorted(set(new) & set(prev))
        if not qids:
            continue
        diffs: dict[str, object] = {}
        for m in COMPARE_METRICS:
            d, lo, hi = bootstrap_diff_ci([new[q].get(m) for q in qids], [prev[q].get(m) for q in qids])
            diffs[f"{m}_diff"], diffs[f"{m}_diff_ci"] = d, [lo, hi]
        cols = [diff_cell(diffs, m, digits=2) for m in COMPARE_METRICS]
        ds, method, kv, ratio = key
        lines.append(f"| {ds} | {method} | {kv} | {ratio:.0%} | `{kbs[key]['old']}` | `{kbs[key]['new']}` | "
                     f"{len(qids)} | " + " | ".join(cols) + " |")
    (folder / "kb_sensitivity.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "studies/quality/results/main")))
