"""A running server takes in what another process changed in its store, for retrieval as for answers."""

from __future__ import annotations

import httpx

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings
from serve_helpers import store_factory


def test_retrieve_never_returns_a_chunk_another_process_deleted(tmp_path):
    """Before: after a CLI ``ingest --sync`` beside a running server, POST /v1/retrieve returned the deleted
    chunk's text for minutes (chat requests did reload)."""
    path = tmp_path / "kb"
    app = create_app(store_factory(path, fuse=False), ServerSettings(default_max_tokens=4))
    app.state.scheduler.wait_ready(120)
    try:
        with ServerThread(app) as server:
            query = {"query": "Zirconium was named after the mineral zircon.", "top_k": 2}

            def titles() -> list[str]:
                hits = httpx.post(server.base_url + "/v1/retrieve", json=query, timeout=60).json()["data"]
                return [h["title"] for h in hits]

            assert "Zirconium" not in titles()
            lm = load_model("tiny-llama")
            other = KnowledgeStore.open(path, lm, embedder=HashingEmbedder())  # as another process would
            build.add_passages(other, lm, [{"title": "Zirconium", "text": query["query"]}], doc="extra")
            assert titles()[0] == "Zirconium"  # added elsewhere: found on the next request
            build.delete_document(other, "extra")
            other.close()
            assert "Zirconium" not in titles()  # deleted elsewhere: gone on the next request
    finally:
        app.state.scheduler.close()
