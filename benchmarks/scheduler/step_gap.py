"""The decode-step gap when a long prompt arrives: four streams decoding, one ~8K-token prefill, before and after.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scheduler/step_gap.py --out benchmarks/scheduler/results \\
        [--model qwen2.5-0.5b] [--context-tokens 8192] [--budgets 0,512] [--methods full,fusionrag] [--rounds 3]

Four chat streams decode through one :class:`~fusionrag.online.scheduler.BatchScheduler` (the server's); once
each has its first tokens, a long request arrives whose passages (a data file's, in file order) fill
``--context-tokens``. What a stream sees is the longest wait between two of its tokens while that prompt is
prefilled: with no step budget (``0``, the scheduler before the budget) the whole prefill runs between two
decode steps; with a budget of ``N`` tokens it runs in pieces of ``N`` minus the decoding rows, one piece per
decode step. The long request's TTFT is the price. Budgets and methods are interleaved within each round
(>= 3 rounds); every round's samples are kept. ``fusionrag`` runs on the passages' KV computed once before
the first round (the alternative-path cache of request-supplied passages), as a store would hold it.

Writes ``step_gap.json``, ``README.md`` and ``step_gap.png`` with the command, model, data file and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

DATA = "../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl"
STREAMS = ("Name three rivers of Europe and one city on each.", "Describe how a bicycle gear works.",
           "Write a short note about the history of paper.", "List the planets in order from the Sun.")
LONG_QUESTION = "Which of these passages mentions a river, and what does it say about it?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (JSON, Markdown, PNG)")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it")
    p.add_argument("--data", default=DATA, help="a JSONL file whose passages fill the long prompt")
    p.add_argument("--context-tokens", type=int, default=8192, help="passage tokens of the long prompt")
    p.add_argument("--budgets", default="0,512", help="step token budgets; 0: a whole prefill between decode steps")
    p.add_argument("--methods", default="full,fusionrag", help="the long request's methods")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stream-tokens", type=int, default=512, help="max tokens of each stream (they are cancelled "
                                                                  "once the long request has its first token)")
    return p.parse_args(argv)


def long_passages(lm: Any, path: str, tokens: int) -> list[dict]:
    """Passages of ``path`` in file order until their tokens reach ``tokens``."""
    out, n = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            for p in json.loads(line)["passages"]:
                if n >= tokens:
                    return out
                out.append({"title": p["title"], "text": p["text"]})
                n += len(lm.tokenizer(f"{p['title']}\n{p['text']}")["input_ids"])
    if n < tokens:
        raise SystemExit(f"{path} holds only ~{n} passage tokens; lower --context-tokens")
    return out


def one_run(engine: Any, budget: int, method: str, passages: list[dict], stream_tokens: int) -> dict[str, Any]:
    """Four streams, then the long request: each stream's longest wait between tokens during its prefill."""
    from fusionrag.online.scheduler import BatchScheduler
    from fusionrag.online.state import Request

    sched = BatchScheduler(engine, max_batch=8, stop_ids=[], step_tokens=budget or None)
    try:
        started = threading.Semaphore(0)

        def listener(req_tokens: list[int]):
            def on(event) -> None:
                if event.kind == "token":
                    req_tokens.append(event.token)
                    if len(req_tokens) == 3:
                        started.release()
            return on

        streams = [sched.submit(Request.of(q, max_new_tokens=stream_tokens, method="full", chunks=[]),
                                listener=listener([])) for q in STREAMS]
        for _ in STREAMS:
            if not started.acquire(timeout=600):
                raise RuntimeError("a stream did not start")
        pieces = sched.stats.prefill_pieces
        arrived = time.perf_counter()
        long = sched.submit(Request.of(LONG_QUESTION, max_new_tokens=1, method=method, chunks=passages, ratio=0.15))
        long.result(timeout=3600)
        first = long.answer.first_token_at
        for s in streams:
            s.cancel()
        for s in streams:
            with contextlib.suppress(Exception):  # cancelled: the streams' job was done
                s.result(timeout=600)
        gaps = []  # every stream's waits between tokens that end after the long request arrived
        for s in streams:
            times = [t for t in s.answer.token_times if t <= first]
            gaps += [b - a for a, b in itertools.pairwise(times) if b > arrived]
            after = [t for t in s.answer.token_times if t > first]
            if times and after:  # the wait across the long request's first token
                gaps.append(after[0] - times[-1])
        return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
                "long_ttft_s": first - arrived, "long_ttft_ms": dict(long.ttft_ms),
                "prompt_tokens": long.prompt_tokens, "method_run": long.method,
                "stream_tokens_during_prefill": sum(1 for s in streams for t in s.answer.token_times
                                                    if arrived < t <= first),
                "pieces": sched.stats.prefill_pieces - pieces}
    finally:
        sched.close()


def summarise(rows: list[dict], budgets: list[int], methods: list[str]) -> list[dict]:
    """Per (method, budget): medians over rounds; against budget 0, the paired ratios with bootstrap intervals."""
    from fusionrag.bench.metrics import bootstrap_ci

    out = []
    for method in methods:
        base = [r for r in rows if r["method"] == method and r["budget"] == 0]
        for budget in budgets:
            mine = [r for r in rows if r["method"] == method and r["budget"] == budget]
            row: dict[str, Any] = {"method": method, "budget": budget, "n": len(mine)}
            for key in ("max_gap_s", "median_gap_s", "long_ttft_s"):
                row[key] = statistics.median(r[key] for r in mine)
            row["pieces"] = statistics.median(r["pieces"] for r in mine)
            if budget and base:
                pairs = list(zip(sorted(base, key=lambda r: r["round"]), sorted(mine, key=lambda r: r["round"]),
                                 strict=True))
                for key, name in (("max_gap_s", "gap_ratio"), ("long_ttft_s", "ttft_ratio")):
                    ratios = [a[key] / b[key] if key == "max_gap_s" else b[key] / a[key] for a, b in pairs]
                    _, lo, hi = bootstrap_ci(ratios)
                    row[name] = {"median": statistics.median(ratios), "lo": lo, "hi": hi, "n": len(ratios)}
            out.append(row)
    return out


def markdown(doc: dict) -> str:
    meta, summary = doc["meta"], doc["summary"]
    lines = [
        "# Decode-step gap while a long prompt is prefilled",
        "",
        f"Four streams decode; a ~{meta['context_tokens']}-token request arrives (`{meta['model']}`, "
        f"{meta['dtype']}, {meta['threads']} thread(s), {meta['rounds']} interleaved rounds, on "
        f"{meta['machine'].get('cpu_model')}). *Longest wait* is the longest time any stream waited between two "
        "of its tokens while that prompt was prefilled; budget 0 is a whole prefill between two decode steps "
        "(the scheduler before the step budget).",
        "",
        "| long request | step budget | longest wait (s) | median wait (s) | its TTFT (s) | pieces | "
        "longest wait, budget 0 / this | its TTFT, this / budget 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ratio(r: dict | None) -> str:
        return "-" if not r else f"{r['median']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}] (n={r['n']})"

    for r in summary:
        lines.append(f"| {r['method']} | {r['budget'] or 'none'} | {r['max_gap_s']:.2f} | {r['median_gap_s']:.2f} | "
                     f"{r['long_ttft_s']:.2f} | {r['pieces']:.0f} | {ratio(r.get('gap_ratio'))} | "
                     f"{ratio(r.get('ttft_ratio'))} |")
    lines += ["", "Medians over rounds; intervals: percentile bootstrap over the rounds' paired ratios.", "",
              f"Command: `{meta['command']}`", "", f"Data: `{meta['data']}`", "",
              "Every sample: `step_gap.json`. Plot: `step_gap.png`.", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import figure, save_png

    summary = doc["summary"]
    methods = list(dict.fromkeys(r["method"] for r in summary))
    budgets = list(dict.fromkeys(r["budget"] for r in summary))
    fig, grid = figure(1, 2, 5, 4)
    axes = grid[0]
    width = 0.8 / len(budgets)
    for i, budget in enumerate(budgets):
        for ax, key in zip(axes, ("max_gap_s", "long_ttft_s"), strict=True):
            vals = [next(r[key] for r in summary if r["method"] == m and r["budget"] == budget) for m in methods]
            xs = [j + i * width for j in range(len(methods))]
            bars = ax.bar(xs, vals, width, label=f"budget {budget or 'none'}")
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for ax, title in zip(axes, ("longest wait of a stream (s)", "TTFT of the long request (s)"), strict=True):
        ax.set_xticks([j + width * (len(budgets) - 1) / 2 for j in range(len(methods))], methods)
        ax.set_title(title)
        ax.set_ylabel("seconds")
        ax.legend()
    meta = doc["meta"]
    fig.suptitle(f"4 streams + one ~{meta['context_tokens']}-token prompt, {meta['model']} {meta['dtype']}, "
                 f"{meta['threads']} thread(s), n={meta['rounds']} rounds")
    save_png(fig, path)


def write_report(doc: dict, out: Path) -> None:
    from fusionrag.bench.provenance import write_report_files

    write_report_files(out, "step_gap", doc, markdown(doc), lambda path: plot(doc, path))


def run(args: argparse.Namespace) -> dict:
    import torch

    from fusionrag.bench.provenance import machine_info
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype)
    engine = Engine(None, lm)
    passages = long_passages(lm, args.data, args.context_tokens)
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    if "fusionrag" in methods:  # the passages' KV, computed once, as a store holds it
        engine.answer(LONG_QUESTION, method="fusionrag", chunks=passages, max_new_tokens=1)
    rows = []
    for rnd in range(args.rounds):
        for method in methods:
            for budget in budgets:
                r = one_run(engine, budget, method, passages, args.stream_tokens)
                rows.append({"round": rnd, "method": method, "budget": budget, **r})
                print(f"round {rnd} {method} budget {budget}: longest wait {r['max_gap_s']:.2f} s, "
                      f"TTFT {r['long_ttft_s']:.2f} s, {r['pieces']} pieces", file=sys.stderr, flush=True)
    meta = {"command": "benchmarks/scheduler/step_gap.py " + shlex.join(sys.argv[1:]), "model": args.model,
            "dtype": str(lm.dtype).removeprefix("torch."), "threads": args.threads, "rounds": args.rounds,
            "context_tokens": args.context_tokens, "data": args.data, "machine": machine_info(),
            "streams": len(STREAMS)}
    return {"meta": meta, "rows": rows, "summary": summarise(rows, budgets, methods)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    write_report(doc, Path(args.out))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
