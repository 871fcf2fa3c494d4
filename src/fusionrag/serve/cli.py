"""``fusionrag serve``: the OpenAI-compatible HTTP server on the command line.

``register(sub)`` adds the sub-command; nothing heavy is imported until it runs. The load
test against this server is ``fusionrag bench serve`` (:mod:`fusionrag.eval.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys

from fusionrag.errors import FusionRAGError
from fusionrag.serve.launch import add_server_args, build_app

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not args.store:
        raise FusionRAGError("serve needs --store DIR (a knowledge store from 'fusionrag ingest')")
    if args.host not in LOOPBACK:
        print(f"fusionrag: warning: listening on {args.host}, reachable from other machines"
              f"{'' if (args.api_key or os.environ.get('FUSIONRAG_API_KEY')) else ' WITHOUT an API key'}",
              file=sys.stderr)
    app, settings = build_app(args)
    print(f"fusionrag: serving {args.store} on http://{settings.host}:{settings.port} "
          f"(OpenAI base_url http://{settings.host}:{settings.port}/v1)", file=sys.stderr)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server answering with RAG over a knowledge store")
    add_server_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)
