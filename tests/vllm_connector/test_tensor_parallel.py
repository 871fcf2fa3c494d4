"""The connector under vLLM's tensor parallelism (TP=2 on the CPU build: two worker processes, one core each).

Each rank loads only its own stored KV heads, the question's scores are summed over the ranks and one
selection is used by both (:mod:`fusionrag.vllm.parallel`). Two layouts: 2 KV heads split one per rank, and
1 KV head replicated on both. fp32, a tiny random Qwen2 (4 query heads of 32).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm")

from fusionrag.online.engine import Engine
from vllm_helpers import QUESTION, VOCAB, connector_config, prompt_ids, run, tiny_store


@pytest.fixture(scope="module", params=[2, 1], ids=["kv-heads-split", "kv-heads-replicated"])
def tp2(request, tmp_path_factory, monkeypatch_module):
    from vllm import LLM

    root = tmp_path_factory.mktemp(f"tp2-kv{request.param}")
    folder, lm, store = tiny_store(root, hidden_size=128, num_attention_heads=4, num_key_value_heads=request.param)
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "nobind")
    debug = root / "debug"
    config = connector_config(store, debug, memory_budget_mb=0, load_tokens_per_step=16)  # both ranks cut pieces
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, enable_prefix_caching=True, block_size=32,
              max_model_len=4096, max_logprobs=VOCAB, kv_transfer_config=config, seed=0,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    yield {"llm": llm, "lm": lm, "store": store, "debug": debug, "root": root}
    del llm


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _run(tp2, ids, cell, max_tokens=1, reset=True):
    """:func:`vllm_helpers.run` on the TP=2 engine, with the tokens the connector recomputed (None: not loaded)."""
    first, tokens = run(tp2, ids, cell, max_tokens=max_tokens, reset=reset)
    files = list(tp2["debug"].glob("*.json"))
    return first, tokens, json.loads(files[0].read_text())["selected"] if files else None


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum())


def test_ratio_one_under_tp2_is_vllms_own_tp2_prefill(tp2):
    ids = prompt_ids(tp2["store"], tp2["store"].chunk_ids()[:4])
    exact, exact_tokens, none = _run(tp2, ids, "off", max_tokens=16)
    ours, our_tokens, selected = _run(tp2, ids, {"ratio": 1.0}, max_tokens=16)
    assert none is None and selected, "the connector must load the ratio-1 request (and not the off one)"
    assert (ours - exact).abs().max() < 1e-3
    assert our_tokens == exact_tokens


def test_fifteen_percent_under_tp2_selects_as_one_rank_and_is_as_close_to_full_attention(tp2):
    """The same tokens as TP=1 (our engine's selection, which the TP=1 connector equals), and a first-token
    KL to Full Attention within 1e-3 of TP=1's."""
    store, lm = tp2["store"], tp2["lm"]
    chunk_ids = store.chunk_ids()[:5]
    ids = prompt_ids(store, chunk_ids)
    exact, _, _ = _run(tp2, ids, "off")
    approx, _, selected = _run(tp2, ids, {"ratio": 0.15})
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    one_rank = Engine(store, lm).prepare(QUESTION, method="fusionrag", ratio=0.15, chunks=chunks)
    assert selected == one_rank.pre.selected.tolist()
    reference = torch.log_softmax(one_rank.pre.last_logits.float(), -1)
    assert abs(_kl(exact, approx) - _kl(exact, reference)) < 1e-3
    after, _, _ = _run(tp2, ids, "off", reset=False)  # prefix caching on: still exact after an approximate one
    assert (after - exact).abs().max() < 1e-5


def test_a_corrupted_entry_under_tp2_falls_back_on_every_rank(tp2):
    """Both ranks agree before any pass: a read that fails means vLLM's own prefill, on both, and the engine
    serves on."""
    store = tp2["store"]
    chunk_ids = store.chunk_ids()[2:6]
    ids = prompt_ids(store, chunk_ids)
    exact, _, _ = _run(tp2, ids, "off")
    path = store.kv_path(chunk_ids[1], "fused")
    saved = tp2["root"] / "saved.kv"
    shutil.copy(path, saved)
    try:
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        broken, _, _ = _run(tp2, ids, {"ratio": 0.15})
    finally:
        shutil.copy(saved, path)
    assert (broken - exact).abs().max() < 1e-3
    after, _, selected = _run(tp2, ids, {"ratio": 1.0})
    assert selected and (after - exact).abs().max() < 1e-3
