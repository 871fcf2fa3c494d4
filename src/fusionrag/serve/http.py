"""The HTTP server under the app: uvicorn, with the two bounds it lacks.

- **Half-sent requests time out.** uvicorn times out idle keep-alive connections, but a client
  that opens a connection and sends half a request head (or stops mid-body) holds it forever.
  :class:`BoundedH11Protocol` closes a connection whose request has not fully arrived within
  ``header_timeout_s`` of its first byte (or of the connection).
- **A second SIGTERM exits at once.** uvicorn forces an exit on a second SIGINT only; a
  supervisor's second SIGTERM should not wait for open streams either (:class:`Server`). The
  first waits for open requests up to ``shutdown_timeout_s``; near that deadline the open ones
  are ended with an error (a final SSE error event for streams) rather than cut mid-answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive completely."""

    header_timeout_s: float = 30.0  # set per server by :func:`make_config`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arrival: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and data:
            self._arm()  # a request is arriving: it has until the deadline to arrive whole
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if getattr(self, "_arrival", None) is None:
            self._arrival = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        timer = getattr(self, "_arrival", None)
        if timer is not None:
            timer.cancel()
            self._arrival = None

    def _too_slow(self) -> None:
        self._arrival = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()  # nothing was dispatched: no handler is left waiting


class Server(uvicorn.Server):
    """uvicorn's server, where a second SIGTERM (not only SIGINT) forces the exit, and open requests are
    ended by ``on_deadline`` (the scheduler's close: streams get a final SSE error event, others a 503)
    shortly before the graceful-shutdown timeout would cut them off mid-answer."""

    def __init__(self, config: uvicorn.Config, on_deadline: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_deadline = on_deadline

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        handle = None
        timeout = self.config.timeout_graceful_shutdown
        if self.on_deadline is not None and timeout:
            loop = asyncio.get_running_loop()
            callback = self.on_deadline
            handle = loop.call_later(max(0.0, timeout * 0.8), lambda: loop.run_in_executor(None, callback))
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()


def make_config(app: Any, host: str, port: int, log_level: str = "info", header_timeout_s: float = 30.0,
                shutdown_timeout_s: float = 30.0, lifespan: str = "on") -> uvicorn.Config:
    """The uvicorn configuration every fusionrag server uses (the CLI's and the in-process one)."""
    protocol = type("FusionRAGH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan=lifespan,
                          http=protocol, timeout_graceful_shutdown=shutdown_timeout_s)
