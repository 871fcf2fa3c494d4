"""The wire protocol through the app: malformed and invalid requests are OpenAI-shaped 4xx errors.

Validation (:mod:`fusionrag.serve.protocol`) runs before the model is involved; these tests
send what a careless or hostile client might and check the status and the error code.
"""

from __future__ import annotations

import pytest

from serve_helpers import USER, error_of


@pytest.mark.parametrize(("content", "code"), [(b"{not json", "invalid_json"), (b"", "invalid_json"),
                                               (b"\xff\xfe", "invalid_json"), (b"[" * 200_000, "invalid_json")])
def test_malformed_json_is_400(client, content, code):
    error_of(client.post("/v1/chat/completions", content=content,
                         headers={"content-type": "application/json"}), 400, code)


@pytest.mark.parametrize(("body", "code"), [
    ({"messages": USER, "method": "nope"}, "unknown_method"),
    ({"messages": USER, "ratio": 1.5}, "invalid_ratio"),
    ({"messages": USER, "ratio": "a lot"}, "invalid_ratio"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty_question"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "invalid_value"),
    ({"messages": []}, "invalid_value"),
    ({"messages": "hello"}, "invalid_value"),
    ({"messages": USER, "max_tokens": 0}, "invalid_value"),
    ({"messages": USER, "max_tokens": 10**9}, "invalid_value"),
    ({"messages": USER, "retrieval_top_k": -1}, "invalid_value"),
    ({"messages": USER, "top_k": -2}, "invalid_value"),
    ({"messages": USER, "min_p": 1.5}, "invalid_value"),
    ({"messages": USER, "repetition_penalty": 0}, "invalid_value"),
    ({"messages": USER, "kv": "warm"}, "invalid_value"),
    ({"messages": USER, "n": 300}, "invalid_value"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "unsupported_parameter"),
    ({"messages": USER, "stop": [""]}, "invalid_value"),
    ({"messages": USER, "stop": ["x"] * 9}, "invalid_value"),
    ({"messages": USER, "temperature": 5}, "invalid_value"),
    ({"messages": USER, "top_logprobs": 2}, "invalid_value"),
    ({"messages": [*USER, {"role": "assistant", "content": "Marie"}]}, "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}, *USER]}, "invalid_value"),
    ({"messages": USER, "documents": "text"}, "invalid_value"),
    ({"messages": USER, "documents": [{"title": "no text"}]}, "invalid_value"),
    ([1, 2, 3], None),
])
def test_invalid_requests_are_400(client, body, code):
    error_of(client.post("/v1/chat/completions", json=body), 400, code)


def test_document_limits_are_413(client):
    many = [{"text": f"passage {i}"} for i in range(5)]
    error_of(client.post("/v1/chat/completions", json={"messages": USER, "documents": many}), 413,
             "too_many_documents")
    error_of(client.post("/v1/documents", json=many), 413, "too_many_documents")
    error_of(client.post("/v1/documents", json=[{"text": "x" * 2001}]), 413, "document_too_large")
    error_of(client.post("/v1/documents", json={"documents": []}), 400)


def test_oversize_body_is_413(app, client, monkeypatch):
    monkeypatch.setattr(app.state.settings, "max_body_bytes", 200)
    big = {"messages": [{"role": "user", "content": "x" * 500}]}
    error_of(client.post("/v1/chat/completions", json=big), 413, "body_too_large")

    def chunks():  # no Content-Length: refused while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 100
        yield b'"}]}'

    error_of(client.post("/v1/chat/completions", content=chunks()), 413, "body_too_large")

