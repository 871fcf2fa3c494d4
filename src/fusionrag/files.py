"""Durable file writes and content hashes: the one implementation every module uses.

A reader must never see half a file (a crash mid-write, a second process reading while
the first writes), so every file the project writes goes through :func:`atomic_write`:
a temp file in the same folder, fsynced, renamed over the target, then the folder fsynced
so the rename itself survives a power cut. An interrupted write leaves the old file or
none, plus at most a hidden ``.NAME.*.tmp`` file that :func:`remove_temp_files` cleans.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

#: A test seam for systematic fault injection (``tests/reliability/test_fault_injection.py``): called with
#: ``(step, path)`` before every write-side step of every file the package writes (create, write, fsync,
#: replace, directory fsync); it may raise ``OSError`` (ENOSPC, EIO) to make that step fail. None in use.
fault_hook: Callable[[str, Path], None] | None = None


def _step(step: str, path: Path) -> None:
    if fault_hook is not None:
        fault_hook(step, path)


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Let ``write(tmp_path)`` produce the file (e.g. a library that takes a filename), then commit it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _step("create", path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        _step("write", path)
        write(tmp)
        _step("fsync", path)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _step("replace", path)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _step("fsync-dir", path.parent)
    _fsync_dir(path.parent)
    return path


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically and durably."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    return atomic_write_with(path, lambda tmp: tmp.write_bytes(payload))


def atomic_write_stream(path: str | Path, write: Callable[[IO[str]], None]) -> Path:
    """Like :func:`atomic_write` for text produced by ``write(file)`` (e.g. ``json.dump``)."""

    def produce(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)

    return atomic_write_with(path, produce)


def write_json_atomic(path: str | Path, obj: Any, default: Callable[[Any], Any] | None = None) -> Path:
    """``obj`` as indented JSON (NaN refused: it is not JSON), atomically."""

    def write(f: IO[str]) -> None:
        json.dump(obj, f, indent=2, ensure_ascii=False, allow_nan=False, default=default)
        f.write("\n")

    return atomic_write_stream(path, write)


def remove_temp_files(root: str | Path) -> int:
    """Delete temp files left under ``root`` by interrupted writers (never valid files); returns how many."""
    root = Path(root)
    n = 0
    if root.is_dir():
        for p in root.rglob(".*.tmp"):
            p.unlink(missing_ok=True)
            n += 1
    return n


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def content_hash(content: str | bytes) -> str:
    """sha256 hex of ``content`` (text as UTF-8): the identity of a passage, a prompt or a file's bytes."""
    return hashlib.sha256(content.encode("utf-8") if isinstance(content, str) else content).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
