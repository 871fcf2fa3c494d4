"""Systematic fault injection, the way SQLite tests itself: a clean ``ingest`` + ``preprocess`` of a small store
is run once to count its write points (every file step through ``fusionrag.files`` and every SQLite write
statement), then once per point with that point failing (ENOSPC, then EIO). After each fault: one error line
with its exit code, no traceback; a rerun without the fault ends with ``store verify`` clean and every KV entry
present and identical (checksums) to the clean build's."""

from __future__ import annotations

import errno
import json
import sqlite3
from pathlib import Path

import pytest

from fusionrag import files
from fusionrag.cli import main
from fusionrag.retrieval import store_files

pytestmark = pytest.mark.slow
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP")


class Injector:
    """Counts write points; raises ``OSError(code)`` at the ``fail_at``-th (1-based), once."""

    def __init__(self, fail_at: int | None = None, code: int = errno.ENOSPC) -> None:
        self.fail_at, self.code, self.seen = fail_at, code, 0

    def __call__(self, step: str, path) -> None:
        self.seen += 1
        if self.seen == self.fail_at:
            raise OSError(self.code, f"{errno.errorcode[self.code]} injected at {step}", str(path))


class FaultyConnection:
    """A SQLite connection whose write statements pass through the injector (as SQLite's own errors)."""

    def __init__(self, db: sqlite3.Connection, injector: Injector, path: str) -> None:
        self._db, self._inject, self._path = db, injector, path

    def _check(self, sql: str) -> None:
        if sql.lstrip().upper().startswith(WRITES):
            try:
                self._inject("sqlite", self._path)
            except OSError as exc:
                raise sqlite3.OperationalError("database or disk is full" if exc.errno == errno.ENOSPC
                                               else "disk I/O error") from None

    def execute(self, sql, *args):
        self._check(sql)
        return self._db.execute(sql, *args)

    def executemany(self, sql, *args):
        self._check(sql)
        return self._db.executemany(sql, *args)

    def __enter__(self):
        return self._db.__enter__()

    def __exit__(self, *exc):
        return self._db.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._db, name)


@pytest.fixture
def inject(monkeypatch):
    """``inject(injector)`` routes every write point of the package through ``injector``."""
    real_connect = sqlite3.connect

    def use(injector: Injector) -> None:
        monkeypatch.setattr(files, "fault_hook", injector)
        monkeypatch.setattr(store_files.sqlite3, "connect",
                            lambda *a, **k: FaultyConnection(real_connect(*a, **k), injector, str(a[0])))

    yield use
    monkeypatch.setattr(files, "fault_hook", None)
    monkeypatch.setattr(store_files.sqlite3, "connect", real_connect)


def _job(data: Path, store: Path) -> list[list[str]]:
    common = ["--model", "tiny-llama", "--quiet"]
    return [["ingest", str(data), "--store", str(store), "--embedder", "hashing-64", *common],
            ["preprocess", "--store", str(store), "--top-n", "2", *common]]


def _entries(store: Path) -> dict[str, str]:
    """Every KV file's checksum (from its header), by relative path."""
    out = {}
    for p in sorted((store / "kv").rglob("*.safetensors")):
        data = p.read_bytes()
        n = int.from_bytes(data[:8], "little")
        out[str(p.relative_to(store))] = json.loads(data[8:8 + n])["__metadata__"]["checksum"]
    return out


def _run(argv_list, capsys) -> tuple[int, str]:
    for argv in argv_list:
        code = main(argv)
        err = capsys.readouterr().err
        if code != 0:
            return code, err
    return 0, ""


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_every_write_point_of_ingest_and_preprocess_survives_a_fault(tmp_path, capsys, inject, code,
                                                                     fusionrag_home):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"title": f"T{i}", "text": f"passage {i} about topic {i % 2}."}) + "\n"
                            for i in range(4)))
    counter = Injector()
    inject(counter)
    assert _run(_job(data, tmp_path / "clean"), capsys) == (0, "")
    points = counter.seen
    clean = _entries(tmp_path / "clean")
    assert points > 20 and clean
    failures: list[str] = []
    for n in range(1, points + 1):
        store = tmp_path / f"kb{n}"
        inject(Injector(n, code))
        rc, err = _run(_job(data, store), capsys)
        lines = err.strip().splitlines()
        if rc not in (0, 3) or "Traceback" in err or (rc and len(lines) != 1) or "corrupted" in err:
            failures.append(f"point {n}: exit {rc}: {err.strip()[:300]}")
            continue
        inject(Injector())  # the fault is gone: the same commands must finish the job
        rc2, err2 = _run(_job(data, store), capsys)
        ok = rc2 == 0 and main(["store", "verify", "--store", str(store)]) == 0
        capsys.readouterr()
        if not ok or _entries(store) != clean:
            failures.append(f"point {n}: rerun exit {rc2} {err2.strip()[:200]}; entries equal: "
                            f"{_entries(store) == clean}")
    print(f"fault injection ({errno.errorcode[code]}): {points} write points, {len(failures)} failures")
    assert failures == [], "\n".join(failures)


def test_every_write_point_of_a_server_document_job_survives_a_fault(tmp_path, inject):
    """The same for a document job: the N-th write of the job fails (ENOSPC); the job ends 'failed' with the
    fault named, the server stays up, deleting the job and posting it again ends 'ready' with a verified
    store holding exactly the clean run's passages and as many KV entries."""
    import time

    from fastapi.testclient import TestClient

    from fusionrag.offline.verify import verify_store
    from fusionrag.serve.app import create_app
    from fusionrag.serve.settings import ServerSettings
    from serve_helpers import store_factory

    docs = [{"title": f"New {i}", "text": f"new passage {i} about zebras."} for i in range(3)]

    def run(folder: Path, fail_after: int | None) -> tuple[dict, int, object, list]:
        injector = Injector()
        inject(injector)
        app = create_app(store_factory(folder), ServerSettings(default_max_tokens=2, preprocess_top_n=2))
        app.state.scheduler.wait_ready(120)
        if fail_after is not None:
            injector.fail_at = injector.seen + fail_after
        start = injector.seen
        with TestClient(app, raise_server_exceptions=False) as client:
            job = client.post("/v1/documents", json=docs).json()
            deadline = time.monotonic() + 60
            while job["status"] in ("pending", "running") and time.monotonic() < deadline:
                time.sleep(0.02)
                job = client.get(f"/v1/documents/{job['id']}").json()
            first = dict(job)
            injector.fail_at = None
            if job["status"] == "failed":
                assert client.delete(f"/v1/documents/{job['id']}").status_code == 200
                job = client.post("/v1/documents", json=docs).json()
                while job["status"] in ("pending", "running") and time.monotonic() < deadline:
                    time.sleep(0.02)
                    job = client.get(f"/v1/documents/{job['id']}").json()
            assert client.get("/health").status_code == 200
            store = app.state.scheduler.engine.store
            report = verify_store(store)
            texts = sorted(store.chunk(c).text for c in store.chunk_ids())
            entries = len(store.kv.files("plain")) + len(store.kv.files("fused"))
        return first | {"final": job["status"], "verify_ok": report.ok}, injector.seen - start, texts, [entries]

    clean, points, clean_texts, clean_entries = run(tmp_path / "clean", None)
    assert clean["final"] == "ready" and points > 10
    failures = []
    for n in range(1, points + 1):
        first, _, texts, entries = run(tmp_path / f"kb{n}", n)
        if first["status"] == "failed" and not any(w in (first.get("error") or "") for w in ("disk space", "I/O")):
            failures.append(f"point {n}: failed without naming the fault: {first.get('error')}")
        if "corrupted" in (first.get("error") or ""):
            failures.append(f"point {n}: a false 'corrupted': {first.get('error')}")
        if first["final"] != "ready" or not first["verify_ok"] or texts != clean_texts or entries != clean_entries:
            failures.append(f"point {n}: after the rerun {first['final']}, verify {first['verify_ok']}, "
                            f"passages equal {texts == clean_texts}, entries {entries} vs {clean_entries}")
    print(f"fault injection (document job, ENOSPC): {points} write points, {len(failures)} failures")
    assert failures == [], "\n".join(failures)
