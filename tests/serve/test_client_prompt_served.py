"""Chat messages and raw completions served as the client built them (issue 47, items 1-2).

``prompt_tokens`` equals ``/tokenize`` of the same messages; stored chunks pasted in any message (the system
message included) are reused; at ratio 1 the first token's distribution is Full Attention's over exactly the
client's prompt; a raw completion with pasted context reuses it too.
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings
from serve_helpers import store_factory

Q = "Who discovered polonium?"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(store_factory(tmp_path_factory.mktemp("client-prompt") / "kb"),
                     ServerSettings(default_max_tokens=2))
    with TestClient(app) as c:
        app.state.scheduler.wait_ready(120)
        yield c


def context(client, n=3):
    store = client.app.state.scheduler.engine.store
    return "\n\n".join(store.chunk(c).text for c in store.chunk_ids()[:n])


def tokenized(client, messages):
    return client.post("/tokenize", json={"messages": messages}).json()["tokens"]


@pytest.mark.parametrize("where", ["system", "user", "earlier turn"])
def test_context_in_any_message_is_reused_and_the_prompt_is_the_clients(client, where):
    ctx = context(client)
    messages = {
        "system": [{"role": "system", "content": f"Answer from this context:\n\n{ctx}"},
                   {"role": "user", "content": Q}],
        "user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{ctx}\n\nQuestion: {Q}"}],
        "earlier turn": [{"role": "user", "content": f"Read this:\n{ctx}"}, {"role": "assistant", "content": "Done."},
                         {"role": "user", "content": Q}],
    }[where]
    out = client.post("/v1/chat/completions", json={"messages": messages, "method": "fusionrag", "ratio": 0.15})
    assert out.status_code == 200, out.text
    usage = out.json()["usage"]
    assert usage["prompt_tokens"] == len(tokenized(client, messages))
    assert usage["fusionrag"]["reused_chunks"] >= 2 and usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_at_ratio_one_the_first_token_is_full_attention_over_the_clients_prompt(client):
    messages = [{"role": "system", "content": "Use:\n" + context(client)}, {"role": "user", "content": Q}]
    out = client.post("/v1/chat/completions", json={"messages": messages, "method": "fusionrag", "ratio": 1.0,
                                                    "max_tokens": 1, "logprobs": True, "top_logprobs": 5}).json()
    engine = client.app.state.scheduler.engine
    ids = tokenized(client, messages)
    with torch.no_grad():
        logp = torch.log_softmax(engine.lm.model(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = sorted((alt["logprob"] for alt in out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]),
                 reverse=True)
    expected = torch.topk(logp, len(top)).values.tolist()
    assert max(abs(a - b) for a, b in zip(top, expected, strict=True)) < 1e-4


def test_a_raw_completion_with_pasted_context_reuses_it(client):
    prompt = "Documents:\n" + context(client) + f"\n\nQuestion: {Q}\nAnswer:"
    out = client.post("/v1/completions", json={"prompt": prompt, "method": "fusionrag", "max_tokens": 2}).json()
    assert out["usage"]["fusionrag"]["reused_chunks"] >= 2
    assert out["usage"]["prompt_tokens"] == len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])



def test_chat_template_kwargs_reach_the_template_in_both_doors(client):
    """vLLM's ``chat_template_kwargs`` go to the template (the tiny one reads Qwen3's ``enable_thinking``): the
    served prompt is ``/tokenize``'s with the same kwargs, and differs from the prompt without them."""
    messages = [{"role": "user", "content": Q}]
    plain = tokenized(client, messages)
    no_thinking = client.post("/tokenize", json={"messages": messages,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert len(no_thinking) > len(plain)
    out = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                    "chat_template_kwargs": {"enable_thinking": False}})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens"] == len(no_thinking)


def test_chat_template_kwargs_with_passages_fusionrag_lays_out_is_a_400(client):
    out = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": Q}], "documents": [{"text": "Marie Curie found it."}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert out.status_code == 400 and out.json()["error"]["param"] == "chat_template_kwargs"
