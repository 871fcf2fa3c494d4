"""The server's routes, one module-level router per concern; ``create_app`` includes them all.

Routes raise and never catch: ``fusionrag.serve.api_errors`` answers every exception in one place.
The keyed routers depend on :func:`~fusionrag.serve.state.require_api_key`; liveness, readiness,
the UI page, ``/version`` and (by default) the metrics are open, as in vLLM.
"""

from fusionrag.serve.routes import completions, documents, embeddings, pages, retrieval, service, tokens

ROUTERS = (completions.router, embeddings.router, retrieval.router, documents.router, pages.router, tokens.router,
           service.keyed, service.open_router)

__all__ = ["ROUTERS"]
