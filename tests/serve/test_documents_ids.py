"""POST /v1/documents with ids (the same id replaces), GET /v1/documents (list), DELETE by job or document id."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from fusionrag.prompt import passage_hash
from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import store_factory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = create_app(store_factory(tmp_path_factory.mktemp("kb") / "kb"), ServerSettings(default_max_tokens=4))
    app.state.scheduler.wait_ready(120)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client


def _finished(client, body):
    r = client.post("/v1/documents", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    deadline = time.monotonic() + 60
    while job["status"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.get(f"/v1/documents/{job['id']}").json()
    assert job["status"] == "ready", job
    return job


def _listed(client):
    r = client.get("/v1/documents")
    assert r.status_code == 200 and r.json()["object"] == "list"
    return {d["id"]: d for d in r.json()["data"]}


def test_the_same_id_replaces_the_document_and_a_document_id_can_be_deleted(served):
    app, client = served
    store = app.state.scheduler.engine.store
    first = _finished(client, [{"id": "zebra-facts", "title": "Zebras", "text": "Zebras are striped horses."}])
    doc = _listed(client)["zebra-facts"]
    assert (doc["object"], doc["origin"], doc["chunks"], doc["title"]) == ("document", "passages", 1, "Zebras")
    second = _finished(client, [{"id": "zebra-facts", "title": "Zebras", "text": "Zebras are striped equids."}])
    assert store.find_by_hash(passage_hash("Zebras", "Zebras are striped horses.")) is None  # the old version
    assert first["chunk_ids"][0] not in store.chunk_ids() and second["chunk_ids"][0] in store.chunk_ids()
    assert client.get("/v1/documents/zebra-facts").json()["chunks"] == 1
    r = client.delete("/v1/documents/zebra-facts")
    assert r.status_code == 200 and r.json() == {"id": "zebra-facts", "object": "document", "deleted": True,
                                                 "chunks_removed": 1, "fused_kv_recomputed": 0}
    assert "zebra-facts" not in _listed(client) and second["chunk_ids"][0] not in store.chunk_ids()
    for method in (client.get, client.delete):
        r = method("/v1/documents/zebra-facts")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_without_ids_a_job_is_one_document_and_deleting_the_job_deletes_all_it_named(served):
    app, client = served
    store = app.state.scheduler.engine.store
    job = _finished(client, [{"title": "Okapi", "text": "The okapi is a forest giraffe."},
                             {"id": "lions", "title": "Lions", "text": "Lions live in prides."}])
    listed = _listed(client)
    assert listed[f"api:{job['id']}"]["chunks"] == 1 and listed["lions"]["chunks"] == 1
    r = client.delete(f"/v1/documents/{job['id']}")
    assert r.status_code == 200 and r.json()["status"] == "deleted"
    assert not {f"api:{job['id']}", "lions"} & set(_listed(client))
    assert not set(job["chunk_ids"]) & set(store.chunk_ids())


def test_a_posted_source_is_split_like_ingest_split_that_file(served):
    app, client = served
    store = app.state.scheduler.engine.store
    job = _finished(client, [{"id": "notes", "text": "# Tigers\nTigers are big cats.\n# Wolves\nWolves howl.",
                              "source": "/docs/notes.md"}])
    assert [store.chunk(c).title for c in job["chunk_ids"]] == ["Tigers", "Wolves"]
    assert _listed(client)["notes"]["source"] == "/docs/notes.md"
    store_path_id = "/srv/docs/a.txt"  # ids may be paths: the route takes slashes
    _finished(client, [{"id": store_path_id, "text": "A path-like id."}])
    assert client.get(f"/v1/documents/{store_path_id}").json()["id"] == store_path_id
    assert client.delete(f"/v1/documents/{store_path_id}").status_code == 200


def test_a_job_waits_while_another_process_writes_and_chats_are_served_meanwhile(served):
    """Another writer (a CLI ingest: the store's lock held from another file handle) makes the job wait,
    saying so, without holding the model thread: a chat is answered meanwhile; the job finishes after."""
    import threading

    from fusionrag.retrieval.store_files import writer_lock

    app, client = served
    store = app.state.scheduler.engine.store
    held, release = threading.Event(), threading.Event()

    def other_writer():
        with writer_lock(store.path, timeout_s=10):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=other_writer, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        r = client.post("/v1/documents", json=[{"id": "okapi", "text": "Okapis are relatives of giraffes."}])
        assert r.status_code == 202
        job_id = r.json()["id"]
        deadline = time.monotonic() + 20
        job = client.get(f"/v1/documents/{job_id}").json()
        while not job["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
            job = client.get(f"/v1/documents/{job_id}").json()
        assert job["status"] == "running" and "another process is writing" in job["waiting"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi?"}]})
        assert chat.status_code == 200  # the model thread is free while the job waits
        assert client.get(f"/v1/documents/{job_id}").json()["status"] == "running"
    finally:
        release.set()
        thread.join(10)
    deadline = time.monotonic() + 60
    while job["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.get(f"/v1/documents/{job_id}").json()
    assert job["status"] == "ready" and job["waiting"] is None and job["chunk_ids"], job


def test_a_delete_while_a_job_is_in_progress_is_a_409_at_once_and_deletes_nothing(served):
    """Before: an API DELETE held its HTTP call 276 s behind a document job (its re-fuse did the job's own
    preprocessing). Now it is refused at once, naming the job; once the job is ready the same call deletes."""
    from fusionrag.retrieval.store_files import writer_lock

    app, client = served
    store = app.state.scheduler.engine.store
    _finished(client, [{"id": "giraffes", "title": "Giraffes", "text": "Giraffes have long necks."}])
    with writer_lock(store.path, timeout_s=5):  # another process writes: the job waits, still running
        job = client.post("/v1/documents", json=[{"title": "Hippos", "text": "Hippos spend days in water."}]).json()
        r = client.delete("/v1/documents/giraffes")  # held behind the job, this call would never return here
        assert r.status_code == 409 and job["id"] in r.json()["error"]["message"]
        assert "giraffes" in _listed(client)
    deadline = time.monotonic() + 60
    while client.get(f"/v1/documents/{job['id']}").json()["status"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.delete("/v1/documents/giraffes").status_code == 200 and "giraffes" not in _listed(client)
