"""vLLM's request features in fusionrag's server: structured outputs, penalties, logit_bias, min_tokens,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, continuous usage stats.

A tiny random model answers (byte tokenizer: token id = byte value for ASCII), so what is checked is what the
features guarantee whatever the model: a structured answer parses and fits its schema, a biased token wins,
no token repeats under a large frequency penalty, and so on, through FusionRAG's reuse and Full Attention alike.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import PASSAGES, store_factory

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer", "minimum": 1800, "maximum": 2100}},
          "required": ["answer", "year"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(store_factory(tmp_path_factory.mktemp("features") / "kb"),
                     ServerSettings(default_max_tokens=8, max_new_tokens=400))
    with TestClient(app) as c:
        app.state.scheduler.wait_ready(120)
        yield c


def tid(client, text: str) -> int:
    """The token id of one character (the byte tokenizer's ids are its alphabet's order, not byte values)."""
    (token,) = client.app.state.scheduler.engine.lm.tokenizer.encode(text, add_special_tokens=False)
    return token


def chat(client, question="Who discovered polonium?", **fields):
    body = {"messages": [{"role": "user", "content": question}], "documents": PASSAGES[:3], **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("method", ["fusionrag", "full"])
def test_a_json_schema_answer_parses_and_fits_its_schema(client, method):
    questions = ["Who discovered polonium?", "When?", "Where was she born?", "Which prizes?", "What city?"]
    for q in questions:
        out = chat(client, q, method=method, max_tokens=200, temperature=0.8, seed=len(q),
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
        answer = json.loads(out["choices"][0]["message"]["content"])
        assert set(answer) == {"answer", "year"} and len(answer["answer"]) <= 12
        assert 1800 <= answer["year"] <= 2100 and out["choices"][0]["finish_reason"] == "stop"


def test_json_object_regex_and_choice(client):
    out = chat(client, max_tokens=300, response_format={"type": "json_object"})
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    out = chat(client, max_tokens=50, structured_outputs={"regex": "[0-9]{4}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", out["choices"][0]["message"]["content"])
    for seed in range(4):
        out = chat(client, temperature=1.0, seed=seed, structured_outputs={"choice": ["yes", "no", "maybe"]})
        assert out["choices"][0]["message"]["content"] in {"yes", "no", "maybe"}
    raw = client.post("/v1/completions", json={"prompt": "The year was", "max_tokens": 20,
                                               "structured_outputs": {"regex": " [0-9]{4}"}})
    assert raw.status_code == 200 and re.fullmatch(r" [0-9]{4}", raw.json()["choices"][0]["text"])


def test_logit_bias_min_tokens_and_stop_token_ids(client):
    x = tid(client, "x")
    out = chat(client, max_tokens=6, logit_bias={str(x): 100})
    assert out["choices"][0]["message"]["content"] == "xxxxxx"
    out = chat(client, max_tokens=6, logit_bias={str(x): 100}, stop_token_ids=[x])
    assert out["choices"][0]["message"]["content"] == "" and out["choices"][0]["finish_reason"] == "stop"
    eos = 258  # <|im_end|>: the tiny model's end of turn
    out = chat(client, max_tokens=20, logit_bias={str(eos): 100}, min_tokens=4)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "stop"


def test_a_large_frequency_penalty_repeats_no_token_and_presence_changes_the_answer(client):
    a = tid(client, "a")
    plain = chat(client, max_tokens=40, logit_bias={str(a): 8})
    tokens = plain["choices"][0]["message"]["content"]
    assert len(set(tokens)) < len(tokens)  # "a" repeats without a penalty
    out = chat(client, max_tokens=40, logit_bias={str(a): 8}, frequency_penalty=2.0, presence_penalty=2.0)
    text = out["choices"][0]["message"]["content"]
    assert text.count("a") <= 4 and text != tokens


def test_the_stop_string_stays_when_asked_and_special_tokens_show_when_not_skipped(client):
    forced = {str(tid(client, "q")): 100}
    out = chat(client, max_tokens=10, logit_bias=forced, stop=["qq"], include_stop_str_in_output=True)
    assert out["choices"][0]["message"]["content"] == "qq"
    assert chat(client, max_tokens=10, logit_bias=forced, stop=["qq"])["choices"][0]["message"]["content"] == ""
    special = {"257": 100}  # <|im_start|>
    shown = chat(client, max_tokens=2, logit_bias=special, skip_special_tokens=False)
    assert shown["choices"][0]["message"]["content"] == "<|im_start|><|im_start|>"
    assert chat(client, max_tokens=2, logit_bias=special)["choices"][0]["message"]["content"] == ""


def test_continuous_usage_stats_put_the_usage_in_every_chunk(client):
    body = {"messages": [{"role": "user", "content": "Who?"}], "documents": PASSAGES[:2], "max_tokens": 5,
            "stream": True, "logit_bias": {str(tid(client, "z")): 100},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 5 and all("usage" in c for c in content)
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty"),
])
def test_bad_feature_values_are_a_400_naming_the_field(client, fields, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q?"}], **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_answers_to_one_prompt_plain_and_streamed(client):
    out = chat(client, max_tokens=4, n=3, temperature=1.0, seed=7)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == sum(1 for _ in out["choices"]) * 4
    texts = [c["message"]["content"] for c in out["choices"]]
    assert len(set(texts)) > 1  # each its own seed
    assert texts == [c["message"]["content"] for c in chat(client, max_tokens=4, n=3, temperature=1.0,
                                                          seed=7)["choices"]]  # and reproducible
    body = {"messages": [{"role": "user", "content": "Who?"}], "documents": PASSAGES[:2], "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    (usage,) = [c["usage"] for c in chunks if not c["choices"]]
    assert usage["completion_tokens"] == 6
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q"}],
                                                     "n": 100}).status_code == 400


def test_prompt_logprobs_are_the_models_own_and_echo_puts_the_prompt_first(client):
    """The prompt's log-probabilities equal a plain Full Attention forward's, whatever method prefilled it."""
    import torch

    engine = client.app.state.scheduler.engine
    out = chat(client, max_tokens=2, method="fusionrag", prompt_logprobs=2)
    found = out["prompt_logprobs"]
    assert found[0] is None and len(found) == out["usage"]["prompt_tokens"]
    assert all(2 <= len(entry) <= 3 and all(v["rank"] >= 1 and v["logprob"] <= 0 for v in entry.values())
               for entry in found[1:])  # the token itself and the 2 most likely ones
    raw = client.post("/v1/completions", json={"prompt": "The river Ostra", "max_tokens": 2, "echo": True,
                                               "logprobs": 1}).json()
    choice = raw["choices"][0]
    assert choice["text"].startswith("The river Ostra")
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) > 2
    tok = engine.lm.tokenizer
    prompt_ids = tok.encode("The river Ostra", add_special_tokens=True)
    with torch.no_grad():
        logp = torch.log_softmax(engine.lm.model(torch.tensor([prompt_ids])).logits[0].float(), -1)
    expected = [float(logp[i, t]) for i, t in enumerate(prompt_ids[1:])]
    got = choice["logprobs"]["token_logprobs"][1:len(prompt_ids)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
    assert client.post("/v1/completions", json={"prompt": "x", "echo": True, "stream": True}).status_code == 400
