"""Under load: vLLM alone vs vLLM with the connector, 8 and 16 closed-loop clients, the issue's JSON rows.

    .venv/bin/python benchmarks/vllm/vllm_load_bench.py --out benchmarks/vllm/results/load \\
        [--clients 8,16] [--duration 240] [--max-requests 64] [--max-tokens 16]

The requests, store and server of ``vllm_serve_bench.py`` (qwen2.5-0.5b bf16, ``bench ttft``'s store, streamed
chat completions whose passages come in a new order each time so vLLM's prefix cache misses, one engine on
one core, prefix caching on, no faults). For each server (vLLM alone, then with the connector at 15%) it
runs each client count in turn on the same server: TTFT p50/p99, the inter-token latency p50/p99 of the
running streams (the gaps between streamed pieces: a step stalled by a prefill or a load shows there),
requests/s, failures. Writes ``load.json`` (``rows``: one per server and client count, in the issue's format,
so anyone can recompute the ratios), ``README.md`` and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engines"))

from vllm_bench import connector_config  # noqa: E402
from vllm_serve_bench import closed_loop, fused_workload, requests_for, serving, summary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.provenance import build_meta
    from fusionrag.files import atomic_write
    from fusionrag.prompt import chat_prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8630)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    lm, store, folder = fused_workload(args.data)
    clients = [int(c) for c in args.clients.split(",")]
    requests = requests_for(store, load_questions(args.data), args.max_requests * len(clients), seed=1)
    context = statistics.median(len(chat_prompt_ids(lm.tokenizer, m)) for m in requests[:20])
    rows = []
    for engine, config in (("vllm", None), ("vllm+fusionrag", connector_config(store.path, 0.15))):
        with serving(folder, args.port, 1, out / "logs" / f"{engine}.log", config):
            for k, n in enumerate(clients):  # each client count its own requests (no prefix-cache hit across)
                batch = requests[k * args.max_requests:(k + 1) * args.max_requests]
                results, wall = asyncio.run(closed_loop(args.port, batch, n, args.duration, args.max_tokens))
                s = summary(results, wall)
                row = {"engine": engine, "clients": n, "replicas": 1, "context_tokens": context,
                       "max_tokens": args.max_tokens, "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                       "itl_p50_s": s["itl_p50_s"], "itl_p99_s": s["itl_p99_s"],
                       "requests_per_s": s["requests_per_s"], "requests": s["requests"], "failed": s["failed"]}
                rows.append(row)
                print(f"[load] {json.dumps(row)}", file=sys.stderr, flush=True)
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_load_bench.py", *sys.argv[1:]]),
                      model="qwen2.5-0.5b", data_files=[args.data],
                      extra={"duration_s": args.duration, "max_requests": args.max_requests, "threads": 1})
    atomic_write(out / "load.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["# Under load: vLLM alone vs vLLM + fusionrag's connector (15%)", "",
          f"`{meta['command']}`: closed loop, at most {args.duration:.0f} s or {args.max_requests} requests per cell, "
          f"{args.max_tokens} tokens per answer, contexts of ~{context:.0f} tokens (median), bf16, one thread, "
          f"{meta['machine'].get('cpu_model')}.", "",
          "| engine | clients | ok / failed | TTFT p50 s | TTFT p99 s | ITL p50 s | ITL p99 s | requests/s |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['engine']} | {r['clients']} | {r['requests'] - r['failed']} / {r['failed']} | "
                  f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['itl_p50_s']:.3f} | {r['itl_p99_s']:.3f} | "
                  f"{r['requests_per_s']:.3f} |")
    md += ["", "| clients | TTFT p50, vLLM / connector | TTFT p99 | ITL p99, connector / vLLM "
           "| requests/s, connector / vLLM |", "|---|---|---|---|---|"]
    for n in clients:
        v = next(r for r in rows if r["engine"] == "vllm" and r["clients"] == n)
        f = next(r for r in rows if r["engine"] == "vllm+fusionrag" and r["clients"] == n)
        md.append(f"| {n} | {v['ttft_p50_s'] / f['ttft_p50_s']:.2f}x | {v['ttft_p99_s'] / f['ttft_p99_s']:.2f}x | "
                  f"{f['itl_p99_s'] / v['itl_p99_s']:.2f}x | {f['requests_per_s'] / v['requests_per_s']:.2f}x |")
    atomic_write(out / "README.md", "\n".join(md) + "\n")
    _plot(rows, clients, out / "load.png")
    print("\n".join(md))
    return 0


def _plot(rows: list[dict], clients: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for engine, marker in (("vllm", "o-"), ("vllm+fusionrag", "s-")):
        mine = [next(r for r in rows if r["engine"] == engine and r["clients"] == n) for n in clients]
        axes[0].plot(clients, [r["ttft_p50_s"] for r in mine], marker, label=engine)
        axes[1].plot(clients, [r["itl_p99_s"] for r in mine], marker, label=engine)
        axes[2].plot(clients, [r["requests_per_s"] for r in mine], marker, label=engine)
    for ax, title in zip(axes, ("TTFT p50 (s)", "inter-token latency p99 (s)", "requests/s"), strict=True):
        ax.set(title=title, xlabel="clients", xticks=clients)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
