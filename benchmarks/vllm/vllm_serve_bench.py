"""Serving: ``vllm serve`` with and without fusionrag's connector under 8 concurrent clients, passages shuffled.

    .venv/bin/python benchmarks/vllm/vllm_serve_bench.py --out benchmarks/vllm/results/serve \\
        [--clients 8] [--duration 300] [--max-requests 200] [--threads 1]

Each server runs on 127.0.0.1 (vLLM's OpenAI server from ``.venv-vllm``, bf16, prefix caching on), one
after the other on the same cores: first vLLM alone, then vLLM with the connector over ``bench ttft``'s
store (``fusionrag serve --engine vllm`` builds the same command). Every request is an ordinary streamed
chat completion (``rag_messages``: the store's system prompt, a question's passages, the question) whose
passages come **in a different order each time**, so vLLM's prefix cache cannot reuse them (the
connector finds the chunks wherever they are). Closed loop: ``--clients`` clients each send the next
request when the last one ends, for ``--duration`` seconds or ``--max-requests`` requests. Per server:
TTFT p50/p99 (the first streamed token), requests/s, failures. Then one LangChain ``ChatOpenAI``
request through the connector's server. Writes ``serve.json`` and ``README.md``.

Faults (on by default; ``--faults 0`` turns them off): the connector's server reads a
copy of the store in which ``--faults`` chunks' KV files are truncated and as many overwritten with noise,
and every 10th request carries one passage the store does not hold. Both servers get the same requests;
the connector must answer every one of them (falling back to vLLM's prefill where it cannot reuse), and
its log's fallback warnings are counted by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engines"))

from engine_cells import venv_python  # noqa: E402
from vllm_bench import connector_config  # noqa: E402


def requests_for(store, examples, n: int, seed: int = 0, min_tokens: int = 0,
                 tokens: Any = None) -> list[list[dict]]:
    """``n`` chat requests: questions whose passages the store holds, each with its passages shuffled; with
    ``min_tokens``, the next questions' passages are added until the request holds that many (``tokens(messages)``
    counts them)."""
    from fusionrag.prompt import chunk_text, rag_messages

    held = {store.chunk(c).text: store.chunk(c) for c in store.chunk_ids()}
    pool = []
    for ex in examples:
        passages = [{"title": p.title, "text": p.text} for p in ex.passages]
        if passages and all(chunk_text("", p["text"]).strip() and p["text"].strip() in held for p in passages):
            pool.append((ex.question, passages))
    if not pool:
        raise SystemExit("no question has all its passages in the store")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, passages = pool[i % len(pool)]
        shuffled = passages[:]
        j = i + 1
        while min_tokens and tokens(rag_messages(store.prompt.system_prompt, shuffled, question)) < min_tokens \
                and j < i + len(pool):
            shuffled += [p for p in pool[j % len(pool)][1] if p not in shuffled]
            j += 1
        rng.shuffle(shuffled)
        out.append(rag_messages(store.prompt.system_prompt, shuffled, question))
    return out


UNSTORED = "This passage was written for the benchmark and is in no store: {}."


def with_unstored(requests: list[list[dict]], every: int = 10) -> int:
    """Every ``every``-th request gets one passage the store does not hold (in place); how many did."""
    from fusionrag.prompt import chunk_text

    n = 0
    for i in range(0, len(requests), every):
        user = requests[i][-1]
        user["content"] = user["content"].replace("Passages:\n", "Passages:\n" + chunk_text("", UNSTORED.format(i)), 1)
        n += 1
    return n


def faulty_copy(store_path: Path, dest: Path, n: int, seed: int = 0) -> list[str]:
    """A copy of the store with ``n`` chunks' KV files truncated and ``n`` overwritten with noise."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(store_path, dest, ignore=shutil.ignore_patterns("store.lock", "*.lock"))
    files = sorted(p for p in (dest / "kv").rglob("*.safetensors") if "system" not in p.name)
    rng = random.Random(seed)
    broken = rng.sample(files, min(2 * n, len(files)))
    for k, path in enumerate(broken):
        data = path.read_bytes()
        if k < n:
            path.write_bytes(data[: len(data) // 2])
        else:
            path.write_bytes(data[:64] + rng.randbytes(len(data) - 64))
    return [str(p.relative_to(dest)) for p in broken]


def fallback_warnings(log: Path) -> list[str]:
    """The connector's fallback warnings in a server log (the first of each reason is logged)."""
    if not log.exists():
        return []
    return [line.split("fusionrag connector: ", 1)[1].strip()[:200]
            for line in log.read_text(errors="replace").splitlines() if "such requests are prefilled by vLLM" in line]


def start_server(folder: Path, port: int, threads: int, log: Path, config: dict | None,
                 extra: list[str] | None = None, omp_threads: int | None = None,
                 first_core: int = 0) -> subprocess.Popen:
    """vLLM's OpenAI server on cores ``first_core..first_core+threads-1`` (``omp_threads`` per engine: ``threads``
    by default; ``extra``: more vLLM flags, e.g. ``--data-parallel-size 2``)."""
    cmd = [str(venv_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--enable-prefix-caching", "--enforce-eager", "--max-model-len", "10240",
           *(extra or [])]
    if config:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(omp_threads or threads)}
    log.parent.mkdir(parents=True, exist_ok=True)
    cores = ",".join(map(str, range(first_core, first_core + threads)))
    return subprocess.Popen(["taskset", "-c", cores, *cmd], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def serving(folder: Path, port: int, threads: int, log: Path, config: dict | None,
            **options: Any) -> Iterator[subprocess.Popen]:
    """A vLLM server (:func:`start_server`), ready when entered, stopped on exit."""
    proc = start_server(folder, port, threads, log, config, **options)
    try:
        wait_ready(port, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def fused_workload(data: str) -> tuple[Any, Any, Path]:
    """qwen2.5-0.5b in bf16, ``bench ttft``'s store over ``data`` with every chunk a request can name fused (the
    contexts bench ttft fuses cover only its prompts), and the model folder vLLM loads."""
    from fusionrag.bench.ttft import ttft_workload
    from fusionrag.models import load_model
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.offline import build

    lm = load_model("qwen2.5-0.5b", dtype="bfloat16", device="cpu")
    store, _, _ = ttft_workload(lm, data, [8192], top_n=2, model_source="qwen2.5-0.5b")
    build.fuse(store, lm, top_n=2)
    return lm, store, ensure_converted(PACKAGED["qwen2.5-0.5b"])


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError("vllm serve did not become ready")


async def closed_loop(port: int, requests: list[list[dict]], clients: int, duration_s: float,
                      max_tokens: int, stream: bool = True, ignore_eos: bool = False) -> tuple[list[dict], float]:
    """``clients`` clients, each sending its next request when the last one ended. A streamed request is ok once
    its stream ended with ``[DONE]`` after at least one token; a non-streamed one (``stream=False``) once it
    answered 200 with a choice (its ``ttft_s`` is then the whole latency). ``ignore_eos`` (vLLM's extension):
    every answer runs to ``max_tokens`` (the model's own answers here end after ~5 tokens)."""
    import httpx

    queue = list(enumerate(requests))
    results: list[dict] = []
    deadline = time.perf_counter() + duration_s
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, i: int, messages: list[dict]) -> dict:
        t0 = time.perf_counter()
        first = None
        arrivals: list[float] = []  # when each streamed piece of the answer arrived (inter-token latency)
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
                **({"ignore_eos": True} if ignore_eos else {})}
        done, tokens = False, None  # tokens: the answer's, from the usage vLLM sends last
        try:
            if not stream:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                ok = r.status_code == 200 and bool(r.json().get("choices"))
                latency = time.perf_counter() - t0
                tokens = (r.json().get("usage") or {}).get("completion_tokens") if ok else None
                return {"i": i, "ok": ok, "ttft_s": latency, "latency_s": latency, "itl_s": [], "tokens": tokens,
                        **({} if ok else {"error": f"HTTP {r.status_code}"})}
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return {"i": i, "ok": False, "error": f"HTTP {r.status_code}"}
                async for line in r.aiter_lines():
                    done = done or line == "data: [DONE]"
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            arrivals.append(time.perf_counter())
                            if first is None:
                                first = arrivals[-1] - t0
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            return {"i": i, "ok": first is not None and done, "ttft_s": first,
                    "latency_s": time.perf_counter() - t0, "itl_s": gaps, "tokens": tokens,
                    **({} if done else {"error": "the stream ended without [DONE]"})}
        except httpx.HTTPError as exc:
            return {"i": i, "ok": False, "error": type(exc).__name__}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.perf_counter() < deadline:
            i, messages = queue.pop(0)
            results.append(await one(client, i, messages))

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return results, time.perf_counter() - start


def summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = sorted(r["ttft_s"] for r in ok)

    def pct(q: float) -> float | None:
        return ttft[min(len(ttft) - 1, round(q * (len(ttft) - 1)))] if ttft else None

    gaps = sorted(g for r in ok for g in r.get("itl_s", ()))

    def gap(q: float) -> float | None:
        return gaps[min(len(gaps) - 1, round(q * (len(gaps) - 1)))] if gaps else None

    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "itl_p50_s": gap(0.5), "itl_p99_s": gap(0.99),
            "answer_tokens_p50": statistics.median(counts) if (counts := [r["tokens"] for r in ok
                                                                            if r.get("tokens") is not None]) else None,
            "requests_per_s": len(ok) / wall if wall else None, "wall_s": wall}


def langchain_check(port: int, messages: list[dict]) -> dict:
    """One LangChain ``ChatOpenAI`` request against the connector's server (what a pipeline sends)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", model="m", max_tokens=16,
                     temperature=0)
    t0 = time.perf_counter()
    reply = llm.invoke([(m["role"], m["content"]) for m in messages])
    return {"answer": reply.content, "latency_s": time.perf_counter() - t0}


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(doc: dict) -> str:
    """The serving run's README: both servers, the faults and what the connector said of them, the ratios."""
    from collections import Counter

    meta, cells, ratios = doc["meta"], doc["cells"], doc["ratios"]
    faults = meta.get("faults") or {}
    lines = ["# vLLM serving with and without fusionrag's connector (passages shuffled per request)", "",
             f"Command: `{meta['command']}`  ", f"{meta['clients']} clients, closed loop, at most "
             f"{meta['duration_s']:.0f} s or {meta['max_requests']} requests per server, {meta['max_tokens']} tokens "
             f"per answer, bf16, {meta['threads']} thread(s), {meta['machine'].get('cpu_model')}.", "",
             "| server | requests ok / failed | TTFT p50 s | TTFT p99 s | requests/s |", "|---|---|---|---|---|"]
    for name, cell in cells.items():
        s = cell["summary"]
        lines.append(f"| {name} | {s['ok']} / {s['failed']} | {_f(s['ttft_p50_s'])} | {_f(s['ttft_p99_s'])} | "
                     f"{_f(s['requests_per_s'], 3)} |")
    if faults.get("kv_files_broken"):
        said = Counter(w.split(";")[0] for w in cells["vllm+fusionrag"].get("fallback_warnings") or [])
        lines += ["", f"Faults: the connector's store copy has {len(faults['kv_files_broken'])} broken chunk KV files "
                  f"(half truncated, half overwritten with noise: {', '.join(faults['kv_files_broken'])}); "
                  f"{faults['requests_with_an_unstored_passage']} requests carry a passage no store holds, first (the "
                  "connector matches stored chunks up to the first unknown passage: vLLM prefills those requests "
                  "itself). The connector's fallback "
                  "warnings (logged once per reason and stats interval), with how often they were logged:", ""]
        lines += [f"- {n}x {w}" for w, n in said.most_common()] or ["- none"]
    lines += ["", f"With the connector: p50 TTFT {_f(ratios['ttft_p50_x'], 2)}x lower, requests/s "
              f"{_f(ratios['requests_per_s_x'], 2)}x higher.", "", "LangChain ChatOpenAI through the connector: "
              f"{json.dumps(cells['vllm+fusionrag'].get('langchain'))}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.provenance import build_meta
    from fusionrag.files import atomic_write
    from fusionrag.paths import fusionrag_home

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8610)
    ap.add_argument("--faults", type=int, default=2,
                    help="chunks whose KV is truncated (and as many corrupted) in the connector's store; 0 = none")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="only rebuild README.md from serve.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        atomic_write(out / "README.md", markdown(json.loads((out / "serve.json").read_text())))
        return 0
    _, store, folder = fused_workload(args.data)
    requests = requests_for(store, load_questions(args.data), args.max_requests)
    unstored = with_unstored(requests) if args.faults else 0
    served_store = store.path
    broken: list[str] = []
    if args.faults:
        served_store = fusionrag_home() / "bench" / "serve-faulty-store"
        broken = faulty_copy(store.path, served_store, args.faults)
    cells = {}
    for name, config in (("vllm", None), ("vllm+fusionrag", connector_config(served_store, 0.15))):
        with serving(folder, args.port, args.threads, out / "logs" / f"{name}.log", config):
            results, wall = asyncio.run(closed_loop(args.port, requests, args.clients, args.duration,
                                                    args.max_tokens))
            cells[name] = {"summary": summary(results, wall), "results": results}
            if config:
                cells[name]["langchain"] = langchain_check(args.port, requests[1])
                cells[name]["fallback_warnings"] = fallback_warnings(out / "logs" / f"{name}.log")
            print(f"[serve] {name}: {json.dumps(cells[name]['summary'])}", file=sys.stderr, flush=True)
    base, ours = cells["vllm"]["summary"], cells["vllm+fusionrag"]["summary"]
    ratios = {"ttft_p50_x": base["ttft_p50_s"] / ours["ttft_p50_s"] if base["ttft_p50_s"] and ours["ttft_p50_s"]
              else None,
              "requests_per_s_x": ours["requests_per_s"] / base["requests_per_s"] if base["requests_per_s"] else None}
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_serve_bench.py", *sys.argv[1:]]),
                      model="qwen2.5-0.5b", data_files=[args.data],
                      extra={"clients": args.clients, "duration_s": args.duration, "max_requests": args.max_requests,
                             "threads": args.threads, "max_tokens": args.max_tokens,
                             "faults": {"kv_files_broken": broken, "requests_with_an_unstored_passage": unstored}})
    doc = {"meta": meta, "cells": cells, "ratios": ratios}
    atomic_write(out / "serve.json", json.dumps(doc, indent=1))
    atomic_write(out / "README.md", markdown(doc))
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
