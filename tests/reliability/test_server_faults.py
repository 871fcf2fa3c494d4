"""The fault battery, server side: job starvation, damaged KV under a live server, kill -9 during a
document job, an ingest and a preprocess (real subprocesses, killed by PID), overlapping deletes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from fusionrag.models import load_model
from fusionrag.offline.verify import verify_store
from fusionrag.prompt import passage_hash
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings
from serve_helpers import USER, store_factory

BIG = [{"title": f"Doc {i}", "text": f"document {i} is about subject {i % 7} and carries detail {i * 13}."}
       for i in range(40)]


def _wait_job(client, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    job = client.get(f"/v1/documents/{job_id}").json()
    while job["status"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.get(f"/v1/documents/{job_id}").json()
    return job


def test_a_chat_is_answered_within_a_bounded_number_of_job_slices(tmp_path):
    """Before: a job ran as one task on the model thread; a chat waited 600 s and got 504."""
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=4))
    sched, jobs = app.state.scheduler, app.state.jobs
    sched.wait_ready(120)
    with TestClient(app) as client:
        gate = sched.run_task(time.sleep, 0.5)  # hold the model thread so the job and the chat both queue
        job_id = client.post("/v1/documents", json={"documents": BIG}).json()["id"]
        before = jobs.get(job_id).slices
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "method": "reuse"})
        assert r.status_code == 200, r.text
        gate.result(10)
        job = jobs.get(job_id)
        # a 4-token answer: one slice before its prefill, one per decode step, plus one of slack
        assert job.status == "running" and job.slices - before <= 4 + 2, (job.status, job.slices)
        assert _wait_job(client, job_id)["status"] == "ready"
        assert jobs.get(job_id).slices > 10  # the job really was cut into many slices
    sched.close()


def test_a_damaged_kv_entry_is_answered_around_and_reported_without_paths(tmp_path):
    """Before: a corrupted entry was a 400 invalid_request_error carrying the store's file path."""
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=4, memory_budget_mb=0))
    sched = app.state.scheduler
    sched.wait_ready(120)
    sched.run_task(lambda: None).result(60)  # after the start's own store tasks: its stale-KV check re-fuses
    with TestClient(app) as client:           # entries that do not verify, and would mend the damage below
        store = sched.engine.store
        for cid in store.chunk_ids():
            path = store.kv_path(cid, "fused")
            path.write_bytes(path.read_bytes()[:-40])
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "retrieval_top_k": 2,
                                                      "kv": "fused", "method": "fusionrag"})
        assert r.status_code == 200, r.text
        assert r.json()["fusionrag"]["fused_fallbacks"] == 2  # answered from freshly computed plain KV
        assert sched.engine.stats()["damaged_entries"] == 2
        assert str(tmp_path) not in r.text
    sched.close()


def test_overlapping_document_jobs_delete_only_their_own_passages(tmp_path):
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2))
    sched = app.state.scheduler
    sched.wait_ready(120)
    a, b, c, d = ({"title": t, "text": f"passage {t} only"} for t in "ABCD")
    with TestClient(app) as client:
        j1 = _wait_job(client, client.post("/v1/documents", json=[a, b]).json()["id"])
        j2 = _wait_job(client, client.post("/v1/documents", json=[c, d, a]).json()["id"])
        assert client.delete(f"/v1/documents/{j1['id']}").json()["status"] == "deleted"
        store = sched.engine.store
        assert set(j2["chunk_ids"]) <= set(store.chunk_ids()) and j1["chunk_ids"][1] not in store.chunk_ids()
        assert client.get(f"/v1/documents/{j2['id']}").json()["status"] == "ready"
    sched.close()


# ------------------------------------------------------------------- real processes, killed by PID


def _cli(*args: str, env: dict) -> list[str]:
    return [sys.executable, "-m", "fusionrag.cli", *args]


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "FUSIONRAG_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}


def _corpus(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"title": f"P{i}", "text": f"passage {i} on theme {i % 5}, fact {i * 7}."})
                            + "\n" for i in range(n)))
    return path


def _kill_when(proc: subprocess.Popen, ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the process finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _kv_files(store: Path, kind: str) -> int:
    return len(list((store / "kv").glob(f"*/*.{kind}.safetensors")))


@pytest.mark.slow  # seconds of real subprocesses
@pytest.mark.parametrize("stage", ["ingest", "preprocess"])
def test_kill_9_during_ingest_or_preprocess_then_rerun_completes_a_verified_store(tmp_path, stage):
    env, kb = _env(tmp_path), tmp_path / "kb"
    corpus = _corpus(tmp_path / "c.jsonl", 60)
    ingest = _cli("ingest", str(corpus), "--store", str(kb), "--model", "tiny-llama", "--embedder", "hashing-64",
                  "--kv-dtype", "float32", "--quiet", env=env)
    preprocess = _cli("preprocess", "--store", str(kb), "--top-n", "3", "--quiet", env=env)
    if stage == "preprocess":
        subprocess.run(ingest, env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.Popen(ingest if stage == "ingest" else preprocess, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kind = "plain" if stage == "ingest" else "fused"
    _kill_when(proc, lambda: _kv_files(kb, kind) >= 5)
    assert _kv_files(kb, kind) < 60  # really interrupted
    for argv in ([ingest] if stage == "ingest" else [preprocess]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    store = KnowledgeStore.open(kb, load_model("tiny-llama"), embedder=HashingEmbedder(64))
    report = verify_store(store)
    assert report.ok and len(store.chunk_ids()) == 60 and _kv_files(kb, kind) == 60, report.problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(kb: Path, port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(_cli("serve", "--store", str(kb), "--port", str(port), "--log-level", "error", env=env),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the server exited"
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


@pytest.mark.slow  # seconds of real subprocesses
def test_kill_9_during_a_document_job_and_the_restarted_server_finishes_it(tmp_path):
    """Before: a server killed during a job lost it (333 chunks without plain KV, 773 without fused KV)."""
    env, kb = _env(tmp_path), tmp_path / "kb"
    subprocess.run(_cli("ingest", str(_corpus(tmp_path / "c.jsonl", 6)), "--store", str(kb), "--model", "tiny-llama",
                        "--embedder", "hashing-64", "--quiet", env=env), env=env, check=True, capture_output=True)
    subprocess.run(_cli("preprocess", "--store", str(kb), "--top-n", "2", "--quiet", env=env), env=env, check=True,
                   capture_output=True)
    port = _free_port()
    server = _serve(kb, port, env)
    try:
        url = f"http://127.0.0.1:{port}"
        job_id = httpx.post(f"{url}/v1/documents", json={"documents": BIG}, timeout=30).json()["id"]
        _kill_when(server, lambda: _kv_files(kb, "plain") >= 16)
    finally:
        if server.poll() is None:
            server.kill()
    server = _serve(kb, port, env)
    try:
        deadline, job = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            job = httpx.get(f"{url}/v1/documents/{job_id}", timeout=10).json()
            if job.get("status") not in ("pending", "running"):
                break
            time.sleep(0.2)
        assert job["status"] == "ready", job
        assert len(job["chunk_ids"]) == len(BIG)
    finally:
        server.kill()
        server.wait(30)
    store = KnowledgeStore.open(kb, load_model("tiny-llama"), embedder=HashingEmbedder(64))
    assert verify_store(store).ok and all(store.has_kv(c, "fused") for c in store.chunk_ids())


def test_a_job_too_large_is_413_before_anything_is_queued(tmp_path):
    """Before: one 1 MiB request could enqueue ~1,000 chunks, and 16 such jobs were accepted."""
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(max_job_chunks=6, max_job_tokens=10_000))
    sched = app.state.scheduler
    sched.wait_ready(120)
    with TestClient(app) as client:
        n = len(sched.engine.store.chunk_ids())
        r = client.post("/v1/documents", json={"documents": BIG[:10]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "job_too_large", r.text
        assert client.post("/v1/documents", json={"documents": BIG[:3]}).status_code == 202
        assert app.state.jobs.counts().get("pending", 0) + app.state.jobs.counts().get("running", 0) <= 1
        assert len(sched.engine.store.chunk_ids()) <= n + 3
    sched.close()


def test_deleting_a_failed_job_removes_what_it_had_added(tmp_path, monkeypatch):
    """Before: a job that failed mid-way (the disk filled) answered DELETE with 200 'deleted', but the passages
    it had already added stayed in the database and the index, were still retrieved, and the job stayed
    'failed'. Now the deletion removes them, and the job records it."""
    import errno

    from fusionrag.serve import documents

    real_add = documents.build.add_passages
    calls = {"n": 0}

    def add_then_fail(*args, **kwargs):
        calls["n"] += str(kwargs.get("doc", "")).startswith("api:")  # the job's slices, not the store's build
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "kb" / "kv"))
        return real_add(*args, **kwargs)

    monkeypatch.setattr(documents.build, "add_passages", add_then_fail)
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2))
    app.state.scheduler.wait_ready(120)
    texts = [f"Zebra {i} grazes on grass." for i in range(12)]  # short: one chunk each (byte tokenizer)
    with TestClient(app, raise_server_exceptions=False) as client:
        job = _wait_job(client, client.post("/v1/documents", json=[{"title": "Z", "text": t} for t in texts]
                                            ).json()["id"])
        assert job["status"] == "failed" and "out of disk space" in job["error"]
        store = app.state.scheduler.engine.store
        added = [store.find_by_hash(passage_hash("Z", t)) for t in texts]
        assert sum(c is not None for c in added) == documents.PASSAGES_PER_SLICE  # the first slice got in
        r = client.delete(f"/v1/documents/{job['id']}")
        assert r.status_code == 200 and r.json()["status"] == "deleted"
        assert all(store.find_by_hash(passage_hash("Z", t)) is None for t in texts)
        assert not set(store.search("zebra grazes on grass", 5)) & {c for c in added if c is not None}
        assert client.get(f"/v1/documents/{job['id']}").json()["status"] == "deleted"
        assert [status for job_id, status, _ in store.jobs.all() if job_id == job["id"]] == ["deleted"]


def test_a_half_sent_request_is_closed_and_a_second_sigterm_forces_the_exit(tmp_path):
    """Before: a half-sent request held its connection forever; a second SIGTERM did not force an exit."""
    from fusionrag.serve.http import Server, make_config

    app = create_app(store_factory(tmp_path / "kb", fuse=False), ServerSettings(default_max_tokens=2))
    app.state.scheduler.wait_ready(120)
    with ServerThread(app, header_timeout_s=1.0) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
            t0 = time.monotonic()
            assert s.recv(1024) == b"" and time.monotonic() - t0 < 5  # closed by the server, not the client
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /health HT")  # half a request line
            assert s.recv(1024) == b""
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # whole requests still served
    srv = Server(make_config(app, "127.0.0.1", 0))
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.should_exit and not srv.force_exit  # the first waits for open requests (up to the timeout)
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.force_exit


def test_open_streams_are_ended_before_the_shutdown_deadline_cuts_them():
    """Before: SIGTERM waited for open streams with no limit. Now the first waits up to the shutdown timeout,
    and shortly before it the open requests are ended (the scheduler's close: a final SSE error event)."""
    import asyncio
    import threading

    from fusionrag.serve.http import Server, make_config

    ended = threading.Event()

    async def forever(scope, receive, send):  # an answer that would never finish on its own
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})  # lifespan.startup / lifespan.shutdown
                if kind == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while not ended.is_set():
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b'data: {"error": "shutting down"}\n\n', "more_body": False})

    srv = Server(make_config(forever, "127.0.0.1", 0, "warning", shutdown_timeout_s=2.0), on_deadline=ended.set)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    with httpx.stream("GET", f"http://127.0.0.1:{port}/", timeout=10) as r:
        t0 = time.monotonic()
        srv.should_exit = True  # what the first SIGTERM does
        body = b"".join(r.iter_bytes())
    assert ended.is_set() and b"shutting down" in body and time.monotonic() - t0 < 5
    thread.join(10)
    assert not thread.is_alive()


def _whole_response(sock: socket.socket) -> bytes:
    """One HTTP response read to its last byte (headers and body can arrive in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(4096)
    return data


def test_sigterm_lets_the_in_flight_answer_finish_and_closes_idle_keep_alive_connections_at_once(tmp_path):
    """Issue 47: SIGTERM with a keep-alive client attached waited and then failed the in-flight request. The
    answer being computed finishes (200, whole), the idle keep-alive connection is closed at once, and the
    server exits as soon as the answer is out, well before the shutdown deadline."""
    import threading

    from fusionrag.serve.http import Server, make_config

    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2, max_new_tokens=1000))
    sched = app.state.scheduler
    sched.wait_ready(120)
    sched.stop_ids = set()  # no end of turn: the answer runs its max_tokens, long enough to be in flight
    srv = Server(make_config(app, "127.0.0.1", 0, "warning", shutdown_timeout_s=60.0), on_deadline=sched.close)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    idle = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in _whole_response(idle)  # served, and kept alive
    result = {}

    def ask():
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Who discovered polonium?"}], "max_tokens": 400})
        result.update(status=r.status_code, tokens=r.json().get("usage", {}).get("completion_tokens"))

    asking = threading.Thread(target=ask)
    asking.start()
    while not sched.active and asking.is_alive():
        time.sleep(0.01)
    t0 = time.monotonic()
    srv.handle_exit(signal.SIGTERM, None)
    assert idle.recv(4096) == b"" and time.monotonic() - t0 < 5  # the idle connection closed at once
    asking.join(120)
    thread.join(60)
    assert result == {"status": 200, "tokens": 400}
    assert not thread.is_alive() and time.monotonic() - t0 < 50  # exited after the answer, not at the deadline
