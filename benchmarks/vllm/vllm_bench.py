"""vLLM with and without fusionrag's connector, as vLLM is deployed: time to first token of the same token ids.

    .venv/bin/python benchmarks/vllm/vllm_bench.py --out benchmarks/vllm/results/NAME \\
        [--lengths 2048,4096] [--tp 1,2] [--threads 1] [--rounds 3]

One vLLM engine per tensor-parallel size (the CPU build here; the same script on a CUDA vLLM where one is
installed), bf16, **prefix caching on and kept** (vLLM's default), with ``fusionrag.vllm``'s connector loaded
over ``bench ttft``'s store; each request picks its mode with ``kv_transfer_params``. TP=1 runs on core 0,
TP=2 on cores 0 and 1 (one core per rank), one after the other. Each round empties vLLM's prefix cache once,
then sends, per context length and with the cache kept, what a deployment sees:

- ``vllm full``: vLLM's own prefill of a context it has not seen (question 1, connector off);
- ``vllm prefix_hit``: a second question on that context (vLLM's prefix cache);
- ``vllm + connector fusionrag 15%``: the connector on the same context: its first request in its own
  prefix-cache namespace (the exact blocks above are not served to it, :mod:`fusionrag.vllm.isolation`);
- ``vllm + connector fusionrag 15% prefix_hit``: a second question on it (the 15% namespace's blocks);
- ``vllm + connector reuse`` / ``fusionrag 100%``: 0 and 100% recompute, each a first sight in its namespace;
- ``fusionrag fusionrag 15%`` (TP=1 only): fusionrag's own engine on the same prompt, in this process.

The prompts are ``benchmarks/engines``' (``S + chunks + Q`` as token ids, the store's own chunks). Each reply
says what the connector served (the response's ``kv_transfer_params``: context tokens, the share from the
store). Writes ``vllm.json`` (every sample), ``README.md`` and ``vllm.png``.
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
from engines_report import find, paired_ratio  # noqa: E402


def connector_config(store: Path, ratio: float, **options: object) -> dict:
    """vLLM's ``--kv-transfer-config`` for fusionrag's connector over ``store`` (``options``: more of its options)."""
    return {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "ratio": ratio, **options}}


def vllm_cells(worker: Worker, threads: int, tp: int) -> list[Cell]:
    """The cells of one engine, in the order a round sends them (the first empties the prefix cache)."""
    def cell(method: str, ratio: float | None, params: dict | str, label: str = "", cache: str = "keep",
             repeat: bool = False) -> Cell:
        def run(prompt: Prompt) -> tuple[float, int, dict]:
            r = worker.ask({"op": "ttft", "ids": prompt.ids2 if repeat else prompt.ids, "cache": cache,
                            "kv_transfer_params": {"fusionrag": params}})
            return r["ttft_s"], r["first_token"], {"cached_tokens": r.get("cached_tokens"), "served": r.get("served")}
        return Cell(f"vllm-tp{tp}", method, "bfloat16", threads, ratio, label=label, run=run)

    return [cell("full", None, "off", cache="cold"), cell("prefix_hit", None, "off", repeat=True),
            cell("fusionrag", 0.15, {"ratio": 0.15}),
            cell("fusionrag", 0.15, {"ratio": 0.15}, label="fusionrag-prefix_hit", repeat=True),
            cell("reuse", 0.0, {"ratio": 0.0}), cell("fusionrag", 1.0, {"ratio": 1.0})]


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
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, one engine each, one after the other")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="only rebuild README.md and the plot from vllm.json")
    args = ap.parse_args(argv)
    if args.report:
        out = Path(args.out)
        doc = json.loads((out / "vllm.json").read_text())
        atomic_write(out / "README.md", markdown(doc))
        plot_rows(doc["rows"], out / "vllm.png", doc["meta"])
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
    probe_start = machine_probe()
    from engines_bench import _memory_tier

    engine = Engine(store, lm, kv_source=_memory_tier(store, lm), context_cache_bytes=DEFAULT_CONTEXT_CACHE_BYTES)
    ours = [c for c in fusionrag_cells(engine, args.threads, 0.15) if c.method == "fusionrag"]
    samples: dict[tuple[str, int], list] = {}
    all_cells: list[Cell] = []
    infos = {}
    for tp in (int(t) for t in args.tp.split(",")):
        argv_w = [str(venv_python("vllm")), str(ENGINES / "vllm_worker.py"), "--model", str(folder), "--tp", str(tp),
                  "--threads", str(args.threads), "--kv-transfer-config",
                  json.dumps(connector_config(store.path, 0.15))]
        worker = Worker(f"vllm-connector-tp{tp}", argv_w, list(range(tp * args.threads)),
                        out / "logs" / f"vllm-connector-tp{tp}.log")
        worker.start()
        infos[f"tp{tp}"] = worker.info
        cells = vllm_cells(worker, args.threads, tp) + (ours if tp == 1 else [])
        all_cells += cells
        samples.update({(c.key, p.target): [] for c in cells for p in prompts})
        try:
            shortest = min(prompts, key=lambda p: p.target)
            for c in cells:
                c.run(shortest)  # warm-up
            for r in range(args.rounds):
                for p in prompts:
                    for c in cells:  # the first cell empties the prefix cache: the rest of the round keeps it
                        samples[(c.key, p.target)].append(c.run(p))
                    print(f"[vllm tp{tp}] round {r + 1}/{args.rounds}, {p.target} tokens: " + ", ".join(
                        f"{c.key} {statistics.median(s[0] for s in samples[(c.key, p.target)]):.2f}s" for c in cells),
                        file=sys.stderr, flush=True)
        finally:
            worker.stop()
    cells = all_cells
    rows = [{"engine": c.engine, "method": c.label or c.method, "ratio": c.ratio, "dtype": c.dtype,
             "threads": c.threads, "tp": int(c.engine.removeprefix("vllm-tp")) if c.engine.startswith("vllm") else 1,
             "target_tokens": p.target,
             "prompt_tokens": len(p.ids2 if "prefix_hit" in (c.label or c.method) else p.ids),
             "ttft_s": [s[0] for s in samples[(c.key, p.target)]],
             "first_tokens": [s[1] for s in samples[(c.key, p.target)]],
             "extra": [s[2] for s in samples[(c.key, p.target)] if len(s) > 2]} for c in cells for p in prompts]
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_bench.py", *sys.argv[1:]]), model=args.model,
                      data_files=[args.data], extra={"rounds": args.rounds, "threads": args.threads, "tp": args.tp,
                                                     "machine_probe": {"start": probe_start, "end": machine_probe()},
                                                     "worker": infos, "interleaved": True, "prefix_cache": "kept"})
    doc = {"meta": meta, "rows": rows, "targets": targets(rows)}
    atomic_write(out / "vllm.json", json.dumps(doc, indent=1))
    atomic_write(out / "README.md", markdown(doc))
    plot_rows(rows, out / "vllm.png", meta)
    print(json.dumps({"rows": len(rows), "out": str(out)}))
    return 0


def name_of(row: dict) -> str:
    """A cell's name: ``vLLM TP=2 + connector fusionrag 15% prefix_hit``, ``fusionrag fusionrag 15%``."""
    method, ratio = row["method"], f" {row['ratio']:.0%}" if row["method"].startswith("fusionrag") else ""
    if not row["engine"].startswith("vllm"):
        return f"fusionrag's engine {method}{ratio}"
    connector = " + connector" if method.startswith("fusionrag") or method == "reuse" else ""
    base, hit = method.removesuffix("-prefix_hit"), " prefix_hit" if method.endswith("-prefix_hit") else ""
    return f"vLLM TP={row['tp']}{connector} {base}{ratio}{hit}"


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for tp in sorted({r["tp"] for r in rows if r["engine"].startswith("vllm")}):
        engine = f"vllm-tp{tp}"
        for n in sorted({r["target_tokens"] for r in rows}):
            r = paired_ratio(find(rows, engine=engine, method="full", target_tokens=n),
                             find(rows, engine=engine, method="fusionrag", ratio=0.15, target_tokens=n))
            if r and n >= 4096:
                out.append({"target": f"TP={tp}: vLLM + FusionRAG 15% >= 5x sooner than vLLM's own prefill of an "
                                      f"unseen context at ~{n // 1024}K", "measured": r, "met": r["median"] >= 5.0})
            r = paired_ratio(find(rows, engine=engine, method="fusionrag-prefix_hit", target_tokens=n),
                             find(rows, engine=engine, method="prefix_hit", target_tokens=n))
            if r:
                out.append({"target": f"TP={tp}: a second question on a context, connector 15% within 1.5x of vLLM's "
                                      f"own prefix hit at ~{n // 1024}K (connector / vLLM)",
                            "measured": {**r, "median": 1 / r["median"], "lo": 1 / r["hi"], "hi": 1 / r["lo"]},
                            "met": 1 / r["median"] <= 1.5})
    return out


def markdown(doc: dict) -> str:
    rows, meta = doc["rows"], doc["meta"]
    machine = meta.get("machine", {})
    lengths = sorted({r["target_tokens"] for r in rows})
    info = next(iter(meta.get("worker", {}).values()), {})
    lines = ["# vLLM with and without fusionrag's connector, as deployed: TTFT of the same token ids", "",
             f"Command: `{meta.get('command')}`  ",
             f"Model: {meta.get('model')}, bfloat16; vLLM {info.get('vllm')} (CPU build), prefix caching on and "
             f"kept within a round; TP=1 on one core, TP=2 on two (one core per rank), {meta.get('threads')} thread "
             f"per rank; machine: {machine.get('cpu_model')} ({machine.get('cpu_bf16')}).  ",
             f"Rounds: {meta.get('rounds')}; a round empties vLLM's prefix cache once, then sends every cell in the "
             "order of the table (a context first seen, then a second question on it; the connector's modes each "
             "in their own prefix-cache namespace). Medians (min-max); ratios paired by round, median [95% "
             "bootstrap interval over rounds], n = rounds.", "", "## Targets", "",
             "| target | measured | met |", "|---|---|---|"]
    for t in doc["targets"]:
        m = t["measured"]
        lines.append(f"| {t['target']} | {m['median']:.2f}x [{m['lo']:.2f}, {m['hi']:.2f}] (n={m['n']}) | "
                     f"{'yes' if t['met'] else '**no**'} |")
    lines += ["", "## TTFT", "", "| cell | " + " | ".join(f"~{n // 1024}K s (min-max)" for n in lengths)
              + " | " + " | ".join(f"~{n // 1024}K vs vLLM's own prefill" for n in lengths) + " | served from the "
              "store |", "|---|" + "---|" * (2 * len(lengths) + 1)]
    for name in dict.fromkeys(name_of(r) for r in rows):
        cells, ratios, shares = [], [], set()
        for n in lengths:
            r = next((x for x in rows if name_of(x) == name and x["target_tokens"] == n), None)
            if r is None:
                cells.append("-")
                ratios.append("-")
                continue
            s = r["ttft_s"]
            cells.append(f"{statistics.median(s):.3f} ({min(s):.3f}-{max(s):.3f})")
            ratio = paired_ratio(find(rows, engine=f"vllm-tp{r['tp']}", method="full", target_tokens=n), r)
            ratios.append(f"{ratio['median']:.2f}x" if ratio else "-")
            for e in r.get("extra", []):
                served = (e or {}).get("served") or {}
                if served.get("loaded_tokens"):
                    shares.add(f"{served['stored_share']:.0%} of {served['context_tokens']}")
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " | "
                     + (", ".join(sorted(shares)) or "-") + " |")
    lines += ["", "## First tokens", "", "The greedy first token of each cell (the set over rounds); the connector "
              "at 100% must give vLLM's own (same TP), at 15% our engine's:", "",
              "| cell | " + " | ".join(f"~{n // 1024}K" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name in dict.fromkeys(name_of(r) for r in rows):
        firsts = [sorted(set(next((x for x in rows if name_of(x) == name and x["target_tokens"] == n),
                                  {"first_tokens": []})["first_tokens"])) for n in lengths]
        lines.append(f"| {name} | " + " | ".join(", ".join(map(str, f)) for f in firsts) + " |")
    lines += ["", "A prefix hit answers another question (its first token differs by design). Every sample: "
              "`vllm.json`; the plot: `vllm.png`.", ""]
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: Path, meta: dict) -> Path:
    """One panel per TP size: median TTFT (log scale) per cell, grouped by context length."""
    from fusionrag.bench.plots import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    tps = sorted({r["tp"] for r in rows})
    lengths = sorted({r["target_tokens"] for r in rows})
    fig = Figure(figsize=(12, 4.5 * len(tps)), layout="constrained")
    for ax, tp in zip(fig.subplots(len(tps), 1, squeeze=False)[:, 0], tps, strict=True):
        names = list(dict.fromkeys(name_of(r) for r in rows if r["tp"] == tp))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [statistics.median(next((x for x in rows if name_of(x) == name and x["target_tokens"] == n),
                                         {"ttft_s": [0.0]})["ttft_s"]) for n in lengths]
            ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"~{n // 1024}K tokens" for n in lengths])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT, s (median, log scale)")
        ax.set_title(f"TP={tp}: vLLM {meta.get('model')} bf16, prefix caching kept; {meta.get('rounds')} rounds")
        ax.legend(fontsize=7, ncols=2)
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
