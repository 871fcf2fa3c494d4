"""Where ``auto`` should stop reusing: FusionRAG 15% vs Full Attention TTFT by the context's share with KV ready.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reuse/auto_share.py --store STORE --out benchmarks/reuse/results \\
        [--model qwen2.5-0.5b] [--tokens 1200] [--shares 0,0.25,0.5,0.75,1] [--rounds 3]

Each context holds about ``--tokens`` tokens: stored chunks of ``STORE`` (KV ready) for the given share,
the rest new text the store does not hold (other stored chunks with their words reversed: text of the
same kind and length, computed by this request; a round-specific marker keeps the prefix cache from
serving it again). The same passages go to ``Engine.prepare`` with ``method=fusionrag`` (ratio 0.15) and
``method=full``, interleaved, on one engine with the whole-context cache off. Reported per share: the
median TTFT of each method and the ratio full / fusionrag with its bootstrap interval over contexts.
``auto`` reuses only where the ratio is clearly above 1 (``online/auto.AUTO_MIN_READY``).
Writes ``auto_share.json``, ``auto_share.md`` and ``auto_share.png``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="a store built for --model (e.g. split_ttft.py's)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=1200)
    p.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    p.add_argument("--contexts", type=int, default=4, help="contexts per share")
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def contexts(store, tokens: int, share: float, n: int, seed: int) -> list[tuple[list[dict], list[dict]]]:
    """``n`` contexts: (stored passages, new passages) of about ``tokens`` tokens, ``share`` of them stored."""
    rng = random.Random(seed)
    ids = store.chunk_ids()
    out = []
    for _ in range(n):
        order = rng.sample(ids, len(ids))
        stored, new, got_s, got_n = [], [], 0, 0
        for cid in order:
            rec = store.chunk(cid)
            if got_s < share * tokens:
                stored.append({"title": rec.title, "text": rec.text})
                got_s += rec.n_tokens
            elif got_n < (1 - share) * tokens:
                new.append({"title": rec.title, "text": " ".join(reversed(rec.text.split()))})
                got_n += rec.n_tokens
        out.append((stored, new))
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from fusionrag.bench.metrics import bootstrap_ci

    out = []
    for share in sorted({r["share"] for r in rows}):
        cells = [r for r in rows if r["share"] == share]
        keys = sorted({r["context"] for r in cells})
        med = {(k, m): statistics.median(r["seconds"] for r in cells if r["context"] == k and r["method"] == m)
               for k in keys for m in ("full", "fusionrag")}
        ratios = [med[(k, "full")] / med[(k, "fusionrag")] for k in keys]
        _, lo, hi = bootstrap_ci(ratios)
        out.append({"share": share, "n": len(keys),
                    "ready_share": statistics.median(r["ready_share"] for r in cells if r["method"] == "fusionrag"),
                    "context_tokens": statistics.median(r["context_tokens"] for r in cells),
                    "full_s": statistics.median(med[(k, "full")] for k in keys),
                    "fusionrag_s": statistics.median(med[(k, "fusionrag")] for k in keys),
                    "ratio": statistics.median(ratios), "lo": lo, "hi": hi})
    return out


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = ["# FusionRAG 15% vs Full Attention by the share of the context with KV ready", "",
             f"`{m['model']}` ({m['dtype']}), 1 thread, contexts of ~{m['tokens']} tokens, {m['rounds']} interleaved "
             f"rounds, on {m['machine'].get('cpu_model')}. `auto` reuses from {m['auto_min_ready']:.0%} of the "
             "context ready.", "",
             "| share with KV ready | n contexts | context tokens | full | FusionRAG 15% | full / FusionRAG |",
             "|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        lines.append(f"| {s['ready_share']:.0%} | {s['n']} | {s['context_tokens']:.0f} | {s['full_s']:.2f} s | "
                     f"{s['fusionrag_s']:.2f} s | **{s['ratio']:.2f}x** [{s['lo']:.2f}, {s['hi']:.2f}] |")
    if m.get("auto_min_ready_at_run", m["auto_min_ready"]) != m["auto_min_ready"]:
        lines += ["", f"The run used `auto`'s earlier threshold ({m['auto_min_ready_at_run']:.0%}); this table set "
                  f"it to {m['auto_min_ready']:.0%}, the lowest share measured where FusionRAG is clearly faster."]
    lines += ["", "New text is computed piece by piece (each passage after `S`) before the selection and the "
              "recompute pass; a full prefill computes everything once.", "", f"Command: `{m['command']}`", "",
              f"Store: `{m['store']}`", "", "Every run: `auto_share.json`.", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import figure, save_png

    fig, axes = figure(1, 1, 6, 4)
    ax = axes[0][0]
    xs = [s["ready_share"] for s in doc["summary"]]
    ax.errorbar(xs, [s["ratio"] for s in doc["summary"]],
                yerr=[[s["ratio"] - s["lo"] for s in doc["summary"]], [s["hi"] - s["ratio"] for s in doc["summary"]]],
                marker="o", capsize=4)
    ax.axhline(1.0, color="#999999", linestyle="--")
    ax.axvline(doc["meta"]["auto_min_ready"], color="#d62728", linestyle=":", label="auto reuses from here")
    ax.set_xlabel("share of the context with KV ready (stored)")
    ax.set_ylabel("TTFT full / FusionRAG 15%")
    ax.set_title(f"When reuse pays, {doc['meta']['model']}, ~{doc['meta']['tokens']} tokens")
    ax.legend()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    import torch

    from fusionrag.bench.provenance import machine_info, write_report_files
    from fusionrag.online.auto import AUTO_MIN_READY
    from fusionrag.online.engine import Engine

    args = parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine.open(args.store, model=args.model)
    engine.context_cache.max_bytes = 0  # each method measured as itself
    rows: list[dict[str, Any]] = []
    shares = [float(s) for s in args.shares.split(",")]
    plan = {share: contexts(engine.store, args.tokens, share, args.contexts, seed=int(share * 100))
            for share in shares}
    question = "Which of these people was born first?"
    engine.prepare(question, chunks=plan[shares[-1]][0][0], method="fusionrag")  # warm-up
    for rnd in range(args.rounds):
        for share in shares:
            for k, (stored, new) in enumerate(plan[share]):
                marked = [{"title": p["title"], "text": f"({rnd}) {p['text']}"} for p in new]
                chunks = stored + marked
                for method in (("full", "fusionrag") if (rnd + k) % 2 else ("fusionrag", "full")):
                    t0 = time.perf_counter()
                    req = engine.prepare(question, chunks=chunks, method=method)
                    seconds = time.perf_counter() - t0
                    rows.append({"round": rnd, "share": share, "context": k, "method": method, "seconds": seconds,
                                 "context_tokens": req.context_tokens,
                                 "ready_share": sum(len(ids) for c, ids in zip(req.chunk_ids, req.chunk_token_ids,
                                                                               strict=True) if c is not None)
                                 / max(1, req.context_tokens)})
                    print(rows[-1], file=sys.stderr, flush=True)
    meta = {"command": "benchmarks/reuse/auto_share.py " + shlex.join(sys.argv[1:]), "model": args.model,
            "dtype": str(engine.lm.dtype).removeprefix("torch."), "tokens": args.tokens, "rounds": args.rounds,
            "store": args.store, "auto_min_ready": AUTO_MIN_READY, "machine": machine_info()}
    doc = {"meta": meta, "summary": summarise(rows), "rows": rows}
    write_report_files(Path(args.out), "auto_share", doc, markdown(doc), lambda path: plot(doc, path))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
