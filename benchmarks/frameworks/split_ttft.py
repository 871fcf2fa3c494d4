"""LangChain's and LlamaIndex's own splits of the user's files, pasted unchanged: reuse and TTFT vs ``method=full``.

    .venv/bin/python benchmarks/frameworks/split_ttft.py --out benchmarks/frameworks/results/split \\
        [--model qwen2.5-0.5b] [--limit 6] [--rounds 3]

The user's files: one Markdown file per question of a 2WikiMQA data file (the first ``--limit`` + 1),
each of its passages a ``## title`` section, so a file runs to several of the store's chunks. They are
ingested and preprocessed with the CLI (256-token chunks, ``--top-n 2``), and ``fusionrag serve`` runs on
one thread with its defaults (no server-side retrieval unless asked, method ``auto``; the whole-context
cache off, so a repeated prompt is measured, not served from it).

In ``.venv-client`` (no torch) ``split_client.py`` splits the same files the framework's way and pastes
the top splits for each question into its prompt: LangChain ``RecursiveCharacterTextSplitter(500, 50)``
(top ``--langchain-top-k``) and LlamaIndex ``SentenceSplitter(256)`` (top ``--llamaindex-top-k``). The
store never saw these splits: a split is a part of a stored chunk or runs across two, and the server
serves each part from the stored KV of its tokens. Each question runs with the pipeline unchanged
(``fusionrag``) and with ``method: full`` (the same prompt prefilled whole), interleaved; round 0 is one
warm-up question, so in round 1 every measured prompt is new to the server (its first request).

Reported per splitter: TTFT (median over rounds per question; the ratio full / unchanged with its
bootstrap interval over questions, for all rounds and for the first request alone), the share of the
context whose KV came precomputed (``precomputed_tokens / context_tokens``), the share served without
recompute (``reused_tokens / context_tokens``: the rest is FusionRAG's ~15%), and the context length.
Writes ``split_ttft.json``, ``README.md`` and ``split_ttft.png``.
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
SPLITTERS = {"langchain": "LangChain `RecursiveCharacterTextSplitter(500, 50)`",
             "llamaindex": "LlamaIndex `SentenceSplitter(256)`"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--data", default=DATA)
    p.add_argument("--limit", type=int, default=6, help="measured questions (one file each, and one warm-up)")
    p.add_argument("--splitters", default="langchain,llamaindex")
    p.add_argument("--langchain-top-k", type=int, default=12, help="500-character splits pasted (~1.3K tokens)")
    p.add_argument("--llamaindex-top-k", type=int, default=5, help="256-token nodes pasted (~1.2K tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the server's threads")
    p.add_argument("--build-threads", type=int, default=2)
    p.add_argument("--work", default="/tmp/fusionrag-split", help="files, store and logs")
    return p.parse_args(argv)


def make_files(questions: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One Markdown file per question: its passages as ``## title`` sections (written only when changed)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, q in enumerate(questions):
        text = "".join(f"## {p['title']}\n\n{p['text'].strip()}\n\n" for p in q["passages"])
        path = folder / f"question-{i:03d}.md"
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per splitter: medians over rounds per question, ratios with intervals, shares of the context."""
    from fusionrag.bench.metrics import bootstrap_ci

    out = {}
    for splitter in dict.fromkeys(r["splitter"] for r in rows):
        measured = [r for r in rows if r["splitter"] == splitter and r["round"] > 0]
        questions = sorted({r["question"] for r in measured})

        def med(q: int, cell: str, first: bool = False, measured=measured) -> float:
            return statistics.median(r["seconds"] for r in measured if r["question"] == q and r["cell"] == cell
                                     and (not first or r["round"] == 1))

        ratios = [med(q, "full") / med(q, "fusionrag") for q in questions]
        firsts = [med(q, "full", True) / med(q, "fusionrag", True) for q in questions]
        _, lo, hi = bootstrap_ci(ratios)
        _, flo, fhi = bootstrap_ci(firsts)
        fr = [r["usage"]["fusionrag"] for r in measured if r["cell"] == "fusionrag"]
        pre = [u["precomputed_tokens"] / u["context_tokens"] for u in fr]
        reused = [u["reused_tokens"] / u["context_tokens"] for u in fr]
        out[splitter] = {
            "n_questions": len(questions), "rounds": max(r["round"] for r in measured),
            "splits": measured[0]["splits"],
            "ttft_full_s": statistics.median(med(q, "full") for q in questions),
            "ttft_fusionrag_s": statistics.median(med(q, "fusionrag") for q in questions),
            "ratio": {"median": statistics.median(ratios), "lo": lo, "hi": hi, "per_question": ratios},
            "first_request_ratio": {"median": statistics.median(firsts), "lo": flo, "hi": fhi, "per_question": firsts},
            "precomputed_share_min": min(pre), "precomputed_share_median": statistics.median(pre),
            "reused_share_median": statistics.median(reused),
            "context_tokens_min": min(u["context_tokens"] for u in fr),
            "context_tokens_median": statistics.median(u["context_tokens"] for u in fr),
            "methods_run": sorted({u["method"] for u in fr}),
            "chunks_added_max": max(sum(1 for s in u["sources"] if s.get("score") is not None) for u in fr),
            "pieces_median": statistics.median(len(u["sources"]) for u in fr),
            "stored_pieces_median": statistics.median(sum(1 for s in u["sources"] if s.get("stored")) for u in fr),
        }
    return out


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = ["# A framework's own split, pasted unchanged, against fusionrag", "",
             f"`{m['model']}`, server on {m['threads']} thread(s) (method `auto`), "
             f"{m['files']} files ({m['chunks']} stored chunks of 256 tokens), on {m['machine'].get('cpu_model')}. "
             "The store never saw the frameworks' splits.", "",
             "| | " + " | ".join(SPLITTERS[s] for s in doc["summary"]) + " |",
             "|---|" + "---|" * len(doc["summary"])]

    def row(label: str, fmt) -> None:
        lines.append(f"| {label} | " + " | ".join(fmt(s) for s in doc["summary"].values()) + " |")

    row("splits made / pasted per question", lambda s: f"{s['splits']} / {m['top_k'][s['name']]}")
    row("context tokens (min / median)", lambda s: f"{s['context_tokens_min']} / {s['context_tokens_median']:.0f}")
    row("context with precomputed KV (min / median)",
        lambda s: f"**{s['precomputed_share_min']:.0%}** / {s['precomputed_share_median']:.0%}")
    row("context served without recompute (median)", lambda s: f"{s['reused_share_median']:.0%}")
    row("pieces per prompt: stored parts or chunks / all (median)",
        lambda s: f"{s['stored_pieces_median']:.0f} / {s['pieces_median']:.0f}")
    row("chunks the server added (max)", lambda s: str(s["chunks_added_max"]))
    row("method the server ran", lambda s: ", ".join(s["methods_run"]))
    row("TTFT, `method=full` (median)", lambda s: f"{s['ttft_full_s']:.2f} s")
    row("TTFT, pipeline unchanged (median)", lambda s: f"{s['ttft_fusionrag_s']:.2f} s")
    row("full / unchanged, first request (round 1)", lambda s: (
        f"**{s['first_request_ratio']['median']:.2f}x** [{s['first_request_ratio']['lo']:.2f}, "
        f"{s['first_request_ratio']['hi']:.2f}]"))
    row("full / unchanged, all rounds", lambda s: (
        f"{s['ratio']['median']:.2f}x [{s['ratio']['lo']:.2f}, {s['ratio']['hi']:.2f}]"))
    n = next(iter(doc["summary"].values()))
    lines += ["", f"n = {n['n_questions']} questions x {n['rounds']} interleaved rounds; intervals: bootstrap over "
              "questions. TTFT is the pipeline's run time with `max_tokens=1` (its BM25 and HTTP included, the same "
              "in both cells).", "", f"Command: `{m['command']}`", "", f"Data: `{m['data']}`", "",
              f"Versions: {m['versions']}", "", "Every run: `split_ttft.json`.", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import figure, save_png

    fig, axes = figure(1, 1, 7, 4)
    ax = axes[0][0]
    names = list(doc["summary"])
    width = 0.38
    for k, (cell, colour, label) in enumerate([("ttft_full_s", "#999999", "method=full"),
                                                ("ttft_fusionrag_s", "#1f77b4", "pipeline unchanged (auto)")]):
        bars = ax.bar([i + (k - 0.5) * width for i in range(len(names))],
                      [doc["summary"][s][cell] for s in names], width, color=colour, label=label)
        ax.bar_label(bars, fmt="%.2f s")
    ax.set_xticks(range(len(names)), [SPLITTERS[s].replace("`", "") for s in names], fontsize=8)
    ax.set_ylabel("TTFT (s), median of questions")
    n = next(iter(doc["summary"].values()))["n_questions"]
    ax.set_title(f"A framework's own split, pasted; {doc['meta']['model']}, n={n} questions")
    ax.legend()
    save_png(fig, path)


def write_report(doc: dict, out: Path) -> None:
    from fusionrag.bench.provenance import write_report_files

    for name, s in doc["summary"].items():
        s["name"] = name
    write_report_files(out, "split_ttft", doc, markdown(doc), lambda path: plot(doc, path))


def main(argv: list[str] | None = None) -> int:
    from framework_ttft import build_store, fusionrag_exe, read_questions, served
    from pasted_ttft import versions

    from fusionrag.bench.provenance import machine_info

    args = parse_args(argv)
    client = ROOT / ".venv-client" / "bin" / "python"
    if not client.is_file():
        raise SystemExit("no .venv-client: run bash scripts/setup_client.sh")
    work = Path(args.work)
    questions = read_questions(Path(args.data), args.limit)[: args.limit + 1]
    paths = make_files(questions, work / "files")
    build_store(work / "files", work / "store", args.model, 2, args.build_threads, 3600)
    files = [p.read_text(encoding="utf-8") for p in paths]
    top_k = {"langchain": args.langchain_top_k, "llamaindex": args.llamaindex_top_k}
    rows: list[dict[str, Any]] = []
    info = subprocess.run([fusionrag_exe(), "store", "info", "--store", str(work / "store")], capture_output=True,
                          text=True, check=True)
    chunks = json.loads(info.stdout)["chunks"]
    with served(work / "store", args.threads, work / "serve.log", 600) as server:
        for splitter in args.splitters.split(","):
            job = {"url": server["url"], "model": server["model"], "files": files, "splitter": splitter,
                   "top_k": top_k[splitter], "rounds": args.rounds, "questions": [q["question"] for q in questions]}
            done = subprocess.run([str(client), str(HERE / "split_client.py")], input=json.dumps(job),
                                  capture_output=True, text=True, timeout=7200, check=False)
            if done.returncode != 0:
                raise SystemExit(f"the {splitter} client failed: {done.stderr[-3000:]}")
            rows += [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    found = versions(client, ["langchain-core", "langchain-openai", "langchain-text-splitters", "llama-index-core",
                              "llama-index-llms-openai-like"])
    meta = {"command": "benchmarks/frameworks/split_ttft.py " + shlex.join(sys.argv[1:]), "model": args.model,
            "threads": args.threads, "top_k": top_k, "data": args.data, "files": len(paths), "chunks": chunks,
            "versions": ", ".join(f"{k} {v}" for k, v in found.items()), "machine": machine_info(),
            "server": server["command"]}
    doc = {"meta": meta, "summary": summarise(rows), "rows": rows}
    write_report(doc, Path(args.out))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
