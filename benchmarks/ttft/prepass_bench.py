"""Where FusionRAG's selection pre-pass goes, and what stopping it early saves (decision 048).

The ``select`` stage of FusionRAG's TTFT runs the question over the assembled reused KV to get
its last-layer attention over the context. This script takes the exact selection input the
engine builds for FusionRAG 15% (the prompts of ``fusionrag bench ttft``: the data file's first
question over its first passages, fused KV with the first chunk plain, in memory) and times,
interleaved per round (every variant once per round; medians):

- ``reference``: the whole forward of the question (every layer, final norm, LM head), the path
  before decision 048 (``tests/online/prepass_reference.py``);
- ``stopped``: the product's path, the same forward ended where the last layer's attention
  begins (that attention, its MLP, the final norm and the LM head skipped), same selection;
- ``layer-K`` (``--layers``): the option of scoring an earlier layer's attention (the pass ends
  at layer K). Only the cost is measured here, with the share of the last layer's selection it
  keeps; its quality (paired KL against Full Attention) is not, so it is no default.

Each variant's time is split into the pass, the scoring (softmax of the question's queries over
the context's keys) and the top-k; one more run per variant with timing hooks on the model's
modules splits the pass into embedding, attention projections, attention over the context, MLP,
norms and LM head.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ttft/prepass_bench.py \\
        --data ../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl --context-tokens 2048,4096 \\
        --rounds 5 --layers 12,18 --out benchmarks/ttft/results/prepass
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

#: The whole-forward pre-pass (before decision 048) is the tests' reference, kept beside them.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "online"))

CAPTURED: list = []


@dataclass
class _Capture:
    """A policy that keeps the engine's selection input and selects as FusionRAG does."""

    name: str = "prepass-capture"

    def scores(self, inp):
        from fusionrag.online.policies import QueryGuided

        CAPTURED.append(inp)
        return QueryGuided().scores(inp)


def selection_input(engine, store, question: str, chunk_ids, ratio: float):
    """The :class:`SelectionInput` the engine builds for FusionRAG over these chunks (fused, first plain)."""
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    CAPTURED.clear()
    engine.prepare(question, method="prepass-capture", ratio=ratio, chunks=chunks)
    return CAPTURED[-1]


def timed_select(lm, inp, layer: int, reference: bool, ratio: float, sync) -> dict:
    """One selection, split into the pass, the scoring and the top-k (ms), and its indices."""
    from prepass_reference import question_queries_reference

    from fusionrag.online.policies import attention_scores, budget, question_queries, top_k_of

    t0 = time.perf_counter()
    qq = question_queries_reference(inp) if reference else question_queries(inp, layer)
    sync()
    t1 = time.perf_counter()
    scores = attention_scores(inp, qq)
    sync()
    t2 = time.perf_counter()
    idx = top_k_of(scores, inp.candidates, budget(ratio, inp.candidates.numel()))
    t3 = time.perf_counter()
    return {"pass_ms": (t1 - t0) * 1e3, "score_ms": (t2 - t1) * 1e3, "topk_ms": (t3 - t2) * 1e3,
            "select_ms": (t3 - t0) * 1e3, "idx": idx}


def module_breakdown(lm, inp, layer: int, reference: bool, ratio: float, sync) -> dict[str, float]:
    """One timed selection with pre/post hooks on the model's modules: ms per part of the pass.

    "attention over the context" is each attention module's time less its projections; the layer
    where a stopped pass ends never finishes its attention module, so only its projections count."""
    adapter = lm.adapter
    parts: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}
    inner: dict[int, float] = defaultdict(float)  # projection time inside each attention module

    def hooks(module, name, owner=None):
        def pre(m, _args):
            sync()
            starts[id(m)] = time.perf_counter()

        def post(m, _args, _out):
            sync()
            ms = (time.perf_counter() - starts.pop(id(m))) * 1e3
            if name == "attention over the context":
                ms -= inner.pop(id(m), 0.0)
            elif owner is not None:
                inner[id(owner)] += ms
            parts[name] += ms

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    handles = hooks(adapter.body.embed_tokens, "embedding") + hooks(adapter.body.norm, "final norm") + \
        hooks(lm.model.lm_head, "LM head")
    for block in adapter.layers:
        attn = block.self_attn
        handles += hooks(block.input_layernorm, "norms") + hooks(block.post_attention_layernorm, "norms")
        handles += hooks(block.mlp, "MLP") + hooks(attn, "attention over the context")
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            handles += hooks(getattr(attn, p), "attention projections", owner=attn)
    try:
        t = timed_select(lm, inp, layer, reference, ratio, sync)
    finally:
        for h in handles:
            h.remove()
    parts["other (RoPE, cache, glue)"] = t["pass_ms"] - sum(parts.values())
    parts["scoring (softmax over the context)"] = t["score_ms"]
    parts["top-k"] = t["topk_ms"]
    return dict(parts)


def ttft_prompts(model: str, data: str, lengths: list[int], top_n: int, device: str | None):
    """``(lm, store, question, {length: chunk ids})``: the store and contexts ``fusionrag bench ttft`` builds
    and reuses for ``data`` (:func:`fusionrag.bench.ttft.ttft_workload`), its first question; float32."""
    from fusionrag.bench.ttft import ttft_workload
    from fusionrag.models import load_model

    lm = load_model(model, device=device)
    store, examples, contexts = ttft_workload(lm, data, lengths, top_n, model_source=model)
    return lm, store, examples[0].question, contexts


def prompt_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a script timing FusionRAG on ``fusionrag bench ttft``'s prompts (this one, in_place_bench)."""
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--context-tokens", default="2048,4096")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top-n", type=int, default=2, help="offline neighbours of the fused KV (bench ttft's default)")
    ap.add_argument("--device", default=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_arguments(ap)
    ap.add_argument("--layers", default="", help="earlier scoring layers to time as options, e.g. 12,18")
    ap.add_argument("--out", default="benchmarks/ttft/results/prepass")
    args = ap.parse_args()

    from fusionrag.bench.provenance import build_meta, write_json_atomic, write_text_atomic
    from fusionrag.bench.ttft import tier_source
    from fusionrag.models.clock import device_sync
    from fusionrag.online.engine import Engine
    from fusionrag.online.methods import register_policy

    lengths = [int(x) for x in args.context_tokens.split(",")]
    lm, store, question, contexts = ttft_prompts(args.model, args.data, lengths, args.top_n, args.device)
    sync = device_sync(lm.device)
    register_policy("prepass-capture", _Capture, kv="plain-first")

    last = lm.num_layers - 1
    variants = {"reference": (last, True), "stopped": (last, False)}
    for k in (int(x) for x in args.layers.split(",") if x):
        variants[f"layer-{k}"] = (k, False)
    rows, breakdowns = [], []
    for n in lengths:
        engine = Engine(store, lm, kv_source=tier_source(store, "memory", contexts[n]))
        inp = selection_input(engine, store, question, contexts[n], args.ratio)
        for layer, reference in variants.values():  # warm-up
            timed_select(lm, inp, layer, reference, args.ratio, sync)
        samples: dict[str, list] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, (layer, reference) in variants.items():
                samples[v].append(timed_select(lm, inp, layer, reference, args.ratio, sync))
        ref_idx = samples["reference"][0]["idx"]
        for v, (layer, reference) in variants.items():
            s = samples[v]
            idx = s[0]["idx"]
            kept = len(set(idx.tolist()) & set(ref_idx.tolist())) / max(1, ref_idx.numel())
            rows.append({"target_tokens": n, "prompt_tokens": len(inp.context) + inp.question_token_ids.numel(),
                         "question_tokens": inp.question_token_ids.numel(), "variant": v, "layer": layer,
                         **{k: statistics.median(x[k] for x in s) for k in ("select_ms", "pass_ms", "score_ms",
                                                                            "topk_ms")},
                         "select_samples_ms": [x["select_ms"] for x in s],
                         "same_selection_as_reference": all(torch.equal(x["idx"], ref_idx) for x in s),
                         "share_of_reference_selection_kept": kept, "rounds": len(s)})
            breakdowns.append({"target_tokens": n, "variant": v,
                               "parts_ms": module_breakdown(lm, inp, layer, reference, args.ratio, sync)})
        print(f"[prepass] {n}: " + ", ".join(f"{r['variant']} {r['select_ms']:.0f} ms" for r in rows
                                              if r["target_tokens"] == n))
    meta = build_meta(model=lm.name, data_files=args.data,
                      extra={"question": question, "ratio": args.ratio, "rounds": args.rounds, "device": str(lm.device),
                             "dtype": str(lm.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
                             "attention": lm.attention, "interleaved": True, "breakdowns": breakdowns})
    out = Path(args.out)
    write_json_atomic(out / "prepass.json", {"meta": meta, "rows": rows})
    write_text_atomic(out / "prepass.md", _markdown(meta, rows, breakdowns))
    return 0


def _markdown(meta: dict, rows: list[dict], breakdowns: list[dict]) -> str:
    lines = ["# The selection pre-pass, timed alone", "", f"Command: `{meta['command']}`  ",
             f"Model `{meta['model']}`, {meta['device']}, {meta['dtype']}, {meta['torch_threads']} torch thread(s), "
             f"ratio {meta['ratio']:.0%}; variants interleaved, median of {meta['rounds']} rounds.", "",
             "| context | prompt tokens | question tokens | variant | select ms | pass | scoring | top-k "
             "| vs reference | same selection | reference's selection kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = next(x for x in rows if x["target_tokens"] == r["target_tokens"] and x["variant"] == "reference")
        lines.append(f"| {r['target_tokens']} | {r['prompt_tokens']} | {r['question_tokens']} | {r['variant']} | "
                     f"{r['select_ms']:.0f} | {r['pass_ms']:.0f} | {r['score_ms']:.1f} | {r['topk_ms']:.1f} | "
                     f"{ref['select_ms'] / r['select_ms']:.2f}x | {r['same_selection_as_reference']} | "
                     f"{r['share_of_reference_selection_kept']:.0%} |")
    names = sorted({k for b in breakdowns for k in b["parts_ms"]}, key=lambda k: -breakdowns[0]["parts_ms"].get(k, 0))
    lines += ["", "## Where the time goes (one run each with timing hooks on the modules, ms)", "",
              "| context | variant | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for b in breakdowns:
        lines.append(f"| {b['target_tokens']} | {b['variant']} | "
                     + " | ".join(f"{b['parts_ms'].get(k, 0.0):.1f}" for k in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
