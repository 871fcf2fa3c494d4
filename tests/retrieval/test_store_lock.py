"""The store's writer lock (``filelock`` underneath): one holder, a named holder in the waiter's error."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionrag.errors import StoreBusyError
from fusionrag.retrieval.store_files import LOCK_NAME, writer_lock


@contextlib.contextmanager
def held_by_a_thread(folder: Path) -> Iterator[None]:
    """The writer lock held by another thread (its own lock file descriptor) until the block ends."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with writer_lock(folder):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join(10)


def test_a_waiter_times_out_naming_the_holder_then_gets_the_lock_once_released(tmp_path):
    with held_by_a_thread(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text().startswith("pid ")
        busy = r"being written by pid \d+; only one writer at a time"
        with pytest.raises(StoreBusyError, match=busy), writer_lock(tmp_path, timeout_s=0.2):
            pass
        # the waiter's failed try left the holder's record as it was
        assert (tmp_path / LOCK_NAME).read_text().startswith("pid ")
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: no holder recorded
    with writer_lock(tmp_path, timeout_s=0.2):  # and free again
        pass


def test_a_holder_in_another_process_is_named_by_its_pid(tmp_path):
    script = ("import sys\nfrom pathlib import Path\nfrom fusionrag.retrieval.store_files import writer_lock\n"
              "with writer_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusyError, match=f"being written by pid {proc.pid};"), \
                writer_lock(tmp_path, timeout_s=0.2):
            pass
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0
    with writer_lock(tmp_path, timeout_s=5):  # the other process ended: the lock is free
        pass


def test_the_lock_waits_for_a_holder_that_finishes_within_the_timeout(tmp_path):
    got = threading.Event()

    def wait_for_it() -> None:
        with writer_lock(tmp_path, timeout_s=30):
            got.set()

    with held_by_a_thread(tmp_path):
        w = threading.Thread(target=wait_for_it)
        w.start()
        assert not got.wait(0.3)  # still held: the second writer waits
    w.join(30)
    assert got.is_set()
