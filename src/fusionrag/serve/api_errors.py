"""OpenAI-shaped errors, and the one place an exception becomes an HTTP answer.

:class:`~fusionrag.errors.FusionRAGError` subclasses carry their status, type and code
(:mod:`fusionrag.errors`); :func:`as_api_error` reads them, names a bare OS or SQLite fault for
what it is (507 full, 409 read-only, 503 I/O), and answers anything else as a logged 500.
:func:`install_error_handlers` wires that into an app: handlers for the known kinds and a last
middleware for the rest, so a route raises and never catches. The caller's fault is a 4xx, ours
a 5xx, and no response carries a server path or a traceback (the server log has the detail).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionrag.errors import FusionRAGError

log = logging.getLogger(__name__)


class APIError(FusionRAGError):
    """An error raised by the HTTP layer itself, with its own status (a body too large, a field refused)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = self.http_status = status
        self.message = message
        self.type = self.api_type = type_
        self.code = self.api_code = code  # type: ignore[assignment]
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
    """The HTTP answer to ``exc``: its class's status, type and code; a 500 for anything unforeseen."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OSError | sqlite3.Error) and not isinstance(exc, TimeoutError | ConnectionError):
        exc = _named_fault(exc)  # a disk fault no layer named: space, permission or I/O, never a bare 500
    if isinstance(exc, FusionRAGError):
        if exc.operator_fault:
            log.error("%s: %s", type(exc).__name__, exc)  # the detail (paths) for the operator only
        return APIError(exc.http_status, exc.public_message(), exc.api_type, exc.api_code, exc.param)
    if isinstance(exc, TimeoutError):
        return APIError(504, f"the request did not finish in time: {exc}", "server_error", "timeout")
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error",
                    "internal_error")


def install_error_handlers(app: FastAPI, count: Callable[[str, int], None]) -> None:
    """Every exception a route raises answered through :func:`as_api_error`; ``count(route, status)`` sees
    every response (the metrics)."""

    @app.middleware("http")
    async def answer_anything(request: Request, call_next: Callable) -> Response:
        try:
            response = await call_next(request)
        except Exception as exc:  # the last line of defence: never a bare 500 page or a crash
            response = as_api_error(exc).response()
        route = request.scope.get("route")
        count(getattr(route, "path", "other"), response.status_code)
        return response

    async def known(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    for kind in (FusionRAGError, OSError, sqlite3.Error, TimeoutError):
        app.add_exception_handler(kind, known)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()}", "invalid_request_error", "invalid_value")


def _named_fault(exc: OSError | sqlite3.Error) -> FusionRAGError:
    """An OS or SQLite error as the storage fault it stands for (space, permission, I/O)."""
    from pathlib import Path

    from fusionrag.errors import storage_error
    from fusionrag.retrieval.store_files import sqlite_fault

    if isinstance(exc, OSError):
        return storage_error(exc, "serving a request")
    return sqlite_fault(exc, Path("store.sqlite"), "serving a request")
