"""FusionRAG's recompute pass before and after decision 050 (in place, last layer on the last row), interleaved.

Takes the exact recompute input the engine builds for FusionRAG 15% on ``fusionrag bench ttft``'s
prompts (the data file's first question over its first passages, fused KV with the first chunk
plain, the selection of the product's pre-pass) and times, interleaved per round (medians):

- ``past + new``: the pass before decision 050: the selected tokens and the question over the shared
  context with the stale slots masked, every layer on every row, then the prompt KV assembled;
- ``in place``: the product's pass: the prompt KV allocated first and written layer by layer, each
  query reading the slots at or before its position, the last layer's attention and MLP on the last row.

Also records the largest differences between the two (first-token logits, prompt KV) and whether the
first token is the same. Writes ``in_place.json``, ``in_place.md`` and ``in_place.png`` to ``--out``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ttft/in_place_bench.py \\
        --data ../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl --context-tokens 2048,4096 \\
        --rounds 5 --out benchmarks/ttft/results/in_place
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepass_bench import CAPTURED, _Capture, prompt_arguments, selection_input, ttft_prompts

VARIANTS = ("past + new", "in place")


@contextmanager
def past_plus_new():
    """Inside: ``sparse_recompute`` takes the pass before decision 050 (as on a backend without an in-place pass)."""
    from fusionrag.execution import recompute

    before = recompute.in_place_available
    recompute.in_place_available = lambda lm: False
    try:
        yield
    finally:
        recompute.in_place_available = before


def recompute_call(inp, idx) -> Callable[[], object]:
    from fusionrag.execution.recompute import sparse_recompute

    return lambda: sparse_recompute(inp.lm, inp.context, inp.context_ids, idx, inp.question_token_ids)


def run_variant(variant: str, call: Callable[[], object], sync: Callable[[], None]) -> tuple[float, object]:
    """One timed recompute (ms) and its result."""
    with past_plus_new() if variant == "past + new" else nullcontext():
        t0 = time.perf_counter()
        res = call()
        sync()
        return (time.perf_counter() - t0) * 1e3, res


def compare(a, b) -> dict:
    """How far apart two recompute results are (logits, prompt KV) and whether they pick the same first token."""
    return {"max_abs_logit_diff": float((a.last_logits - b.last_logits).abs().max()),
            "max_abs_kv_diff": float(max((a.kv.keys - b.kv.keys).abs().max(), (a.kv.values - b.kv.values).abs().max())),
            "same_first_token": bool(a.last_logits.argmax() == b.last_logits.argmax())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(ap)
    ap.add_argument("--out", default="benchmarks/ttft/results/in_place")
    args = ap.parse_args()

    from fusionrag.bench.provenance import build_meta, write_json_atomic, write_text_atomic
    from fusionrag.bench.ttft import tier_source
    from fusionrag.models.clock import device_sync
    from fusionrag.online.engine import Engine
    from fusionrag.online.methods import register_policy
    from fusionrag.online.policies import QueryGuided, budget, top_k_of

    torch.set_grad_enabled(False)
    lengths = [int(x) for x in args.context_tokens.split(",")]
    lm, store, question, contexts = ttft_prompts(args.model, args.data, lengths, args.top_n, args.device)
    sync = device_sync(lm.device)
    register_policy("prepass-capture", _Capture, kv="plain-first")
    rows = []
    for n in lengths:
        engine = Engine(store, lm, kv_source=tier_source(store, "memory", contexts[n], lm.device))
        inp = selection_input(engine, store, question, contexts[n], args.ratio)
        CAPTURED.clear()
        idx = top_k_of(QueryGuided().scores(inp), inp.candidates, budget(args.ratio, inp.candidates.numel()))
        call = recompute_call(inp, idx)
        results = {v: run_variant(v, call, sync)[1] for v in VARIANTS}  # warm-up, and the results compared
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                samples[v].append(run_variant(v, call, sync)[0])
        med = {v: statistics.median(samples[v]) for v in VARIANTS}
        rows.append({"target_tokens": n, "context_tokens": len(inp.context), "recomputed_tokens": int(idx.numel()),
                     "question_tokens": int(inp.question_token_ids.numel()),
                     **{f"{v}_ms": med[v] for v in VARIANTS}, "samples_ms": samples,
                     "speedup": med["past + new"] / med["in place"],
                     "every_in_place_sample_faster": max(samples["in place"]) < min(samples["past + new"]),
                     **compare(results["in place"], results["past + new"])})
        print(f"[in_place] {n}: " + ", ".join(f"{v} {med[v]:.0f} ms" for v in VARIANTS), flush=True)
    meta = build_meta(model=lm.name, data_files=args.data,
                      extra={"question": question, "ratio": args.ratio, "rounds": args.rounds, "device": str(lm.device),
                             "dtype": str(lm.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
                             "attention": lm.attention, "interleaved": True})
    out = Path(args.out)
    write_json_atomic(out / "in_place.json", {"meta": meta, "rows": rows})
    write_text_atomic(out / "in_place.md", markdown(meta, rows))
    plot(rows, out / "in_place.png")
    return 0


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# FusionRAG's recompute pass: past + new vs in place (decision 050)", "",
             f"Command: `{meta['command']}`  ",
             f"Model `{meta['model']}`, {meta['device']}, {meta['dtype']}, {meta['torch_threads']} torch thread(s), "
             f"ratio {meta['ratio']:.0%}, backend `{meta['attention']}`; the two variants interleaved, median of "
             f"{meta['rounds']} rounds (every sample in the JSON).", "",
             "| context | recomputed + question | past + new ms | in place ms | speed-up | every sample faster "
             "| max logit diff | max KV diff | same first token |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context_tokens']:,} | {r['recomputed_tokens']} + {r['question_tokens']} | "
                     f"{r['past + new_ms']:.0f} | {r['in place_ms']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['every_in_place_sample_faster']} | {r['max_abs_logit_diff']:.1e} | "
                     f"{r['max_abs_kv_diff']:.1e} | {r['same_first_token']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Every sample of both variants per context (dots) with the medians (bars)."""
    from matplotlib.figure import Figure

    from fusionrag.files import atomic_write_with

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    for i, v in enumerate(VARIANTS):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[f"{v}_ms"] / 1e3 for r in rows], width, label=v, alpha=0.75)
        for x, r in zip(xs, rows, strict=True):
            ax.plot([x] * len(r["samples_ms"][v]), [s / 1e3 for s in r["samples_ms"][v]], "k.", markersize=4)
    ax.set_xticks(range(len(rows)), [f"{r['context_tokens']:,} tokens\n{r['speedup']:.2f}x" for r in rows])
    ax.set_ylabel("recompute pass (s)")
    ax.set_title("FusionRAG 15%: recompute pass, past + new vs in place")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


if __name__ == "__main__":
    raise SystemExit(main())
