"""A real uvicorn server in a background thread, for tests and in-process load tests.

Real sockets and a real event loop (unlike FastAPI's TestClient) are what an OpenAI client
or the load generator needs; port 0 picks a free one so runs never collide.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fusionrag.errors import FusionRAGError


class ServerThread:
    """Run an ASGI app with uvicorn on a loopback port (0 = a free one) in a background thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 lifespan: str = "on", header_timeout_s: float = 30.0) -> None:
        from fusionrag.serve.http import Server, make_config

        self.host = host
        config = make_config(app, host, port, log_level, header_timeout_s=header_timeout_s, lifespan=lifespan)
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, name="fusionrag-uvicorn", daemon=True)
        self.port = port

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30.0
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise FusionRAGError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30.0)
