"""The engines side by side: time to first token of the same token ids in every engine a CPU user could run.

    .venv/bin/python benchmarks/engines/engines_bench.py --out benchmarks/engines/results/NAME \\
        [--lengths 2048,4096,8192] [--threads 1,2] [--rounds 3] [--engines transformers,fusionrag,vllm,llama.cpp]

One run, interleaved rounds: every cell once per round, >= 3 rounds, the medians reported with every
sample kept. The prompts are ``fusionrag bench ttft``'s (2WikiMQA passages in file order, fused with
2 neighbours; :func:`fusionrag.bench.ttft.ttft_workload`): ``S + chunks + Q`` as token ids, dumped to
``prompts.json`` and fed unchanged to every engine (the peers take ids, not text). Cells, per context
length and thread count:

- plain ``transformers``, float32 and bfloat16 (``model(ids, logits_to_keep=1)``);
- fusionrag ``full``, ``reuse`` (Full Reuse), ``fusionrag`` (FusionRAG 15%) in float32 and bfloat16, and
  its repeated context (``prefix_hit``: a second question on the context it has just computed);
- vLLM's CPU build, bfloat16, prefix caching on: ``full`` with the prefix cache emptied, then
  ``prefix_hit`` (the second question);
- llama.cpp on each GGUF given (the packaged Q4_K_M and a bf16 conversion): ``full`` cold, ``prefix_hit``.

A peer whose environment is missing is skipped with one line saying what to run
(``benchmarks/engines/setup_engines.sh``). Cells on one thread run on core 0, on two threads on cores 0-1;
the machine probe (GEMM GFLOP/s in fp32 and bf16, memory copy GB/s) is taken at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cells import (
    Cell,
    Prompt,
    fusionrag_cells,
    gguf_dtype,
    llama_worker,
    missing_venv,
    peer_cells,
    transformers_cell,
    use_threads,
    vllm_worker,
)
from engines_report import write_report

DATA = "../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl"
ENGINES = ("transformers", "fusionrag", "vllm", "llama.cpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from fusionrag.paths import fusionrag_home

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--dtypes", default="float32,bfloat16", help="fusionrag's and transformers' compute dtypes")
    ap.add_argument("--gguf", action="append", default=None,
                    help="llama.cpp model file (repeatable; default: the packaged Q4_K_M and the bf16 conversion in "
                         "$FUSIONRAG_HOME/engines: bf16 is llama.cpp's fastest file on an AVX512-BF16 CPU and "
                         "the like-for-like dtype; q8_0 and f16 were slower, see README)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    home = fusionrag_home() / "engines"
    args.gguf = [Path(g) for g in (args.gguf or [home / f"qwen2.5-0.5b-{q}.gguf" for q in ("q4_k_m", "bf16")])]
    return args


def build_prompts(args: argparse.Namespace, lm) -> tuple[object, list[Prompt]]:
    """The store and, per length, the prompt every engine gets (question 1, and question 2 on the same context)."""
    from fusionrag.bench.ttft import ttft_workload

    lengths = [int(n) for n in args.lengths.split(",")]
    store, examples, contexts = ttft_workload(lm, args.data, lengths, top_n=2, model_source=args.model)
    q1, q2 = examples[0].question, examples[1].question
    prompts = []
    for n in lengths:
        chunk_ids = contexts[n]
        context = list(store.prompt.system_token_ids) + [t for c in chunk_ids for t in store.chunk(c).token_ids]
        chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
        prompts.append(Prompt(n, context + list(store.prompt.question_token_ids(q1, "")),
                              context + list(store.prompt.question_token_ids(q2, "")), q1, q2, chunks))
    return store, prompts


def make_cells(args, store, models: dict, threads: list[int], logs: Path) -> tuple[list[Cell], list, list[str]]:
    """Every cell of the run, the peer workers started for it, and one line per cell that cannot run."""
    from fusionrag.online.engine import DEFAULT_CONTEXT_CACHE_BYTES, Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore

    engines = set(args.engines.split(","))
    cells, workers, skipped = [], [], []
    fusion = {d: Engine(KnowledgeStore.open(store.path, lm=lm) if d != "float32" else store, lm,
                        kv_source=_memory_tier(store, lm), context_cache_bytes=DEFAULT_CONTEXT_CACHE_BYTES)
              for d, lm in models.items()}
    for t in threads:
        if "transformers" in engines:
            cells += [transformers_cell(lm, t) for lm in models.values()]
        if "fusionrag" in engines:
            for engine in fusion.values():
                cells += fusionrag_cells(engine, t, args.ratio)
        if "vllm" in engines:
            why = missing_venv("vllm")
            if why:
                skipped.append(why)
            else:
                w = vllm_worker(_model_dir(args.model), t, logs)
                w.start()
                workers.append(w)
                cells += peer_cells(w, "vllm", "bfloat16", t)
        if "llama.cpp" in engines:
            why = missing_venv("llama")
            for gguf in args.gguf:
                if why or not gguf.exists():
                    skipped.append(why or f"llama.cpp: no {gguf} (run: bash benchmarks/engines/setup_engines.sh gguf)")
                    continue
                w = llama_worker(gguf, t, logs)
                w.start()
                workers.append(w)
                cells += peer_cells(w, "llama.cpp", gguf_dtype(gguf), t)
    return cells, workers, sorted(set(skipped))


def _memory_tier(store, lm):
    """Every chunk's stored KV in memory (``bench ttft``'s memory tier): the online path without disk reads."""
    from fusionrag.bench.ttft import tier_source

    return tier_source(store, "memory", store.chunk_ids(), lm.device)


def _model_dir(model: str) -> Path:
    """The safetensors folder fusionrag converted (vLLM loads the very weights fusionrag computes with)."""
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED

    if model in PACKAGED:
        return ensure_converted(PACKAGED[model])
    return Path(model)


def run(args: argparse.Namespace) -> dict:
    import torch

    from fusionrag.bench.provenance import build_meta, machine_probe
    from fusionrag.files import atomic_write
    from fusionrag.models import load_model

    out = Path(args.out)
    threads = [int(t) for t in args.threads.split(",")]
    models = {d: load_model(args.model, dtype=d, device="cpu") for d in args.dtypes.split(",")}
    store, prompts = build_prompts(args, next(iter(models.values())))
    atomic_write(out / "prompts.json", json.dumps(
        {"data": args.data, "model": args.model, "prompts": [
            {"target_tokens": p.target, "ids": p.ids, "ids_repeat": p.ids2, "question": p.question,
             "question_repeat": p.question2} for p in prompts]}))
    use_threads(max(threads))
    probe_start = {t: (use_threads(t), machine_probe())[1] for t in threads}
    cells, workers, skipped = make_cells(args, store, models, threads, out / "logs")
    for line in skipped:
        print(f"[engines] skipped: {line}", file=sys.stderr)
    samples: dict[tuple[str, int], list] = {(c.key, p.target): [] for c in cells for p in prompts}
    errors: dict[tuple[str, int], str] = {}
    try:
        shortest = min(prompts, key=lambda p: p.target)
        for c in cells:  # warm-up on the shortest prompt (allocators, kernels, thread pools), not recorded
            _safe(c, shortest, {}, (c.key, shortest.target))
        for r in range(args.rounds):
            for p in prompts:
                for c in cells:
                    sample = _safe(c, p, errors, (c.key, p.target))
                    if sample is not None:
                        samples[(c.key, p.target)].append(sample)
                print(f"[engines] round {r + 1}/{args.rounds}, {p.target} tokens: " + ", ".join(
                    f"{c.key} {statistics.median(s[0] for s in samples[(c.key, p.target)]):.2f}s"
                    for c in cells if samples[(c.key, p.target)]), file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.stop()
    probe_end = {t: (use_threads(t), machine_probe())[1] for t in threads}
    rows = []
    for c in cells:
        for p in prompts:
            s = samples[(c.key, p.target)]
            rows.append({"engine": c.engine, "method": c.method, "ratio": c.ratio, "dtype": c.dtype,
                         "threads": c.threads, "target_tokens": p.target,
                         "prompt_tokens": len(p.ids2 if c.method == "prefix_hit" else p.ids),
                         "ttft_s": [x[0] for x in s], "first_tokens": [x[1] for x in s],
                         "stages_ms": [x[2] for x in s if len(x) > 2], "error": errors.get((c.key, p.target))})
    meta = build_meta(command=shlex.join(["benchmarks/engines/engines_bench.py", *sys.argv[1:]]), model=args.model,
                      data_files=[args.data], extra={
                          "rounds": args.rounds, "ratio": args.ratio, "threads": threads, "interleaved": True,
                          "machine_probe": {"start": probe_start, "end": probe_end}, "skipped": skipped,
                          "workers": {w.name: w.info for w in workers}, "torch": torch.__version__,
                          "questions": [prompts[0].question, prompts[0].question2]})
    doc = {"meta": meta, "rows": rows}
    write_report(doc, out)
    return doc


def _safe(cell: Cell, prompt: Prompt, errors: dict, key) -> tuple | None:
    """One sample of ``cell``; a failure is recorded (one line) and the run goes on."""
    t0 = time.perf_counter()
    try:
        return cell.run(prompt)
    except Exception as exc:
        errors[key] = f"{type(exc).__name__}: {exc}"
        print(f"[engines] {cell.key} at {prompt.target}: {errors[key]} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    print(json.dumps({"rows": len(doc["rows"]), "out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
