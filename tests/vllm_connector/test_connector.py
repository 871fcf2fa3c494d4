"""The connector inside a real vLLM (the CPU build), fp32, on a tiny random Qwen2 saved as a Hugging Face folder.

Runs in the vLLM environment ``scripts/setup.sh`` makes (``.venv-vllm``); skipped, saying so, where vLLM
is not importable. One vLLM engine serves every test (starting one takes ~30 s); each request picks its
cell with ``kv_transfer_params`` (``{"fusionrag": {"ratio": r}}``, or ``"off"``: vLLM's own prefill).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm "
                                          "(bash scripts/setup.sh --test makes it)")

from fusionrag.online.engine import Engine  # noqa: E402
from vllm_helpers import QUESTION, VOCAB, prompt_ids, reset_prefix_cache, run, selected_of  # noqa: E402


def test_ratio_one_is_vllms_own_prefill(parts):
    """Recomputing every context token through vLLM's layers gives vLLM's prefill: first-token log-probs
    within 1e-3 and the same 32 greedy tokens."""
    store = parts["store"]
    ids = prompt_ids(store, store.chunk_ids()[:4])
    ours, ours_tokens = run(parts, ids, {"ratio": 1.0}, max_tokens=32)
    assert len(selected_of(parts)) > 0  # the connector did load this request
    theirs, their_tokens = run(parts, ids, "off", max_tokens=32)
    assert (ours - theirs).abs().max() < 1e-3
    assert ours_tokens == their_tokens


def test_chunks_pasted_into_another_template_are_served_and_ratio_one_is_vllms_prefill(parts):
    """A client's own template (not fusionrag's ``S``), stored chunks pasted with separators between them: the
    connector serves the chunks from the store and recomputes the template's and the separators' ids (the
    gaps); at ratio 1 that is vLLM's own prefill, and at 15% every gap is among the recomputed tokens."""
    store, tok = parts["store"], parts["lm"].tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    chunks = store.chunk_ids()[:3]
    ids = [*enc("You answer from documents.\nDocuments:\n"), *store.chunk(chunks[0]).token_ids, *enc("\n---\n"),
           *store.chunk(chunks[1]).token_ids, *enc("\n---\n"), *store.chunk(chunks[2]).token_ids,
           *enc("\nQuestion: " + QUESTION + "\nAnswer:")]
    ours, ours_tokens = run(parts, ids, {"ratio": 1.0}, max_tokens=16)
    loaded = json.loads(next(parts["debug"].glob("*.json")).read_text())
    assert [c[0] for c in loaded["chunks"]] == chunks and loaded["chunks"][0][2] > 0  # served after the template
    theirs, their_tokens = run(parts, ids, "off", max_tokens=16)
    assert (ours - theirs).abs().max() < 1e-3
    assert ours_tokens == their_tokens
    run(parts, ids, {"ratio": 0.15})
    gaps = [*range(0, loaded["chunks"][0][2]),
            *(p for a, b in zip(loaded["chunks"], loaded["chunks"][1:], strict=False) for p in range(a[3], b[2]))]
    assert gaps and set(gaps) <= set(selected_of(parts))


def test_ratio_zero_is_our_engines_full_reuse(parts):
    store, lm = parts["store"], parts["lm"]
    chunk_ids = store.chunk_ids()[1:5]
    ids = prompt_ids(store, chunk_ids)
    ours, _ = run(parts, ids, {"ratio": 0.0})
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    engine = Engine(store, lm).prepare(QUESTION, method="fusionrag", ratio=0.0, chunks=chunks)
    reference = torch.log_softmax(engine.pre.last_logits.float(), -1)
    assert (ours - reference).abs().max() < 1e-3


def test_fifteen_percent_selects_the_tokens_our_engine_selects(parts):
    store, lm = parts["store"], parts["lm"]
    chunk_ids = store.chunk_ids()[:5]
    run(parts, prompt_ids(store, chunk_ids), {"ratio": 0.15})
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    engine = Engine(store, lm).prepare(QUESTION, method="fusionrag", ratio=0.15, chunks=chunks)
    assert selected_of(parts) == engine.pre.selected.tolist()


def test_auto_selects_what_our_engine_selects_and_a_bad_ratio_is_vllms_prefill(parts):
    """``ratio: "auto"`` (issue 50): the connector sizes the recompute with the store's setting, as our engine
    does, so both select the same tokens; a ratio no request can run is served by vLLM's own prefill."""
    store, lm = parts["store"], parts["lm"]
    chunk_ids = store.chunk_ids()[:5]
    ids = prompt_ids(store, chunk_ids)
    run(parts, ids, {"ratio": "auto"})
    loaded = json.loads(next(parts["debug"].glob("*.json")).read_text())
    assert loaded["ratio"] == "auto" and 0.0 < loaded["chosen_share"] <= 1.0
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    engine = Engine(store, lm).prepare(QUESTION, method="fusionrag", ratio="auto", chunks=chunks)
    assert loaded["selected"] == engine.pre.selected.tolist()
    bad, _ = run(parts, ids, {"ratio": "most"})
    assert not list(parts["debug"].glob("*.json"))  # not loaded: vLLM prefilled it
    theirs, _ = run(parts, ids, "off")
    assert (bad - theirs).abs().max() < 1e-3


def test_a_missing_or_corrupted_entry_falls_back_to_vllms_prefill(parts):
    """A flipped byte fails the worker's verified read (the request's blocks are reported invalid and vLLM
    prefills them); a chunk with no KV at all is not matched (vLLM prefills from there). Either way the
    answer is vLLM's own, and the engine goes on serving."""
    store = parts["store"]
    chunk_ids = store.chunk_ids()[2:6]
    ids = prompt_ids(store, chunk_ids)
    reference, _ = run(parts, ids, "off")
    saved = parts["root"] / "saved"
    saved.mkdir(exist_ok=True)
    paths = [store.kv_path(chunk_ids[1], "fused"), store.kv_path(chunk_ids[0], "plain"),
             store.kv_path(chunk_ids[0], "fused")]
    for p in paths:
        shutil.copy(p, saved / p.name)
    try:
        data = bytearray(paths[0].read_bytes())
        data[-10] ^= 0xFF
        paths[0].write_bytes(bytes(data))
        corrupted, _ = run(parts, ids, {"ratio": 0.15})
        paths[0].write_bytes(bytes(data[: len(data) // 2]))  # a write cut short
        truncated, _ = run(parts, ids, {"ratio": 0.15})
        for p in paths[1:]:
            p.unlink()
        missing, _ = run(parts, ids, {"ratio": 1.0})
    finally:
        for p in paths:
            shutil.copy(saved / p.name, p)
    assert (corrupted - reference).abs().max() < 1e-3
    assert (truncated - reference).abs().max() < 1e-3
    assert (missing - reference).abs().max() < 1e-3
    after, _ = run(parts, ids, {"ratio": 1.0})  # still up and serving
    assert (after - reference).abs().max() < 1e-3


def test_requests_aborted_before_during_or_after_their_kv_loads_leave_the_others_served(parts):
    """Requests aborted at different moments (the engine core runs on its own, so before the scheduler saw
    them, while the connector loads their chunks, or while they decode) take nothing down: the next
    request through the connector is still vLLM's own prefill at ratio 1."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    store = parts["store"]
    ids = prompt_ids(store, store.chunk_ids()[1:5])
    reference, _ = run(parts, ids, "off")
    engine = parts["llm"].llm_engine
    for k in range(4):
        params = SamplingParams(max_tokens=16, temperature=0.0,
                                extra_args={"kv_transfer_params": {"fusionrag": {"ratio": 0.15}}})
        engine.add_request(f"aborted-{k}", TokensPrompt(prompt_token_ids=ids), params)
        time.sleep(0.05 * k)
        engine.abort_request([f"aborted-{k}"])
    after, _ = run(parts, ids, {"ratio": 1.0})
    assert (after - reference).abs().max() < 1e-3


def test_a_chat_request_built_with_rag_messages_is_served_by_the_connector(parts):
    """What an OpenAI client sends (chat messages, vLLM's chat template): the stored chunks are found."""
    from vllm import SamplingParams

    from fusionrag.prompt import rag_messages

    store = parts["store"]
    passages = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in store.chunk_ids()[:3]]
    messages = rag_messages(store.prompt.system_prompt, passages, QUESTION)
    for old in parts["debug"].glob("*.json"):
        old.unlink()
    parts["llm"].reset_prefix_cache()
    parts["llm"].chat(messages, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    (loaded,) = [json.loads(p.read_text()) for p in parts["debug"].glob("*.json")]
    assert [c[0] for c in loaded["chunks"]] == store.chunk_ids()[:3]


@pytest.mark.parametrize(("extra", "refused"), [({"ratio": "auto"}, None), ({"ratio": 0.3}, None),
                                                ({"ratio": 1.5}, "within"), ({"ratio": "most"}, "within"),
                                                ({"ratio": "auto", "method": "reuse"}, None)])
def test_a_ratio_option_no_request_could_run_is_refused_at_start(extra, refused):
    from types import SimpleNamespace

    from fusionrag.vllm.connector import _options

    config = SimpleNamespace(kv_connector_extra_config={"store": "kb/", **extra})
    if refused is None:
        assert _options(config)["ratio"] in ("auto", 0.3, 0.0)
    else:
        with pytest.raises(ValueError, match=f"kv_connector_extra_config: 'ratio' must be a number {refused}"):
            _options(config)


def test_asynchronous_loads_run_beside_decodes_and_several_at_once(parts):
    """Issue 49: a request waits for its load outside vLLM's step (48 tokens a step here): a running request
    keeps decoding while it loads (sync loading ran the whole load inside one step: one token at most), and
    three loads in flight at once each end as they do alone (ratio 1: vLLM's
    prefill; 15%: our engine's selection)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    store, engine = parts["store"], parts["llm"].llm_engine
    assert reset_prefix_cache(parts["llm"])
    chunk_sets = [store.chunk_ids()[i:i + 4] for i in (0, 1, 2)]
    alone = [run(parts, prompt_ids(store, c), "off")[0] for c in chunk_sets]

    def params(cell, max_tokens=1):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=VOCAB,
                              extra_args={"kv_transfer_params": {"fusionrag": cell}})

    for old in parts["debug"].glob("*.json"):
        old.unlink()
    assert reset_prefix_cache(parts["llm"])
    engine.add_request("decoding", TokensPrompt(prompt_token_ids=prompt_ids(store, store.chunk_ids()[5:6])),
                       params("off", max_tokens=200))
    while not any(o.request_id == "decoding" and o.outputs[0].token_ids for o in engine.step()):
        pass
    for k, chunk_ids in enumerate(chunk_sets):
        engine.add_request(f"loaded-{k}", TokensPrompt(prompt_token_ids=prompt_ids(store, chunk_ids)),
                           params({"ratio": 1.0} if k < 2 else {"ratio": 0.15}))
    firsts, decoded_while_loading, steps = {}, 0, 0
    while len(firsts) < 3 and steps < 2000:
        steps += 1
        outputs = {o.request_id: o for o in engine.step()}
        if "decoding" in outputs and not firsts:
            decoded_while_loading += 1
        for rid, out in outputs.items():
            if rid.startswith("loaded-") and out.outputs[0].logprobs:
                first = torch.full((VOCAB,), float("-inf"))
                for tok, lp in out.outputs[0].logprobs[0].items():
                    first[tok] = lp.logprob
                firsts.setdefault(rid, first)
    engine.abort_request(["decoding"])
    while engine.has_unfinished_requests():
        engine.step()
    loads = [json.loads(p.read_text()) for p in parts["debug"].glob("*.json")]
    assert len(firsts) == 3 and len(loads) == 3  # all three were loaded
    assert decoded_while_loading >= 3
    for k in (0, 1):
        assert (firsts[f"loaded-{k}"] - alone[k]).abs().max() < 1e-3
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_sets[2]]
    ours = Engine(store, parts["lm"]).prepare(QUESTION, method="fusionrag", ratio=0.15, chunks=chunks)
    (path,) = parts["debug"].glob("loaded-2*.json")  # named by vLLM's id of the request (it may add a suffix)
    loaded = json.loads(path.read_text())
    assert loaded["selected"] == ours.pre.selected.tolist()
