"""The front door as a client sees it: the official ``openai`` client against a live server on loopback.

Chat and text completions (plain and streamed), stop strings (also across token
boundaries), seeded sampling, logprobs, system messages and earlier turns, passages from
the client, and one test per field that used to be ignored silently: each now works or
is a 400. vLLM's habits, as its clients send them: sampling under vLLM's names (``top_k`` is
sampling, the retrieval depth ``retrieval_top_k``), the neutral values the SDK sends back
(``message.model_dump()`` of an earlier answer), a raw ``/v1/completions`` (the prompt continued
as it is), vLLM's extra routes and one access-log line per request. A tiny random model answers,
so answers are compared with what the engine or the model gives for the same prompt, never with
expected words.
"""

from __future__ import annotations

import itertools
import logging
import threading

import httpx
import openai
import pytest
import torch

import fusionrag
from fusionrag.online.request import DEFAULT_TOP_K
from fusionrag.prompt import conversation_preamble
from serve_helpers import PASSAGES, USER, error_of, live_small_server, serial, stored_passages

Q = "Who discovered polonium?"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_small_server(tmp_path_factory) as (app, base):
        yield app, base


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[1] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live[1], timeout=120) as c:
        yield c


def chat(client, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("extra_body", {"retrieval_top_k": 2})
    return client.chat.completions.create(model="tiny-llama", **kw)


def stream_text(stream) -> tuple[list[str], str | None]:
    deltas, reason = [], None
    for ev in stream:
        if ev.choices:
            c = ev.choices[0]
            piece = c.delta.content if hasattr(c, "delta") else c.text
            if piece:
                deltas.append(piece)
            reason = c.finish_reason or reason
    return deltas, reason


# ------------------------------------------------------------------------------- both endpoints


def test_chat_and_completions_match_the_engine_plain_and_streamed(live, client):
    app, _ = live
    ref = serial(app, Q, 8, top_k=2)
    assert chat(client).choices[0].message.content == ref.text
    deltas, reason = stream_text(chat(client, stream=True))
    assert "".join(deltas).strip() == ref.text and reason in ("stop", "length")
    done = client.completions.create(model="tiny-llama", prompt=Q, max_tokens=8, extra_body={"retrieval_top_k": 2})
    assert done.object == "text_completion" and done.choices[0].text.strip() == ref.text
    assert done.usage.completion_tokens == len(ref.token_ids)
    deltas, _ = stream_text(client.completions.create(model="tiny-llama", prompt=Q, max_tokens=8, stream=True,
                                                      extra_body={"retrieval_top_k": 2}))
    assert "".join(deltas).strip() == ref.text


def test_completions_take_token_ids(live, client):
    app, _ = live
    ids = app.state.scheduler.engine.lm.tokenizer.encode(Q, add_special_tokens=False)
    out = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6,
                                    extra_body={"retrieval_top_k": 2})
    assert out.choices[0].text.strip() == serial(app, Q, 6, top_k=2).text


# ------------------------------------------------------------------------------- sampling


def _boundary_stop(deltas: list[str]) -> tuple[str, str]:
    """A stop string spanning two streamed tokens, and the text before it."""
    text = "".join(deltas)
    pos = 0
    for a, b in itertools.pairwise(deltas):
        pos += len(a)
        stop = text[pos - 1:pos + 1]
        if a and b and stop.strip() and text.find(stop) == pos - 1:
            return stop, text[:pos - 1]
    pytest.skip(f"no usable token boundary in {deltas!r}")


def test_stop_strings_across_token_boundaries_plain_and_streamed(client):
    deltas, _ = stream_text(chat(client, max_tokens=12, stream=True))
    stop, before = _boundary_stop(deltas)
    out = chat(client, max_tokens=12, stop=[stop])
    assert out.choices[0].message.content == before.strip() and out.choices[0].finish_reason == "stop"
    got, reason = stream_text(chat(client, max_tokens=12, stop=stop, stream=True))
    assert "".join(got) == before and reason == "stop"
    assert stop not in "".join(got)


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return chat(client, max_tokens=8, temperature=1.5, seed=seed).choices[0].message.content

    assert sample(11) == sample(11)
    assert len({sample(s) for s in range(4)}) > 1  # a random model at temperature 1.5: seeds differ


def test_temperature_top_p_and_top_k_change_or_keep_the_greedy_answer(client):
    greedy = chat(client, max_tokens=8).choices[0].message.content
    hot = {chat(client, max_tokens=8, temperature=2.0, seed=s).choices[0].message.content for s in range(3)}
    assert hot != {greedy}
    # a nucleus this small, or a top-k of 1, leaves only the most likely token: sampling is greedy again
    assert chat(client, max_tokens=8, temperature=1.0, top_p=1e-6, seed=3).choices[0].message.content == greedy
    tk1 = chat(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"retrieval_top_k": 2, "top_k": 1})
    assert tk1.choices[0].message.content == greedy


def test_logprobs_chat_and_completions(client):
    out = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs))  # greedy: the best one
    done = client.completions.create(model="tiny-llama", prompt=Q, max_tokens=5, logprobs=2,
                                     extra_body={"retrieval_top_k": 2})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == done.usage.completion_tokens
    assert all(len(alts) <= 2 for alts in lp.top_logprobs) and lp.text_offset[0] == 0


def test_max_completion_tokens_is_the_limit(client):
    out = chat(client, max_tokens=None, max_completion_tokens=3)
    assert out.usage.completion_tokens <= 3


# ------------------------------------------------------------------------------- messages and passages


def test_system_message_and_earlier_turns_go_into_the_question_segment(live, client):
    app, _ = live
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, *USER]
    out = chat(client, messages=msgs)
    preamble = conversation_preamble(["Be brief."], [("user", "Hello"), ("assistant", "Hi.")])
    ref = serial(app, Q, 8, top_k=2, preamble=preamble)
    assert out.choices[0].message.content == ref.text
    plain = chat(client)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # not dropped
    assert out.model_extra["fusionrag"]["chunk_ids"] == plain.model_extra["fusionrag"]["chunk_ids"]  # same retrieval


def test_document_blocks_in_the_message_are_the_passages(live, client):
    app, _ = live
    docs = [*stored_passages(app, [0, 2]), {"title": "New", "text": "A passage the store has never seen."}]
    blocks = "".join(f'<document title="{p["title"]}">{p["text"]}</document>\n' for p in docs)
    out = chat(client, messages=[{"role": "user", "content": blocks + Q}], extra_body={"method": "fusionrag"})
    ref = serial(app, Q, 8, chunks=docs)
    assert out.choices[0].message.content == ref.text
    reuse = out.usage.model_extra["fusionrag"]
    # the two stored chunks are found by content hash (their fused KV); the new one goes to the prefix cache
    assert reuse["reused_chunks"] == 2 and reuse["adhoc_chunks"] == 1
    assert (reuse["computed_chunks"], reuse["prefix_cache_hits"]) == (1, 0)  # the new one, computed by this request
    assert out.model_extra["fusionrag"]["chunk_ids"] == [0, 2, None]
    via_field = chat(client, extra_body={"documents": docs, "method": "fusionrag"})
    assert via_field.choices[0].message.content == ref.text
    again = via_field.usage.model_extra["fusionrag"]  # its KV computed before: from the prefix or context cache
    assert again["context_cache_hit"] or (again["computed_chunks"], again["prefix_cache_hits"]) == (0, 1)
    assert again["reused_tokens"] > reuse["reused_tokens"]  # the new passage's tokens count once its KV is reused


@pytest.mark.parametrize(("content", "extra", "code"), [
    ('<document title="a">x</document>' + Q, {"documents": PASSAGES[:1]}, "ambiguous_documents"),
    ('<document title="a">unclosed ' + Q, {}, "invalid_documents"),
    ('<document title="a"><document>nested</document></document>' + Q, {}, "invalid_documents"),
    ('<document title="a">only a passage</document>', {}, "empty_question"),
])
def test_ambiguous_passages_are_refused(http, content, extra, code):
    body = {"messages": [{"role": "user", "content": content}], **extra}
    error_of(http.post("/v1/chat/completions", json=body), 400, code)


def test_document_blocks_outside_the_last_message_are_refused(http):
    body = {"messages": [{"role": "user", "content": "<document>x</document>hi"}, {"role": "assistant",
                                                                                   "content": "ok"}, *USER]}
    error_of(http.post("/v1/chat/completions", json=body), 400, "invalid_documents")


# ------------------------------------------------------------------------------- fields that were ignored


@pytest.mark.parametrize("field", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tool_choice": "auto"},
    {"functions": [{"name": "f"}]},
    {"parallel_tool_calls": True},
    {"something_new": 1},
])
def test_unsupported_fields_are_400_naming_the_field(http, field):
    err = error_of(http.post("/v1/chat/completions", json={"messages": USER, **field}), 400, "unsupported_parameter")
    name = next(iter(field))
    assert err["param"] == name and name in err["message"]


def test_n_above_the_batch_is_400(http):
    err = error_of(http.post("/v1/chat/completions", json={"messages": USER, "n": 1000}), 400, "invalid_value")
    assert err["param"] == "n"


def test_completions_refuse_batches_and_legacy_fields(http):
    error_of(http.post("/v1/completions", json={"prompt": ["a?", "b?"]}), 400, "invalid_value")
    assert http.post("/v1/completions", json={"prompt": Q, "echo": True, "max_tokens": 2}).status_code == 200
    error_of(http.post("/v1/completions", json={"prompt": Q, "suffix": "x"}), 400, "unsupported_parameter")


def test_openapi_schema_describes_the_bodies(http):
    spec = http.get("/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "documents", "stop", "seed", "logprobs"} <= set(body["properties"])
    assert "/v1/completions" in spec["paths"]


# ------------------------------------------------------------------------------- explain, health, limits


def test_explain_page_of_a_recent_answer(client, http):
    out = chat(client, extra_body={"retrieval_top_k": 2, "method": "fusionrag", "ratio": 0.3})
    rid = out.model_extra["fusionrag"]["request_id"]
    page = http.get(f"/v1/explain/{rid}")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text.count("<mark>") > 0 and Q in page.text
    error_of(http.get("/v1/explain/nope"), 404, "not_found")


def test_health_degrades_while_the_model_thread_is_stuck_and_ready_is_separate(live, http, monkeypatch):
    app, _ = live
    assert http.get("/health").json()["status"] == "ok" and http.get("/ready").status_code == 200
    monkeypatch.setattr(app.state.settings, "stall_after_s", 0.0)
    gate, started = threading.Event(), threading.Event()
    app.state.scheduler.run_task(lambda: (started.set(), gate.wait(30)))
    try:
        assert started.wait(30)
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "degraded"
    finally:
        gate.set()
    monkeypatch.setattr(app.state.settings, "max_queue", 0)
    r = http.get("/ready")
    assert r.status_code == 503 and "queue is full" in r.json()["reasons"][0]


def test_retrieval_prompt_limit_is_checked_before_prefill(live, http, monkeypatch):
    app, _ = live
    engine = app.state.scheduler.engine

    def no_prefill(*_a, **_k):
        raise AssertionError("prepare ran for a prompt over the limit")

    monkeypatch.setattr(app.state.scheduler, "max_prompt_tokens", 60)
    monkeypatch.setattr(engine, "plan", no_prefill)
    error_of(http.post("/v1/chat/completions", json={"messages": USER, "retrieval_top_k": 4}), 400,
             "context_length_exceeded")


# ------------------------------------------------------------------------------- vLLM's habits


def recent(app, completion):
    """The engine's record of an answer (its prompt and output token ids), by the answer's request id."""
    return app.state.fusionrag.recent.get(completion.model_extra["fusionrag"]["request_id"])[1]


# ------------------------------------------------------------------------------- neutral values


@pytest.mark.parametrize("field", [
    {"response_format": {"type": "text"}},
    {"tools": []},
    {"tool_choice": "none"},
    {"parallel_tool_calls": False},
    {"presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "store": False, "logit_bias": {}},
])
def test_neutral_openai_values_are_accepted(http, field):
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **field})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("message", "name"), [
    ({"tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "tool_calls"),
    ({"refusal": "no"}, "refusal"),
    ({"function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
    ({"audio": {"id": "a"}}, "audio"),
    ({"annotations": [{"type": "url_citation"}]}, "annotations"),
])
def test_a_turn_with_tool_calls_or_a_refusal_is_400_naming_the_field(http, message, name):
    turn = {"role": "assistant", "content": "x", **message}
    err = error_of(http.post("/v1/chat/completions", json={"messages": [*USER, turn, *USER]}), 400,
                   "unsupported_parameter")
    assert err["param"] == "messages" and f"messages[1].{name}" in err["message"]


def test_the_sdks_model_dump_multi_turn_pattern_works(client):
    first = chat(client)
    turn = first.choices[0].message.model_dump()
    assert {"tool_calls", "refusal", "function_call", "audio", "annotations"} <= set(turn)
    again = chat(client, messages=[*USER, turn, {"role": "user", "content": "And when?"}])
    assert again.choices[0].message.content is not None
    # the neutral empty lists an SDK may also send
    turn |= {"tool_calls": [], "annotations": []}
    assert chat(client, messages=[*USER, turn, {"role": "user", "content": "And when?"}]).choices


# ------------------------------------------------------------------------------- top_k is sampling


def test_top_k_is_sampling_and_the_retrieval_depth_is_retrieval_top_k(client):
    greedy = chat(client, extra_body={"retrieval": True})
    chunks = len(greedy.model_extra["fusionrag"]["chunk_ids"])
    assert chunks == DEFAULT_TOP_K
    for top_k in (-1, 0, 2, 20, 50):  # 20: Qwen's recommended setting; all of them over the server's max_top_k (8)
        out = chat(client, temperature=0.8, seed=5, extra_body={"top_k": top_k, "retrieval": True})
        assert len(out.model_extra["fusionrag"]["chunk_ids"]) == chunks  # retrieval depth unaffected
    assert chat(client, extra_body={"top_k": 20}).model_extra["fusionrag"]["chunk_ids"] == []  # nor retrieval asked
    one = chat(client, temperature=1.5, seed=7, extra_body={"top_k": 1, "retrieval": True})
    assert one.choices[0].message.content == greedy.choices[0].message.content
    assert len(chat(client, extra_body={"retrieval_top_k": 2}).model_extra["fusionrag"]["chunk_ids"]) == 2


def test_sample_top_k_is_a_deprecated_name_of_top_k(client, http):
    greedy = chat(client).choices[0].message.content
    deprecated = chat(client, temperature=1.5, seed=7, extra_body={"retrieval_top_k": 2, "sample_top_k": 1})
    assert deprecated.choices[0].message.content == greedy
    error_of(http.post("/v1/chat/completions", json={"messages": USER, "top_k": 1, "sample_top_k": 3}), 400,
             "invalid_value")


def test_min_p_is_taken_and_leaves_greedy_alone(client):
    greedy = chat(client, max_tokens=8)
    same = chat(client, max_tokens=8, extra_body={"retrieval_top_k": 2, "min_p": 0.3, "repetition_penalty": 1.0})
    assert same.choices[0].message.content == greedy.choices[0].message.content  # argmax-invariant, as in vLLM


# ------------------------------------------------------------------------------- raw completions


def greedy_continuation(app, prompt: str, n: int, penalty: float = 1.0) -> tuple[list[int], list[int]]:
    """Plain transformers: the prompt's ids and ``n`` greedy steps of the model over them (one forward each, no
    cache), up to a stop token; ``penalty``: transformers' repetition penalty over the prompt and output so far."""
    from transformers import RepetitionPenaltyLogitsProcessor

    sched = app.state.scheduler
    lm = sched.engine.lm
    ids = lm.tokenizer(prompt)["input_ids"]

    def run() -> list[int]:
        out, seq = [], list(ids)
        for _ in range(n):
            logits = lm.model(torch.tensor([seq], device=lm.device)).logits[0, -1].float().cpu()
            if penalty != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seq]), logits.unsqueeze(0))[0]
            token = int(torch.argmax(logits))
            if token in sched.stop_ids:
                break
            out.append(token)
            seq.append(token)
        return out

    return ids, sched.run_task(run).result(60)


def test_completions_continue_the_raw_prompt_like_transformers(live, client):
    app, _ = live
    prompt = "The capital of France is"
    ids, want = greedy_continuation(app, prompt, 8)
    out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8)
    rec = recent(app, out)
    assert rec.prompt_token_ids == ids and out.usage.prompt_tokens == len(ids)  # no template, no S, no passages
    assert rec.chunk_ids == [] and out.model_extra["fusionrag"]["method"] == "full"
    assert rec.token_ids == want
    tokenizer = app.state.scheduler.engine.lm.tokenizer
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)  # not stripped
    by_ids = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8)
    assert recent(app, by_ids).prompt_token_ids == ids and by_ids.choices[0].text == out.choices[0].text
    streamed = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_repetition_penalty_is_transformers_and_vllms_over_prompt_and_output(live, client):
    app, _ = live
    prompt = "Polonium polonium polonium"
    for penalty in (1.3, 3.0):
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10,
                                        extra_body={"repetition_penalty": penalty})
        assert recent(app, out).token_ids == greedy_continuation(app, prompt, 10, penalty)[1]
    # the penalty changed this greedy answer (else the test would prove nothing)
    assert greedy_continuation(app, prompt, 10)[1] != greedy_continuation(app, prompt, 10, 3.0)[1]


def test_a_completion_with_passages_or_retrieval_is_a_rag_request(live, client):
    app, _ = live
    rag = client.completions.create(model="tiny-llama", prompt=Q, max_tokens=2, extra_body={"retrieval": True})
    assert len(recent(app, rag).chunk_ids) == DEFAULT_TOP_K
    docs = client.completions.create(model="tiny-llama", prompt=Q, max_tokens=2,
                                     extra_body={"documents": [{"title": "t", "text": "A passage."}]})
    assert len(recent(app, docs).chunk_ids) == 1
    assert rag.usage.prompt_tokens > len(app.state.scheduler.engine.lm.tokenizer(Q)["input_ids"])


# ------------------------------------------------------------------------------- vLLM's routes


def test_version_models_retrieve_tokenize_and_detokenize(live, client, http):
    app, _ = live
    assert http.get("/version").json() == {"version": fusionrag.__version__}
    card = client.models.retrieve("tiny-llama")
    assert card.id == "tiny-llama" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found"
    tok = app.state.scheduler.engine.lm.tokenizer
    text = "Polonium, 1898 — Curie"
    out = http.post("/tokenize", json={"model": "tiny-llama", "prompt": text}).json()
    assert out["tokens"] == tok(text)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == app.state.settings.max_prompt_tokens
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
    chat_ids = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": True}).json()["tokens"]
    templated = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert chat_ids == tok.encode(templated, add_special_tokens=False)
    error_of(http.post("/detokenize", json={"tokens": [10**6]}), 400, "invalid_value")
    error_of(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model_not_found")
    error_of(http.post("/tokenize", json={"prompt": "x", "extra": 1}), 400, "unsupported_parameter")


# ------------------------------------------------------------------------------- the access log


def test_one_access_log_line_per_request_without_body_or_key(client, http, caplog):
    caplog.set_level(logging.INFO, logger="fusionrag.access")
    out = chat(client)
    rid = out.model_extra["fusionrag"]["request_id"]
    r = http.get("/version", headers={"Authorization": "Bearer secret-key-value"})
    http.get("/v1/no-such-route")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "fusionrag.access"]
    chats = [line for line in lines if line.startswith("POST /v1/chat/completions 200 ")]
    assert len(chats) == 1 and chats[0].endswith(f"request_id={rid}") and "ms " in chats[0]
    version = [line for line in lines if line.startswith("GET /version 200 ")]
    assert len(version) == 1 and version[0].endswith(f"request_id={r.headers['x-request-id']}")
    assert any(line.startswith("GET /v1/no-such-route 404 ") for line in lines)
    assert not any("secret-key-value" in line or Q in line for line in lines)
