"""Documents added through ``POST /v1/documents``: the background job and the table of jobs.

A job is answered at once (202) and runs later on the model thread, because the store and
the model are used by one thread at a time; clients poll ``GET /v1/documents/{id}``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fusionrag.errors import FusionRAGError
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.serve.settings import ServerSettings

log = logging.getLogger(__name__)


@dataclass
class DocumentJob:
    """One batch of documents on its way into the store, and what became of it."""

    id: str
    documents: list[dict] = field(repr=False)
    status: str = "pending"  # pending -> running -> ready | failed; ready -> deleted
    chunk_ids: list[int] = field(default_factory=list)
    error: str | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
    preprocess: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "document_job",
            "status": self.status,
            "documents": len(self.documents),
            "chunk_ids": self.chunk_ids,
            "error": self.error,
            "created": int(self.created),
            "finished": None if self.finished is None else int(self.finished),
            "preprocess": self.preprocess,
        }


def run_document_job(engine: Engine, job: DocumentJob, settings: ServerSettings) -> None:
    """Add ``job``'s documents to ``engine``'s store and fuse their KV; the outcome is recorded on ``job``.

    Runs on the model thread (the store and the model are used by one thread at a time).
    A fused store is re-fused incrementally with its recorded settings (new chunks get fused
    KV; chunks whose neighbour lists now include a new chunk are re-fused, as ``fusionrag
    ingest`` does); a never-fused store with ``--preprocess-top-n`` fuses only the new chunks,
    without switching the whole store to fused mode. Every entry the fuse rewrote is
    invalidated in the engine's KV tiers, so no request reuses the old KV. Never raises:
    a failure marks the job failed with its reason.
    """
    job.status = "running"
    try:
        store, lm = engine.store, engine.lm
        job.chunk_ids = [int(c) for c in build.add_passages(store, lm, job.documents, doc=f"api:{job.id}")]
        report = None
        if build.recorded_fuse_settings(store) is not None:
            report = build.fuse(store, lm, progress=False)
        elif settings.preprocess_top_n is not None:
            report = build.fuse(store, lm, top_n=int(settings.preprocess_top_n), chunk_ids=job.chunk_ids,
                                progress=False, record=False)
        if report is not None:
            engine.invalidate(report.changed_keys)
            job.preprocess = report.to_dict()
        job.status = "ready"
    except Exception as exc:
        log.warning("document job %s failed: %s", job.id, exc)
        job.error = str(exc) if isinstance(exc, FusionRAGError) else f"{type(exc).__name__}: {exc}"
        job.status = "failed"
    finally:
        job.finished = time.time()


def delete_document_job(engine: Engine, job: DocumentJob) -> None:
    """Remove a finished job's chunks from the store and their KV from the engine's tiers (model thread)."""
    engine.invalidate(build.delete_document(engine.store, f"api:{job.id}"))


class DocumentJobs:
    """The jobs a server remembers for ``GET``, oldest first, bounded by ``settings.keep_jobs``.

    Read by the event loop and written by request handlers, hence the lock. Jobs still
    pending or running are never forgotten (dropping stops at the first unfinished one).
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._jobs: OrderedDict[str, DocumentJob] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, job: DocumentJob) -> None:
        with self._lock:
            self._jobs[job.id] = job
            while len(self._jobs) > self.settings.keep_jobs:
                oldest = next(iter(self._jobs))
                if self._jobs[oldest].status in ("pending", "running"):
                    break
                self._jobs.pop(oldest)

    def get(self, job_id: str) -> DocumentJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def counts(self) -> dict[str, int]:
        """Jobs by status (for ``/metrics`` and the in-progress limit)."""
        with self._lock:
            return dict(Counter(j.status for j in self._jobs.values()))
