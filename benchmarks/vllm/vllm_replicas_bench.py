"""One store, one vLLM replica vs two (vLLM's data parallelism, one core each), the connector on both, 8 clients.

    .venv/bin/python benchmarks/vllm/vllm_replicas_bench.py --out benchmarks/vllm/results/replicas \\
        [--clients 8] [--duration 180] [--max-requests 120]

The requests, store and server of ``vllm_serve_bench.py`` (qwen2.5-0.5b bf16, ``bench ttft``'s store fused,
streamed chat completions whose passages come in a different order each time, closed loop), served by
vLLM's OpenAI server with the connector: once with one engine (one thread on core 0), once with
``--data-parallel-size 2`` (two engines, one thread each, on cores 0-1: vLLM balances the requests, no router
of ours) over a shared Redis tier (a real redis-server on loopback). Per run: TTFT p50/p99, requests/s,
failures; for two replicas, Redis's own hit and miss counts (a chunk one replica read from disk is a hit
for the other). Writes ``replicas.json`` (one row per run, the issue's format), ``README.md`` and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engines"))

from vllm_bench import connector_config  # noqa: E402
from vllm_serve_bench import closed_loop, fused_workload, requests_for, serving, summary  # noqa: E402


def redis_stats(port: int) -> dict[str, int]:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "stats"], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    return {k: int(v) for k, v in (line.split(":", 1) for line in out.split() if line.startswith("keyspace_"))}


def one_run(folder: Path, store: Path, requests: list, replicas: int, args: argparse.Namespace, out: Path) -> dict:
    redis = None
    config = connector_config(store, 0.15)
    if replicas > 1:
        redis = subprocess.Popen(["redis-server", "--port", str(args.redis_port), "--bind", "127.0.0.1", "--save",
                                  "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        config["kv_connector_extra_config"]["kv_tier"] = f"redis://127.0.0.1:{args.redis_port}"
    try:
        with serving(folder, args.port, replicas, out / "logs" / f"replicas-{replicas}.log", config,
                     extra=["--data-parallel-size", str(replicas)] if replicas > 1 else [], omp_threads=1):
            before = redis_stats(args.redis_port) if redis else {}
            results, wall = asyncio.run(closed_loop(args.port, requests, args.clients, args.duration,
                                                    args.max_tokens))
            after = redis_stats(args.redis_port) if redis else {}
            if redis:  # entries in Redis: each was a miss once (its first read, from disk, by one replica or another)
                after["keys"] = int(subprocess.run(["redis-cli", "-p", str(args.redis_port), "dbsize"],
                                                   capture_output=True, text=True, timeout=10, check=True).stdout)
    finally:
        if redis is not None:
            redis.kill()
    s = summary(results, wall)
    row = {"engine": "vllm+fusionrag", "clients": args.clients, "replicas": replicas, "max_tokens": args.max_tokens,
           "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"], "requests_per_s": s["requests_per_s"],
           "requests": s["requests"], "failed": s["failed"]}
    if redis:
        hits = after.get("keyspace_hits", 0) - before.get("keyspace_hits", 0)
        misses = after.get("keyspace_misses", 0) - before.get("keyspace_misses", 0)
        rate = hits / (hits + misses) if hits + misses else None
        later = hits + misses - after["keys"]  # reads of an entry after its first: one the other replica loaded
        row.update(redis_hits=hits, redis_misses=misses, redis_keys=after["keys"], redis_hit_rate=rate,
                   redis_hit_rate_after_first_read=hits / later if later > 0 else None)
    print(f"[replicas] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.provenance import build_meta
    from fusionrag.files import atomic_write

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--max-requests", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8620)
    ap.add_argument("--redis-port", type=int, default=6395)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    _, store, folder = fused_workload(args.data)
    requests = requests_for(store, load_questions(args.data), args.max_requests)
    rows = [one_run(folder, store.path, requests, n, args, out) for n in (1, 2)]
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_replicas_bench.py", *sys.argv[1:]]),
                      model="qwen2.5-0.5b", data_files=[args.data],
                      extra={"clients": args.clients, "duration_s": args.duration, "max_requests": args.max_requests})
    atomic_write(out / "replicas.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    one, two = rows
    x = two["requests_per_s"] / one["requests_per_s"] if one["requests_per_s"] else None
    md = ["# One store, one replica vs two (vLLM data parallelism, connector on both)", "",
          f"`{meta['command']}`: {args.clients} clients, closed loop, at most {args.duration:.0f} s or "
          f"{args.max_requests} requests per run, {args.max_tokens} tokens per answer, bf16, one thread per engine, "
          f"{meta['machine'].get('cpu_model')}.", "",
          "| replicas | requests ok / failed | TTFT p50 s | TTFT p99 s | requests/s | Redis hits / misses (entries) "
          "| hit rate after an entry's first read |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        redis = f"{r['redis_hits']} / {r['redis_misses']} ({r['redis_keys']})" if "redis_hits" in r else "-"
        after = r.get("redis_hit_rate_after_first_read")
        md.append(f"| {r['replicas']} | {r['requests'] - r['failed']} / {r['failed']} | {r['ttft_p50_s']:.2f} | "
                  f"{r['ttft_p99_s']:.2f} | {r['requests_per_s']:.3f} | {redis} | "
                  f"{'-' if after is None else f'{after:.0%}'} |")
    md += ["", f"Two replicas: **{x:.2f}x** the requests/s of one." if x else ""]
    atomic_write(out / "README.md", "\n".join(md) + "\n")
    _plot(rows, out / "replicas.png")
    print("\n".join(md))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [f"{r['replicas']} replica{'s' if r['replicas'] > 1 else ''}" for r in rows]
    axes[0].bar(names, [r["requests_per_s"] for r in rows])
    axes[0].set(title="requests/s (8 clients)")
    axes[1].bar(names, [r["ttft_p50_s"] for r in rows], label="p50")
    axes[1].bar(names, [r["ttft_p99_s"] - r["ttft_p50_s"] for r in rows], bottom=[r["ttft_p50_s"] for r in rows],
                label="to p99", alpha=0.5)
    axes[1].set(title="TTFT (s)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
