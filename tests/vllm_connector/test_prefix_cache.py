"""The connector with vLLM's prefix cache on (vLLM's default): no request is served KV of another mode.

vLLM publishes a request's blocks under hashes of its ids; the connector salts every request it loads with
its mode (:mod:`fusionrag.vllm.isolation`), so exact (``off``) requests never read FusionRAG's approximate
blocks, another ratio never reads them either, and requests of one mode on one context share them.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm")

from vllm_helpers import QUESTION, prompt_ids, run

OTHER_QUESTION = "Where was Marie Curie born?"


def _ids(store, chunk_ids, question=QUESTION):
    return [*prompt_ids(store, chunk_ids)[: -len(store.prompt.question_token_ids(QUESTION))],
            *store.prompt.question_token_ids(question)]


def _loaded(parts) -> bool:
    return any(parts["debug"].glob("*.json"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() < 1e-5)


def test_an_exact_request_after_an_approximate_one_gets_exact_kv(parts):
    """The issue's three calls (off, 15%, off with the cache kept), then a second question on the context and
    another ratio: each equals the same request on an empty prefix cache."""
    store = parts["store"]
    ids = _ids(store, store.chunk_ids()[:4])
    exact, _ = run(parts, ids, "off")
    approx, _ = run(parts, ids, {"ratio": 0.15})
    assert not _same(exact, approx), "15% must differ from exact here, or this test could not fail"
    after, _ = run(parts, ids, "off", reset=False)
    assert _same(after, exact), "an exact request was served the connector's approximate KV"
    again, _ = run(parts, ids, {"ratio": 0.15}, reset=False)
    assert _same(again, approx) and not _loaded(parts), "15% twice on one context shares its blocks"
    thirty, _ = run(parts, ids, {"ratio": 0.3}, reset=False)
    assert _loaded(parts), "30% must not be served the 15% blocks"
    assert _same(thirty, run(parts, ids, {"ratio": 0.3})[0])
    ids2 = _ids(store, store.chunk_ids()[:4], OTHER_QUESTION)
    exact2, _ = run(parts, ids2, "off")
    run(parts, ids, {"ratio": 0.15})
    after2, _ = run(parts, ids2, "off", reset=False)
    assert _same(after2, exact2)


def test_mixed_modes_over_shared_contexts_each_get_their_own_mode(parts):
    """Exact, 15%, 30% and Full Reuse requests over two shared contexts and two questions, interleaved, with
    the cache kept throughout: each answer equals what its own mode gives alone (for 15% and 30%: after the
    first request of that mode on that context, whose context blocks it may share), never another mode's."""
    store = parts["store"]
    contexts = [store.chunk_ids()[:4], store.chunk_ids()[4:8]]
    modes = ["off", {"ratio": 0.15}, {"ratio": 0.3}, {"ratio": 0.0}]
    cells = [(m, c, q) for m in range(len(modes)) for c in range(2) for q in (QUESTION, OTHER_QUESTION)] * 2
    random.Random(0).shuffle(cells)
    assert parts["llm"].reset_prefix_cache()
    served = [run(parts, _ids(store, contexts[c], q), modes[m], reset=False)[0] for m, c, q in cells]
    wrong = 0
    for (m, c, q), got in zip(cells, served, strict=True):
        first = next(cell for cell in cells if cell[:2] == (m, c))
        run(parts, _ids(store, contexts[c], first[2]), modes[m])  # that mode's blocks of this context
        alone, _ = run(parts, _ids(store, contexts[c], q), modes[m], reset=False)
        wrong += not _same(got, alone)
    assert wrong == 0, f"{wrong} of {len(cells)} requests were served KV of another mode"


def test_the_response_says_what_the_request_was_served(parts):
    """``kv_transfer_params["fusionrag"]`` of the response: method, ratio (``auto``: the share chosen), the context
    tokens and the share of them served from the store, the tokens recomputed; an exact request says so; a
    second request of the same mode on the same prompt was served by this mode's prefix-cache blocks (nothing
    loaded)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    store, llm = parts["store"], parts["llm"]
    ids = prompt_ids(store, store.chunk_ids()[:4])

    def report(cell):
        params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"fusionrag": cell}})
        return llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0].kv_transfer_params

    assert llm.reset_prefix_cache()
    served = report({"ratio": 0.3})["fusionrag"]
    context = len(ids) - len(store.prompt.system_token_ids) - len(store.prompt.question_token_ids(QUESTION))
    assert served["method"] == "fusionrag" and served["ratio"] == 0.3 and served["chunks"] == 4
    assert served["context_tokens"] == served["stored_tokens"] == context and served["stored_share"] == 1.0
    assert served["loaded_tokens"] > 0 and int(0.3 * context) <= served["recomputed_tokens"] <= context
    again = report({"ratio": 0.3})["fusionrag"]
    assert again["loaded_tokens"] == 0 and "recomputed_tokens" not in again  # this mode's prefix-cache blocks
    assert llm.reset_prefix_cache()
    auto = report({"ratio": "auto"})["fusionrag"]  # issue 50: the share its selection chose, and the setting
    assert isinstance(auto["ratio"], float) and 0.0 < auto["ratio"] <= 1.0 and auto["auto_ratio"]
    assert auto["recomputed_tokens"] >= int(auto["ratio"] * context)
    assert report("off")["fusionrag"] == {"method": "off", "reason": "off"}
