"""Why single questions move between float32 and bfloat16: the tokens FusionRAG 15% selects in each dtype.

For the study's questions, FusionRAG 15% (fused KV) is prepared in float32 and in bfloat16 on the same store
(the one run.sh built); per question: the share of float32's selected tokens bf16 also selects, whether
the first token (argmax) is the same, the KL between the two first-token distributions (bf16 against
float32, full vocabulary), and the study's |bf16 - fp32| first-token KL to Full Attention from the records.
Writes results/selection_overlap.json.

    OMP_NUM_THREADS=1 .venv/bin/python studies/bf16/selection_overlap.py --data FILE [--limit 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fusionrag.bench.datasets import load_questions
from fusionrag.bench.metrics import kl_first_token
from fusionrag.bench.records import read_records
from fusionrag.files import write_json_atomic
from fusionrag.models import load_model
from fusionrag.online.engine import Engine
from fusionrag.retrieval.knowledge import KnowledgeStore

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "studies" / "bf16" / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--store", type=Path, default=None,
                   help="default: runs/cache/stores/qwen2.5-0.5b-DATASET-n100-top10-nearest_first")
    p.add_argument("--out", type=Path, default=RESULTS / "selection_overlap.json")
    args = p.parse_args(argv)
    examples = load_questions(args.data, None, seed=0)[:args.limit]
    dataset = examples[0].dataset
    store_path = args.store or ROOT / "runs" / "cache" / "stores" / f"qwen2.5-0.5b-{dataset}-n100-top10-nearest_first"
    fp32, bf16 = load_model("qwen2.5-0.5b"), load_model("qwen2.5-0.5b", dtype="bfloat16")
    store = KnowledgeStore.open(store_path, lm=fp32)
    engines = {"fp32": Engine(store, fp32), "bf16": Engine(store, bf16)}
    records = read_records(RESULTS / "records.jsonl")
    rows = []
    for ex in examples:
        chunks = [{"title": p.title, "text": p.text} for p in ex.passages]
        preps = {k: e.prepare(ex.question, method="fusionrag", ratio=0.15, chunks=chunks, kv="fused")
                 for k, e in engines.items()}
        sel = {k: set(map(int, pr.pre.selected.tolist())) for k, pr in preps.items()}
        logits = {k: pr.pre.last_logits.float().reshape(-1) for k, pr in preps.items()}
        kl = {k: records.get((dataset, ex.id, f"{m}|fused|0.15|10"), {}).get("kl_first_c")
              for k, m in (("fp32", "fusionrag"), ("bf16", "fusionrag@bf16"))}
        rows.append({"qid": ex.id, "selected": len(sel["fp32"]),
                     "selected_overlap": len(sel["fp32"] & sel["bf16"]) / max(1, len(sel["fp32"])),
                     "same_first_token": bool(torch.argmax(logits["fp32"]) == torch.argmax(logits["bf16"])),
                     "kl_bf16_to_fp32_first_token": float(kl_first_token(logits["fp32"], logits["bf16"])),
                     "abs_diff_kl_first_c": None if None in kl.values() else abs(kl["bf16"] - kl["fp32"])})
        print(f"{ex.id}: overlap {rows[-1]['selected_overlap']:.3f}, "
              f"KL(fp32||bf16) {rows[-1]['kl_bf16_to_fp32_first_token']:.2e}", file=sys.stderr)
    overlaps = [r["selected_overlap"] for r in rows]
    kls = [r["kl_bf16_to_fp32_first_token"] for r in rows]
    summary = {"n": len(rows), "selected_overlap_mean": statistics.fmean(overlaps),
               "selected_overlap_min": min(overlaps),
               "identical_selection": sum(o == 1.0 for o in overlaps),
               "same_first_token": sum(r["same_first_token"] for r in rows),
               "kl_bf16_to_fp32_first_token_median": statistics.median(kls),
               "kl_bf16_to_fp32_first_token_max": max(kls)}
    # Does a question move more when bf16 selects other tokens? |bf16 - fp32| KL to FA by selection.
    for name, keep in (("identical", lambda o: o == 1.0), ("different", lambda o: o < 1.0)):
        gaps = [r["abs_diff_kl_first_c"] for r in rows
                if keep(r["selected_overlap"]) and r["abs_diff_kl_first_c"] is not None]
        summary[f"abs_diff_kl_first_c_median_{name}_selection"] = statistics.median(gaps) if gaps else None
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {}
    doc[dataset] = {"summary": summary, "questions": rows, "store": store_path.name}
    write_json_atomic(args.out, doc)
    print(dataset, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
