"""``POST /v1/embeddings``: the store's embedding model, as OpenAI's endpoint, for frameworks' own vector stores."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import store_factory


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(store_factory(tmp_path_factory.mktemp("emb") / "kb"), ServerSettings(max_documents=4))
    with TestClient(app) as c:
        app.state.scheduler.wait_ready(120)
        yield c


def test_texts_get_the_stores_own_vectors(client):
    store = client.app.state.scheduler.engine.store
    r = client.post("/v1/embeddings", json={"input": ["Polonium", "Warsaw is in Poland"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == store.embedder.name and len(body["data"]) == 2
    expected = store.embedder.embed(["Polonium", "Warsaw is in Poland"])
    assert np.allclose([d["embedding"] for d in body["data"]], expected, atol=1e-6)
    one = client.post("/v1/embeddings", json={"input": "Polonium", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, expected[0], atol=1e-6)


@pytest.mark.parametrize("body, status", [
    ({"input": []}, 400), ({"input": ["a"] * 5}, 400), ({"input": [""]}, 400),
    ({"input": "a", "model": "text-embedding-3-small"}, 404), ({"input": "a", "dimensions": 7}, 400),
    ({"input": [[1, 2, 3]]}, 400),  # token ids: the hashing embedder has no tokenizer
])
def test_bad_inputs_are_a_clear_4xx(client, body, status):
    assert client.post("/v1/embeddings", json=body).status_code == status
