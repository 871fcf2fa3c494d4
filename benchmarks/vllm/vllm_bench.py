"""vLLM with and without fusionrag's connector, side by side: time to first token of the same token ids.

    .venv/bin/python benchmarks/vllm/vllm_bench.py --out benchmarks/vllm/results/NAME \\
        [--lengths 2048,4096,8192] [--threads 1] [--rounds 3]

One vLLM engine (the CPU build here; the same script on a CUDA vLLM where one is installed), bf16, prefix
caching on, with ``fusionrag.vllm``'s connector loaded over ``bench ttft``'s store; each request picks
its cell with ``kv_transfer_params``. Cells, every one once per round, interleaved:

- ``vllm full``: vLLM's own prefill, its prefix cache emptied first (the connector off for the request);
- ``vllm prefix_hit``: a second question on the same context, vLLM's prefix cache kept;
- ``vllm reuse`` / ``vllm fusionrag 15%`` / ``vllm fusionrag 100%``: vLLM with the connector at 0, 15 and
  100% recompute (prefix cache emptied first, so nothing but the connector is reused);
- ``fusionrag fusionrag 15%``: fusionrag's own engine on the same prompt, in this process.

The prompts are ``benchmarks/engines``' (``S + chunks + Q`` as token ids, the store's own chunks).
Writes ``vllm.json`` (every sample), ``README.md`` and ``vllm.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engines"))

from engine_cells import HERE as ENGINES  # noqa: E402
from engine_cells import Cell, Prompt, Worker, fusionrag_cells, missing_venv, use_threads, venv_python  # noqa: E402
from engines_bench import DATA, build_prompts  # noqa: E402
from engines_report import cell_name, find, paired_ratio, plot  # noqa: E402


def connector_config(store: Path, ratio: float) -> dict:
    """vLLM's ``--kv-transfer-config`` for fusionrag's connector over ``store``."""
    return {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "ratio": ratio}}


def vllm_cells(worker: Worker, threads: int) -> list[Cell]:
    def cell(method: str, ratio: float | None, params: dict | str, cache: str = "cold", repeat: bool = False) -> Cell:
        def run(prompt: Prompt) -> tuple[float, int, dict]:
            r = worker.ask({"op": "ttft", "ids": prompt.ids2 if repeat else prompt.ids, "cache": cache,
                            "kv_transfer_params": {"fusionrag": params}})
            return r["ttft_s"], r["first_token"], {"cached_tokens": r.get("cached_tokens")}
        return Cell("vllm", method, "bfloat16", threads, ratio, run=run)

    return [cell("full", None, "off"), cell("prefix_hit", None, "off", cache="keep", repeat=True),
            cell("reuse", 0.0, {"ratio": 0.0}), cell("fusionrag", 0.15, {"ratio": 0.15}),
            cell("fusionrag", 1.0, {"ratio": 1.0})]


def main(argv: list[str] | None = None) -> int:
    from fusionrag.bench.provenance import build_meta, machine_probe
    from fusionrag.files import atomic_write
    from fusionrag.models import load_model
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.online.engine import DEFAULT_CONTEXT_CACHE_BYTES, Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="only rebuild README.md and the plot from vllm.json")
    args = ap.parse_args(argv)
    if args.report:
        out = Path(args.out)
        doc = json.loads((out / "vllm.json").read_text())
        atomic_write(out / "README.md", markdown(doc))
        plot(doc["rows"], out / "vllm.png", doc["meta"])
        return 0
    why = missing_venv("vllm")
    if why:
        print(f"vllm_bench: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    use_threads(args.threads)
    lm = load_model(args.model, dtype="bfloat16", device="cpu")
    store, prompts = build_prompts(args, lm)
    folder = ensure_converted(PACKAGED[args.model]) if args.model in PACKAGED else Path(args.model)
    argv_w = [str(venv_python("vllm")), str(ENGINES / "vllm_worker.py"), "--model", str(folder),
              "--threads", str(args.threads), "--kv-transfer-config", json.dumps(connector_config(store.path, 0.15))]
    worker = Worker(f"vllm-connector-t{args.threads}", argv_w, list(range(args.threads)),
                    out / "logs" / "vllm-connector.log")
    probe_start = machine_probe()
    worker.start()
    from engines_bench import _memory_tier

    engine = Engine(store, lm, kv_source=_memory_tier(store, lm), context_cache_bytes=DEFAULT_CONTEXT_CACHE_BYTES)
    ours = [c for c in fusionrag_cells(engine, args.threads, 0.15) if c.method == "fusionrag"]
    cells = vllm_cells(worker, args.threads) + ours
    samples: dict[tuple[str, int], list] = {(c.key, p.target): [] for c in cells for p in prompts}
    try:
        shortest = min(prompts, key=lambda p: p.target)
        for c in cells:
            c.run(shortest)  # warm-up
        for r in range(args.rounds):
            for p in prompts:
                for c in cells:
                    samples[(c.key, p.target)].append(c.run(p))
                print(f"[vllm] round {r + 1}/{args.rounds}, {p.target} tokens: " + ", ".join(
                    f"{c.key} {statistics.median(s[0] for s in samples[(c.key, p.target)]):.2f}s" for c in cells),
                    file=sys.stderr, flush=True)
    finally:
        worker.stop()
    rows = [{"engine": c.engine, "method": c.method, "ratio": c.ratio, "dtype": c.dtype, "threads": c.threads,
             "target_tokens": p.target, "prompt_tokens": len(p.ids2 if c.method == "prefix_hit" else p.ids),
             "ttft_s": [s[0] for s in samples[(c.key, p.target)]],
             "first_tokens": [s[1] for s in samples[(c.key, p.target)]],
             "extra": [s[2] for s in samples[(c.key, p.target)] if len(s) > 2]} for c in cells for p in prompts]
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_bench.py", *sys.argv[1:]]), model=args.model,
                      data_files=[args.data], extra={"rounds": args.rounds, "threads": args.threads,
                                                     "machine_probe": {"start": probe_start, "end": machine_probe()},
                                                     "worker": worker.info, "interleaved": True})
    doc = {"meta": meta, "rows": rows, "targets": targets(rows)}
    atomic_write(out / "vllm.json", json.dumps(doc, indent=1))
    atomic_write(out / "README.md", markdown(doc))
    plot(rows, out / "vllm.png", meta)
    print(json.dumps({"rows": len(rows), "out": str(out)}))
    return 0


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for n, want in ((4096, 5.0), (8192, 6.0)):
        r = paired_ratio(find(rows, engine="vllm", method="full", target_tokens=n),
                         find(rows, engine="vllm", method="fusionrag", ratio=0.15, target_tokens=n))
        if r:
            out.append({"target": f"vLLM + FusionRAG 15% >= {want:g}x sooner than vLLM's cold full prefill at "
                                  f"~{n // 1024}K", "measured": r, "met": r["median"] >= want})
    for n in sorted({r["target_tokens"] for r in rows}):
        r = paired_ratio(find(rows, engine="vllm", method="reuse", target_tokens=n),
                         find(rows, engine="vllm", method="prefix_hit", target_tokens=n))
        if r:
            out.append({"target": f"vLLM + Full Reuse within 1.5x of vLLM's prefix-cache hit at ~{n // 1024}K "
                                  "(reuse / hit)", "measured": r, "met": r["median"] <= 1.5})
    return out


def markdown(doc: dict) -> str:
    rows, meta = doc["rows"], doc["meta"]
    machine = meta.get("machine", {})
    lengths = sorted({r["target_tokens"] for r in rows})
    info = meta.get("worker", {})
    lines = ["# vLLM with and without fusionrag's connector: TTFT of the same token ids", "",
             f"Command: `{meta.get('command')}`  ",
             f"Model: {meta.get('model')}, bfloat16; vLLM {info.get('vllm')} (CPU build), {meta.get('threads')} "
             f"thread(s); machine: {machine.get('cpu_model')} ({machine.get('cpu_bf16')}); probe "
             f"{json.dumps(meta.get('machine_probe'))}.  ",
             f"Rounds: {meta.get('rounds')}, every cell once per round; medians (min-max); ratios paired by round, "
             "median [95% bootstrap interval over rounds], n = rounds.", "", "## Targets", "",
             "| target | measured | met |", "|---|---|---|"]
    for t in doc["targets"]:
        m = t["measured"]
        lines.append(f"| {t['target']} | {m['median']:.2f}x [{m['lo']:.2f}, {m['hi']:.2f}] (n={m['n']}) | "
                     f"{'yes' if t['met'] else 'no'} |")
    lines += ["", "## TTFT", "", "| cell | " + " | ".join(f"~{n // 1024}K s (min-max)" for n in lengths)
              + " | " + " | ".join(f"~{n // 1024}K vs vLLM full" for n in lengths) + " |",
              "|---|" + "---|" * (2 * len(lengths))]
    for name in dict.fromkeys(cell_name(r) for r in rows):
        cells, ratios = [], []
        for n in lengths:
            r = next(x for x in rows if cell_name(x) == name and x["target_tokens"] == n)
            s = r["ttft_s"]
            cells.append(f"{statistics.median(s):.3f} ({min(s):.3f}-{max(s):.3f})")
            ratio = paired_ratio(find(rows, engine="vllm", method="full", target_tokens=n), r)
            ratios.append(f"{ratio['median']:.2f}x" if ratio else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines += ["", "## First tokens", "", "The greedy first token of each cell (the set over rounds); vLLM + connector "
              "at 100% must be vLLM's own, at 15% our engine's:", "",
              "| cell | " + " | ".join(f"~{n // 1024}K" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name in dict.fromkeys(cell_name(r) for r in rows):
        firsts = [sorted(set(next(x for x in rows if cell_name(x) == name and x["target_tokens"] == n)
                             ["first_tokens"])) for n in lengths]
        lines.append(f"| {name} | " + " | ".join(", ".join(map(str, f)) for f in firsts) + " |")
    lines += ["", "A prefix hit answers another question (its first token differs by design). Every sample: "
              "`vllm.json`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
