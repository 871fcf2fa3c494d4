"""The fault battery, store side: corrupt, truncate or delete each kind of store file; two writers;
overlapping document deletes. Each case states what used to happen and checks what must happen now.
"""

from __future__ import annotations

import json
import threading

import pytest

from fusionrag.cli import main
from fusionrag.errors import StoreBusyError
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.offline.verify import verify_store
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore

PASSAGES = [{"title": f"T{i}", "text": f"passage number {i} talks about topic {i % 4} and item {i}."}
            for i in range(24)]


@pytest.fixture
def lm():
    return load_model("tiny-llama")


def _store(path, lm, fuse: bool = False) -> KnowledgeStore:
    store = build.create_store(path, lm, kv_dtype="float32", embedder=HashingEmbedder(64), model_source="tiny-llama")
    build.add_passages(store, lm, PASSAGES, doc="corpus")
    if fuse:
        build.fuse(store, lm, top_n=2, progress=False)
    return store


def _reopen(path, lm) -> KnowledgeStore:
    return KnowledgeStore.open(path, lm, embedder=HashingEmbedder(64))


def test_random_bytes_in_the_index_are_detected_and_the_index_rebuilt(tmp_path, lm):
    """Before: 30 KB of random bytes at offset 200 of index.faiss gave wrong chunks with exit 0."""
    store = _store(tmp_path / "kb", lm)
    query = "passage number 3 talks about topic 3 and item 3."
    expected = store.search(query, 5)
    store.close()
    index = tmp_path / "kb" / "index.faiss"
    data = bytearray(index.read_bytes())
    data[200:200 + 3000] = bytes((i * 97 + 13) % 256 for i in range(3000))
    index.write_bytes(bytes(data))
    reopened = _reopen(tmp_path / "kb", lm)
    assert reopened.search(query, 5) == expected
    assert verify_store(reopened).ok


def test_deleting_one_job_keeps_passages_another_job_shares(tmp_path, lm):
    """Before: job 1 posts A, B; job 2 posts C, D, A; deleting job 1 removed A from job 2 too."""
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    a, b, c, d = ({"title": t, "text": f"{t} text"} for t in "ABCD")
    job1 = build.add_passages(store, lm, [a, b], doc="api:1")
    job2 = build.add_passages(store, lm, [c, d, a], doc="api:2")
    assert job2[2] == job1[0]  # A is one chunk, used by both
    removed = build.delete_document(store, "api:1")
    assert removed == [(job1[1], "plain"), (job1[1], "fused")]  # only B
    assert set(job2) <= set(store.chunk_ids()) and store.search("A text", 1) == [job1[0]]
    assert store.has_kv(job1[0], "plain")
    build.delete_document(store, "api:2")
    assert store.chunk_ids() == []


def test_a_second_writer_waits_then_gets_a_clear_error(tmp_path, lm):
    """Before: 'fusionrag ingest' into a served store interleaved writes (KeyError, index 23 of 43 vectors)."""
    store = _store(tmp_path / "kb", lm)
    other = _reopen(tmp_path / "kb", lm)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.writer():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(10)
    try:
        with pytest.raises(StoreBusyError, match="being written by pid"), other.writer(timeout_s=0.3):
            pass
    finally:
        release.set()
        t.join(10)


def test_a_reader_sees_another_process_s_writes_before_its_next_use(tmp_path, lm):
    server_view = _store(tmp_path / "kb", lm)
    n = len(server_view.chunk_ids())
    writer = _reopen(tmp_path / "kb", lm)  # another process: its own connection
    new_ids = build.add_passages(writer, lm, [{"title": "New", "text": "a brand new passage about zebras"}])
    assert server_view.refresh() is True and server_view.refresh() is False
    assert len(server_view.index) == n + 1
    assert server_view.search("a brand new passage about zebras", 1) == new_ids
    # the reader can write next without tripping over the other's chunk ids
    more = build.add_passages(server_view, lm, [{"title": "More", "text": "and one more about giraffes"}])
    assert more[0] == new_ids[0] + 1 and len(server_view.index) == n + 2 and verify_store(server_view).ok


def test_a_deleted_metadata_file_never_lets_old_kv_files_be_reused(tmp_path, lm):
    """Before: store.sqlite deleted, KV files left: re-ingest reused them (plain_computed 0), every ask failed."""
    _store(tmp_path / "kb", lm).close()
    (tmp_path / "kb" / "store.sqlite").unlink()
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    corpus = tmp_path / "other.jsonl"
    corpus.write_text("".join(json.dumps({"title": f"O{i}", "text": f"other text {i}"}) + "\n" for i in range(5)))
    report = build.ingest(store, lm, [corpus], progress=False)
    assert report.plain_computed == report.new_chunks == 5
    assert verify_store(store).ok


def test_a_corrupted_metadata_file_is_one_line_and_exit_4(tmp_path, lm, capsys):
    """Before: a Python traceback and exit 1 in ask, store info and serve."""
    _store(tmp_path / "kb", lm).close()
    db = tmp_path / "kb" / "store.sqlite"
    for extra in ("-wal", "-shm"):
        (tmp_path / "kb" / f"store.sqlite{extra}").unlink(missing_ok=True)
    data = bytearray(db.read_bytes())
    data[100:4096] = b"\x5a" * (4096 - 100)
    db.write_bytes(bytes(data))
    for argv in (["store", "info", "--store", str(tmp_path / "kb")],
                 ["ask", "what?", "--store", str(tmp_path / "kb")],
                 ["store", "verify", "--store", str(tmp_path / "kb")]):
        assert main(argv) == 4, argv  # 4: a store that failed an integrity check
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("fusionrag: error: ") and "corrupted" in last and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1  # ask checks the store before it says what it loads


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "orphan", "temp"])
def test_verify_reports_each_broken_kv_file_and_repair_mends_it(tmp_path, lm, damage, capsys):
    """Before: a truncated or flipped KV file was counted by 'store info' and 'skipped' by preprocess forever."""
    store = _store(tmp_path / "kb", lm, fuse=True)
    path = store.kv_path(5, "fused")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-64])
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "delete":
        path.unlink()
    elif damage == "orphan":
        (path.parent / "999.plain.safetensors").write_bytes(path.read_bytes())
    else:
        (path.parent / ".5.fused.safetensors.123.tmp").write_bytes(b"half")
    report = verify_store(store)
    assert not report.ok and len(report.problems) == 1
    if damage in ("truncate", "flip"):
        # preprocess alone re-creates an entry that fails verification instead of skipping it
        assert build.fuse(store, lm, progress=False).computed == 1
        assert verify_store(store).ok
        return
    store.close()
    assert main(["store", "verify", "--store", str(tmp_path / "kb"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert main(["store", "verify", "--store", str(tmp_path / "kb"), "--repair", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["store", "verify", "--store", str(tmp_path / "kb"), "--json"]) == 0


@pytest.mark.parametrize("what", ["fifo", "symlink", "huge", "padded"])
def test_a_kv_path_that_is_not_an_entry_is_never_read(tmp_path, lm, what, caplog):
    """Before: a KV path that was not a regular file, or was absurdly large, was read whole before its header
    was checked: `store verify` could block on a FIFO or grow without bound on a huge file, and the server
    read such a file on every request; then a symlinked one fell back without a word. Now: checked (type, then
    size against the header) before reading; verify reports it, answering computes the chunk's KV and names
    the entry on stderr (once)."""
    import os
    import resource

    from fusionrag.online.engine import Engine

    store = _store(tmp_path / "kb", lm, fuse=True)
    path = store.kv_path(5, "fused")
    good = path.read_bytes()
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    elif what == "symlink":
        (tmp_path / "elsewhere.safetensors").write_bytes(good)
        os.symlink(tmp_path / "elsewhere.safetensors", path)
    elif what == "huge":
        path.write_bytes(good)
        os.truncate(path, 6 << 30)  # sparse: 6 GiB on paper, nothing on disk
    else:
        path.write_bytes(good + b"\0" * 4096)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = verify_store(store)
    assert not report.ok and any("chunk 5" in p.what for p in report.problems)
    assert store.kv.header(5, "fused") is None and (what != "fifo" or not store.has_kv(5, "fused"))
    engine = Engine(store, lm)
    res = engine.answer("topic 1 item 5", method="fusionrag", ratio=0.15, kv="fused",
                        chunks=[{"title": "T5", "text": PASSAGES[5]["text"]}], max_new_tokens=2)
    assert res.fused_fallbacks == 1  # answered from freshly computed plain KV, the path never trusted
    named = [r.getMessage() for r in caplog.records if "chunk 5" in r.getMessage()]
    assert len(named) == 1 and "verify --repair" in named[0]
    assert what not in ("fifo", "symlink") or str(path) in named[0]
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 512 * 1024  # nothing near the file's claimed size was read into memory
    store.close()


def test_a_symlinked_instruction_kv_is_found_by_verify_and_answered_around(tmp_path, lm, caplog):
    """Before: kv/system.safetensors replaced by a symlink to a good copy passed `store verify` (and answering
    silently took it for "not computed")."""
    from fusionrag.online.engine import Engine

    store = _store(tmp_path / "kb", lm, fuse=True)
    system = store.kv_path(None, "system")
    (tmp_path / "copy.safetensors").write_bytes(system.read_bytes())
    system.unlink()
    system.symlink_to(tmp_path / "copy.safetensors")
    report = verify_store(store)
    assert not report.ok and "not a regular file" in report.problems[0].why
    assert Engine(store, lm).answer("topic 3?", method="fusionrag", top_k=3, max_new_tokens=2).context_tokens > 0
    assert "system prompt KV" in caplog.text and "not a regular file" in caplog.text
    assert verify_store(store, lm, repair=True).ok and not system.is_symlink() and verify_store(store).ok
    store.close()


def test_a_damaged_instruction_kv_is_found_by_verify_mended_by_repair_and_answered_around(tmp_path, lm):
    """Before: 1 MB appended to kv/system.safetensors: verify said ok, ask exited 4, verify --repair exited 4 too."""
    from fusionrag.online.engine import Engine

    store = _store(tmp_path / "kb", lm, fuse=True)
    system = store.kv_path(None, "system")
    assert system.exists()
    store.close()
    with system.open("ab") as f:
        f.write(b"\x00junk" * 200_000)
    store = _reopen(tmp_path / "kb", lm)
    report = verify_store(store)
    assert not report.ok and [p.what for p in report.problems] == ["system prompt KV"]
    answer = Engine(store, lm).answer("topic 3?", method="fusionrag", top_k=3, max_new_tokens=2)  # answered around
    assert answer.context_tokens > 0
    repaired = verify_store(store, lm, repair=True)
    assert repaired.ok and repaired.problems[0].repaired == "recomputed"
    assert verify_store(_reopen(tmp_path / "kb", lm)).ok and store.load_system_kv() is not None


def test_a_delete_whose_re_fuse_never_ran_is_found_by_verify_and_finished_by_repair(tmp_path, lm):
    """Before: kill -9 of `fusionrag delete` after its commit left the neighbours' fused KV built on the deleted
    text forever: the rerun said "no document" and verify said ok."""
    store = _store(tmp_path / "kb", lm, fuse=True)
    extra = [{"title": f"X{i}", "text": f"passage number {i} talks about topic {i % 4} and more item {i}."}
             for i in range(6)]
    build.add_passages(store, lm, extra, doc="extra")
    build.fuse(store, lm, progress=False)
    assert verify_store(store).ok
    build.delete_document(store, "extra")  # committed; the re-fuse that follows in `delete` never runs
    report = verify_store(store)
    stale = [p for p in report.problems if "stale" in p.why]
    assert stale and not report.ok
    assert verify_store(store, lm, repair=True).ok and verify_store(store).ok


def test_deleting_a_document_through_the_api_re_fuses_its_neighbours(tmp_path, lm):
    """Before: DELETE /v1/documents/{id} left the neighbours' fused KV built on the deleted text."""
    from fusionrag.online.engine import Engine
    from fusionrag.serve.documents import delete_stored_document

    store = _store(tmp_path / "kb", lm, fuse=True)
    build.add_passages(store, lm, [{"title": "X", "text": "passage number 3 talks about topic 3, an extra."}],
                       doc="extra")
    build.fuse(store, lm, progress=False)
    result = delete_stored_document(Engine(store, lm), "extra")
    assert result["deleted"] and result["fused_kv_recomputed"] > 0
    assert verify_store(store).ok


def test_verify_checks_the_documents_table_against_the_chunks(tmp_path, lm):
    """A chunk no document uses and a reference to a missing chunk (a run stopped between its steps) are named,
    and repaired."""
    import sqlite3

    store = _store(tmp_path / "kb", lm)
    store.close()
    db = sqlite3.connect(tmp_path / "kb" / "store.sqlite")
    first = db.execute("SELECT MIN(chunk_id) FROM chunk_refs").fetchone()[0]
    db.execute("DELETE FROM chunk_refs WHERE chunk_id = ?", (first,))
    db.execute("INSERT INTO chunk_refs(chunk_id, doc) VALUES (999999, 'corpus')")
    db.commit()
    db.close()
    store = _reopen(tmp_path / "kb", lm)
    report = verify_store(store)
    assert {p.kind for p in report.problems} == {"documents"} and len(report.problems) == 2
    assert verify_store(store, lm, repair=True).ok and verify_store(_reopen(tmp_path / "kb", lm)).ok


def test_the_next_delete_or_server_start_finishes_a_re_fuse_a_killed_delete_left(tmp_path, lm, capsys):
    """Before: the rerun of a `delete` killed after its commit said "no document" and left the neighbours' fused
    KV stale; now the next writer (a CLI delete, a starting server) finishes that work first."""
    from fastapi.testclient import TestClient

    from fusionrag.online.engine import Engine
    from fusionrag.serve.app import create_app
    from fusionrag.serve.settings import ServerSettings

    extra = [{"title": f"X{i}", "text": f"passage number {i} talks about topic {i % 4} and more item {i}."}
             for i in range(6)]
    for name, finish in (("cli", "delete"), ("server", "start")):
        store = _store(tmp_path / name, lm, fuse=True)
        build.add_passages(store, lm, extra, doc="extra")
        build.fuse(store, lm, progress=False)
        build.delete_document(store, "extra")  # committed; the process dies before its re-fuse
        assert not verify_store(store).ok
        store.close()
        if finish == "delete":
            code = main(["delete", "--store", str(tmp_path / name), "extra", "--model", "tiny-llama", "--quiet"])
            err = capsys.readouterr().err
            assert code == 2 and "no document" in err
            assert "finished what an earlier, interrupted change left undone" in err
        else:
            app = create_app(Engine(_reopen(tmp_path / name, lm), lm), ServerSettings(default_max_tokens=2))
            with TestClient(app, raise_server_exceptions=False) as client:
                app.state.scheduler.wait_ready(60)
                app.state.scheduler.run_task(lambda: None).result(timeout=60)  # after the start's tasks (FIFO)
                assert client.get("/v1/documents").status_code == 200
        assert verify_store(_reopen(tmp_path / name, lm)).ok, name
