"""fusionrag: fast RAG prefill by reusing precomputed, similarity-fused chunk KV caches.

Import cost matters for the CLI, so the heavy objects are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusionrag.version import __version__ as __version__

__all__ = ["Engine", "KnowledgeStore", "Request", "ReuseRequest", "load_model", "register_policy"]

if TYPE_CHECKING:
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine
    from fusionrag.online.methods import register_policy
    from fusionrag.online.request import ReuseRequest
    from fusionrag.online.state import Request
    from fusionrag.retrieval.knowledge import KnowledgeStore


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from fusionrag.online.engine import Engine

        return Engine
    if name == "KnowledgeStore":
        from fusionrag.retrieval.knowledge import KnowledgeStore

        return KnowledgeStore
    if name == "load_model":
        from fusionrag.models import load_model

        return load_model
    if name == "ReuseRequest":
        from fusionrag.online.request import ReuseRequest

        return ReuseRequest
    if name == "Request":
        from fusionrag.online.state import Request

        return Request
    if name == "register_policy":
        from fusionrag.online.methods import register_policy

        return register_policy
    raise AttributeError(name)
