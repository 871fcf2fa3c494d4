"""What every route shares: the server's state on the app, and the checks routes depend on.

A route asks for :func:`server_state` (FastAPI's ``Depends``) instead of closing over ``create_app``'s
locals; the API key is one dependency on the routers that need it (:func:`require_api_key`).
"""

from __future__ import annotations

import collections
import hmac
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from fastapi import Request as HTTPRequest

from fusionrag.online.scheduler import BatchScheduler
from fusionrag.online.state import Request, Status
from fusionrag.serve.api_errors import APIError
from fusionrag.serve.documents import DocumentJobs
from fusionrag.serve.metrics import Metrics
from fusionrag.serve.settings import ServerSettings


class RecentAnswers:
    """The last ``keep`` finished answers by request id, for ``GET /v1/explain/{id}`` (bounded, thread-safe)."""

    def __init__(self, keep: int) -> None:
        self.keep = max(0, int(keep))
        self._items: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, req: Request) -> None:
        if not self.keep or req.status not in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH):
            return
        with self._lock:
            self._items[req.id] = (req.question, req)
            while len(self._items) > self.keep:
                self._items.popitem(last=False)

    def get(self, request_id: str) -> tuple[str, Any] | None:
        with self._lock:
            return self._items.get(request_id)


@dataclass
class ServerState:
    """The server's parts, made once by ``create_app`` and kept on ``app.state.fusionrag``."""

    settings: ServerSettings
    scheduler: BatchScheduler
    jobs: DocumentJobs
    metrics: Metrics = field(init=False)
    recent: RecentAnswers = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name, self.scheduler, self.jobs.counts)
        self.recent = RecentAnswers(self.settings.explain_keep)

    @property
    def engine(self) -> Any:
        return self.scheduler.engine

    def served_names(self) -> list[str]:
        """The names clients may ask for (the first is reported): ``--served-model-name``, else the model's."""
        if self.settings.served_model_name:
            return list(self.settings.served_model_name)
        return [self.engine.lm.name if self.engine is not None else "fusionrag"]

    def model_name(self) -> str:
        return self.served_names()[0]

    def check_model(self, name: str | None) -> None:
        """vLLM's habit: a ``model`` the server does not serve is a 404 (absent means the served one)."""
        if name is not None and name not in self.served_names():
            raise APIError(404, f"the model '{name}' does not exist on this server (it serves "
                                f"{', '.join(map(repr, self.served_names()))}; see GET /v1/models)",
                           "invalid_request_error", "model_not_found", "model")

    def ensure_ready(self) -> None:
        if self.scheduler.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.scheduler.load_error}", "server_error",
                           "unavailable")
        if not self.scheduler.ready:
            raise APIError(503, "the model is still loading; retry shortly", "server_error", "loading")

    def has_store(self) -> None:
        if self.engine is not None and self.engine.store is None:
            raise APIError(409, "this server has no knowledge store (started without --store): send passages "
                                "with each request, or start it with --store DIR", code="no_store")

    def writable(self) -> None:
        """Document jobs change the store: a store opened read-only refuses them (chats still work)."""
        self.has_store()
        if self.engine is not None and getattr(self.engine.store, "read_only", False):
            raise APIError(409, "the store is read-only (read-only media or no write permission): documents cannot "
                                "be added or deleted; questions are answered as usual", code="read_only_store")

    def on_done(self, req: Request) -> None:
        self.metrics.observe_answer(req)
        self.recent.add(req)


def server_state(request: HTTPRequest) -> ServerState:
    return request.app.state.fusionrag


#: A route's parameter ``server: State`` is the app's :class:`ServerState`.
State = Annotated[ServerState, Depends(server_state)]


def check_api_key(settings: ServerSettings, request: HTTPRequest) -> None:
    if not settings.api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                       "authentication_error", "invalid_api_key")


def require_api_key(request: HTTPRequest) -> None:
    """The dependency of every keyed route: ``Authorization: Bearer KEY`` when the server has a key."""
    check_api_key(server_state(request).settings, request)
