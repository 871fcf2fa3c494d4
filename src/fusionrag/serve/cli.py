"""``fusionrag serve``: the OpenAI-compatible HTTP server on the command line.

``register(sub)`` adds the sub-command; nothing heavy is imported until it runs. The load
test against this server is ``fusionrag bench serve`` (:mod:`fusionrag.bench.cli`).
"""

from __future__ import annotations

import argparse
import sys

from fusionrag.serve.launch import add_server_args, build_app

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _cmd_serve(args: argparse.Namespace) -> int:
    from fusionrag.serve.http import Server, make_config

    _log_to_stderr(args.log_level)
    app, settings = build_app(args)
    if args.store:  # once, at start: otherwise only each response's fused_fallbacks would say it
        from fusionrag.retrieval.store_info import preprocess_hint

        hint = preprocess_hint(args.store)
        if hint:
            print(f"fusionrag: warning: {hint}", file=sys.stderr)
    if settings.host not in LOOPBACK:
        print(f"fusionrag: warning: listening on {settings.host}, reachable from other machines"
              f"{'' if settings.api_key else ' WITHOUT an API key'}", file=sys.stderr)
    print(f"fusionrag: serving {args.store or args.model or 'the default model'} on "
          f"http://{settings.host}:{settings.port} "
          f"(OpenAI base_url http://{settings.host}:{settings.port}/v1)", file=sys.stderr)
    Server(make_config(app, settings.host, settings.port, args.log_level, settings.header_timeout_s,
                       settings.shutdown_timeout_s), on_deadline=app.state.scheduler.close).run()
    return 0


def _log_to_stderr(level: str) -> None:
    """fusionrag's own loggers (the access log, ``fusionrag.access``, among them) on stderr at ``--log-level``,
    next to uvicorn's lines and in their format."""
    import logging

    logger = logging.getLogger("fusionrag")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server answering with RAG over a knowledge store "
                                     "(or over the passages clients send)")
    add_server_args(p)
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1: loopback only; or FUSIONRAG_HOST)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default 8000; or FUSIONRAG_PORT)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)
