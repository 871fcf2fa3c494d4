"""llama.cpp (llama-cpp-python) as a long-lived TTFT worker; runs in benchmarks/engines/.venvs/llama.

    .venvs/llama/bin/python llama_worker.py --gguf FILE --threads N [--n-batch 512]

Loads the GGUF once, prints {"ready": true, ...} and answers the JSON-lines protocol of
_worker_io.py. TTFT = wall time of feeding exactly those ids (no tokenizer, no BOS added, no chat
template) through Llama.generate and sampling the first token greedily (temp 0). "cold" first
clears the KV cache and the binding's token history, so nothing is reused; "keep" leaves both, and
Llama.generate's own prefix matching reuses the KV of the longest common prefix with the tokens it
evaluated last (the reply's "reused_tokens" says how many), evaluating only the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _worker_io import log, protocol_stream, send, serve


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="GGUF model file")
    p.add_argument("--threads", type=int, required=True, help="n_threads and n_threads_batch")
    p.add_argument("--n-ctx", type=int, default=10240)
    p.add_argument("--n-batch", type=int, default=512, help="logical batch (n_batch); n_ubatch follows it")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on",
                   help="llama-server's default is 'auto', which turns it on for the CPU backend")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up eval at load")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    proto = protocol_stream()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    t0 = time.perf_counter()
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=args.n_batch, n_ubatch=args.n_batch,
                          flash_attn=args.flash_attn == "on", logits_all=False, verbose=False, seed=0)

    def clear() -> None:
        llm.reset()  # the binding's token history: no prefix to match
        llm._ctx.kv_cache_clear()  # and the KV cells themselves

    def first_token(ids: list[int]) -> int:
        gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        try:
            return int(next(gen))
        finally:
            gen.close()

    if not args.no_warmup:
        first_token(list(range(1000, 1256)))
        clear()
    load_s = time.perf_counter() - t0

    def ttft(ids: list[int], cache: str) -> dict:
        if len(ids) >= args.n_ctx:
            raise ValueError(f"{len(ids)} ids do not fit n_ctx={args.n_ctx}")
        if cache == "cold":
            clear()
            reused = 0
        else:
            prev = llm._input_ids.tolist()
            same = (i for i, (a, b) in enumerate(zip(prev, ids, strict=False)) if a != b)
            reused = next(same, min(len(prev), len(ids)))
            if not (prev == ids and not llm._requires_eval):  # an exact repeat samples the live logits
                reused = min(reused, len(ids) - 1)  # otherwise generate() re-evaluates >= 1 token
        start = time.perf_counter()
        tok = first_token(ids)
        elapsed = time.perf_counter() - start
        return {"ttft_s": elapsed, "first_token": tok, "prompt_tokens": len(ids), "reused_tokens": reused,
                "cache": cache}

    def info() -> dict:
        cp = llm.context_params
        return {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
                "gguf": args.gguf, "threads": args.threads, "n_threads_batch": cp.n_threads_batch,
                "n_ctx": llm.n_ctx(), "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch,
                "flash_attn": args.flash_attn, "type_k": cp.type_k, "type_v": cp.type_v,
                "model_desc": llm.metadata.get("general.file_type"),
                "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                "load_s": round(load_s, 2), "cpu_affinity": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}

    log(f"llama_worker: ready in {load_s:.1f} s")
    send(proto, {"ready": True, **info()})
    serve(proto, ttft, info)


if __name__ == "__main__":
    main()
