"""vLLM (CPU build) as a long-lived TTFT worker; runs in benchmarks/engines/.venvs/vllm.

    .venvs/vllm/bin/python vllm_worker.py --model FOLDER --threads N [--dtype bfloat16]

Loads the safetensors folder once (fusionrag's $FUSIONRAG_HOME/models/qwen2.5-0.5b-*), prints
{"ready": true, ...} and answers the JSON-lines protocol of _worker_io.py. TTFT = wall time of
llm.generate(TokensPrompt(ids), max_tokens=1, temperature=0): feeding exactly those ids (no
tokenizer, no chat template) and producing the first greedy token. "cold" empties the prefix cache
first (llm.reset_prefix_cache()); "keep" leaves it, so vLLM's automatic prefix caching reuses the
full blocks a request shares with earlier ones (the reply's "cached_tokens" says how many).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _worker_io import log, protocol_stream, send, serve


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face safetensors folder")
    p.add_argument("--threads", type=int, required=True, help="OpenMP threads (pin cores with taskset)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--max-model-len", type=int, default=10240)
    p.add_argument("--kv-space-gib", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generate at load")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (mp executor, one core per rank: the "
                                                      "worker's taskset gives the cores)")
    p.add_argument("--kv-transfer-config", default=None,
                   help="JSON of vLLM's --kv-transfer-config (e.g. fusionrag's connector); a request then picks "
                        "its cell with \"kv_transfer_params\"")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    proto = protocol_stream()
    # Read by vLLM (and OpenMP) at import / engine start: set before importing vllm. The engine
    # core runs in a spawned child process, which inherits them (and the taskset CPU mask).
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    cores = sorted(os.sched_getaffinity(0))
    # one core per rank under tensor parallelism (vLLM binds rank r's threads to the r-th list), else no binding
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores[:args.tp])) if args.tp > 1 else "nobind"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = time.perf_counter()
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if args.kv_transfer_config is None else {"kv_transfer_config": json.loads(args.kv_transfer_config)}
    if args.tp > 1:
        extra.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, enforce_eager=True,
              max_model_len=args.max_model_len, seed=0, **extra)

    def generate(ids: list[int], kv_transfer_params: dict | None = None):
        greedy = SamplingParams(max_tokens=1, temperature=0.0, extra_args=None if kv_transfer_params is None
                                else {"kv_transfer_params": kv_transfer_params})
        return llm.generate(TokensPrompt(prompt_token_ids=ids), greedy, use_tqdm=False)[0]

    if not args.no_warmup:  # first-call costs (kernel creation, allocator) stay out of the first cold TTFT
        generate(list(range(1000, 1256)))
        llm.reset_prefix_cache()
    load_s = time.perf_counter() - t0

    def ttft(ids: list[int], cache: str, kv_transfer_params: dict | None = None) -> dict:
        if cache == "cold" and not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache() refused (requests still running?)")
        start = time.perf_counter()
        out = generate(ids, kv_transfer_params)
        elapsed = time.perf_counter() - start
        return {"ttft_s": elapsed, "first_token": int(out.outputs[0].token_ids[0]),
                "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                "cache": cache, "served": (out.kv_transfer_params or {}).get("fusionrag")}

    def config_value(path: str):
        obj = llm.llm_engine
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)
        except AttributeError:
            return None

    def info() -> dict:
        return {"engine": "vllm", "vllm": vllm.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__, "dtype": args.dtype, "threads": args.threads, "tp": args.tp,
                "torch_threads": torch.get_num_threads(), "model": args.model,
                "max_model_len": args.max_model_len, "kv_cache_space_gib": args.kv_space_gib,
                "block_size": config_value("vllm_config.cache_config.block_size"),
                "max_num_batched_tokens": config_value("vllm_config.scheduler_config.max_num_batched_tokens"),
                "chunked_prefill": config_value("vllm_config.scheduler_config.enable_chunked_prefill"),
                "prefix_caching": True, "enforce_eager": True, "load_s": round(load_s, 2),
                "cpu_affinity": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}

    log(f"vllm_worker: ready in {load_s:.1f} s")
    send(proto, {"ready": True, **info()})
    serve(proto, ttft, info)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: this guard is required
    main()
