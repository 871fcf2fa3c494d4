"""One server's limits and defaults, shared by the protocol (validation), the routes and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ServerSettings:
    """Limits and defaults of one server; every limit exists so that bad input gets a 4xx, not an outage."""

    host: str = "127.0.0.1"  # loopback by default: exposing a model server is an explicit choice
    port: int = 8000
    api_key: str | None = None  # if set, every route but /health needs "Authorization: Bearer KEY"
    model_name: str | None = None  # the "model" reported in responses (default: the engine's model)
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_new_tokens: int = 512  # upper bound on a request's max_tokens
    default_max_tokens: int = 64
    max_documents: int = 64  # per request, for chat "documents" and for POST /v1/documents
    max_document_chars: int = 32_000
    max_top_k: int = 32
    max_queue: int = 64  # requests waiting for prefill; more -> 429
    max_batch: int = 8  # rows of one batched decode step
    max_document_jobs: int = 16  # document jobs pending at once; more -> 429
    default_method: str = "fusionrag"
    default_ratio: float = 0.15
    request_timeout_s: float = 600.0
    preprocess_top_n: int | None = 10  # fused preprocess after adding documents (None: plain KV only)
    keep_jobs: int = 1000  # finished document jobs remembered for GET

    def to_json(self) -> dict[str, Any]:
        """The settings for logs and reports, with the API key reduced to whether one is set."""
        d = asdict(self)
        d["api_key"] = "set" if self.api_key else None
        return d
