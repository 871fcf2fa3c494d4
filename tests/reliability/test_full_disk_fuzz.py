"""The document routes fuzzed on a really full disk: a store on a small tmpfs filled to the last byte, a live
server on 127.0.0.1, schemathesis' bodies for ``POST /v1/documents`` and deletes of jobs and documents. No
answer may be a 500 (a disk fault is 507/409/503, or a job that fails naming the full disk), the server stays
up, and once space is freed the same documents go in and the store verifies. Needs root to mount the tmpfs
(skipped, saying so, elsewhere)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (the 'dev' extra)")
import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusionrag.serve.app import create_app  # noqa: E402
from fusionrag.serve.server_thread import ServerThread  # noqa: E402
from fusionrag.serve.settings import ServerSettings  # noqa: E402
from serve_helpers import store_factory  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = 120
STATUSES: list[int] = []


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(folder: Path) -> Path:
    """Write a file until the disk is full (ENOSPC); the file is returned so that space can be freed."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with contextlib.suppress(OSError), filler.open("ab") as f:  # the last partial block
        while True:
            f.write(b"\0")
            f.flush()
    return filler


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    with _tmpfs(tmp_path_factory.mktemp("disk") / "mnt", "48m") as disk:
        app = create_app(store_factory(disk / "kb"), ServerSettings(
            default_max_tokens=2, max_documents=8, max_document_chars=400, max_job_chunks=16, max_job_tokens=4096,
            preprocess_top_n=2))
        app.state.scheduler.wait_ready(120)
        with ServerThread(app) as server:
            filler = _fill(disk)
            yield server, app, filler


@pytest.fixture(scope="module")
def api_schema(full):
    return schemathesis.openapi.from_url(f"{full[0].base_url}/openapi.json")


def _wait(client: httpx.Client, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    job = client.get(f"/v1/documents/{job_id}").json()
    while job.get("status") in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.get(f"/v1/documents/{job_id}").json()
    return job


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_no_document_request_on_a_full_disk_is_a_server_error(full, api_schema, data):
    server = full[0]
    case = data.draw(api_schema["/v1/documents"]["POST"].as_strategy())
    response = case.call(base_url=server.base_url, timeout=30)
    STATUSES.append(response.status_code)
    assert response.status_code < 500 or response.status_code in (503, 507), response.text[:300]
    if response.status_code == 202:  # the job runs on the full disk, and is deleted again
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            job = _wait(client, response.json()["id"])
            assert job["status"] in ("ready", "failed"), job
            gone = client.delete(f"/v1/documents/{job['id']}")
            STATUSES.append(gone.status_code)
            assert gone.status_code < 500 or gone.status_code in (503, 507), gone.text[:300]


def test_a_job_on_a_full_disk_names_it_and_goes_in_once_space_is_freed(full):
    from fusionrag.offline.verify import verify_store

    server, app, filler = full
    docs = [{"id": "zebra", "title": "Zebras", "text": "Zebras are African equines with black-and-white stripes."}]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        posted = client.post("/v1/documents", json=docs)
        if posted.status_code == 202:
            job = _wait(client, posted.json()["id"])
            assert job["status"] == "failed" and "disk space" in job["error"], job
            assert client.delete(f"/v1/documents/{job['id']}").status_code in (200, 404, 507)
        else:
            assert posted.status_code == 507, posted.text
        filler.unlink()
        posted = client.post("/v1/documents", json=docs)
        assert posted.status_code == 202, posted.text
        job = _wait(client, posted.json()["id"])
        assert job["status"] == "ready", job
        store = app.state.scheduler.engine.store
        report = app.state.scheduler.run_task(verify_store, store).result(timeout=120)
        assert report.ok, report.problems
    print(f"full-disk fuzz: {len(STATUSES)} requests, by status "
          f"{sorted({s: STATUSES.count(s) for s in set(STATUSES)}.items())}")
