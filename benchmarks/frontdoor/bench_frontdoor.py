"""TTFT through LangChain: documents reused (fusionrag) vs the same chain on Full Attention; framework overhead.

Builds a fused store of the first N questions' passages (smollm2-135m by default, one
thread), serves it on loopback (the real ``fusionrag serve`` app in a thread), and for each
question streams the same request four ways, in an order rotated per question:

- LangChain ``rag_chain`` (``fusionrag.integrations.langchain``) with ``method=fusionrag``:
  the retriever's documents go as passages and their fused KV is reused;
- the same chain with ``method=full`` (the same documents, recomputed from scratch);
- the official ``openai`` client directly, both methods (no framework in between).

TTFT is measured by the client: from the call to the first streamed chunk with text (what
a user of the chain waits for). The server's own TTFT (``fusionrag.server.ttft_ms``) is
read from a non-streamed call of each kind once per question, for reference.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frontdoor/bench_frontdoor.py \\
        --data ../shared/data/triviaqa/triviaqa_dev_searchr1_e5_wiki18.jsonl --limit 20

Writes ``frontdoor.json`` and ``frontdoor.md`` next to this file (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def first_text_ms(start, text_of, last: list | None = None) -> float:
    """Milliseconds from ``start()`` (which sends the request) to the first chunk with text.

    The stream is read to its end (so the next request starts on an idle server); the last
    chunk goes to ``last`` when given.
    """
    t0 = time.perf_counter()
    ttft = None
    for chunk in start():
        if ttft is None and text_of(chunk):
            ttft = (time.perf_counter() - t0) * 1000.0
        if last is not None:
            last[:] = [chunk]
    return ttft if ttft is not None else (time.perf_counter() - t0) * 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--top-n", type=int, default=10, help="offline fusion neighbours")
    ap.add_argument("--store", default="/tmp/fusionrag-frontdoor-kb", help="store folder (reused if present)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--screenshot", default=None, help="also save a /ui screenshot here (needs chromium)")
    ap.add_argument("--build-only", action="store_true", help="build the store and stop")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import openai
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from fusionrag.bench.datasets import load_questions
    from fusionrag.integrations.langchain import chat_model, rag_chain
    from fusionrag.models import load_model
    from fusionrag.offline import build
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore
    from fusionrag.serve.app import create_app
    from fusionrag.serve.server_thread import ServerThread
    from fusionrag.serve.settings import ServerSettings

    questions = load_questions(args.data, limit=args.limit)
    lm = load_model(args.model)
    store_dir = Path(args.store)
    t_build = time.perf_counter()
    if not (store_dir / "store.sqlite").exists():
        store = build.create_store(store_dir, lm, model_source=args.model)
        for q in questions:
            build.add_passages(store, lm, [{"title": p.title, "text": p.text} for p in q.passages], doc=q.id)
        build.fuse(store, lm, top_n=args.top_n, progress=True)
        store.close()
    build_s = time.perf_counter() - t_build
    if args.build_only:
        print(f"store built in {build_s:.1f} s", file=sys.stderr)
        return 0
    probe = KnowledgeStore.open(store_dir, lm)
    docs_of: dict[str, list[dict]] = {}
    groups = probe.doc_groups()  # each question's passages were added as one document group
    for q in questions:
        docs_of[q.question] = [{"title": probe.chunk(c).title, "text": probe.chunk(c).text}
                               for c in groups.get(q.id, [])]
    probe.close()

    class QuestionRetriever(BaseRetriever):
        """The question's own passages (the benchmark measures serving, not retrieval quality)."""

        def _get_relevant_documents(self, query: str, *, run_manager: Any = None) -> list[Document]:
            return [Document(d["text"], metadata={"title": d["title"]}) for d in docs_of[query]]

    def engine() -> Engine:
        return Engine(KnowledgeStore.open(store_dir, lm), lm, memory_budget_bytes=256 << 20)

    settings = ServerSettings(default_max_tokens=args.max_tokens, max_documents=64, max_document_chars=64_000)
    app = create_app(engine, settings)
    app.state.scheduler.wait_ready(300)
    rows: list[dict[str, Any]] = []
    with ServerThread(app) as server:
        url = server.base_url + "/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        chains = {m: rag_chain(QuestionRetriever(), chat_model(url, model=args.model, method=m, ratio=args.ratio,
                                                               max_tokens=args.max_tokens, max_retries=0))
                  for m in ("fusionrag", "full")}

        def lc(method: str, q: str) -> float:
            return first_text_ms(lambda: chains[method].stream(q), lambda c: c.content)

        def direct(method: str, q: str) -> float:
            def start():  # the openai client returns once the response starts, i.e. after the first token
                return client.chat.completions.create(
                    model=args.model, messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens,
                    temperature=0, stream=True, extra_body={"method": method, "ratio": args.ratio,
                                                            "documents": docs_of[q]})

            last: list = []
            ms = first_text_ms(start, lambda c: c.choices and c.choices[0].delta.content, last)
            final = [c for c in last if c.model_extra.get("fusionrag")]
            server_ttft[method] = final[0].model_extra["fusionrag"]["server"]["ttft_ms"] if final else None
            return ms

        server_ttft: dict[str, float | None] = {}
        kinds = [("langchain", "fusionrag"), ("langchain", "full"), ("direct", "fusionrag"), ("direct", "full")]
        for q in questions[:2]:  # warm-up: prefix cache, memory tier, allocator (not recorded)
            for path, m in kinds:
                (lc if path == "langchain" else direct)(m, q.question)
        for i, q in enumerate(questions):
            row: dict[str, Any] = {"question": q.question, "chunks": len(docs_of[q.question])}
            for path, m in kinds[i % 4:] + kinds[:i % 4]:
                row[f"{path}_{m}_ttft_ms"] = (lc if path == "langchain" else direct)(m, q.question)
            for m in ("fusionrag", "full"):
                row[f"server_{m}_ttft_ms"] = server_ttft[m]  # of the direct streamed call
            msg = chains["fusionrag"].invoke(q.question)  # what the chain's response reports about reuse
            usage = msg.response_metadata["token_usage"]["fusionrag"]
            row["fusionrag_reused_chunks"] = usage["reused_chunks"]
            row["fusionrag_recomputed_tokens"] = usage["recomputed_tokens"]
            row["context_tokens"] = usage["context_tokens"]
            row["load_avg_1m"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                              if k != "question"}), file=sys.stderr)
        if args.screenshot:
            import subprocess
            import urllib.parse

            query = urllib.parse.urlencode({"q": questions[0].question, "method": "fusionrag",
                                            "ratio": str(args.ratio), "retrieval_top_k": "5"})
            subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=60000",
                            "--window-size=1100,1300", f"--screenshot={args.screenshot}",
                            f"{server.base_url}/ui?{query}"], check=False, capture_output=True, timeout=300)
    app.state.scheduler.close()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {k: round(med(k), 1) for k in rows[0] if k.endswith("_ms") and all(r[k] is not None for r in rows)}
    summary["load_avg_1m_median"] = round(med("load_avg_1m"), 2)
    summary["langchain_full_over_fusionrag"] = round(med("langchain_full_ttft_ms") / med("langchain_fusionrag_ttft_ms"),
                                                     2)
    summary["direct_full_over_fusionrag"] = round(med("direct_full_ttft_ms") / med("direct_fusionrag_ttft_ms"), 2)
    for m in ("fusionrag", "full"):
        diffs = [r[f"langchain_{m}_ttft_ms"] - r[f"direct_{m}_ttft_ms"] for r in rows]
        summary[f"langchain_overhead_{m}_ms_median"] = round(statistics.median(diffs), 1)
    summary["reused_chunks_fusionrag"] = sum(r["fusionrag_reused_chunks"] for r in rows)
    summary["chunks"] = sum(r["chunks"] for r in rows)
    summary["median_context_tokens"] = med("context_tokens")
    report = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frontdoor/bench_frontdoor.py "
                   + " ".join(sys.argv[1:]),
        "data": args.data, "questions": len(rows), "model": args.model, "ratio": args.ratio, "top_n": args.top_n,
        "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "store_build_s": round(build_s, 1),
        "machine": platform.platform(), "cpu_count": os.cpu_count(),
        "summary": summary, "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontdoor.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "frontdoor.md").write_text(markdown(report))
    print(json.dumps(summary, indent=2))
    return 0


def markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [
        "# Front door: TTFT through LangChain, documents reused vs Full Attention",
        "",
        f"{r['questions']} questions of `{r['data']}`, model {r['model']}, {r['threads']} thread, ratio "
        f"{r['ratio']}, fused with top-{r['top_n']} neighbours; streamed, TTFT measured by the client "
        f"(call to first chunk with text), median over questions. Command:",
        "",
        f"    {r['command']}",
        "",
        "| path | fusionrag (documents reused) | full | full / fusionrag |",
        "|---|---|---|---|",
        f"| LangChain `rag_chain` | {s['langchain_fusionrag_ttft_ms']} ms | {s['langchain_full_ttft_ms']} ms | "
        f"{s['langchain_full_over_fusionrag']}x |",
        f"| openai client, direct | {s['direct_fusionrag_ttft_ms']} ms | {s['direct_full_ttft_ms']} ms | "
        f"{s['direct_full_over_fusionrag']}x |",
        f"| server-side TTFT (the direct calls, queueing included) | {s['server_fusionrag_ttft_ms']} ms | "
        f"{s['server_full_ttft_ms']} ms | |",
        "",
        f"LangChain's overhead over the direct call (median of per-question differences): "
        f"{s['langchain_overhead_fusionrag_ms_median']} ms with fusionrag, {s['langchain_overhead_full_ms_median']} ms "
        f"with full. The framework's documents were reused: {s['reused_chunks_fusionrag']} of {s['chunks']} chunks "
        f"found in the store by content hash (`usage.fusionrag.reused_chunks`). Median context: "
        f"{s['median_context_tokens']} tokens. Store built in {r['store_build_s']} s (0 when reused). "
        f"The machine was shared: median 1-minute load average {s['load_avg_1m_median']} on "
        f"{r['cpu_count']} cores during the run, so absolute times are inflated; the four paths were "
        "interleaved per question (order rotated), so the ratios and differences are paired.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
