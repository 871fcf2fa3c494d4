"""Under load: vLLM alone vs vLLM with the connector, 8 and 16 closed-loop clients, the issue's JSON rows.

    .venv/bin/python benchmarks/vllm/vllm_load_bench.py --out benchmarks/vllm/results/load \\
        [--clients 8,16] [--contexts 2048] [--duration 240] [--max-requests 64] [--max-tokens 16] [--ignore-eos] \\
        [--servers vllm,async,sync,async256]

Servers: ``vllm`` (vLLM alone), ``async`` (the connector at 15%, asynchronous loads in pieces: its default,
decision 066), ``sync`` (the connector loading inside vLLM's step, ``async_loads: false``: what it did before),
``async256`` (asynchronous loads at half the default budget, ``load_tokens_per_step: 256``).
``--contexts``: each request's passages are a question's, then the next questions' until the prompt holds
about that many tokens (one list of requests per context length, every server gets the same).

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
    ap.add_argument("--contexts", default="0", help="about this many prompt tokens per request (0: one question's "
                                                    "passages); comma-separated")
    ap.add_argument("--servers", default="vllm,async,sync")
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens (vLLM's ignore_eos)")
    ap.add_argument("--port", type=int, default=8630)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    lm, store, folder = fused_workload(args.data)
    clients = [int(c) for c in args.clients.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    examples = load_questions(args.data)
    batches = {}  # per context length: each client count its own requests (no prefix-cache hit across)
    for target in contexts:
        requests = requests_for(store, examples, args.max_requests * len(clients), seed=1, min_tokens=target,
                                tokens=lambda m: len(chat_prompt_ids(lm.tokenizer, m)))
        batches[target] = (requests, statistics.median(len(chat_prompt_ids(lm.tokenizer, m)) for m in requests[:20]))
    servers = {"vllm": ("vllm", None), "async": ("vllm+fusionrag", connector_config(store.path, 0.15)),
               "sync": ("vllm+fusionrag", connector_config(store.path, 0.15, async_loads=False)),
               "async256": ("vllm+fusionrag", connector_config(store.path, 0.15, load_tokens_per_step=256))}
    rows = []
    for name in args.servers.split(","):
        engine, config = servers[name]
        with serving(folder, args.port, 1, out / "logs" / f"{name}.log", config):
            for target in contexts:
                requests, context = batches[target]
                for k, n in enumerate(clients):
                    batch = requests[k * args.max_requests:(k + 1) * args.max_requests]
                    results, wall = asyncio.run(closed_loop(args.port, batch, n, args.duration, args.max_tokens,
                                                                ignore_eos=args.ignore_eos))
                    s = summary(results, wall)
                    row = {"engine": engine, "loads": name if name != "vllm" else None, "clients": n, "replicas": 1,
                           "context_tokens": context, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                           "ttft_p50_s": s["ttft_p50_s"],
                           "ttft_p99_s": s["ttft_p99_s"], "itl_p50_s": s["itl_p50_s"], "itl_p99_s": s["itl_p99_s"],
                           "requests_per_s": s["requests_per_s"], "requests": s["requests"], "failed": s["failed"],
                           "answer_tokens_p50": s["answer_tokens_p50"]}
                    rows.append(row)
                    print(f"[load] {json.dumps(row)}", file=sys.stderr, flush=True)
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_load_bench.py", *sys.argv[1:]]),
                      model="qwen2.5-0.5b", data_files=[args.data],
                      extra={"duration_s": args.duration, "max_requests": args.max_requests, "threads": 1})
    atomic_write(out / "load.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    eos = " (ignore_eos: every answer that long)" if args.ignore_eos else ""
    md = ["# Under load: vLLM alone vs vLLM + fusionrag's connector (15%)", "",
          f"`{meta['command']}`: closed loop, at most {args.duration:.0f} s or {args.max_requests} requests per cell, "
          f"up to {args.max_tokens} tokens per answer{eos}"
          ", bf16, one thread per server (every process of a server on one "
          f"core), {meta['machine'].get('cpu_model')}. `vllm+fusionrag` loads asynchronously in pieces (its "
          "default); `vllm+fusionrag sync` loads inside vLLM's step (`async_loads: false`).", "",
          "| engine | context tokens | clients | ok / failed | TTFT p50 s | TTFT p99 s | ITL p50 s | ITL p99 s "
          "| requests/s | answer tokens p50 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {_label(r)} | {r['context_tokens']:.0f} | {r['clients']} | {r['requests'] - r['failed']} / "
                  f"{r['failed']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['itl_p50_s']:.3f} | "
                  f"{r['itl_p99_s']:.3f} | {r['requests_per_s']:.3f} | {r.get('answer_tokens_p50') or '-'} |")
    md += ["", "| connector | context tokens | clients | TTFT p50, vLLM / connector | TTFT p99 | ITL p99, connector / "
           "vLLM | requests/s, connector / vLLM |", "|---|---|---|---|---|---|---|"]
    for f in rows:
        v = next((r for r in rows if r["engine"] == "vllm" and r["clients"] == f["clients"]
                  and r["context_tokens"] == f["context_tokens"]), None)
        if f["engine"] == "vllm" or v is None:
            continue
        md.append(f"| {_label(f)} | {f['context_tokens']:.0f} | {f['clients']} | "
                  f"{v['ttft_p50_s'] / f['ttft_p50_s']:.2f}x | {v['ttft_p99_s'] / f['ttft_p99_s']:.2f}x | "
                  f"{f['itl_p99_s'] / v['itl_p99_s']:.2f}x | {f['requests_per_s'] / v['requests_per_s']:.2f}x |")
    atomic_write(out / "README.md", "\n".join(md) + "\n")
    _plot(rows, clients, out / "load.png")
    print("\n".join(md))
    return 0


def _label(row: dict) -> str:
    """The row's engine, and for the connector which loads ran (issue 49's rows keep ``engine`` to its two names)."""
    return {None: "vllm", "async": "vllm+fusionrag", "sync": "vllm+fusionrag sync"}.get(
        row.get("loads"), f"vllm+fusionrag {row.get('loads')}")


def _plot(rows: list[dict], clients: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2))
    for key in sorted({(_label(r), r["context_tokens"]) for r in rows}):
        mine = [r for n in clients for r in rows if (_label(r), r["context_tokens"]) == key and r["clients"] == n]
        label = f"{key[0]}, ~{key[1]:.0f} tokens"
        for ax, field in zip(axes, ("ttft_p50_s", "itl_p99_s", "requests_per_s"), strict=True):
            ax.plot([r["clients"] for r in mine], [r[field] for r in mine], "o-", label=label)
    for ax, title in zip(axes, ("TTFT p50 (s)", "inter-token latency p99 (s)", "requests/s"), strict=True):
        ax.set(title=title, xlabel="clients", xticks=clients)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
