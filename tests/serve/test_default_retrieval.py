"""``--default-retrieval on``: chat requests search the store; a raw completion is still a whole prompt.

Issue 47 bug 13: with it on, every plain ``/v1/completions`` was a 400 ("a raw prompt takes no ... retrieval").
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import store_factory


def test_default_retrieval_searches_chats_and_leaves_raw_completions_whole(tmp_path):
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2, default_retrieval=True))
    with TestClient(app) as client:
        app.state.scheduler.wait_ready(120)
        chat = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "Who discovered polonium?"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["fusionrag"]["sources"], chat.text
        raw = client.post("/v1/completions", json={"prompt": "Polonium was discovered by", "max_tokens": 2})
        assert raw.status_code == 200, raw.text
        asked = client.post("/v1/completions", json={"prompt": "Who discovered polonium?", "retrieval": True})
        assert asked.status_code == 200 and asked.json()["usage"]["fusionrag"]["sources"]  # asked: a RAG request
