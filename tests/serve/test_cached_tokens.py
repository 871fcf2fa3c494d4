"""OpenAI's and vLLM's standard field for reuse, ``usage.prompt_tokens_details.cached_tokens``, read by the
official ``openai`` SDK from a live loopback server: chat and text completions, plain and streamed
(``include_usage``). It is the prompt tokens whose KV the request did not compute itself
(``usage.fusionrag.reused_tokens``): stored chunks pasted into the prompt count, ``method: full`` gives 0,
and tokens found precomputed but recomputed (FusionRAG's selection) do not count.
"""

from __future__ import annotations

import openai
import pytest

from serve_helpers import live_small_server, stored_passages

Q = "Who discovered polonium?"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_small_server(tmp_path_factory) as (app, base):
        yield app, base


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[1] + "/v1", api_key="none", max_retries=0, timeout=120)


def pasted(app, ids: list[int]) -> str:
    """A prompt as a framework pastes its retrieved passages: stored chunks' text, then the question."""
    context = "\n\n".join(p["text"] for p in stored_passages(app, ids))
    return f"Answer using the documents below.\n\nDocuments:\n{context}\n\nQuestion: {Q}\nAnswer:"


def stream_usage(stream):
    """The usage chunk of a stream (``include_usage``: the last one, with no choices)."""
    usage = [ev.usage for ev in stream if ev.usage is not None]
    assert len(usage) == 1
    return usage[0]


def test_chat_reports_the_reused_pasted_tokens_as_cached(live, client):
    app, _ = live
    messages = [{"role": "user", "content": pasted(app, [0, 4])}]  # chunks long enough to be matched
    out = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                         extra_body={"method": "fusionrag", "ratio": 0.3})
    fr = out.usage.model_extra["fusionrag"]
    assert [s["chunk_id"] for s in fr["sources"] if s["stored"]] == [0, 4] and fr["reused_chunks"] == 2
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached == fr["reused_tokens"] > 0
    assert cached <= fr["precomputed_tokens"] <= fr["context_tokens"] < out.usage.prompt_tokens
    if not fr["context_cache_hit"] and fr["recomputed_tokens"]:  # recomputed here: not cached
        assert cached < fr["precomputed_tokens"]

    streamed = stream_usage(client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True},
        extra_body={"method": "fusionrag", "ratio": 0.3}))
    assert streamed.prompt_tokens == out.usage.prompt_tokens
    assert streamed.prompt_tokens_details.cached_tokens == streamed.model_extra["fusionrag"]["reused_tokens"] > 0

    full = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                          extra_body={"method": "full"})
    assert full.usage.prompt_tokens_details.cached_tokens == 0 and full.usage.prompt_tokens == out.usage.prompt_tokens


def test_a_question_alone_has_nothing_cached(client):
    out = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": Q}], max_tokens=2)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.usage.model_extra["fusionrag"]["chunks"] == 0


def test_text_completions_report_cached_tokens_plain_and_streamed(live, client):
    app, _ = live
    docs = stored_passages(app, [2, 6])
    kw = {"model": "tiny-llama", "prompt": Q, "max_tokens": 2, "extra_body": {"documents": docs, "method": "fusionrag"}}
    out = client.completions.create(**kw)
    fr = out.usage.model_extra["fusionrag"]
    assert fr["reused_chunks"] == 2
    assert out.usage.prompt_tokens_details.cached_tokens == fr["reused_tokens"] > 0
    streamed = stream_usage(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed.prompt_tokens_details.cached_tokens == streamed.model_extra["fusionrag"]["reused_tokens"] > 0
    raw = client.completions.create(model="tiny-llama", prompt=Q, max_tokens=2)  # a raw prompt: no passages
    assert raw.usage.prompt_tokens_details.cached_tokens == 0


def test_reuse_from_an_earlier_request_counts_with_its_origin_and_an_ab_baseline_reads_none(live, client):
    """Issue 47: a ``method: full`` answer served by an earlier request's whole-context KV reported
    ``cached_tokens: 0`` (2.5 s vs 13.9 s in an A/B test). What a request did not compute counts, by origin; and
    ``skip_reading_prefix_cache`` (vLLM's name) makes the baseline compute its whole prompt."""
    app, _ = live
    app.state.scheduler.engine.context_cache.max_bytes = 1 << 28  # the server's default (this test app has it off)
    messages = [{"role": "user", "content": pasted(app, [0, 4])}]  # chunks long enough to be matched
    ask = dict(model="tiny-llama", messages=messages, max_tokens=2)
    client.chat.completions.create(**ask, extra_body={"method": "full"})
    again = client.chat.completions.create(**ask, extra_body={"method": "full"})
    fusion = again.usage.model_extra["fusionrag"]
    assert fusion["context_cache_hit"] and again.usage.prompt_tokens_details.cached_tokens > 0
    assert fusion["reused_tokens_by_origin"] == {"context_cache": again.usage.prompt_tokens_details.cached_tokens}
    baseline = client.chat.completions.create(**ask, extra_body={"method": "full", "skip_reading_prefix_cache": True})
    assert baseline.usage.prompt_tokens_details.cached_tokens == 0
    assert not baseline.usage.model_extra["fusionrag"]["context_cache_hit"]
    auto = client.chat.completions.create(**ask, extra_body={"method": "auto", "skip_reading_prefix_cache": True})
    assert "context_cache" not in auto.usage.model_extra["fusionrag"]["reused_tokens_by_origin"]
