"""Documents added through ``POST /v1/documents``: durable background jobs that never starve chats.

A job is answered at once (202); clients poll ``GET /v1/documents/{id}``. Three properties:

- **Durable**: a job (its documents, status and outcome) is a row of the store's SQLite
  ``jobs`` table, written at every change. A server that restarts resumes every job that
  was pending or running; each step is idempotent (passages dedup by content hash, KV
  entries that are current are skipped), so resuming redoes nothing that was finished.
- **Fair**: a job runs on the model thread (the store and the model are used by one thread
  at a time) as a chain of small *slices* (a few passages added, a few chunks' plain KV, a
  few chunks fused), each a separate scheduler task. Between two slices the scheduler
  admits and prefills waiting chats and runs a decode step, so a chat waits for at most
  one slice, however large the job (``tests/reliability/test_server_faults.py``).
- **Bounded**: a job is refused with 413 before anything is queued if its passages would
  make more than ``max_job_chunks`` chunks or ``max_job_tokens`` tokens.
- **Patient with other writers**: while another process (a CLI ``ingest``) holds the store's writer
  lock, a slice does not block the model thread: it is retried a second later, the job saying it
  waits (``waiting``), for up to ``job_lock_wait_s`` before it fails naming the holder.
- **Documents with identity**: passages posted with an ``id`` form the document of that id; if
  the store has one already, the job replaces it (chunks only it used are removed and dropped
  from the tiers). Passages without an ``id`` form the job's own document ``api:JOB``.
  Deleting a job deletes its documents; ``DELETE /v1/documents/{id}`` also takes a document id.

A fused store is re-fused incrementally with its recorded settings (new chunks get fused KV;
chunks whose neighbour lists now include a new chunk are re-fused); a never-fused store with
``preprocess_top_n`` fuses only the new chunks. Every entry a slice rewrote is invalidated in
the engine's KV tiers, so no request reuses old KV.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError, SchedulerClosedError, StoreBusyError, storage_error
from fusionrag.files import content_hash
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.retrieval.store_files import sqlite_fault
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.settings import ServerSettings

log = logging.getLogger(__name__)

#: Work per slice: small enough that a waiting chat is never held long, large enough to batch.
PASSAGES_PER_SLICE = 8
CHUNKS_PER_PLAIN_SLICE = 8
CHUNKS_PER_FUSE_SLICE = 4
#: What a slice yields when another process holds the writer lock: run me again later.
BUSY = "busy"
#: How long a slice tries for the writer lock on the model thread (chats wait behind it), and the pause
#: before the next try.
LOCK_TRY_S = 0.2
LOCK_RETRY_S = 1.0


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
    slices: int = 0  # scheduler tasks this job has run so far
    waiting: str | None = None  # why the job is not progressing (another process holds the writer lock)

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
            "waiting": self.waiting,
        }


def check_job_size(engine: Engine, documents: list[dict], settings: ServerSettings) -> None:
    """413 before queueing a job whose passages would make too many chunks or tokens."""
    chunk_tokens = int(engine.store.settings["chunk_tokens"])
    tokens = chunks = 0
    for d in documents:
        n = len(engine.prompt.chunk_token_ids(d.get("title", ""), d["text"]))
        tokens += n
        chunks += max(1, math.ceil(n / chunk_tokens))
    if chunks > settings.max_job_chunks or tokens > settings.max_job_tokens:
        raise APIError(413, f"these documents make about {chunks} chunks and {tokens} tokens; a job may have at "
                            f"most {settings.max_job_chunks} chunks and {settings.max_job_tokens} tokens "
                            "(send them in several requests)", code="job_too_large")


def job_documents(job: DocumentJob) -> dict[str, list[dict]]:
    """The job's passages by document: those with an ``id`` make that document, the rest ``api:JOB``."""
    groups: dict[str, list[dict]] = {}
    for d in job.documents:
        groups.setdefault(str(d.get("id") or f"api:{job.id}"), []).append(d)
    return groups


def _locked(job: DocumentJob, store: Any, step: Any, wait_s: float) -> Iterator[str | None]:
    """Run ``step()`` holding the writer lock, trying only briefly: while another process holds it, yield
    :data:`BUSY` (the caller comes back later) for up to ``wait_s``; ``step``'s result is the return value."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with store.writer(timeout_s=LOCK_TRY_S):
                result = step()
            job.waiting = None
            return result
        except StoreBusyError as exc:
            if time.monotonic() >= deadline:
                raise StoreBusyError(f"{exc} (the job waited {wait_s:.0f} s for it)") from None
            job.waiting = f"another process is writing to the store: {exc}"
            yield BUSY


def job_slices(engine: Engine, job: DocumentJob, settings: ServerSettings) -> Iterator[str | None]:
    """The job as a sequence of small steps (one per ``next``; :data:`BUSY`: the writer lock is another
    process's, try again later); records the outcome on ``job``."""
    store, lm = engine.store, engine.lm
    wait = settings.job_lock_wait_s
    try:
        ids: list[int] = []
        for doc, items in job_documents(job).items():
            used: list[int] = []
            for i in range(0, len(items), PASSAGES_PER_SLICE):
                part = items[i:i + PASSAGES_PER_SLICE]
                used += yield from _locked(job, store, lambda part=part, doc=doc: build.add_passages(
                    store, lm, part, doc=doc, plain_kv=False), wait)
                yield None
            # the document is now exactly these chunks: an earlier version's own chunks go, tiers included
            digest = content_hash(json.dumps(items, sort_keys=True))
            engine.invalidate((yield from _locked(job, store, lambda doc=doc, used=used, items=items, digest=digest:
                                                  build.set_document(store, doc, used, source=items[0].get("source"),
                                                                     title=str(items[0].get("title") or ""),
                                                                     digest=digest), wait)))
            ids += used
        job.chunk_ids = [int(c) for c in ids]
        unique = list(dict.fromkeys(job.chunk_ids))
        for i in range(0, len(unique), CHUNKS_PER_PLAIN_SLICE):
            batch = unique[i:i + CHUNKS_PER_PLAIN_SLICE]
            yield from _locked(job, store, lambda batch=batch: build.compute_plain_kv(store, lm, batch), wait)
            yield None
        recorded = build.recorded_fuse_settings(store)
        if recorded is not None:  # incremental over the whole store, with its own settings
            fuse_args: dict[str, Any] = {}
            todo = build.stale_fused(store, recorded, verify=False)
        elif settings.preprocess_top_n is not None:  # only the new chunks; the store stays unfused
            fuse_args = {"top_n": int(settings.preprocess_top_n), "record": False}
            todo = build.stale_fused(store, build.resolve_fuse_settings(store, top_n=settings.preprocess_top_n),
                                     unique, verify=False)
        else:
            todo = []
        total: Counter[str] = Counter()
        for i in range(0, len(todo), CHUNKS_PER_FUSE_SLICE):
            batch = todo[i:i + CHUNKS_PER_FUSE_SLICE]
            report = yield from _locked(job, store, lambda batch=batch: build.fuse(
                store, lm, chunk_ids=batch, progress=False, verify=False, **fuse_args), wait)
            engine.invalidate(report.changed_keys)
            total.update({k: v for k, v in report.to_dict().items() if k in ("computed", "new", "replaced")})
            job.preprocess = {**report.to_dict(), **total, "chunks": len(todo)}
            yield None
        job.status = "ready"
    except Exception as exc:
        log.warning("document job %s failed: %s", job.id, exc)
        job.error = fault_message(exc, store.path, f"adding the documents of job {job.id}")
        job.status = "failed"
    finally:
        job.finished = time.time()


def fault_message(exc: BaseException, store_path: Path, doing: str) -> str:
    """A job's error as the user should read it: a disk fault named for what it is (space, permission, I/O;
    from the OS or from SQLite), a FusionRAGError as it is, anything else with its type."""
    if isinstance(exc, OSError):
        exc = storage_error(exc, doing)
    elif isinstance(exc, sqlite3.Error):
        exc = sqlite_fault(exc, store_path / "store.sqlite", doing)
    return str(exc) if isinstance(exc, FusionRAGError) else f"{type(exc).__name__}: {exc}"


def delete_document_job(engine: Engine, job: DocumentJob) -> None:
    """Remove a finished job's documents from the store and their KV from the engine's tiers (model thread),
    then re-fuse the neighbours whose fused KV was built on them (as ``fusionrag delete`` does)."""
    for doc in job_documents(job) or [f"api:{job.id}"]:
        engine.invalidate(build.delete_document(engine.store, doc))
    refuse_stale(engine)


def delete_stored_document(engine: Engine, doc_id: str) -> dict[str, Any]:
    """Remove one document (any origin) and the chunks only it used; tiers invalidated; the neighbours
    whose fused KV was built on them re-fused (model thread)."""
    keys = build.delete_document(engine.store, doc_id)
    engine.invalidate(keys)
    refused = refuse_stale(engine)
    return {"id": doc_id, "object": "document", "deleted": True, "chunks_removed": len({c for c, _ in keys}),
            "fused_kv_recomputed": refused}


def refuse_stale(engine: Engine) -> int:
    """In a fused store, re-fuse every chunk whose fused KV no longer matches its neighbours (a deleted
    document was one of them); the tiers drop the old copies. How many were re-fused."""
    done = build.finish_interrupted(engine.store, engine.lm)
    engine.invalidate(done.keys)
    return done.counts["refused"]


def document_json(record: Any) -> dict[str, Any]:
    """A stored document as the API shows it."""
    d = record.to_dict()
    return {"id": d["id"], "object": "document", "origin": d["origin"], "source": d["source"], "title": d["title"],
            "chunks": d["chunks"], "ingested": d["ingested"]}


class DocumentJobs:
    """The jobs a server remembers, in memory for ``GET`` and in the store's SQLite for restarts.

    Read by the event loop and written by request handlers and the model thread, hence the
    lock. At most ``settings.keep_jobs`` finished jobs are kept in memory (every job stays in
    SQLite); jobs still pending or running are never forgotten.
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

    def in_progress(self) -> list[DocumentJob]:
        """The jobs still pending or running, oldest first."""
        with self._lock:
            return [j for j in self._jobs.values() if j.status in ("pending", "running")]

    # -- running (the scheduler's model thread) ----------------------------------------------

    def start(self, scheduler: Any, job: DocumentJob) -> None:
        """Queue ``job``: saved first (so a crash before it runs still resumes it), then its slices."""
        self.remember(job)
        scheduler.run_task(self._begin, scheduler, job)

    def resume(self, scheduler: Any) -> None:
        """Load the store's saved jobs and restart the unfinished ones (queued as a model-thread task)."""
        scheduler.run_task(self._resume, scheduler)

    def save(self, engine: Engine, job: DocumentJob) -> bool:
        """Record the job durably; if the store cannot be written (a full disk...), the job ends 'failed'
        with that fault named, rather than staying 'pending' or 'running' forever. Whether it was saved."""
        body = {k: v for k, v in asdict(job).items() if k not in ("id", "status")}
        try:
            engine.store.jobs.put(job.id, job.status, body)
            return True
        except Exception as exc:
            log.warning("document job %s could not be saved: %s", job.id, exc)
            job.error = fault_message(exc, engine.store.path, f"saving document job {job.id}")
            job.status, job.finished = "failed", time.time()
            return False

    def delete_document(self, scheduler: Any, doc_id: str) -> Any:
        """Remove a stored document (model thread); the scheduler's future holds the response body."""
        return scheduler.run_task(delete_stored_document, scheduler.engine, doc_id)

    def delete(self, scheduler: Any, job: DocumentJob) -> Any:
        """Remove a ready job's documents (model thread); returns the scheduler's future."""

        def run() -> None:
            delete_document_job(scheduler.engine, job)
            job.status = "deleted"
            self.save(scheduler.engine, job)

        return scheduler.run_task(run)

    def _begin(self, scheduler: Any, job: DocumentJob) -> None:
        if not self.save(scheduler.engine, job):
            return
        job.status = "running"
        self._run_slice(scheduler, job, job_slices(scheduler.engine, job, self.settings))

    def _run_slice(self, scheduler: Any, job: DocumentJob, steps: Iterator[str | None]) -> None:
        try:
            step = next(steps)
        except StopIteration:
            self.save(scheduler.engine, job)
            return
        job.slices += 1
        if not self.save(scheduler.engine, job):
            steps.close()  # the job ended 'failed'; a DELETE removes what it had added
            return
        if step == BUSY:  # another process writes: come back later, the model thread serves chats meanwhile
            timer = threading.Timer(LOCK_RETRY_S, self._later, (scheduler, job, steps))
            timer.daemon = True
            timer.start()
            return
        scheduler.run_task(self._run_slice, scheduler, job, steps)  # the next slice queues behind waiting chats

    def _later(self, scheduler: Any, job: DocumentJob, steps: Iterator[str | None]) -> None:
        try:
            scheduler.run_task(self._run_slice, scheduler, job, steps)
        except SchedulerClosedError:  # shutting down: the saved job resumes with the next server
            steps.close()

    def _resume(self, scheduler: Any) -> None:
        if getattr(scheduler.engine.store, "read_only", False):
            log.warning("the store is read-only: unfinished document jobs are not resumed")
            return
        unfinished = []
        for job_id, status, data in scheduler.engine.store.jobs.all():
            job = DocumentJob(job_id, data.pop("documents"), status, **{k: data[k] for k in data if k != "slices"})
            if status in ("pending", "running"):
                log.info("resuming document job %s (%s when the server stopped)", job_id, status)
                job.status, job.error, job.finished = "pending", None, None
                unfinished.append(job)
            self.remember(job)  # visible to GET before anything below runs
        try:  # a change another process committed but did not finish (killed before its re-fuse)
            if n := refuse_stale(scheduler.engine):
                log.info("finished what an earlier, interrupted change left undone (%d chunks re-fused)", n)
        except Exception as exc:
            log.warning("could not finish an earlier change's re-fuse (%s); 'fusionrag store verify --repair' "
                        "will", exc)
        for job in unfinished:
            self._begin(scheduler, job)
