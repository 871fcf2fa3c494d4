"""OpenAI-shaped errors: the JSON body, and which HTTP status each engine, scheduler or storage fault gets.

The caller's fault is a 4xx, ours a 5xx, a disk fault the status of what it is (507 full, 409 read-only,
503 I/O), and no response carries a server path or a traceback (the server log has the detail).
"""

from __future__ import annotations

import logging
import sqlite3

from fastapi.responses import JSONResponse

from fusionrag.errors import (
    CacheIntegrityError,
    FusionRAGError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
)
from fusionrag.retrieval.store_files import StoreBusyError, StoreCorruptedError
from fusionrag.serve.requests import (
    PromptTooLongError,
    QueueFullError,
    RequestCancelledError,
    SchedulerClosedError,
)

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.code, self.param)


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """The JSON error body (401 also says which scheme to use, as HTTP asks)."""
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def as_api_error(exc: BaseException) -> APIError:
    """Map engine/scheduler errors to statuses: the caller's fault is 4xx, ours is 5xx."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OSError | sqlite3.Error) and not isinstance(exc, TimeoutError | ConnectionError):
        exc = _named_fault(exc)  # a disk fault no layer named: space, permission or I/O, never a bare 500
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", "queue_full")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, SchedulerClosedError):
        return APIError(503, str(exc), "server_error", "unavailable")
    if isinstance(exc, RequestCancelledError):
        return APIError(499, str(exc), "invalid_request_error", "cancelled")
    if isinstance(exc, CacheIntegrityError | StoreCorruptedError | StoreBusyError):
        # the server's own data, not the request: 503, and no file paths in what the client sees
        log.error("store fault: %s", exc)
        return APIError(503, "the knowledge store has a damaged or busy file; the operator has been told "
                             "(server log); retry later", "server_error", "store_unavailable")
    if isinstance(exc, StorageError):
        log.error("storage fault: %s", exc)  # the server's disk, not the request: no paths in the response
        status, code, what = ((507, "insufficient_storage", "out of disk space")
                              if isinstance(exc, StorageFullError) else
                              (409, "store_read_only", "the store cannot be written (read-only or no permission)")
                              if isinstance(exc, StoragePermissionError) else
                              (503, "storage_io_error", "the disk reported an I/O error"))
        return APIError(status, f"{what}; nothing already stored was lost; the operator has been told (server log)",
                        "server_error", code)
    if isinstance(exc, FusionRAGError):
        return APIError(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, TimeoutError):
        return APIError(504, f"the request did not finish in time: {exc}", "server_error", "timeout")
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error",
                    "internal_error")


def _named_fault(exc: OSError | sqlite3.Error) -> FusionRAGError:
    """An OS or SQLite error as the storage fault it stands for (space, permission, I/O)."""
    from pathlib import Path

    from fusionrag.errors import storage_error
    from fusionrag.retrieval.store_files import sqlite_fault

    if isinstance(exc, OSError):
        return storage_error(exc, "serving a request")
    return sqlite_fault(exc, Path("store.sqlite"), "serving a request")
