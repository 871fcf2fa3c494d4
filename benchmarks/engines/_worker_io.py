"""The JSON-lines protocol shared by the engine workers (each runs in its own venv).

stdin: one JSON request a line; stdout: one JSON reply a line and nothing else. File descriptor 1
is pointed at stderr for the rest of the process (Python prints, C libraries, child processes),
so an engine's logs can never corrupt the protocol stream.

Requests: {"op": "ttft", "ids": [int, ...], "cache": "cold" | "keep"[, "kv_transfer_params": {...}: vLLM only,
passed to the request, e.g. fusionrag's connector cell]} -> {"ttft_s", "first_token",
"prompt_tokens", ...}; {"op": "info"} -> versions and settings; {"op": "quit"} -> {"bye": true}.
A failed request answers {"error": "..."} and the worker goes on.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def protocol_stream():
    """Return a line-buffered writer on the original stdout; fd 1 becomes a copy of stderr."""
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by children
    os.dup2(2, 1)
    return proto


def send(proto, obj: dict[str, Any]) -> None:
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def check_ttft_request(req: dict[str, Any]) -> tuple[list[int], str]:
    ids = req.get("ids")
    cache = req.get("cache", "cold")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError("'ids' must be a non-empty list of ints")
    if cache not in ("cold", "keep"):
        raise ValueError("'cache' must be 'cold' or 'keep'")
    return ids, cache


def serve(proto, ttft: Callable[..., dict[str, Any]], info: Callable[[], dict[str, Any]]) -> None:
    """Answer requests from stdin until quit or EOF."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                send(proto, {"bye": True})
                return
            if op == "info":
                send(proto, info())
            elif op == "ttft":
                ids, cache = check_ttft_request(req)
                extra = {"kv_transfer_params": req["kv_transfer_params"]} if "kv_transfer_params" in req else {}
                send(proto, ttft(ids, cache, **extra))
            else:
                send(proto, {"error": f"unknown op {op!r}"})
        except Exception as exc:  # one bad request must not kill the worker
            traceback.print_exc(file=sys.stderr)
            send(proto, {"error": f"{type(exc).__name__}: {exc}"})
