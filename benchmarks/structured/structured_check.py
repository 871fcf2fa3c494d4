"""Structured outputs on the real model: a ``json_schema`` answer is valid JSON that fits its schema, FusionRAG 15%
and Full Attention alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured/structured_check.py \\
        --data ../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl --limit 50 --out benchmarks/structured/results

qwen2.5-0.5b in float32 (the engine's default), the first ``--limit`` questions with their own passages, a
schema that asks for a short answer and a confidence label, greedy decoding up to 128 tokens, through fusionrag's
engine and scheduler as the server runs them (``response_format`` -> :mod:`fusionrag.online.constraints`). Per
question and method: whether the answer parses, fits the schema (``jsonschema``), and ended by itself (not cut
by the token limit). Writes ``structured.json``, ``README.md`` and ``structured.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
          "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 80},
                         "confidence": {"type": "string", "enum": ["low", "medium", "high"]}}}
METHODS = ("fusionrag", "full")


def main(argv: list[str] | None = None) -> int:
    import jsonschema

    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.provenance import build_meta, machine_probe
    from fusionrag.files import atomic_write
    from fusionrag.models import load_model
    from fusionrag.offline import build
    from fusionrag.online.constraints import GrammarSpec
    from fusionrag.online.engine import Engine
    from fusionrag.online.sampling import SamplingParams
    from fusionrag.retrieval.embedder import HashingEmbedder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=False)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--report", action="store_true", help="only rebuild README.md and the plot from structured.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        doc = json.loads((out / "structured.json").read_text())
        atomic_write(out / "README.md", markdown(doc))
        plot(doc, out / "structured.png")
        return 0
    lm = load_model(args.model)
    examples = load_questions(args.data, args.limit, seed=0)
    kb = Path("runs") / "structured" / f"kb-{args.model}-{args.limit}"  # ignored by git
    store = build.create_store(kb, lm, embedder=HashingEmbedder(), model_source=args.model) \
        if not kb.exists() else None
    if store is None:
        from fusionrag.retrieval.knowledge import KnowledgeStore

        store = KnowledgeStore.open(kb, lm, embedder=HashingEmbedder())
    else:
        build.add_passages(store, lm, [{"title": p.title, "text": p.text} for ex in examples for p in ex.passages])
        build.fuse(store, lm, top_n=2, progress=False)
    engine = Engine(store, lm)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rows, t0 = [], time.perf_counter()
    for i, ex in enumerate(examples):
        passages = [{"title": p.title, "text": p.text} for p in ex.passages]
        for method in METHODS:
            done = engine.answer(ex.question, method=method, ratio=0.15, chunks=passages,
                                 max_new_tokens=args.max_new_tokens, sampling=SamplingParams(grammar=spec))
            row = {"qid": ex.id, "method": done.method, "asked": method, "text": done.text,
                   "finish_reason": done.finish_reason, "tokens": len(done.token_ids),
                   "prompt_tokens": done.prompt_tokens, "ratio": done.ratio}
            try:
                jsonschema.validate(json.loads(done.text), SCHEMA)
                row["valid"] = True
            except (ValueError, jsonschema.ValidationError) as exc:
                row["valid"], row["why"] = False, str(exc).splitlines()[0]
            rows.append(row)
        print(f"[structured] {i + 1}/{len(examples)}: " + ", ".join(
            f"{r['asked']} {'ok' if r['valid'] else 'INVALID'}" for r in rows[-2:]), file=sys.stderr, flush=True)
    summary = {m: {"n": sum(r["asked"] == m for r in rows), "valid": sum(r["valid"] for r in rows if r["asked"] == m),
                   "ended_by_itself": sum(r["finish_reason"] == "stop" for r in rows if r["asked"] == m)}
               for m in METHODS}
    meta = build_meta(command=shlex.join(["benchmarks/structured/structured_check.py", *(argv or sys.argv[1:])]),
                      model=args.model, data_files=[args.data], extra={"dtype": str(lm.dtype),
                                                                       "machine_probe": machine_probe(),
                                                                       "wall_s": round(time.perf_counter() - t0, 1)})
    doc = {"meta": meta, "schema": SCHEMA, "summary": summary, "rows": rows}
    atomic_write(out / "structured.json", json.dumps(doc, indent=1))
    atomic_write(out / "README.md", markdown(doc))
    plot(doc, out / "structured.png")
    print(json.dumps(summary))
    return 0 if all(s["valid"] == s["n"] for s in summary.values()) else 1


def markdown(doc: dict) -> str:
    meta, summary = doc["meta"], doc["summary"]
    lines = ["# Structured outputs on the real model: valid JSON that fits the schema", "",
             f"Command: `{meta.get('command')}`  ",
             f"Model: {meta.get('model')} ({doc['meta'].get('dtype')}), greedy, up to 128 tokens; machine: "
             f"{meta.get('machine', {}).get('cpu_model')}; data: "
             f"{', '.join(d['path'] if isinstance(d, dict) else str(d) for d in meta.get('data_files', []))}.", "",
             "Schema: `" + json.dumps(doc["schema"]) + "`", "",
             "| method | questions | valid JSON fitting the schema | ended by itself |", "|---|---|---|---|"]
    for m, s in summary.items():
        lines.append(f"| {m} | {s['n']} | **{s['valid']} / {s['n']}** | {s['ended_by_itself']} / {s['n']} |")
    lines += ["", "The first answers of each method:", ""]
    for r in doc["rows"][:6]:
        lines.append(f"- {r['asked']}: `{r['text']}`")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    methods = list(doc["summary"])
    ax.bar(methods, [doc["summary"][m]["valid"] for m in methods], label="valid, fits the schema")
    ax.bar(methods, [doc["summary"][m]["n"] - doc["summary"][m]["valid"] for m in methods],
           bottom=[doc["summary"][m]["valid"] for m in methods], label="invalid")
    ax.set_ylabel("answers")
    ax.set_title(f"json_schema answers, {doc['meta'].get('model')}")
    ax.legend()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
