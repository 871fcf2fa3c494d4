"""Storage faults are named for what they are: a full disk, a read-only store, an I/O error, and only a
damaged file as "corrupted". Real file systems where the machine allows it: a size-limited tmpfs for a full
disk, a read-only remount for read-only media (root, as on the CI machine; skipped, saying so, elsewhere)."""

from __future__ import annotations

import json
import sqlite3
import subprocess

import pytest

from fusionrag.cli import main
from fusionrag.errors import (
    StorageFullError,
    StorageIOError,
    StoragePermissionError,
    StoreBusyError,
    StoreCorruptedError,
)
from fusionrag.retrieval.store_files import sqlite_fault

INGEST = ["--model", "tiny-llama", "--embedder", "hashing-64", "--quiet"]


@pytest.fixture
def mount(tmp_path):
    """``mount(options)`` -> a fresh tmpfs folder; ``mount.remount(options)`` changes it (size, ro)."""
    where = tmp_path / "fs"
    where.mkdir()

    def run(*args: str) -> None:
        r = subprocess.run(["mount", *args], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'}): the disk-fault tests need it")

    def make(options: str):
        run("-t", "tmpfs", "-o", options, "tmpfs", str(where))
        return where

    make.remount = lambda options: run("-o", f"remount,{options}", str(where))  # type: ignore[attr-defined]
    yield make
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _passages(path, n=300):
    path.write_text("".join(json.dumps({"title": f"T{i}", "text": f"passage {i} " + "word " * 60}) + "\n"
                            for i in range(n)))
    return path


def test_sqlite_errors_are_classified_not_all_called_corruption():
    """Before: any SQLite error, a full disk or a read-only mount included, said 'corrupted ... rebuild'."""
    cases = {"database or disk is full": StorageFullError, "attempt to write a readonly database":
             StoragePermissionError, "disk I/O error": StorageIOError, "database is locked": StoreBusyError,
             "file is not a database": StoreCorruptedError, "database disk image is malformed": StoreCorruptedError}
    for message, kind in cases.items():
        err = sqlite_fault(sqlite3.OperationalError(message), "kb/store.sqlite")
        assert type(err) is kind, message
        assert ("corrupted" in str(err)) == (kind is StoreCorruptedError)


@pytest.mark.parametrize("size", ["600k", "1200k", "2500k"])  # the disk fills in SQLite, the index, the KV files
def test_a_full_disk_is_one_line_exit_3_and_a_rerun_resumes(tmp_path, mount, capsys, fusionrag_home, size):
    """Before: a Python traceback (OSError: [Errno 28], or FAISS's RuntimeError) or 'store.sqlite is
    corrupted', exit 1 or 2."""
    data = _passages(tmp_path / "many.jsonl")
    disk = mount(f"size={size}")
    code = main(["ingest", str(data), "--store", str(disk / "kb"), *INGEST])
    err = capsys.readouterr().err
    assert code == 3 and "out of disk space" in err and "corrupted" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    if size == "2500k":  # full while writing KV: how much more the rest needs
        assert "more are needed for the" in err
    if (disk / "kb" / "store.sqlite").exists():  # something was stored: reading it needs no space
        assert main(["store", "info", "--store", str(disk / "kb")]) == 0
    else:  # a first ingest that stored nothing leaves nothing behind
        assert size != "2500k" and not (disk / "kb").exists()
    capsys.readouterr()
    mount.remount("size=40m")
    assert main(["ingest", str(data), "--store", str(disk / "kb"), *INGEST]) == 0
    assert main(["store", "verify", "--store", str(disk / "kb")]) == 0
    assert " ok" in capsys.readouterr().out


def test_a_read_only_store_answers_and_verifies_and_refuses_writes_clearly(tmp_path, mount, capsys,
                                                                           fusionrag_home):
    """Before: ask, store info, store verify and serve all refused a store on read-only media."""
    data = _passages(tmp_path / "few.jsonl", 12)
    disk = mount("size=40m")
    assert main(["ingest", str(data), "--store", str(disk / "kb"), *INGEST]) == 0
    mount.remount("ro")
    capsys.readouterr()
    assert main(["store", "info", "--store", str(disk / "kb")]) == 0
    assert main(["store", "verify", "--store", str(disk / "kb")]) == 0
    assert main(["ask", "passage 3?", "--store", str(disk / "kb"), "--max-new-tokens", "2", "--json"]) == 0
    capsys.readouterr()
    code = main(["ingest", str(data), "--store", str(disk / "kb"), *INGEST])
    err = capsys.readouterr().err
    assert code == 3 and "read-only" in err and "corrupted" not in err and len(err.strip().splitlines()) == 1


def test_the_server_on_a_read_only_store_answers_chats_and_refuses_documents(tmp_path, mount, fusionrag_home):
    from fastapi.testclient import TestClient

    from fusionrag.models import load_model
    from fusionrag.offline import build
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.embedder import HashingEmbedder
    from fusionrag.retrieval.knowledge import KnowledgeStore
    from fusionrag.serve.app import create_app
    from fusionrag.serve.settings import ServerSettings
    from serve_helpers import USER, error_of

    disk = mount("size=40m")
    lm = load_model("tiny-llama")
    store = build.create_store(disk / "kb", lm, embedder=HashingEmbedder(64), model_source="tiny-llama")
    build.add_passages(store, lm, [{"title": "P", "text": "Polonium was discovered by the Curies."}])
    store.close()
    mount.remount("ro")

    def make() -> Engine:
        return Engine(KnowledgeStore.open(disk / "kb", lm, embedder=HashingEmbedder(64)), lm)

    app = create_app(make, ServerSettings(default_max_tokens=2))
    app.state.scheduler.wait_ready(60)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
        error_of(client.post("/v1/documents", json=[{"text": "new"}]), 409, "read_only_store")


def test_no_os_or_sqlite_error_reaches_a_client_as_a_500():
    """A disk fault no layer named (ENOSPC, EACCES, EIO, SQLite's full disk) is the status of what it is."""
    import errno
    import sqlite3

    from fusionrag.serve.api_errors import as_api_error

    where = "/srv/private/kb/chunks.sqlite"  # a server path is not the client's business
    cases = {OSError(errno.ENOSPC, "No space left on device", where): (507, "insufficient_storage"),
             OSError(errno.EACCES, "Permission denied", where): (409, "store_read_only"),
             OSError(errno.EIO, "Input/output error", where): (503, "storage_io_error"),
             sqlite3.OperationalError("database or disk is full"): (507, "insufficient_storage")}
    for exc, (status, code) in cases.items():
        err = as_api_error(exc)
        assert (err.status, err.code) == (status, code)
        assert "/srv/private" not in str(err) and "\n" not in str(err)


def test_a_read_only_home_holding_the_model_answers(tmp_path, mount, capsys, monkeypatch):
    """Issue 47 bug 12: a read-only ``$FUSIONRAG_HOME`` holding the model (a prepared image mounted elsewhere):
    ``ask`` exited 3 because the weights' hash memo was always written. The memo only saves time: the answer
    comes, the hash computed."""
    from family_helpers import family_model
    from fusionrag.models.tiny import byte_tokenizer

    home = mount("size=40m")
    folder = home / "models" / "tiny-qwen2"
    family_model("qwen2-rope-yarn").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    monkeypatch.setenv("FUSIONRAG_HOME", str(tmp_path / "build-home"))
    data = _passages(tmp_path / "few.jsonl", 6)
    assert main(["ingest", str(data), "--store", str(tmp_path / "kb"), "--model", str(folder), "--embedder",
                 "hashing-64", "--quiet"]) == 0
    mount.remount("ro")
    monkeypatch.setenv("FUSIONRAG_HOME", str(home))  # no memo there, and nothing can be written
    capsys.readouterr()
    assert main(["ask", "passage 3?", "--store", str(tmp_path / "kb"), "--max-new-tokens", "2", "--json"]) == 0
