"""One access-log line per HTTP request on the ``fusionrag.access`` logger, at INFO (as uvicorn's and vLLM's).

``POST /v1/chat/completions 200 41.7ms request_id=3f2a...``: the method, the path (no query string: it may
carry a question), the status, the time from the request's arrival to its last byte (a streamed answer's
whole stream), and the request id: a completion's own (the ``request_id`` of its ``fusionrag`` object and
of ``/v1/explain/{id}``), else one made here. The id is also the response's ``X-Request-Id`` header. No
body and no header is logged, so neither a question nor an API key reaches the log.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

log = logging.getLogger("fusionrag.access")

#: Where a route that has its own id for the request (a completion's) leaves it, in the ASGI scope's state.
REQUEST_ID = "request_id"


def set_request_id(scope_state: Any, request_id: str) -> None:
    """Name this HTTP request's id (``request.state`` of a route): the log line and the header carry it."""
    setattr(scope_state, REQUEST_ID, request_id)


def _printable(text: str, limit: int = 200) -> str:
    """The path as one line (a decoded path may hold control characters), bounded."""
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


class AccessLog:
    """ASGI middleware: the outermost layer, so it sees the status the client gets and the whole response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        state.setdefault(REQUEST_ID, uuid.uuid4().hex)
        status, logged = 500, False  # 500 unless a response starts: the app failed before answering

        def line() -> None:
            nonlocal logged
            if not logged and log.isEnabledFor(logging.INFO):
                log.info("%s %s %d %.1fms request_id=%s", scope.get("method", "?"), _printable(scope.get("path", "")),
                         status, (time.perf_counter() - start) * 1000.0, state[REQUEST_ID])
            logged = True

        length, sent = None, 0

        async def sending(message: dict) -> None:
            nonlocal status, length, sent
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", str(state[REQUEST_ID]).encode("latin-1", "replace")))
                message = {**message, "headers": headers}
                length = next((int(v) for k, v in headers if k.lower() == b"content-length" and v.isdigit()), None)
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                if not message.get("more_body", False) or (length is not None and sent >= length):
                    line()  # before the last byte goes: a client that has its answer finds the line logged
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            line()  # a response that never finished (the client went away, the app failed)
