"""Bad input is refused at the door with a 400 (API) or one named line (CLI), never a 500 or a traceback:
invalid Unicode, numbers out of range, unknown keys in nested bodies, the same passage sent many times."""

from __future__ import annotations

import json

from fusionrag.cli import main
from serve_helpers import USER, error_of

SURROGATE = "\ud800"


def post(client, url, body):
    """Send ``body`` as JSON with ASCII escapes, as a client would (``\\ud800`` stays an escape on the wire)."""
    return client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})


def test_lone_surrogates_are_a_400_naming_the_field_on_every_route(client):
    """Before: 500 internal error (TypeError) on chat, completions, documents and POST /v1/documents."""
    chat = {"messages": [{"role": "user", "content": f"Who {SURROGATE}?"}], "max_tokens": 2}
    err = error_of(post(client, "/v1/chat/completions", chat), 400, "invalid_unicode")
    assert "messages[0].content" in err["message"]
    error_of(post(client, "/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}), 400, "invalid_unicode")
    docs = {"messages": USER, "max_tokens": 2, "documents": [{"title": "T", "text": f"x{SURROGATE}"}]}
    err = error_of(post(client, "/v1/chat/completions", docs), 400, "invalid_unicode")
    assert "documents[0].text" in err["message"]
    error_of(post(client, "/v1/documents", [{"text": SURROGATE}]), 400, "invalid_unicode")
    assert client.get("/health").status_code == 200


def test_numbers_out_of_range_are_400s(client):
    """Before: a seed beyond 64 bits and token ids that are negative or huge were 500s (OverflowError); an id
    beyond the vocabulary was a misleading 'the question is empty'."""
    for seed in (2**64, -1):
        error_of(client.post("/v1/chat/completions", json={"messages": USER, "seed": seed, "max_tokens": 2}), 400)
    for ids in ([-1], [10**12], [5, 1_000_000]):
        err = error_of(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2}), 400, "invalid_value")
        assert "vocabulary" in err["message"]
    ok = client.post("/v1/chat/completions", json={"messages": USER, "seed": 2**64 - 1, "max_tokens": 2})
    assert ok.status_code == 200


def test_nested_bodies_are_as_strict_as_the_top_level(client):
    """Before: unknown keys of a `documents` item were silently dropped."""
    body = {"messages": USER, "max_tokens": 2, "documents": [{"title": "T", "text": "t", "url": "x"}]}
    err = error_of(client.post("/v1/chat/completions", json=body), 400, "unsupported_parameter")
    assert "documents.0.url" in err["message"]
    error_of(client.post("/v1/documents", json=[{"text": "t", "url": "s"}]), 400, "unsupported_parameter")
    error_of(client.post("/v1/documents", json={"documents": [{"text": "t"}], "wait": True}), 400,
             "unsupported_parameter")


def test_the_same_passage_many_times_is_computed_once(client):
    """Before: the same passage sent 50 times was accepted and prefilled 50 times."""
    passage = {"title": "Polonium", "text": "Polonium was discovered by Marie and Pierre Curie in 1898."}
    body = {"messages": USER, "max_tokens": 2, "documents": [passage] * 3 + [{"text": "Another one."}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    once = client.post("/v1/chat/completions", json={**body, "documents": [passage, {"text": "Another one."}]})
    assert r.json()["usage"]["fusionrag"]["chunks"] == once.json()["usage"]["fusionrag"]["chunks"]


def test_ingest_names_the_line_and_passage_with_invalid_unicode_and_keeps_the_rest(tmp_path, capsys, fusionrag_home):
    """Before: a traceback that rejected the whole file without naming the line or passage."""
    data = tmp_path / "in" / "kb.jsonl"
    data.parent.mkdir()
    rows = [{"title": "Good", "text": "A fine passage."}, {"title": "Bad", "text": f"broken {SURROGATE} text"},
            {"id": "q", "passages": [{"title": "Fine", "text": "ok"}, {"title": "Worse", "text": SURROGATE}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["ingest", str(data.parent), "--store", str(tmp_path / "kb"), "--model", "tiny-llama",
                 "--embedder", "hashing-64", "--quiet", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    report = json.loads(out)
    assert report["new_chunks"] == 2
    problems = " ".join(report["problems"])
    assert "kb.jsonl:2" in problems and "kb.jsonl:3" in problems and "passage 1 ('Worse')" in problems


def test_ask_with_undecodable_bytes_is_one_line(tmp_path, capsys, fusionrag_home):
    """Before: `ask $'\\xff'` was a traceback (the argument arrives as a lone surrogate)."""
    code = main(["ask", "caf\udcff?", "--store", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and "not valid Unicode" in err and "Traceback" not in err
