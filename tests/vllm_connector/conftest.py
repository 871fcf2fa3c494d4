"""The tiny vLLM engine the connector's tests share (one engine start, ~30 s, for every test file here).

A tiny random Qwen2 saved as a Hugging Face folder, a fused store of the sample's passages built by fusionrag
from it, and vLLM's CPU build with the connector, fp32, prefix caching on as vLLM is deployed. Each request
picks its cell with ``kv_transfer_params`` (``{"fusionrag": {"ratio": r}}``, or ``"off"``: vLLM's own prefill).
"""

from __future__ import annotations

import os

import pytest

from vllm_helpers import VOCAB, closed_port, connector_config, tiny_store


@pytest.fixture(scope="session")
def parts(tmp_path_factory):
    """A tiny Qwen2 folder (head size 32: vLLM's CPU kernels need >= 32), a fused store of the sample's
    passages built by fusionrag from that folder, and one vLLM engine with the connector, whose shared
    Redis tier is unreachable (nothing listens on its port): every test below is also served through a
    tier that is down, which must cost nothing but reads from the store's files."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm "
                                       "(bash scripts/setup.sh --test makes it)")
    from vllm import LLM

    root = tmp_path_factory.mktemp("vllm")
    folder, lm, store = tiny_store(root)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    debug = root / "debug"
    config = connector_config(store, debug, memory_budget_mb=0,  # every read from the files: the fault tests
                              load_tokens_per_step=48,  # asynchronous loads in many pieces: each load spans steps
                              kv_tier=f"redis://127.0.0.1:{closed_port()}")
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, enable_prefix_caching=True, block_size=32,
              max_model_len=4096, max_logprobs=VOCAB, kv_transfer_config=config, seed=0)
    yield {"folder": folder, "lm": lm, "store": store, "llm": llm, "debug": debug, "root": root}
    del llm
