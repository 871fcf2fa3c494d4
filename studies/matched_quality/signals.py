"""Which per-request signal predicts a question's distance from Full Attention at the fixed ratio (issue 50 item 3)?

For the questions the curve cells answered (``results/records.jsonl``: fixed 15%'s first-token KL to the fp32
reference, per question), on the same store, prompts and dtype (bf16), two signals an engine can read without
Full Attention:

- ``auto_share``: the share ``ratio="auto"`` recomputes at the store's calibrated mass (the signal it uses:
  how spread the question's attention over the context is);
- ``moved``: how far recomputing 15% moved the first answer token from Full Reuse's (KL(p_15 || p_reuse), both on
  the same fused KV): a question whose answer still moves is not settled. It costs a second pass online.

Each is ranked against the fixed 15%'s KL (Spearman, bootstrap interval over questions).

    .venv/bin/python -m studies.matched_quality.signals \\
        --data ../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl \\
        --store runs/cache/stores/qwen2.5-0.5b-2wikimqa-n100-top10-nearest_first
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fusionrag.bench.datasets import load_questions
from fusionrag.bench.records import read_records
from fusionrag.files import write_json_atomic
from fusionrag.models import load_model
from fusionrag.online.calibration import first_token_kl
from fusionrag.online.engine import Engine
from fusionrag.retrieval.knowledge import KnowledgeStore
from studies.matched_quality.summarize import RESULTS, spearman_ci

FIXED = "fusionrag@bf16|fused|0.15|10"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--limit", type=int, default=100)
    args = p.parse_args(argv)
    records = read_records(RESULTS / "records.jsonl")
    examples = load_questions(args.data, None)
    dataset = examples[0].dataset
    fixed = {q: r for (d, q, run), r in records.items() if d == dataset and run == FIXED}
    examples = [ex for ex in examples if ex.id in fixed][: args.limit]
    torch.set_num_threads(1)
    lm = load_model("qwen2.5-0.5b", dtype="bfloat16")
    engine = Engine(KnowledgeStore.open(Path(args.store), lm), lm)
    rows = []
    for ex in examples:
        chunks = [{"title": x.title, "text": x.text} for x in ex.passages]
        reuse = engine.prepare(ex.question, method="reuse", chunks=chunks, kv="fused").pre.last_logits
        at15 = engine.prepare(ex.question, method="fusionrag", ratio=0.15, chunks=chunks, kv="fused")
        auto = engine.prepare(ex.question, method="fusionrag", ratio="auto", chunks=chunks, kv="fused")
        rows.append({"qid": ex.id, "kl_first_at_15": fixed[ex.id]["kl_first_c"],
                     "moved": first_token_kl(at15.pre.last_logits, reuse), "auto_share": float(auto.ratio)})
    target = [r["kl_first_at_15"] for r in rows]
    out = {"dataset": dataset, "n": len(rows), "store_mass": engine.auto_ratio.mass,
           "spearman_vs_kl_first_at_15": {s: spearman_ci([r[s] for r in rows], target)
                                          for s in ("auto_share", "moved")},
           "rows": rows,
           "command": "python -m studies.matched_quality.signals " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_json_atomic(RESULTS / f"signals_{dataset}.json", out)
    print(json.dumps(out["spearman_vs_kl_first_at_15"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
