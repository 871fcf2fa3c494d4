"""GPU benchmark: TTFT of every method at 8K / 16K / 32K tokens on the Qwen2.5-7B shape, and the kernel alone.

One command, no download: the model is randomly initialised with Qwen2.5-7B's configuration
(built with transformers' ``Qwen2Config``; timing does not depend on weight values) in bf16
on the GPU. Writes ``gpu_bench.json`` and ``gpu_bench.md`` to ``--out``.

Measured, methods interleaved (each round runs every cell once; medians over rounds),
``torch.cuda.synchronize()`` around every timed call:
- ``transformers``: the library's own prefill, ``model(ids, logits_to_keep=1)`` with SDPA;
- ``full``: our Full Attention path (the same causal kernel, no mask);
- ``full_reuse``: assemble the chunks' KV (already on the GPU) + prefill the question;
- ``fusionrag_15_<backend>``: query-guided selection + sparse recompute of 15%, the sparse
  passes on ``reference`` (masked SDPA), ``triton`` (Q-Sparse-Attn, a program per query head)
  or ``triton-packed`` (a program per KV head, its query heads packed into the tile's rows); the
  recompute pass is in place (decision 050) on ``reference`` and ``triton-packed``, past + new on ``triton``;
- ``cacheblend_15``: CacheBlend's selection (two fresh layers) + the same recompute (the last backend);
- ``fusionrag_15_pinned`` / ``fusionrag_15_disk`` (the device and pinned host tiers): FusionRAG 15% on the last backend
  with the chunks' KV waiting in page-locked host memory (copied to the GPU by each request), or in a
  store's files on local disk (fp16, read, verified and copied by each request after being dropped
  from the OS page cache); the ``fusionrag_15_<backend>`` cells have it on the GPU already.
First the kernels alone against masked SDPA at 15% of each ``--kernel-contexts`` size (one layer's
shapes; the packed kernel's autotuned tiles recorded), then the TTFT table, and an exactness check:
ratio 1 against Full Attention on every backend. Triton backends that cannot run here (no CUDA and
no ``TRITON_INTERPRET=1``) are left out, with a note in the JSON; under the interpreter their
timings exercise the code and measure nothing.

Usage (H200, ~2 min): ``python benchmarks/gpu/gpu_bench.py --out benchmarks/gpu/results``
CPU smoke test (seconds): ``TRITON_INTERPRET=1 python benchmarks/gpu/gpu_bench.py --config tiny --device cpu
--contexts 96,160 --chunk-tokens 32 --repeats 1 --kernel-contexts 128 --out /tmp/gb``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SYSTEM_TOKENS = 64
QUESTION_TOKENS = 32
RATIO = 0.15


def qwen_config(name: str):
    """Qwen2.5-7B's shape (28 layers, 28 query / 4 KV heads of 128, 18944 MLP), 3B's, 0.5B's, or a tiny one."""
    from transformers import Qwen2Config

    if name == "qwen2.5-7b":
        return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           use_sliding_window=False, sliding_window=None)
    if name == "qwen2.5-3b":  # gpu_serve.py's fallback: 36 layers, 16 query / 2 KV heads of 128
        return Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                           num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           use_sliding_window=False, sliding_window=None)
    if name == "qwen2.5-0.5b":  # the CPU model's shape: 24 layers, 14 query / 2 KV heads of 64
        return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           use_sliding_window=False, sliding_window=None)
    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,  # as the real ones
                       rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)


def random_model(config_name: str, device: str, dtype: torch.dtype):
    """A randomly initialised model, created directly on ``device`` (no 15 GB detour through the CPU)."""
    from transformers import AutoModelForCausalLM

    from fusionrag.models.compat import check_supported
    from fusionrag.models.registry import LoadedModel

    config = qwen_config(config_name)
    check_supported(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return LoadedModel(f"random-{config_name}", model.eval(), None, "random-weights")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], object]) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000.0, out


@dataclasses.dataclass
class Prompt:
    system: list[int]
    chunks: list[list[int]]
    question: list[int]

    @property
    def ids(self) -> list[int]:
        return [*self.system, *(t for c in self.chunks for t in c), *self.question]


def make_prompt(vocab: int, total: int, chunk_tokens: int, system: int, question: int) -> Prompt:
    """Random token ids: ``S``, chunks of ``chunk_tokens`` (the last one ragged), ``Q``; ``total`` in all."""
    g = torch.Generator().manual_seed(total)
    body = total - system - question
    sizes = [chunk_tokens] * (body // chunk_tokens) + ([body % chunk_tokens] if body % chunk_tokens else [])
    rand = lambda n: torch.randint(10, vocab - 10, (n,), generator=g).tolist()  # noqa: E731
    return Prompt(rand(system), [rand(n) for n in sizes], rand(question))


def methods(lm, prompt: Prompt, chunk_kvs: list, s_kv, backends: list[str],
            tiers: dict[str, Callable[[], list]] | None = None) -> dict[str, Callable[[], object]]:
    """Each method as a zero-argument call from token ids (and reused KV) to first-token logits;
    ``tiers``: ``{name: () -> the chunks' KV from that tier}``, one FusionRAG 15% cell each."""
    from fusionrag.execution.attention_hook import attention_implementation
    from fusionrag.online.methods import make_policy
    from fusionrag.online.policies import SelectionInput, select
    from fusionrag.online.prefill import assemble_context, prefill_full, prefill_reused

    ids = torch.tensor([prompt.ids], device=lm.device)

    def transformers_prefill():
        with attention_implementation(lm.model, "sdpa"):
            return lm.model(ids, logits_to_keep=1).logits[0, -1]

    def reused(method: str, ratio: float, backend: str, kvs: Callable[[], list] = lambda: chunk_kvs):
        def run():
            view = dataclasses.replace(lm, attention=backend)
            ctx, ctx_ids, spans = assemble_context(view, s_kv, kvs(), prompt.system, prompt.chunks)
            idx = None
            if ratio > 0:
                inp = SelectionInput(view, ctx, ctx_ids, spans, torch.tensor(prompt.question))
                idx = select(make_policy(method), inp, ratio)
            return prefill_reused(view, ctx, ctx_ids, spans, prompt.question, idx).last_logits
        return run

    cells = {"transformers": transformers_prefill,
             "full": lambda: prefill_full(lm, prompt.system, prompt.chunks, prompt.question).last_logits,
             "full_reuse": reused("fusionrag", 0.0, backends[-1])}
    for b in backends:
        cells[f"fusionrag_15_{b}"] = reused("fusionrag", RATIO, b)
    cells["cacheblend_15"] = reused("cacheblend", RATIO, backends[-1])
    for name, kvs in (tiers or {}).items():
        cells[f"fusionrag_15_{name}"] = reused("fusionrag", RATIO, backends[-1], kvs)
    return cells


def host_tiers(chunk_kvs: list, chunks: list[list[int]], folder: Path) -> tuple[Callable[[int], list],
                                                                             Callable[[int], list]]:
    """The chunks' KV in page-locked host memory (plain host memory without CUDA) and in a store's files
    (fp16, as stores keep it): ``pinned(n)`` / ``disk(n)`` give the first ``n`` chunks' KV from there, the
    disk ones read and verified after their files are dropped from the OS page cache."""
    from fusionrag.kvcache.kv import KV
    from fusionrag.kvcache.sources import drop_from_page_cache
    from fusionrag.kvcache.store import KVStore

    pin = torch.cuda.is_available()
    host = [KV(*(t.to("cpu").pin_memory() if pin else t.to("cpu") for t in (kv.keys, kv.values)), kv.base_position)
            for kv in chunk_kvs]
    store = KVStore(folder, "gpu-bench", "random-system", "float16")
    for i, kv in enumerate(host):
        store.save(i, "plain", kv, chunks[i])

    def disk(n: int) -> list:
        drop_from_page_cache(store.path(i, "plain") for i in range(n))
        return [store.load(i, "plain", token_ids=chunks[i]).kv for i in range(n)]

    return (lambda n: host[:n]), disk


def median_ms(device: str, fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call (kernels compiled, allocator grown)."""
    timed(device, fn)
    return statistics.median(timed(device, fn)[0] for _ in range(repeats))


def kernel_inputs(lm, context: int) -> tuple[tuple[torch.Tensor, ...], Callable[[], object], float]:
    """One layer's sparse-pass inputs at ``RATIO`` of ``context`` (+ the question): ``(q, k_past, v_past,
    k_new, v_new)``, a factory of fresh :class:`SparseQuery` specs (each memoises its own per-pass masks),
    and the softmax scale."""
    from fusionrag.execution.attention_backends import SparseQuery

    cfg, dev, dtype = lm.config, lm.device, lm.dtype
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randperm(context - SYSTEM_TOKENS, generator=g)[: int(RATIO * context)].sort().values + SYSTEM_TOKENS
    pos = torch.cat([idx, torch.arange(context, context + QUESTION_TOKENS)]).to(dev)
    stale = torch.zeros(context, dtype=torch.bool, device=dev)
    stale[idx.to(dev)] = True
    n = pos.numel()
    t = lambda *s: torch.randn(*s, generator=g).to(device=dev, dtype=dtype)  # noqa: E731
    tensors = (t(hq, n, d), t(hkv, context, d), t(hkv, context, d), t(hkv, n, d), t(hkv, n, d))
    return tensors, lambda: SparseQuery(pos, 0, context, stale), d ** -0.5


def kernel_alone(lm, context: int, backends: list[str], repeats: int) -> list[dict]:
    """One layer's sparse recompute attention at 15% of ``context``: every backend vs masked SDPA (and the
    Triton kernels against each other)."""
    from fusionrag.execution.attention_backends import get_backend

    tensors, spec, scale = kernel_inputs(lm, context)
    names = ["reference", *[b for b in backends if b != "reference"]]
    specs = {b: spec() for b in names}  # one per backend, reused across calls: per-pass memo, as in a real pass
    outs = {b: get_backend(b)(*tensors, specs[b], scale).float() for b in names}  # warm-up / compile
    times: dict[str, list[float]] = {b: [] for b in names}
    for _ in range(repeats):  # interleaved
        for b in names:
            times[b].append(timed(str(lm.device), lambda b=b: get_backend(b)(*tensors, specs[b], scale))[0])
    n = tensors[0].shape[1]
    rows = [{"backend": b, "ms": statistics.median(times[b]), "samples_ms": times[b], "queries": n,
             "context": context, "layers": lm.config.num_hidden_layers,
             "max_abs_diff_vs_reference": float((outs[b] - outs["reference"]).abs().max())} for b in names]
    ref = next(r["ms"] for r in rows if r["backend"] == "reference")
    per_head = next((r["ms"] for r in rows if r["backend"] == "triton"), None)
    for r in rows:
        r["speedup_vs_masked_sdpa"] = ref / r["ms"]
        r["speedup_vs_per_head_kernel"] = per_head / r["ms"] if per_head else None
    return rows


def usable_backends(names: list[str], device: str) -> tuple[list[str], list[str]]:
    """``(backends that run here, notes on those left out)``: the Triton kernels need CUDA or the interpreter."""
    from fusionrag.execution.attention_backends import triton_available

    if triton_available():
        notes = [] if device.startswith("cuda") else [
            "Triton kernels ran under TRITON_INTERPRET=1 on the CPU: their timings exercise the code, not the kernel"]
        return names, notes
    kept = [b for b in names if not b.startswith("triton")]
    return kept, [f"left out {b}: Triton cannot run here (no CUDA device, TRITON_INTERPRET unset or Triton "
                  "not installed)" for b in names if b not in kept]


def packed_autotune(backends: list[str]) -> dict:
    """The packed kernel's autotuned tile per (head size, group size, query-count bucket, dtypes) so far."""
    if "triton-packed" not in backends:
        return {}
    from fusionrag.execution.attention_backends import qsparse_packed

    return qsparse_packed.best_configs()


def run(args: argparse.Namespace, save: Callable[[dict], None] = lambda doc: None) -> dict:
    """Kernel alone first, then each context (smallest first); ``save`` gets the document after each
    step, so a run stopped at its time limit keeps every finished step."""
    from fusionrag.execution.segments import chunk_kv_plain, system_kv
    from fusionrag.models.devices import DTYPES, default_device

    dtype = DTYPES[args.dtype]
    device = args.device or default_device()
    t0 = time.perf_counter()
    lm = random_model(args.config, device, dtype)
    backends, notes = usable_backends(args.backends.split(","), device)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    build_ms = (time.perf_counter() - t0) * 1000.0
    rows: list[dict] = []
    exactness: list[dict] = []
    kernel: list[dict] = []
    doc = {"meta": _meta(args, lm, device, build_ms), "notes": notes, "rows": rows, "kernel": kernel,
           "exactness": exactness, "packed_autotune": {}}
    for context in sorted(int(c) for c in args.kernel_contexts.split(",") if c):
        kernel.extend(kernel_alone(lm, context, backends, max(3, args.repeats)))
        doc["packed_autotune"] = packed_autotune(backends)
        print(f"[gpu_bench] kernel {context}: " + ", ".join(
            f"{k['backend']} {k['ms']:.2f} ms" for k in kernel if k["context"] == context), file=sys.stderr, flush=True)
        save(doc)
    if args.kernel_only:
        contexts = []
    longest = None if not contexts else make_prompt(lm.config.vocab_size, contexts[-1], args.chunk_tokens,
                                                    SYSTEM_TOKENS, QUESTION_TOKENS)
    if longest is not None:
        s_kv = system_kv(lm, longest.system).to(device=device)
        all_kvs = [chunk_kv_plain(lm, s_kv, c).to(device=device) for c in longest.chunks]  # the device tier
        pinned, disk = host_tiers(all_kvs, longest.chunks, Path(tempfile.mkdtemp(prefix="gpu-bench-kv-")))
    for total in contexts:
        body = total - SYSTEM_TOKENS - QUESTION_TOKENS
        n_chunks = -(-body // args.chunk_tokens)
        prompt = Prompt(longest.system, [c for c in longest.chunks[:n_chunks]], longest.question)
        kvs = all_kvs[:n_chunks]
        cells = methods(lm, prompt, kvs, s_kv, backends,
                        {"pinned": lambda n=n_chunks: pinned(n), "disk": lambda n=n_chunks: disk(n)})
        samples: dict[str, list[float]] = {name: [] for name in cells}
        for fn in cells.values():  # warm-up: kernels compiled, allocator grown
            timed(device, fn)
        for _ in range(args.repeats):
            for name, fn in cells.items():
                samples[name].append(timed(device, fn)[0])
        fa = min(statistics.median(samples["transformers"]), statistics.median(samples["full"]))
        for name, ts in samples.items():
            med = statistics.median(ts)
            rows.append({"context_tokens": len(prompt.ids), "method": name, "ttft_ms": med,
                         "samples_ms": ts, "speedup_vs_full_attention": fa / med})
        print(f"[gpu_bench] {total}: " + ", ".join(f"{r['method']} {r['ttft_ms']:.0f} ms" for r in rows[-len(cells):]),
              file=sys.stderr, flush=True)
        if total == contexts[0]:
            exactness.extend(_exactness(lm, prompt, kvs, s_kv, backends))
        doc["packed_autotune"] = packed_autotune(backends)
        save(doc)
    return doc


def _exactness(lm, prompt: Prompt, kvs: list, s_kv, backends: list[str]) -> list[dict]:
    """Ratio 1 on each backend against Full Attention (max |logit difference|, first token)."""
    from fusionrag.online.prefill import all_chunk_indices, assemble_context, prefill_full, prefill_reused

    full = prefill_full(lm, prompt.system, prompt.chunks, prompt.question).last_logits
    out = []
    for b in backends:
        view = dataclasses.replace(lm, attention=b)
        ctx, ctx_ids, spans = assemble_context(view, s_kv, kvs, prompt.system, prompt.chunks)
        res = prefill_reused(view, ctx, ctx_ids, spans, prompt.question, all_chunk_indices(spans))
        out.append({"backend": b, "max_abs_logit_diff_ratio1_vs_full": float((res.last_logits - full).abs().max()),
                    "logit_scale": float(full.abs().max())})
    return out


def _meta(args: argparse.Namespace, lm, device: str, build_ms: float) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "config": args.config,
            "dtype": args.dtype, "device": device, "gpu": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton_version, "python": platform.python_version(),
            "repeats": args.repeats, "chunk_tokens": args.chunk_tokens, "system_tokens": SYSTEM_TOKENS,
            "question_tokens": QUESTION_TOKENS, "ratio": RATIO, "model_build_ms": build_ms,
            "weights": "random (timing does not depend on weight values)"}


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = ["# GPU TTFT benchmark", "",
             f"`{m['command']}`  ", f"{m['gpu'] or m['device']}, {m['config']} shape, {m['dtype']}, random weights; "
             f"torch {m['torch']}, transformers {m['transformers']}, triton {m['triton']}. Cells interleaved, "
             f"median of {m['repeats']} rounds; speed-up against the faster of `transformers` and `full`.", "",
             "| context tokens | method | TTFT ms | speed-up vs Full Attention |", "|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['context_tokens']:,} | {r['method']} | {r['ttft_ms']:.1f} | "
                     f"{r['speedup_vs_full_attention']:.2f}x |")
    lines += ["", "## Sparse attention alone (one layer, 15% of the context + question)", "",
              "| backend | context | queries | ms | vs masked SDPA | vs per-head kernel | max abs diff vs reference |",
              "|---|---|---|---|---|---|---|"]
    for k in doc["kernel"]:
        vs_head = f"{k['speedup_vs_per_head_kernel']:.2f}x" if k.get("speedup_vs_per_head_kernel") else "-"
        lines.append(f"| {k['backend']} | {k['context']:,} | {k['queries']:,} | {k['ms']:.2f} | "
                     f"{k['speedup_vs_masked_sdpa']:.2f}x | {vs_head} | {k['max_abs_diff_vs_reference']:.2e} |")
    if doc.get("packed_autotune"):
        lines += ["", "Packed kernel's autotuned tiles (key: head size, group size, query-count bucket, dtypes): "
                  + "; ".join(f"`{k}` -> {v}" for k, v in doc["packed_autotune"].items())]
    if doc.get("notes"):
        lines += ["", *(f"Note: {n}" for n in doc["notes"])]
    lines += ["", "## Ratio 1 vs Full Attention (smallest context)", "",
              "| backend | max abs first-token logit diff | largest logit |", "|---|---|---|"]
    for e in doc["exactness"]:
        lines.append(f"| {e['backend']} | {e['max_abs_logit_diff_ratio1_vs_full']:.2e} | {e['logit_scale']:.2f} |")
    return "\n".join(lines) + "\n"


def _save(out: Path, doc: dict) -> None:
    """Both files written atomically: a stop mid-write leaves the last good copy."""
    from fusionrag.files import atomic_write

    atomic_write(out / "gpu_bench.json", json.dumps(doc, indent=2))
    atomic_write(out / "gpu_bench.md", markdown(doc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.md")
    p.add_argument("--config", choices=["qwen2.5-7b", "qwen2.5-0.5b", "tiny"], default="qwen2.5-7b")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--contexts", default="8192,16384,32768", help="context sizes in tokens (S + chunks + Q)")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default="reference,triton-packed,triton", help="sparse-pass backends; the last "
                   "one (the default CUDA backend, as in the first run) also runs Full Reuse and CacheBlend")
    p.add_argument("--kernel-contexts", default="8192,16384,32768", help="context sizes of the kernels-alone "
                   "comparison (15%% of each + the question)")
    p.add_argument("--kernel-only", action="store_true", help="only the attention-alone comparison")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = run(args, save=lambda d: _save(out, d))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    raise SystemExit(main())
