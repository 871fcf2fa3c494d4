"""``JobStore``: the server's document jobs, kept in the store's database so a restart resumes them.

The table lives with the store (``store_files.SCHEMA``: ``jobs(id, status, body)``), but only
this class reads or writes it: the server asks for ``put`` / ``all``, never for SQL.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any


class JobStore:
    """Durable ``(id, status, body)`` rows of document jobs, one transaction per write."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock) -> None:
        self._db = db
        self._lock = lock

    def put(self, job_id: str, status: str, body: dict[str, Any]) -> None:
        """Insert or replace one job's row (its status and the rest of its fields as JSON)."""
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO jobs(id, status, body) VALUES (?, ?, ?)",
                             (job_id, status, json.dumps(body)))

    def all(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Every job as ``(id, status, body)``, in the order they were first saved."""
        with self._lock:
            rows = self._db.execute("SELECT id, status, body FROM jobs ORDER BY rowid").fetchall()
        return [(job_id, status, json.loads(body)) for job_id, status, body in rows]
