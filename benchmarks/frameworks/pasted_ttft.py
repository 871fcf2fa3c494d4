"""A Haystack pipeline that pastes its context, unchanged, against a fusionrag server: chunks added, reuse, TTFT.

    .venv/bin/python benchmarks/frameworks/pasted_ttft.py --out benchmarks/frameworks/results/pasted \\
        [--model qwen2.5-0.5b] [--limit 6] [--top-k 10] [--rounds 3]

The user's files are the first ``--limit`` questions' passages of a 2WikiMQA data file, one file per
title (as ``framework_ttft.py`` makes them), ingested and preprocessed with the CLI (``--top-n 2``).
``fusionrag serve`` runs on one thread with its defaults (no server-side retrieval unless asked, method
``auto``). In ``.venv-client`` (Haystack 3, no torch), ``haystack_paste_client.py`` runs BM25 over the
files -> ``ChatPromptBuilder`` pasting the top ``--top-k`` documents -> ``OpenAIChatGenerator``, once as a
Haystack user writes it (``fusionrag``) and once with ``extra_body={"method": "full"}`` (the baseline, the
same prompt prefilled whole), interleaved, ``max_tokens=1``: the pipeline's run time is its TTFT.

Reported per cell: TTFT (median over rounds per question; the ratio's bootstrap interval over questions),
chunks the server added that the pipeline did not paste (retrieved ones: a score), and the share of the
context whose KV came precomputed from the store (``precomputed_tokens / context_tokens``).
Writes ``pasted_ttft.json``, ``README.md`` and ``pasted_ttft.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

DATA = "../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--data", default=DATA)
    p.add_argument("--limit", type=int, default=6, help="questions (their passages are the user's files)")
    p.add_argument("--top-k", type=int, default=10, help="documents the pipeline's BM25 pastes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the server's threads")
    p.add_argument("--build-threads", type=int, default=2)
    p.add_argument("--work", default="/tmp/fusionrag-pasted", help="files, store and logs")
    return p.parse_args(argv)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per question and cell; the full / fusionrag ratio per question with its interval."""
    from fusionrag.bench.metrics import bootstrap_ci

    measured = [r for r in rows if r["round"] > 0]
    questions = sorted({r["question"] for r in measured})
    med = {(q, c): statistics.median(r["seconds"] for r in measured if r["question"] == q and r["cell"] == c)
           for q in questions for c in ("full", "fusionrag")}
    ratios = [med[(q, "full")] / med[(q, "fusionrag")] for q in questions]
    _, lo, hi = bootstrap_ci(ratios)
    fr = [r["usage"]["fusionrag"] for r in measured if r["cell"] == "fusionrag"]
    added = [sum(1 for s in u["sources"] if s.get("score") is not None) for u in fr]
    coverage = [u["precomputed_tokens"] / u["context_tokens"] for u in fr if u["context_tokens"]]
    return {"n_questions": len(questions), "rounds": max(r["round"] for r in rows),
            "ttft_full_s": statistics.median(med[(q, "full")] for q in questions),
            "ttft_fusionrag_s": statistics.median(med[(q, "fusionrag")] for q in questions),
            "ratio": {"median": statistics.median(ratios), "lo": lo, "hi": hi, "per_question": ratios},
            "chunks_added_max": max(added), "precomputed_share_min": min(coverage),
            "precomputed_share_median": statistics.median(coverage),
            "context_tokens_min": min(u["context_tokens"] for u in fr),
            "methods_run": sorted({u["method"] for u in fr}),
            "reused_chunks_median": statistics.median(u["reused_chunks"] for u in fr)}


def markdown(doc: dict) -> str:
    m, s = doc["meta"], doc["summary"]
    r = s["ratio"]
    return "\n".join([
        "# A pasting Haystack pipeline, unchanged, against fusionrag",
        "",
        f"`{m['model']}`, server on {m['threads']} thread(s), {s['n_questions']} questions x {s['rounds']} "
        f"interleaved rounds, BM25 top {m['top_k']} pasted by `ChatPromptBuilder`, `OpenAIChatGenerator` "
        f"(Haystack {m.get('haystack')}), on {m['machine'].get('cpu_model')}.",
        "",
        "| | value |",
        "|---|---|",
        f"| chunks the server added that the pipeline did not paste (max over requests) | {s['chunks_added_max']} |",
        f"| context whose KV came precomputed from the store (min / median) | {s['precomputed_share_min']:.0%} / "
        f"{s['precomputed_share_median']:.0%} |",
        f"| stored chunks reused per request (median) | {s['reused_chunks_median']:.0f} |",
        f"| context tokens (min) | {s['context_tokens_min']} |",
        f"| method the server ran | {', '.join(s['methods_run'])} |",
        f"| TTFT, `method=full` (median) | {s['ttft_full_s']:.2f} s |",
        f"| TTFT, the pipeline unchanged (median) | {s['ttft_fusionrag_s']:.2f} s |",
        f"| full / unchanged, per question | **{r['median']:.2f}x** [{r['lo']:.2f}, {r['hi']:.2f}] "
        f"(n={s['n_questions']}) |",
        "",
        "TTFT is the pipeline's run time with `max_tokens=1` (BM25 and HTTP included, the same in both cells).",
        "",
        f"Command: `{m['command']}`", "", f"Data: `{m['data']}`", "", "Every run: `pasted_ttft.json`.", ""])


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import figure, save_png

    s = doc["summary"]
    fig, axes = figure(1, 1, 6, 4)
    ax = axes[0][0]
    bars = ax.bar(["method=full", "pipeline unchanged\n(auto: FusionRAG)"], [s["ttft_full_s"], s["ttft_fusionrag_s"]],
                  color=["#999999", "#1f77b4"])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("TTFT (s), median of questions")
    ax.set_title(f"Haystack pasting its context, {doc['meta']['model']}, n={s['n_questions']} questions")
    save_png(fig, path)


def write_report(doc: dict, out: Path) -> None:
    from fusionrag.bench.provenance import write_report_files

    write_report_files(out, "pasted_ttft", doc, markdown(doc), lambda path: plot(doc, path))


def main(argv: list[str] | None = None) -> int:
    from framework_ttft import build_store, make_files, read_questions, served

    from fusionrag.bench.provenance import machine_info

    args = parse_args(argv)
    client = ROOT / ".venv-client" / "bin" / "python"
    if not client.is_file():
        raise SystemExit("no .venv-client: run bash scripts/setup_client.sh")
    work = Path(args.work)
    questions = read_questions(Path(args.data), args.limit)[: args.limit]
    files = make_files(questions, work / "files")
    build_store(work / "files", work / "store", args.model, 2, args.build_threads, 3600)
    documents = [{"title": f["title"], "text": Path(f["path"]).read_text(encoding="utf-8")} for f in files]
    with served(work / "store", args.threads, work / "serve.log", 600) as server:
        job = {"url": server["url"], "model": server["model"], "documents": documents, "top_k": args.top_k,
               "rounds": args.rounds, "questions": [q["question"] for q in questions]}
        done = subprocess.run([str(client), str(HERE / "haystack_paste_client.py")], input=json.dumps(job),
                              capture_output=True, text=True, timeout=7200, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the Haystack client failed: {done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    haystack = subprocess.run([str(client), "-c", "import haystack, importlib.metadata as m; "
                               "print(m.version('haystack-ai'))"], capture_output=True, text=True).stdout.strip()
    meta = {"command": "benchmarks/frameworks/pasted_ttft.py " + shlex.join(sys.argv[1:]), "model": args.model,
            "threads": args.threads, "top_k": args.top_k, "data": args.data, "haystack": haystack,
            "machine": machine_info(), "server": server["command"]}
    doc = {"meta": meta, "summary": summarise(rows), "rows": rows}
    write_report(doc, Path(args.out))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
