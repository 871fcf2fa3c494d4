"""TTFT and chunk reuse through LangChain and LlamaIndex over a store built from files, fusionrag vs full.

What a new user does, end to end, with the package's CLI and its framework integrations only:

1. a folder of user files: the first N questions' passages of a 2WikiMQA data file, one file per
   distinct title (``TITLE.md`` with ``# Title`` then the text, every third one ``TITLE.txt`` with
   the text alone, titled by the file name);
2. ``fusionrag ingest FOLDER --store STORE --model MODEL`` then ``fusionrag preprocess --store STORE
   --top-n 10`` (the fused KV FusionRAG reads; ``ingest`` alone keeps plain KV), both subprocesses,
   skipped when this script already built the same store;
3. ``fusionrag --threads 1 serve --store STORE`` as a subprocess (``OMP_NUM_THREADS=1``), killed at the end;
4. four framework paths, each with ``method=full`` and ``method=fusionrag`` (ratio 0.15), the eight
   cells interleaved per question (order rotated by one cell per question), ``max_tokens=1`` and greedy,
   so the framework's end-to-end call time is its time to first token (retrieval included):

   - ``lc_fusionrag``: LangChain ``rag_chain`` with ``FusionRAGRetriever`` (the store's chunks, top 5);
   - ``lc_own``: LangChain ``rag_chain`` with its own ``InMemoryVectorStore`` over the files (one
     Document per file, as ``TextLoader`` makes them, MiniLM embeddings, k=3);
   - ``li_fusionrag``: LlamaIndex ``FusionRAGQueryEngine`` with ``FusionRAGRetriever`` (top 5);
   - ``li_own``: LlamaIndex ``SimpleDirectoryReader`` -> ``VectorStoreIndex`` (its default node
     parser, MiniLM embeddings) -> ``as_retriever(similarity_top_k=3)`` -> ``FusionRAGQueryEngine``.

Each request's ``usage.fusionrag`` (chunks, reused_chunks, adhoc_chunks, context_tokens, note,
sources) is recorded. Writes ``framework_ttft.json``, ``.md`` and ``.png`` to ``--out``::

    .venv/bin/python benchmarks/frameworks/framework_ttft.py --model qwen2.5-0.5b --limit 24
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "2wikimqa" / "2wikimqa_dev_bm25_hipporag.jsonl"
DEFAULT_WORK = ROOT / "runs" / "frameworks"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

PATHS = ("lc_fusionrag", "lc_own", "li_fusionrag", "li_own")
SHORT = {
    "lc_fusionrag": "LangChain\n+ FusionRAG-\nRetriever",
    "lc_own": "LangChain\n+ its own\nvector store",
    "li_fusionrag": "LlamaIndex\n+ FusionRAG-\nRetriever",
    "li_own": "LlamaIndex\n+ its own\nVectorStoreIndex",
}
LABELS = {
    "lc_fusionrag": "LangChain + FusionRAGRetriever",
    "lc_own": "LangChain + its InMemoryVectorStore",
    "li_fusionrag": "LlamaIndex + FusionRAGRetriever",
    "li_own": "LlamaIndex + its VectorStoreIndex",
}
METHODS = ("full", "fusionrag")
#: Python packages whose versions the report records.
VERSIONS = ("fusionrag", "torch", "langchain-core", "langchain-openai", "llama-index-core",
            "llama-index-llms-openai-like", "sentence-transformers", "openai")
#: Framework modules the run needs (a clear message, not a traceback, when one is missing).
NEEDS = ("langchain_core", "langchain_openai", "llama_index.core", "llama_index.llms.openai_like",
         "sentence_transformers", "matplotlib", "httpx")


def log(msg: str) -> None:
    print(f"[framework_ttft] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the user's files


def read_questions(data: Path, limit: int) -> list[dict[str, Any]]:
    rows = []
    with data.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) >= limit + 1:  # one more: the warm-up question, not measured
                break
    return rows


def file_name(title: str) -> str:
    """A file name for a title: no path separators, no hidden files, not too long."""
    name = re.sub(r"[/\\\x00]", "_", title).strip() or "untitled"
    if name.startswith("."):
        name = "_" + name[1:]
    return name[:180]


def make_files(questions: list[dict[str, Any]], folder: Path) -> list[dict[str, str]]:
    """One file per distinct passage title of ``questions`` (first text wins); written only when changed.

    Every third file is ``.txt`` (the text alone: ingest titles it with the file name), the rest
    ``.md`` (``# Title`` then the text); a title that cannot be a file name as it is goes to ``.md``."""
    texts: dict[str, str] = {}
    for q in questions:
        for p in q["passages"]:
            texts.setdefault(p["title"], p["text"])
    folder.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, str]] = []
    used: set[str] = set()
    for i, (title, text) in enumerate(texts.items()):
        stem = file_name(title)
        while stem.lower() in used:
            stem += "_"
        used.add(stem.lower())
        txt = i % 3 == 2 and stem == title
        path = folder / (stem + (".txt" if txt else ".md"))
        body = f"{text.strip()}\n" if txt else f"# {title}\n\n{text.strip()}\n"
        if not path.is_file() or path.read_text(encoding="utf-8") != body:
            path.write_text(body, encoding="utf-8")
        files.append({"title": title, "path": str(path)})
    keep = {f["path"] for f in files}
    for stale in folder.iterdir():  # the folder is this script's: nothing else belongs in it
        if stale.is_file() and str(stale) not in keep:
            stale.unlink()
    return files


# ------------------------------------------------------------------ the store


def fusionrag_exe() -> str:
    here = Path(sys.executable).parent / "fusionrag"
    return str(here) if here.is_file() else (shutil.which("fusionrag") or "fusionrag")


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false"}


def run_cli(cmd: list[str], threads: int, timeout: float) -> dict[str, Any]:
    """A ``fusionrag`` command; its JSON report (stdout) when it prints one."""
    log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=thread_env(threads), capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"stdout": done.stdout.strip()[-2000:]}
    return {"command": " ".join(cmd), "seconds": round(seconds, 1), "report": report}


def build_store(files_dir: Path, store: Path, model: str, top_n: int, threads: int, timeout: float) -> dict[str, Any]:
    """``fusionrag ingest`` + ``fusionrag preprocess``; skipped when the marker says this store is built."""
    marker = store.with_name(store.name + ".built.json")
    wanted = {"files": str(files_dir), "model": model, "top_n": top_n,
              "file_names": sorted(p.name for p in files_dir.iterdir())}
    if (store / "store.sqlite").is_file() and marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("settings") == wanted:
            log(f"store {store} already built (reused)")
            return {**done, "reused": True}
    exe = fusionrag_exe()
    steps = [run_cli([exe, "--threads", str(threads), "ingest", str(files_dir), "--store", str(store), "--model", model,
                      "--quiet", "--json"], threads, timeout)]
    if top_n > 0:
        steps.append(run_cli([exe, "--threads", str(threads), "preprocess", "--store", str(store),
                              "--top-n", str(top_n), "--quiet"], threads, timeout))
    built = {"settings": wanted, "threads": threads, "steps": steps,
             "seconds": round(sum(s["seconds"] for s in steps), 1)}
    marker.write_text(json.dumps(built, indent=2) + "\n")
    return {**built, "reused": False}


# ------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(store: Path, threads: int, log_path: Path, ready_timeout: float) -> Iterator[dict[str, Any]]:
    """``fusionrag serve`` on a free loopback port until the block ends (then terminated, killed if need be)."""
    import httpx

    port = free_port()
    cmd = [fusionrag_exe(), "--threads", str(threads), "serve", "--store", str(store), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning",
           "--context-cache-mb", "0"]  # rounds repeat contexts: each cell is measured as itself, not a cache hit
    log(f"$ OMP_NUM_THREADS={threads} {' '.join(cmd)}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=thread_env(threads),
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fusionrag serve exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/ready", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"fusionrag serve not ready after {ready_timeout:.0f} s: "
                                   f"{log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        ready_s = time.perf_counter() - t0
        models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        yield {"url": base + "/v1", "model": models[0]["id"], "command": " ".join(cmd), "ready_s": round(ready_s, 1)}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# ------------------------------------------------------------------ the framework paths


def minilm_adapters(embedder: Any) -> tuple[Any, Any]:
    """The packaged MiniLM as a LangChain ``Embeddings`` and a LlamaIndex ``BaseEmbedding``."""
    from langchain_core.embeddings import Embeddings
    from llama_index.core.embeddings import BaseEmbedding
    from pydantic import PrivateAttr

    class LangChainMiniLM(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return embedder.embed(list(texts)).tolist()

        def embed_query(self, text: str) -> list[float]:
            return embedder.embed([text])[0].tolist()

    class LlamaIndexMiniLM(BaseEmbedding):
        _embedder: Any = PrivateAttr()

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(model_name=embedder.name, **kwargs)
            self._embedder = embedder

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embedder.embed([query])[0].tolist()

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embedder.embed([text])[0].tolist()

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.embed(list(texts)).tolist()

    return LangChainMiniLM(), LlamaIndexMiniLM()


def make_paths(url: str, model: str, files_dir: Path, files: list[dict[str, str]], ratio: float, max_tokens: int,
               top_k: int, own_k: int, timeout: float) -> tuple[dict[str, dict[str, Callable[[str], Any]]], dict]:
    """``{path: {method: ask(question) -> (usage.fusionrag, answer)}}`` and the setup costs of the own indexes."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore
    from llama_index.core import SimpleDirectoryReader, VectorStoreIndex

    from fusionrag.integrations import langchain as lc
    from fusionrag.integrations import llamaindex as li
    from fusionrag.retrieval.embedder import get_embedder

    setup: dict[str, Any] = {}
    t0 = time.perf_counter()
    lc_emb, li_emb = minilm_adapters(get_embedder())
    setup["embedder_load_s"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    docs = [Document(page_content=Path(f["path"]).read_text(encoding="utf-8"), metadata={"source": f["path"]})
            for f in files]
    lc_store = InMemoryVectorStore.from_documents(docs, embedding=lc_emb)
    lc_own = lc_store.as_retriever(search_kwargs={"k": own_k})
    setup["lc_own_index_s"] = round(time.perf_counter() - t0, 2)
    setup["lc_own_documents"] = len(docs)

    t0 = time.perf_counter()
    li_docs = SimpleDirectoryReader(str(files_dir)).load_data()
    index = VectorStoreIndex.from_documents(li_docs, embed_model=li_emb)
    li_own = index.as_retriever(similarity_top_k=own_k)
    setup["li_own_index_s"] = round(time.perf_counter() - t0, 2)
    setup["li_own_documents"] = len(li_docs)
    setup["li_own_nodes"] = len(index.docstore.docs)

    def ratio_of(m: str) -> float | None:
        return ratio if m != "full" else None

    def lc_ask(retriever: Any, m: str) -> Callable[[str], Any]:
        chain = lc.rag_chain(retriever, lc.chat_model(url, model=model, method=m, ratio=ratio_of(m),
                                                      max_tokens=max_tokens, max_retries=0, timeout=timeout))

        def ask(question: str) -> tuple[dict, str]:
            msg = chain.invoke(question)
            return msg.response_metadata["token_usage"]["fusionrag"], str(msg.content)
        return ask

    def li_ask(retriever: Any, m: str) -> Callable[[str], Any]:
        engine = li.FusionRAGQueryEngine(retriever=retriever, method=m, ratio=ratio_of(m),
                                         llm=li.llm(url, model=model, max_tokens=max_tokens, max_retries=0,
                                                    timeout=timeout))

        def ask(question: str) -> tuple[dict, str]:
            response = engine.query(question)
            return response.metadata["fusionrag"], str(response.response)
        return ask

    paths = {
        "lc_fusionrag": {m: lc_ask(lc.FusionRAGRetriever(base_url=url, top_k=top_k, timeout=timeout), m)
                         for m in METHODS},
        "lc_own": {m: lc_ask(lc_own, m) for m in METHODS},
        "li_fusionrag": {m: li_ask(li.FusionRAGRetriever(url, top_k=top_k, timeout=timeout), m) for m in METHODS},
        "li_own": {m: li_ask(li_own, m) for m in METHODS},
    }
    return paths, setup


def usage_row(usage: dict[str, Any]) -> dict[str, Any]:
    """What a row keeps of ``usage.fusionrag``: the counts, the note, and the pieces that were not stored."""
    sources = usage.get("sources") or []
    return {
        "ran": usage.get("method"), "chunks": usage.get("chunks"), "reused_chunks": usage.get("reused_chunks"),
        "adhoc_chunks": usage.get("adhoc_chunks"), "context_tokens": usage.get("context_tokens"),
        "recomputed_tokens": usage.get("recomputed_tokens"), "note": usage.get("note") or "",
        "adhoc_sources": [{"title": s.get("title"), "source": Path(str(s.get("source") or "")).name}
                          for s in sources if not s.get("stored")],
    }


# ------------------------------------------------------------------ the measurement


def measure(paths: dict, questions: list[str], warmup: str, rounds: int) -> list[dict[str, Any]]:
    cells = [(p, m) for p in PATHS for m in METHODS]
    log(f"warm-up: {len(cells)} cells once on a question outside the measured set")
    for p, m in cells:
        paths[p][m](warmup)
    rows: list[dict[str, Any]] = []
    turn = 0
    for r in range(rounds):
        for qi, question in enumerate(questions):
            order = cells[turn % len(cells):] + cells[:turn % len(cells)]
            turn += 1
            for p, m in order:
                t0 = time.perf_counter()
                usage, answer = paths[p][m](question)
                ms = (time.perf_counter() - t0) * 1000.0
                rows.append({"round": r, "question": qi, "path": p, "method": m, "ttft_ms": round(ms, 1),
                             "answer": answer, "load_avg_1m": round(os.getloadavg()[0], 2), **usage_row(usage)})
            got = {(x["path"], x["method"]): x for x in rows[-len(cells):]}
            log(f"round {r} question {qi + 1}/{len(questions)}: " + ", ".join(
                f"{p} {got[(p, 'full')]['ttft_ms'] / 1000:.1f}/{got[(p, 'fusionrag')]['ttft_ms'] / 1000:.1f} s "
                f"({got[(p, 'fusionrag')]['reused_chunks']}/{got[(p, 'fusionrag')]['chunks']})" for p in PATHS))
    return rows


def median_ci(values: list[float], n_boot: int = 2000) -> tuple[float, float, float]:
    """Median and its 95% percentile-bootstrap interval (fusionrag.bench.metrics' bootstrap helper)."""
    import numpy as np

    from fusionrag.bench.metrics import percentile_bootstrap

    x = np.asarray(values, dtype=np.float64)
    med = float(np.median(x))
    if x.size < 2:
        return med, med, med
    lo, hi = percentile_bootstrap([x], lambda a, axis=-1: np.median(a, axis=axis), n_boot=n_boot)
    return med, lo, hi


def per_question(rows: list[dict[str, Any]], path: str) -> list[tuple[float, float]]:
    """``(full, fusionrag)`` TTFT in ms per question of ``path``: each the median over the rounds."""
    got: dict[int, dict[str, list[float]]] = {}
    for r in rows:
        if r["path"] == path:
            got.setdefault(r["question"], {}).setdefault(r["method"], []).append(r["ttft_ms"])
    return [(statistics.median(m["full"]), statistics.median(m["fusionrag"]))
            for _, m in sorted(got.items()) if m.get("full") and m.get("fusionrag")]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path. TTFTs and speed-ups are per question (the median over the rounds of each method),
    so ``n`` and the bootstrap resample questions; the reuse counts cover every request."""
    out: dict[str, Any] = {}
    for p in PATHS:
        mine = [r for r in rows if r["path"] == p]
        fr = [r for r in mine if r["method"] == "fusionrag"]
        by = {(r["round"], r["question"], r["method"]): r for r in mine}
        pairs = [(by[(r["round"], r["question"], "full")], r) for r in fr
                 if (r["round"], r["question"], "full") in by]
        ttft = per_question(rows, p)
        speed, lo, hi = median_ci([a / b for a, b in ttft])
        chunks = sum(b["chunks"] for b in fr)
        reused = sum(b["reused_chunks"] for b in fr)
        adhoc: dict[str, int] = {}
        for b in fr:
            for s in b["adhoc_sources"]:
                key = f"{s['title'] or '(no title)'} [{s['source']}]"
                adhoc[key] = adhoc.get(key, 0) + 1
        med_full, med_fr = statistics.median(a for a, _ in ttft), statistics.median(b for _, b in ttft)
        out[p] = {
            "label": LABELS[p], "n": len(ttft), "requests": len(fr),
            "chunks_per_request_mean": round(statistics.mean(b["chunks"] for b in fr), 2) if fr else None,
            "chunks": chunks, "reused_chunks": reused, "adhoc_chunks": sum(b["adhoc_chunks"] for b in fr),
            "reused_fraction": round(reused / chunks, 4) if chunks else None,
            "requests_at_100pct": sum(b["reused_chunks"] == b["chunks"] for b in fr),
            "ran": sorted({r["ran"] for r in mine}),
            "median_ttft_ms_full": round(med_full, 1), "median_ttft_ms_fusionrag": round(med_fr, 1),
            "speedup_median": round(speed, 3), "speedup_ci95": [round(lo, 3), round(hi, 3)],
            "speedup_of_medians": round(med_full / med_fr, 3),
            "context_tokens_median": statistics.median(b["context_tokens"] for b in fr),
            "context_tokens_equal_full": all(a["context_tokens"] == b["context_tokens"] for a, b in pairs),
            "same_first_token": sum(a["answer"] == b["answer"] for a, b in pairs),
            "notes": sorted({r["note"] for r in mine if r["note"]}),
            "adhoc_sources": dict(sorted(adhoc.items(), key=lambda kv: -kv[1])),
        }
    return out


# ------------------------------------------------------------------ the report


def fmt_s(ms: float) -> str:
    return f"{ms / 1000:.2f} s"


def markdown(rep: dict[str, Any]) -> str:
    s = rep["summary"]
    git = f" (git {rep['git']})" if rep.get("git") else ""
    lines = [
        "# TTFT through LangChain and LlamaIndex over a store built from files: fusionrag vs full",
        "",
        f"{rep['questions']} questions of `{rep['data']}`, {rep['rounds']} round(s) (a question's TTFT per "
        f"method: the median over its rounds; n = questions), model `{rep['model']}` "
        f"(served as `{rep['served_model']}`), {rep['threads']} thread, method `fusionrag` at ratio {rep['ratio']} "
        f"vs `full`, greedy, `max_tokens={rep['max_tokens']}`: the framework's end-to-end call (its retrieval, "
        "the HTTP request, the one token) is its time to first token. Store: "
        f"{rep['files']} user files ({rep['file_kinds']}) ingested with `fusionrag ingest` and fused with "
        f"`fusionrag preprocess --top-n {rep['top_n']}`; "
        f"{rep['store_chunks']} chunks. Machine: {rep['machine']}, {rep['cpu_count']} cores, median 1-minute "
        f"load average {rep['load_avg_1m_median']} during the run. Command:",
        "",
        f"    {rep['command']}",
        "",
        "| path | n | chunks / request | chunks reused (fusionrag) | requests at 100% | median TTFT full | "
        "median TTFT fusionrag | speed-up (median of per-question full/fusionrag) [95% CI] | context tokens (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PATHS:
        x = s[p]
        frac = "n/a" if x["reused_fraction"] is None else f"{100 * x['reused_fraction']:.1f}%"
        lines.append(
            f"| {x['label']} | {x['n']} | {x['chunks_per_request_mean']} | {frac} ({x['reused_chunks']}/{x['chunks']}) "
            f"| {x['requests_at_100pct']}/{x['requests']} | {fmt_s(x['median_ttft_ms_full'])} | "
            f"{fmt_s(x['median_ttft_ms_fusionrag'])} | {x['speedup_median']:.2f}x "
            f"[{x['speedup_ci95'][0]:.2f}, {x['speedup_ci95'][1]:.2f}] | {x['context_tokens_median']} |")
    lines += [
        "",
        "How to read it: *chunks reused* counts, over the `fusionrag` requests, the prompt's chunks whose "
        "precomputed (fused) KV the server found in the store (`usage.fusionrag.reused_chunks` / `chunks`); "
        "the rest (`adhoc_chunks`) were text the store does not hold, computed and kept in the prefix cache. "
        "`full` recomputes every chunk (0 reused by definition), over the same documents. The eight cells "
        "(4 paths x 2 methods) ran interleaved per question, the order rotated by one cell per question, "
        "after one warm-up call of each on a question outside the set, so the ratios are paired.",
        "",
        f"FusionRAGRetriever paths retrieve the store's top {rep['top_k']} chunks (`POST /v1/retrieve`); the "
        f"frameworks' own indexes retrieve {rep['own_k']} documents/nodes with the same MiniLM embedder "
        f"(LangChain: one Document per file, {rep['setup']['lc_own_documents']} documents; LlamaIndex: "
        f"{rep['setup']['li_own_nodes']} nodes from {rep['setup']['li_own_documents']} documents), which the "
        "server maps onto the stored chunks (`fusionrag.retrieval.matching`).",
        "",
    ]
    notes = [(p, s[p]) for p in PATHS if s[p]["notes"] or s[p]["adhoc_sources"]]
    if notes:
        lines.append("Below 100%, and notes the server returned:")
        lines.append("")
        for _, x in notes:
            if x["adhoc_sources"]:
                top = "; ".join(f"{k} x{v}" for k, v in list(x["adhoc_sources"].items())[:8])
                lines.append(f"- {x['label']}: {x['adhoc_chunks']} new piece(s) in {x['requests']} requests: {top}")
            for note in x["notes"]:
                lines.append(f"- {x['label']}: note `{note}`")
        lines.append("")
    lines += [
        "First answer token equal under both methods (greedy): " + ", ".join(
            f"{s[p]['label']} {s[p]['same_first_token']}/{s[p]['requests']}" for p in PATHS) + " requests.",
        "",
        f"Setup (not in the TTFTs): store {'reused' if rep['build']['reused'] else 'built'} "
        f"({rep['build']['seconds']} s when built: " + "; ".join(
            f"`{st['command'].split(' ', 1)[1]}` {st['seconds']} s" for st in rep['build']['steps']) + "), "
        f"server ready in {rep['server_ready_s']} s, MiniLM loaded in {rep['setup']['embedder_load_s']} s, "
        f"LangChain's index built in {rep['setup']['lc_own_index_s']} s, LlamaIndex's in "
        f"{rep['setup']['li_own_index_s']} s. Server: `OMP_NUM_THREADS={rep['threads']} {rep['server_command']}`.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in rep["versions"].items()) + f"{git}.",
        "",
        "![TTFT per path](framework_ttft.png)",
        "",
    ]
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, s = rep["rows"], rep["summary"]
    colours = {"full": "#7f7f7f", "fusionrag": "#1f77b4"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.6, 1]})
    xs = range(len(PATHS))
    ticks = [SHORT[p] for p in PATHS]
    for k, m in enumerate(METHODS):
        data = [[pair[k] / 1000 for pair in per_question(rows, p)] for p in PATHS]
        pos = [x + (k - 0.5) * 0.36 for x in xs]
        box = ax.boxplot(data, positions=pos, widths=0.3, patch_artist=True, showfliers=True,
                         medianprops={"color": "black"}, flierprops={"markersize": 3})
        for patch in box["boxes"]:
            patch.set_facecolor(colours[m])
            patch.set_alpha(0.75)
        ax.plot([], [], "s", color=colours[m], label=f"method={m}")
    ax.set_xticks(list(xs), ticks, fontsize=9)
    ax.set_ylabel("time to first token, s (framework call, max_tokens=1)")
    ax.set_ylim(0, max(max(pair) for p in PATHS for pair in per_question(rows, p)) / 1000 * 1.18)
    ax.set_title(f"TTFT per question ({rep['model']}, {rep['threads']} thread, n={rep['questions']})", fontsize=11)
    ax.legend(loc="upper center", ncol=2, fontsize=9)
    ax.grid(axis="y", alpha=0.3)

    med = [s[p]["speedup_median"] for p in PATHS]
    err = [[m - s[p]["speedup_ci95"][0] for m, p in zip(med, PATHS, strict=True)],
           [s[p]["speedup_ci95"][1] - m for m, p in zip(med, PATHS, strict=True)]]
    bx.bar(list(xs), med, color=colours["fusionrag"], alpha=0.75, width=0.5)
    bx.errorbar(list(xs), med, yerr=err, fmt="none", ecolor="black", capsize=5)
    bx.axhline(1.0, color="black", lw=0.8, ls="--")
    top = max(s[p]["speedup_ci95"][1] for p in PATHS) * 1.25 + 0.2
    for x, p in zip(xs, PATHS, strict=True):
        frac = s[p]["reused_fraction"]
        text = f"{med[x]:.2f}x\nreused {100 * frac:.0f}%" if frac is not None else f"{med[x]:.2f}x"
        bx.text(x, s[p]["speedup_ci95"][1] + 0.02 * top, text, ha="center", va="bottom", fontsize=8.5,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    bx.set_xticks(list(xs), ticks, fontsize=9)
    bx.set_ylabel("speed-up: median of full / fusionrag per question")
    bx.set_ylim(0, top)
    bx.set_xlim(-0.5, len(PATHS) - 0.1)
    bx.set_title("paired speed-up, 95% bootstrap CI", fontsize=11)
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "framework_ttft.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "framework_ttft.md").write_text(markdown(report))
    plot(report, out / "framework_ttft.png")


def git_state() -> str:
    """The checkout's commit, ``+dirty`` when ``src/`` has uncommitted changes (what the server ran)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def missing_modules() -> list[str]:
    import importlib.util

    missing = []
    for name in NEEDS:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="a 2WikiMQA-style JSONL file with passages")
    ap.add_argument("--limit", type=int, default=24, help="questions (their passages become the files)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the questions")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--top-n", type=int, default=10, help="fusion neighbours for 'fusionrag preprocess' (0: plain KV)")
    ap.add_argument("--top-k", type=int, default=5, help="chunks FusionRAGRetriever retrieves")
    ap.add_argument("--own-k", type=int, default=3, help="documents/nodes the frameworks' own retrievers return")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="server threads (torch and OMP); the client uses 1")
    ap.add_argument("--build-threads", type=int, default=1, help="threads of ingest and preprocess")
    ap.add_argument("--work", default=str(DEFAULT_WORK), help="files and store (reused when already built)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--build-timeout", type=float, default=4 * 3600.0, help="seconds per ingest/preprocess step")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for the server to become ready")
    ap.add_argument("--build-only", action="store_true", help="make the files and the store, then stop")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only re-summarize an existing framework_ttft.json's rows and rewrite the report (into --out)")
    args = ap.parse_args(argv)
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        report["summary"] = summarize(report["rows"])  # this version's summary of the recorded rows
        write_report(report, Path(args.out))
        return 0

    missing = missing_modules()
    if missing:
        log(f"missing Python packages: {', '.join(missing)} (pip install 'fusionrag[langchain,llamaindex,bench]')")
        return 2
    data = Path(args.data)
    if not data.is_file():
        log(f"data file not found: {data}")
        return 2
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the client's MiniLM queries: one thread too (client and server never overlap)
    try:
        return run(args, data)
    finally:
        torch.set_num_threads(threads_before)


def run(args: argparse.Namespace, data: Path) -> int:
    rows_in = read_questions(data, args.limit)
    questions = rows_in[:args.limit]
    warmup = rows_in[args.limit]["question"] if len(rows_in) > args.limit else "Who directed the film?"
    work = Path(args.work)
    tag = f"{data.stem.split('_')[0]}-n{len(questions)}"
    files_dir = work / f"files-{tag}"
    files = make_files(questions, files_dir)
    log(f"{len(files)} files in {files_dir}")
    store = work / f"store-{args.model.replace('/', '_')}-{tag}-top{args.top_n}"
    build = build_store(files_dir, store, args.model, args.top_n, args.build_threads, args.build_timeout)
    if args.build_only:
        log(f"store {store} ready ({build['seconds']} s to build)")
        return 0

    with served(store, args.threads, work / "serve.log", args.ready_timeout) as server:
        log(f"server ready in {server['ready_s']} s at {server['url']}, model '{server['model']}'")
        paths, setup = make_paths(server["url"], server["model"], files_dir, files, args.ratio, args.max_tokens,
                                  args.top_k, args.own_k, args.timeout)
        import httpx

        info = httpx.get(server["url"].removesuffix("/v1") + "/health", timeout=30).json()
        t0 = time.perf_counter()
        rows = measure(paths, [q["question"] for q in questions], warmup, args.rounds)
        measure_s = time.perf_counter() - t0

    ingest_report = next((st["report"] for st in build["steps"] if " ingest " in st["command"]), {})
    store_chunks = ingest_report.get("new_chunks") if isinstance(ingest_report, dict) else None
    kinds = {"md": sum(f["path"].endswith(".md") for f in files), "txt": sum(f["path"].endswith(".txt") for f in files)}
    argv_shown = " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "framework_ttft.py" else ""
    report = {
        "command": f".venv/bin/python benchmarks/frameworks/framework_ttft.py {argv_shown}".strip(),
        "args": vars(args), "data": os.path.relpath(data, ROOT), "model": args.model, "served_model": server["model"],
        "questions": len(questions), "rounds": args.rounds, "ratio": args.ratio, "top_n": args.top_n,
        "top_k": args.top_k, "own_k": args.own_k, "max_tokens": args.max_tokens, "threads": args.threads,
        "files": len(files), "file_kinds": f"{kinds['md']} .md, {kinds['txt']} .txt",
        "store": str(store), "store_chunks": store_chunks, "build": build, "server_command": server["command"],
        "server_ready_s": server["ready_s"], "server_health": info, "setup": setup,
        "measure_s": round(measure_s, 1), "machine": platform.platform(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "versions": versions(),
        "git": git_state(),
        "load_avg_1m_median": statistics.median(r["load_avg_1m"] for r in rows),
        "summary": summarize(rows), "rows": rows,
    }
    if store_chunks is None:  # a reused store: count what it holds from the first build's report
        report["store_chunks"] = "?"
    out = Path(args.out)
    write_report(report, out)
    log(f"wrote {out / 'framework_ttft.md'} ({measure_s / 60:.1f} min measured)")
    print(json.dumps({p: {k: v for k, v in x.items() if k not in ("adhoc_sources", "notes")}
                      for p, x in report["summary"].items()}, indent=2))
    return 0 if all(not math.isnan(x["speedup_median"]) for x in report["summary"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
