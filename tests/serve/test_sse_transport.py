"""The SSE transport under a real uvicorn server: a stream open at shutdown ends with an error event and
``[DONE]``; a client that goes away mid-answer cancels its request."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from fusionrag.online.scheduler import BatchScheduler
from fusionrag.serve.app import create_app
from fusionrag.serve.http import Server, make_config
from fusionrag.serve.settings import ServerSettings
from serve_helpers import USER, store_factory

LONG = {"messages": USER, "max_tokens": 4000, "stream": True}  # far longer than a test waits


def _start(app, shutdown_timeout_s: float = 30.0) -> tuple[Server, threading.Thread, str]:
    srv = Server(make_config(app, "127.0.0.1", 0, "warning", shutdown_timeout_s=shutdown_timeout_s),
                 on_deadline=app.state.scheduler.close)  # as `fusionrag serve` runs it
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    return srv, thread, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture
def app(tmp_path):
    # no stop token: an answer ends only at max_tokens, so it is still streaming when the test acts
    sched = BatchScheduler(store_factory(tmp_path / "kb", fuse=False), stop_ids=[])
    app = create_app(None, ServerSettings(max_new_tokens=4000), scheduler=sched)
    sched.wait_ready(120)
    yield app
    sched.close()


def test_a_stream_open_at_sigterm_ends_with_an_error_event_then_done(app):
    srv, thread, url = _start(app, shutdown_timeout_s=2.0)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=LONG, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["object"] == "chat.completion.chunk"
        srv.handle_exit(signal.SIGTERM, None)  # the first SIGTERM: wait, then end the open requests
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    thread.join(30)
    assert not thread.is_alive()
    assert rest[-1] == "[DONE]"
    assert "error" in json.loads(rest[-2])


def test_a_client_that_goes_away_cancels_its_request(app):
    srv, thread, url = _start(app)
    try:
        sched = app.state.scheduler
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=LONG, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 20  # closed mid-answer: cancelled at a following decode step
        while not sched.stats.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sched.stats.cancelled == 1 and sched.stats.completed == 0
        assert sched.active == 0
    finally:
        srv.should_exit = True
        thread.join(30)
