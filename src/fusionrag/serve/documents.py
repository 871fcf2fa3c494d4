"""Documents added through ``POST /v1/documents``: the background job and the table of jobs.

A job is answered at once (202) and runs later on the model thread, because the store and
the model are used by one thread at a time; clients poll ``GET /v1/documents/{id}``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from fusionrag.errors import FusionRAGError
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


def _report_dict(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    if hasattr(report, "to_dict"):
        return report.to_dict()
    with contextlib.suppress(TypeError):
        return asdict(report)
    return {"report": str(report)}


def run_document_job(engine: Any, job: DocumentJob, settings: ServerSettings) -> None:
    """Add ``job``'s documents to ``engine``'s store and fuse their KV; the outcome is recorded on ``job``.

    Runs on the model thread (the store and the model are used by one thread at a time).
    Never raises: a failure marks the job failed with its reason.
    """
    job.status = "running"
    try:
        store = engine.store
        if not hasattr(store, "add_passages"):
            raise FusionRAGError("this knowledge store cannot add documents (no add_passages)")
        job.chunk_ids = [int(c) for c in store.add_passages(job.documents, doc=f"api:{job.id}")]
        store_top_n = store.settings.get("top_n") if hasattr(store, "settings") else None
        if store_top_n is not None and hasattr(store, "preprocess"):
            # A preprocessed store: incremental over the whole store, with the store's own
            # settings; new chunks get fused KV, and chunks whose neighbour lists now include
            # a new chunk are re-fused (as 'fusionrag ingest' does).
            job.preprocess = _report_dict(store.preprocess(top_n=int(store_top_n), progress=False))
        elif settings.preprocess_top_n is not None and hasattr(store, "settings"):
            # Never preprocessed: fuse only the new chunks, without switching the whole store
            # to fused mode (store.preprocess would record top_n and fuse everything).
            from fusionrag.offline.preprocess import DEFAULT_NEIGHBOUR_ORDER, run_preprocess

            job.preprocess = _report_dict(run_preprocess(
                store, top_n=int(settings.preprocess_top_n),
                neighbour_order=store.settings.get("neighbour_order") or DEFAULT_NEIGHBOUR_ORDER,
                same_document=bool(store.settings.get("same_document")), chunk_ids=job.chunk_ids,
                progress=False))
        job.status = "ready"
    except Exception as exc:
        log.warning("document job %s failed: %s", job.id, exc)
        job.error = str(exc) if isinstance(exc, FusionRAGError) else f"{type(exc).__name__}: {exc}"
        job.status = "failed"
    finally:
        job.finished = time.time()


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
