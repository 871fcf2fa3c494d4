"""The server as routers: every /v1 route keyed by the one auth dependency, no route catching exceptions
(the app answers them in one place), and each error class answered with the status its class declares."""

from __future__ import annotations

import ast
import inspect
import sqlite3

import pytest
from fastapi.routing import APIRoute

from fusionrag import errors
from fusionrag.serve import routes
from fusionrag.serve.api_errors import as_api_error
from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from fusionrag.serve.state import require_api_key


def _app():
    return create_app(lambda: None, ServerSettings(api_key="k"))


def test_every_v1_route_depends_on_the_api_key_and_the_open_ones_do_not():
    app = _app()
    keyed = {}
    for route in _api_routes(app.routes):
        keyed[route.path] = require_api_key in [d.call for d in route.dependant.dependencies]
    v1 = {path for path in keyed if path.startswith("/v1/")}
    assert v1 >= {"/v1/chat/completions", "/v1/completions", "/v1/retrieve", "/v1/documents", "/v1/models",
                  "/v1/explain/{request_id}", "/v1/documents/{job_id:path}"}
    assert all(keyed[p] for p in v1), {p for p in v1 if not keyed[p]}
    assert "/v1/models/{model_id:path}" in v1
    assert keyed["/tokenize"] and keyed["/detokenize"]  # stricter than vLLM, which keys /v1 only
    assert not any(keyed[p] for p in ("/health", "/ready", "/ui", "/metrics", "/version"))
    app.state.scheduler.close()


def _api_routes(items):
    for item in items:
        if isinstance(item, APIRoute):
            yield item
        elif hasattr(item, "original_router"):  # FastAPI >= 0.16x keeps an included router whole
            yield from _api_routes(item.original_router.routes)
        elif hasattr(item, "routes"):
            yield from _api_routes(item.routes)


def test_no_route_catches_exceptions():
    for module in (routes.completions, routes.retrieval, routes.documents, routes.pages, routes.service,
                   routes.tokens):
        tree = ast.parse(inspect.getsource(module))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Try)], module.__name__


@pytest.mark.parametrize(("exc", "status", "code"), [
    (errors.QueueFullError("busy"), 429, "queue_full"),
    (errors.PromptTooLongError("long"), 400, "context_length_exceeded"),
    (errors.SchedulerClosedError("closing"), 503, "unavailable"),
    (errors.RequestCancelledError("gone"), 499, "cancelled"),
    (errors.StoreBusyError("/srv/kb is locked"), 503, "store_unavailable"),
    (errors.StoreCorruptedError("/srv/kb/store.sqlite is corrupted"), 503, "store_unavailable"),
    (errors.CacheIntegrityError("/srv/kb/kv/1.safetensors bad"), 503, "store_unavailable"),
    (errors.StorageFullError("no space in /srv/kb"), 507, "insufficient_storage"),
    (errors.StoragePermissionError("read-only /srv/kb"), 409, "store_read_only"),
    (errors.StorageIOError("EIO on /srv/kb"), 503, "storage_io_error"),
    (OSError(28, "No space left on device", "/srv/kb/kv/x"), 507, "insufficient_storage"),
    (sqlite3.OperationalError("disk I/O error"), 503, "storage_io_error"),
    (errors.FusionRAGError("bad input"), 400, "invalid_request"),
    (TimeoutError("slow"), 504, "timeout"),
    (KeyError("bug"), 500, "internal_error"),
])
def test_each_error_class_is_answered_with_its_declared_status_and_no_server_path(exc, status, code):
    api = as_api_error(exc)
    assert (api.status, api.code) == (status, code)
    assert "/srv" not in api.message or status == 400  # the caller's own input may be echoed; our files never


def test_the_page_shows_the_servers_default_ratio_as_it_is():
    """``serve --ratio auto`` puts ``auto`` in the page's ratio field (not a quoted JSON string, which the field
    would send back as text the server refuses); a number stays a number."""
    from fusionrag.serve.ui import ui_page

    assert 'id="ratio" list="ratios" size="6" value="auto"' in ui_page(["fusionrag"], "fusionrag", "auto", False)
    assert 'value="0.15"' in ui_page(["fusionrag"], "fusionrag", 0.15, False)
