"""The connector on every model family fusionrag serves, inside vLLM (the CPU build), fp32, prefix caching on.

For each tiny random checkpoint of ``tests/family_helpers.py`` (the same cases our engine is tested exact on),
a store built by fusionrag and a vLLM engine with the connector: recomputing 100% is vLLM's own prefill
(first-token log-probabilities within 1e-3, the same 8 greedy tokens), and 15% selects our engine's tokens.
vLLM runs the families as it runs them for users: natively (Llama, Qwen2/3, Qwen3-MoE, Mistral, Phi-3,
Granite, StableLM) or through its Transformers backend (OLMo 2, GPT-NeoX). A configuration the connector
cannot serve stops vLLM at start, saying why.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm")
pytestmark = pytest.mark.slow

from family_helpers import FAMILIES, NOT_IN_VLLM, family_model  # noqa: E402
from fusionrag.online.engine import Engine  # noqa: E402
from vllm_helpers import QUESTION, VOCAB, connector_config, prompt_ids, run, tiny_store  # noqa: E402

MAX_MODEL_LEN = 2048  # phi3-longrope's original length: vLLM keeps its short factors, as the store's model did


def _llm(folder, store, debug, max_model_len=MAX_MODEL_LEN):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return LLM(model=str(folder), dtype="float32", enforce_eager=True, enable_prefix_caching=True, block_size=32,
               max_model_len=max_model_len, max_logprobs=VOCAB, seed=0,
               kv_transfer_config=connector_config(store, debug, memory_budget_mb=0,
                                                   async_loads=False))  # the synchronous path, on every family


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - set(NOT_IN_VLLM)))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder, lm, store = tiny_store(root, request.param, model=family_model(request.param))
    debug = root / "debug"
    llm = _llm(folder, store, debug)
    yield {"llm": llm, "lm": lm, "store": store, "debug": debug, "case": request.param}
    del llm


def test_ratio_one_is_vllms_own_prefill(family):
    ids = prompt_ids(family["store"], family["store"].chunk_ids()[:4])
    exact, exact_tokens = run(family, ids, "off", max_tokens=8)
    ours, our_tokens = run(family, ids, {"ratio": 1.0}, max_tokens=8)
    assert any(family["debug"].glob("*.json")), "the connector did not load the request"
    assert (ours - exact).abs().max() < 1e-3
    assert our_tokens == exact_tokens


def test_fifteen_percent_selects_our_engines_tokens(family):
    store, lm = family["store"], family["lm"]
    chunk_ids = store.chunk_ids()[:5]
    run(family, prompt_ids(store, chunk_ids), {"ratio": 0.15})
    (loaded,) = [json.loads(p.read_text()) for p in family["debug"].glob("*.json")]
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    ours = Engine(store, lm).prepare(QUESTION, method="fusionrag", ratio=0.15, chunks=chunks)
    assert loaded["selected"] == ours.pre.selected.tolist()


def test_a_model_vllm_rotates_otherwise_stops_vllm_at_start_saying_why(tmp_path, capfd):
    """Phi-3 with longrope, served past its original length: vLLM then rotates every position with the long
    factors, fusionrag's store holds keys rotated with the short ones: refused at start, not served wrong."""
    folder, _, store = tiny_store(tmp_path, "phi3-longrope", model=family_model("phi3-longrope"))
    with pytest.raises(Exception):  # noqa: B017 (vLLM wraps the worker's error in its own)
        _llm(folder, store, tmp_path / "debug", max_model_len=4096)
    assert "rotates phi3's keys otherwise" in capfd.readouterr().err


def test_a_family_fusionrag_does_not_serve_is_named_at_start(tmp_path, capfd):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fusionrag.models.tiny import byte_tokenizer

    _, _, store = tiny_store(tmp_path / "qwen", "llama", model=family_model("llama"))
    config = AutoConfig.for_model("gemma2", vocab_size=262, hidden_size=128, intermediate_size=128, head_dim=32,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, architectures=["Gemma2ForCausalLM"])
    folder = tmp_path / "tiny-gemma2"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    with pytest.raises(Exception):  # noqa: B017
        _llm(folder, store, tmp_path / "debug")
    assert "Gemma 2" in capfd.readouterr().err


