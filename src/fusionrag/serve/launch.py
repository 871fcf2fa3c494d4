"""Building a server from command-line options: one definition for ``fusionrag serve`` and ``bench serve``.

The serving CLI runs the app with uvicorn; the load test (:mod:`fusionrag.eval`) starts the
same app in-process. Both take the same options and must build the same server, so the
options, the settings they make and the engine factory live here, below both commands.
Nothing heavy is imported until a server is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusionrag.errors import FusionRAGError
from fusionrag.serve.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The options of a server over a knowledge store (limits, defaults, model, memory tier)."""
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


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """:class:`ServerSettings` from :func:`add_server_args` options plus ``host``/``port``."""
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


def engine_factory(store: str, model: str | None, memory_budget_mb: int = 0) -> Callable[[], Any]:
    """Builds the engine on the model thread (the store's SQLite connection belongs to its creating thread)."""
    if not Path(store).exists():
        raise FusionRAGError(f"no knowledge store at '{store}'; create one with "
                             f"'fusionrag ingest FILES --store {store}'")

    def factory():
        from fusionrag.online.engine import Engine

        return Engine.open(store, model=model, memory_budget_bytes=memory_budget_mb << 20 or None)

    return factory


def build_app(args: argparse.Namespace) -> tuple[FastAPI, ServerSettings]:
    """The app for ``args`` with its model loaded, so a bad store or model fails here, before binding."""
    from fusionrag.serve.app import create_app

    settings = settings_from_args(args)
    app = create_app(engine_factory(args.store, args.model, args.memory_budget_mb), settings)
    print(f"fusionrag: loading the model for {args.store} ...", file=sys.stderr)
    app.state.scheduler.wait_ready()  # a bad store or model fails here, as one line, before binding
    return app, settings
