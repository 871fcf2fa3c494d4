"""Preprocessing throughput: serial (1 and 2 torch threads) vs Ray with 1 and 2 one-thread workers.

Every configuration builds the same small store from scratch (the first passages of a data
file; plain KV, then fusion with top-n neighbours) in this one run, so the ratios compare like
with like on this machine; chunks/s of each stage, the speed-up over the 2-thread serial run,
and the projection of each to 1M chunks (linear in chunks: neighbour search at that size is
HNSW, benchmarks/ann/results, and costs minutes). Ray's start-up and the workers' model loads are
reported apart, not inside the stage times.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ray/ray_bench.py --data FILE --chunks 24 --out benchmarks/ray/results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(path: Path, lm, passages, top_n: int, runner_factory=None) -> dict:
    from fusionrag.offline import build as b

    store = b.create_store(path, lm, chunk_tokens=100_000, kv_dtype="float16", model_source=lm.name)
    b.add_passages(store, lm, passages, plain_kv=False)
    t0 = time.perf_counter()
    runner = runner_factory(store) if runner_factory else None
    startup = time.perf_counter() - t0
    try:
        if runner is not None:  # wait for the workers' models, so start-up is not counted as work
            runner.worker_pids()
        startup = time.perf_counter() - t0
        n, plain_s = b.compute_plain(store, lm, b.ensure_system_kv(store, lm), progress=False, runner=runner)
        rep = b.fuse(store, lm, top_n=top_n, progress=False, runner=runner)
    finally:
        if runner is not None:
            runner.close()
        store.close()
    return {"chunks": n, "startup_s": round(startup, 2), "plain_s": round(plain_s, 2),
            "fuse_s": round(rep.seconds, 2), "plain_chunks_per_s": round(n / plain_s, 4),
            "fuse_chunks_per_s": round(rep.computed / rep.seconds, 4)}


def markdown(res: dict) -> str:
    """The report: the table, then the three ratios the issue asks about, read from the same run."""
    rows = res["rows"]
    md = ["# Preprocessing on Ray vs serial", "", f"Command: `{res['command']}`", "",
          f"{res['model']}, {res['chunks']} TriviaQA passages, top-{res['top_n']} fusion, fp16 store; one run, "
          "configurations in sequence on this 2-core machine (1-minute load average before/after each row).", "",
          "| configuration | plain chunks/s | fused chunks/s | plain vs serial 2 threads | fused vs serial 2 threads | "
          "start-up (s) | 1M chunks (days) | load avg before/after |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        md.append(f"| {name} | {r['plain_chunks_per_s']:.3f} | {r['fuse_chunks_per_s']:.3f} | "
                  f"{r['plain_vs_serial_2_threads']:.2f}x | {r['fuse_vs_serial_2_threads']:.2f}x | {r['startup_s']} | "
                  f"{r['projected_1M_chunks_days']} | {r.get('load_avg_1min_before_after', '')} |")

    def ratio(a: str, b: str) -> str:
        return " / ".join(f"{rows[a][f'{s}_chunks_per_s'] / rows[b][f'{s}_chunks_per_s']:.2f}x"
                          for s in ("plain", "fuse"))

    md += ["", "Ratios (plain / fused stage):", "",
           "- Ray's overhead, 1 one-thread worker vs the serial 1-thread run: "
           f"{ratio('ray_1_worker', 'serial_1_thread')}.",
           f"- Scaling, 2 workers vs 1: {ratio('ray_2_workers', 'ray_1_worker')} (2 cores).",
           f"- The target, 2 one-thread workers vs the serial run with 2 threads: "
           f"{ratio('ray_2_workers', 'serial_2_threads')}.", "",
           "1M-chunk projection: (1 / plain chunks/s + 1 / fused chunks/s) x 1M, on this machine; with W such "
           "workers on W cores it divides by W (each worker holds one model and needs no other worker). Start-up "
           "(the cluster plus one model load per worker) is reported apart and paid once per run.", ""]
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="data file whose first passages are built (not with --report-only)")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--top-n", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/ray/results")
    ap.add_argument("--report-only", action="store_true", help="rewrite results.md from results.json")
    args = ap.parse_args()
    if args.report_only:
        res = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "results.md").write_text(markdown(res))
        return 0
    if not args.data:
        ap.error("--data is required (unless --report-only)")

    import ray

    from fusionrag.bench.datasets import load_questions
    from fusionrag.models import load_model
    from fusionrag.offline.distributed import RayRunner

    lm = load_model(args.model)
    passages, seen = [], set()
    for ex in load_questions(Path(args.data), None):
        for p in ex.passages:
            if (p.title, p.text) not in seen and len(passages) < args.chunks:
                seen.add((p.title, p.text))
                passages.append({"title": p.title, "text": p.text})
    configs = {
        "serial_2_threads": (2, None),
        "serial_1_thread": (1, None),
        "ray_1_worker": (1, 1),
        "ray_2_workers": (1, 2),
    }
    tmp = Path(tempfile.mkdtemp(prefix="fusionrag-ray-bench-"))
    rows = {}
    try:
        for name, (threads, workers) in configs.items():
            torch.set_num_threads(threads)
            factory = None
            if workers:
                def factory(store, w=workers):
                    return RayRunner(store, args.model, workers=w,
                                     init_options={"num_cpus": 2, "object_store_memory": 300 << 20})
            load_before = os.getloadavg()[0]
            rows[name] = {"torch_threads_driver": threads, "workers": workers or 0,
                          **build(tmp / name, lm, passages, args.top_n, factory),
                          "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
            print(name, rows[name], flush=True)
            if workers:
                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows["serial_2_threads"]
    for r in rows.values():
        for stage in ("plain", "fuse"):
            r[f"{stage}_vs_serial_2_threads"] = round(r[f"{stage}_chunks_per_s"] / base[f"{stage}_chunks_per_s"], 3)
        per_chunk = 1 / r["plain_chunks_per_s"] + 1 / r["fuse_chunks_per_s"]
        r["projected_1M_chunks_days"] = round(per_chunk * 1_000_000 / 86400, 1)
    res = {"command": " ".join([".venv/bin/python", *sys.argv]), "model": args.model, "chunks": len(passages),
           "top_n": args.top_n, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
