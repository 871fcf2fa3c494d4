"""``fusionrag serve`` (the HTTP server) and ``fusionrag bench-serve`` (the load test).

``register(sub)`` adds both sub-commands; nothing heavy is imported until one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fusionrag.errors import FusionRAGError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _settings(args: argparse.Namespace):
    from fusionrag.serve.app import ServerSettings

    return ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("FUSIONRAG_API_KEY") or None,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        default_method=args.method,
        default_ratio=args.ratio,
    )


def _engine_factory(store: str, model: str | None, memory_budget_mb: int = 0):
    """Builds the engine on the model thread (the store's SQLite connection belongs to its creating thread)."""
    if not Path(store).exists():
        raise FusionRAGError(f"no knowledge store at '{store}'; create one with "
                             f"'fusionrag ingest FILES --store {store}'")

    def factory():
        from fusionrag.online.engine import Engine

        return Engine.open(store, model=model, memory_budget_bytes=memory_budget_mb << 20 or None)

    return factory


def _build_app(args: argparse.Namespace):
    from fusionrag.serve.app import create_app

    settings = _settings(args)
    app = create_app(_engine_factory(args.store, args.model, args.memory_budget_mb), settings)
    print(f"fusionrag: loading the model for {args.store} ...", file=sys.stderr)
    app.state.scheduler.wait_ready()  # a bad store or model fails here, as one line, before binding
    return app, settings


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not args.store:
        raise FusionRAGError("serve needs --store DIR (a knowledge store from 'fusionrag ingest')")
    if args.host not in LOOPBACK:
        print(f"fusionrag: warning: listening on {args.host}, reachable from other machines"
              f"{'' if (args.api_key or os.environ.get('FUSIONRAG_API_KEY')) else ' WITHOUT an API key'}",
              file=sys.stderr)
    app, settings = _build_app(args)
    print(f"fusionrag: serving {args.store} on http://{settings.host}:{settings.port} "
          f"(OpenAI base_url http://{settings.host}:{settings.port}/v1)", file=sys.stderr)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from fusionrag.serve.loadtest import ServerThread, ingest_documents, load_questions, run_load_test

    questions = load_questions(args.data, limit=args.limit, with_documents=args.mode == "documents",
                               max_passages=args.max_passages)
    if args.mode == "retrieval":
        for q in questions:
            q.pop("documents", None)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    meta = {"data": str(args.data), "mode": args.mode, "store": args.store, "model": args.model}

    def run(base_url: str) -> dict:
        if args.ingest:
            docs = load_questions(args.data, limit=args.limit, with_documents=True, max_passages=args.max_passages)
            ids = ingest_documents(base_url, docs, api_key=args.api_key)
            meta["ingested_chunks"] = len(set(ids))
        return run_load_test(base_url, questions, rates=rates, methods=methods, duration_s=args.duration,
                             n_requests=args.n_requests, out_dir=args.out, max_tokens=args.max_tokens,
                             top_k=args.top_k, api_key=args.api_key, timeout_s=args.timeout, meta=meta)

    if args.url:
        report = run(args.url)
    elif args.store:
        args.host, args.port = "127.0.0.1", 0
        app, _ = _build_app(args)
        with ServerThread(app) as server:
            report = run(server.base_url)
    else:
        raise FusionRAGError("give --url of a running server or --store to start one in-process")
    for c in report["cells"]:
        print(json.dumps({k: c[k] for k in ("label", "rate", "sent", "ok", "ttft_ms_p50", "ttft_ms_p95",
                                             "throughput_rps", "throughput_tok_s")}))
    if args.out:
        print(f"fusionrag: wrote {args.out}/loadtest.json, loadtest.md, loadtest.png", file=sys.stderr)
    return 0


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="knowledge store folder (from 'fusionrag ingest')")
    p.add_argument("--model", default=None, help="model (default: the one the store was built with)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set FUSIONRAG_API_KEY)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for prefill before 429 (default 64)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together per step (default 8)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=8192, help="prompt token limit (default 8192)")
    p.add_argument("--method", default="fusionrag", help="default method of requests that name none")
    p.add_argument("--ratio", type=float, default=0.15, help="default recompute ratio")
    p.add_argument("--memory-budget-mb", type=int, default=1024,
                   help="in-memory KV tier (heat-based, with the asynchronous loader); 0 reads the store directly")


def register(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server answering with RAG over a knowledge store")
    _server_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)



def add_bench_serve(bench_sub: argparse._SubParsersAction) -> None:
    """``fusionrag bench serve`` (registered under the ``bench`` command by the evaluation CLI)."""
    from fusionrag.online.policies import METHODS

    p = bench_sub.add_parser("serve", help="load test: TTFT p50/p95 and throughput vs request rate per method")
    _server_args(p)
    p.add_argument("--url", default=None, help="a running server on loopback (else --store starts one in-process)")
    p.add_argument("--data", required=True, help="questions JSONL (../shared/data/...)")
    p.add_argument("--limit", type=int, default=50, help="questions to use (default 50)")
    p.add_argument("--mode", choices=["documents", "retrieval"], default="documents",
                   help="send each question's passages as request documents, or retrieve from the store")
    p.add_argument("--max-passages", type=int, default=None, help="passages per question (default all)")
    p.add_argument("--ingest", action="store_true", help="add the questions' passages to the store first")
    p.add_argument("--rates", default="0.5,1,2,4", help="request rates in req/s, comma-separated")
    p.add_argument("--methods", default="full,cacheblend:0.15,fusionrag:0.15",
                   help=f"method[:ratio], comma-separated ({', '.join(METHODS)})")
    p.add_argument("--n-requests", type=int, default=None, help="requests per (method, rate) cell")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per cell (default 30)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a cell's requests")
    p.add_argument("--out", default="docs/results/serve", help="output folder (JSON, Markdown, PNG)")
    p.set_defaults(func=_cmd_bench_serve, log_level="warning")

