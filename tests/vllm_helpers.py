"""Requests to the tiny vLLM engine of ``tests/vllm_connector/conftest.py`` (the ``parts`` fixture)."""

from __future__ import annotations

import json

import torch

QUESTION = "Who discovered polonium?"
VOCAB = 262


def tiny_store(root, family: str = "qwen2", architecture: str = "Qwen2ForCausalLM", model=None, **overrides):
    """A tiny random checkpoint (``model``, or one of ``family`` made here; head size 32 by default: vLLM's CPU
    kernels need >= 32) saved as a Hugging Face folder with the byte tokenizer, and a fused fp32 store of the
    sample's passages built by fusionrag from it: ``(folder, lm, store)``."""
    from fusionrag.models import load_model
    from fusionrag.models.tiny import byte_tokenizer, tiny_model
    from fusionrag.offline import build
    from fusionrag.retrieval.embedder import HashingEmbedder
    from fusionrag.sample import load_sample

    folder = root / f"tiny-{family}"
    if model is None:
        model = tiny_model(family, **{"num_attention_heads": 2, "num_key_value_heads": 1, **overrides})
        model.config.architectures = [architecture]
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    lm = load_model(str(folder), dtype="float32", device="cpu")
    store = build.create_store(root / "kb", lm, chunk_tokens=4096, kv_dtype="float32", embedder=HashingEmbedder(),
                               model_source=str(folder))
    build.add_passages(store, lm, [p for ex in load_sample()[:2] for p in ex["passages"]], doc="sample")
    build.fuse(store, lm, top_n=2, progress=False)
    return folder, lm, store


def connector_config(store, debug, **extra) -> dict:
    """vLLM's ``kv_transfer_config`` for the connector over ``store`` (15%, short contexts served, a debug folder)."""
    return {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store.path), "ratio": 0.15, "min_context_tokens": 16,
                                          "debug_dir": str(debug), **extra}}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompt_ids(store, chunk_ids):
    ids = list(store.prompt.system_token_ids)
    for c in chunk_ids:
        ids += list(store.chunk(c).token_ids)
    return ids + list(store.prompt.question_token_ids(QUESTION))


def reset_prefix_cache(llm, within_s: float = 30.0) -> bool:
    """Empty vLLM's prefix cache once no request holds blocks: a request aborted while its KV was loading
    asynchronously keeps its blocks until the worker names its load finished, a step later (vLLM's contract:
    the worker may still be writing them), and vLLM refuses to reset while blocks are held."""
    import time

    deadline = time.monotonic() + within_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run(parts, ids, cell, max_tokens=1, reset=True):
    """First-token log-probabilities over the whole vocabulary and the greedy tokens, for one cell; vLLM's
    prefix cache (on, as deployed) is emptied first unless ``reset`` is False."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for old in parts["debug"].glob("*.json"):  # what the connector writes now is this request's
        old.unlink()
    if reset:
        assert reset_prefix_cache(parts["llm"])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=VOCAB,
                            extra_args={"kv_transfer_params": {"fusionrag": cell}})
    out = parts["llm"].generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0].outputs[0]
    first = torch.full((VOCAB,), float("-inf"))
    for tok, lp in out.logprobs[0].items():
        first[tok] = lp.logprob
    return first, list(out.token_ids)


def selected_of(parts) -> list[int]:
    files = list(parts["debug"].glob("*.json"))
    assert len(files) == 1, "the connector loaded no request (or several)"
    return json.loads(files[0].read_text())["selected"]
