"""Where FusionRAG 15%'s time goes at one context size, and the Q-Sparse-Attn kernel's tile sweep.

Companion of ``benchmarks/gpu/gpu_bench.py`` (same random model, same prompt): writes to ``--out``
- ``phases_<context>.json``: assemble (RoPE re-positioning), query-guided selection, the sparse
  recompute pass and the question-only pass, per attention backend (median of ``--repeats``), and a
  plain contiguous prefill of as many tokens as the sparse pass recomputes;
- ``profile_recompute_<context>.txt``: torch.profiler's kernel table of one sparse pass (triton);
- ``kernel_tiles_<context>.json``: the kernels alone against masked SDPA for each tile: the per-head
  kernel's ``--tiles`` and the packed kernel's ``--packed-tiles`` (what its autotuner chooses among).

Usage (H200, ~1 min): ``python benchmarks/gpu/gpu_profile.py --out benchmarks/gpu/results``
CPU smoke test: ``TRITON_INTERPRET=1 python benchmarks/gpu/gpu_profile.py --config tiny --device cpu
--context 256 --chunk-tokens 32 --backends reference,triton --tiles 16x16x4x2 --packed-tiles 16x16x1x1 --out /tmp/gp``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _backend_phases(bench, view, s_kv, kvs: list, p, repeats: int) -> tuple[dict, tuple]:
    """One backend's median assemble / select / recompute / question-only times, and the assembled
    context and selection (``(ctx, ids, spans, idx)``) for profiling one pass."""
    from fusionrag.online.methods import make_policy
    from fusionrag.online.policies import SelectionInput, select
    from fusionrag.online.prefill import assemble_context, prefill_reused

    dev = str(view.device)
    ctx, ids, spans = assemble_context(view, s_kv, kvs, p.system, p.chunks)
    inp = SelectionInput(view, ctx, ids, spans, torch.tensor(p.question))
    idx = select(make_policy("fusionrag"), inp, bench.RATIO)
    return {
        "assemble_ms": bench.median_ms(dev, lambda: assemble_context(view, s_kv, kvs, p.system, p.chunks), repeats),
        "select_ms": bench.median_ms(dev, lambda: select(make_policy("fusionrag"), inp, bench.RATIO), repeats),
        "recompute_ms": bench.median_ms(dev, lambda: prefill_reused(view, ctx, ids, spans, p.question, idx), repeats),
        "question_only_ms": bench.median_ms(dev, lambda: prefill_reused(view, ctx, ids, spans, p.question, None),
                                            repeats),
        "recomputed_tokens": int(idx.numel()),
    }, (ctx, ids, spans, idx)


def phases(bench, lm, context: int, chunk_tokens: int, backends: list[str], repeats: int) -> tuple[dict, str]:
    """Per backend: assemble / select / recompute / question-only, and the profiler table of one pass."""
    from fusionrag.execution.segments import chunk_kv_plain, system_kv
    from fusionrag.online.prefill import prefill_reused

    dev = str(lm.device)
    p = bench.make_prompt(lm.config.vocab_size, context, chunk_tokens, bench.SYSTEM_TOKENS, bench.QUESTION_TOKENS)
    s_kv = system_kv(lm, p.system).to(device=lm.device)
    kvs = [chunk_kv_plain(lm, s_kv, c).to(device=lm.device) for c in p.chunks]
    out: dict = {"context_tokens": len(p.ids), "ratio": bench.RATIO, "backends": {}}
    for b in backends:
        view = dataclasses.replace(lm, attention=b)
        out["backends"][b], (ctx, ids, spans, idx) = _backend_phases(bench, view, s_kv, kvs, p, repeats)
        print(f"[gpu_profile] {b}: {out['backends'][b]}", file=sys.stderr, flush=True)
    n = out["backends"][backends[-1]]["recomputed_tokens"] + len(p.question)
    ids_t = torch.tensor([p.ids[:n]], device=lm.device)
    out["contiguous_prefill_same_tokens_ms"] = bench.median_ms(dev, lambda: lm.model(ids_t, logits_to_keep=1), repeats)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        prefill_reused(view, ctx, ids, spans, p.question, idx)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
    sort = "cuda_time_total" if dev.startswith("cuda") else "cpu_time_total"
    return out, prof.key_averages().table(sort_by=sort, row_limit=30)


def kernel_tiles(bench, lm, context: int, tiles: list[dict[str, int]], repeats: int,
                 packed_tiles: list[dict[str, int]] = ()) -> dict:
    """The triton kernels alone at 15% of ``context`` (one layer's shapes) for each tile, vs masked SDPA;
    each backend keeps one spec across its calls, so the reference builds its mask once (as in a pass)."""
    from fusionrag.execution.attention_backends import get_backend, qsparse_packed, qsparse_triton

    tensors, spec, scale = bench.kernel_inputs(lm, context)
    ref, ref_spec = get_backend("reference"), spec()
    expected = ref(*tensors, ref_spec, scale).float()
    dev = str(lm.device)
    res: dict = {"context": context, "queries": tensors[0].shape[1], "dtype": str(lm.dtype),
                 "reference_ms": bench.median_ms(dev, lambda: ref(*tensors, ref_spec, scale), repeats), "tiles": []}
    runs = [("triton", qsparse_triton.attend, t) for t in tiles]
    runs += [("triton-packed", qsparse_packed.attend, t) for t in packed_tiles]
    for kernel, attend, tile in runs:
        sq = spec()
        got = attend(*tensors, sq, scale, config=tile).float()
        ms = bench.median_ms(dev, lambda attend=attend, tile=tile, sq=sq: attend(*tensors, sq, scale, config=tile),
                             repeats)
        res["tiles"].append({"kernel": kernel, **tile, "ms": ms, "speedup_vs_masked_sdpa": res["reference_ms"] / ms,
                             "max_abs_diff_vs_reference": float((got - expected).abs().max())})
        print(f"[gpu_profile] {kernel} tile {tile}: {ms:.2f} ms", file=sys.stderr, flush=True)
    return res


def parse_tiles(text: str, rows: str = "block_m") -> list[dict[str, int]]:
    """``64x64x4x2,128x64x8x3`` -> rows (``block_m``, the packed kernel's ``block_r``) x block_n x num_warps x
    num_stages each."""
    keys = (rows, "block_n", "num_warps", "num_stages")
    return [dict(zip(keys, map(int, one.split("x")), strict=True)) for one in text.split(",") if one]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", choices=["qwen2.5-7b", "qwen2.5-0.5b", "tiny"], default="qwen2.5-7b")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="reference,blocked,triton,triton-packed", help="the last one is profiled")
    p.add_argument("--tiles", default="64x64x4x2,64x64x4x3,128x64x8x3", help="the per-head kernel's tiles (the "
                   "first run swept nine: benchmarks/gpu/results/kernel_tiles_32768.json)")
    p.add_argument("--packed-tiles", default=None, help="the packed kernel's tiles (rows x keys x warps x stages); "
                   "default: the ones its autotuner chooses among")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import gpu_bench as bench

    torch.set_grad_enabled(False)
    from fusionrag.files import atomic_write
    from fusionrag.models.devices import DTYPES, default_device

    dtype = DTYPES[args.dtype]
    lm = bench.random_model(args.config, args.device or default_device(), dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc, table = phases(bench, lm, args.context, args.chunk_tokens, args.backends.split(","), args.repeats)
    gpu = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else None
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "config": args.config, "dtype": args.dtype, "device": str(lm.device), "gpu": gpu,
            "torch": torch.__version__}
    atomic_write(out / f"phases_{args.context}.json", json.dumps({"meta": meta, **doc}, indent=2))
    atomic_write(out / f"profile_recompute_{args.context}.txt", table + "\n")
    if args.tiles and "triton" in args.backends.split(","):
        from fusionrag.execution.attention_backends.qsparse_packed import GPU_TILES

        packed = args.packed_tiles if args.packed_tiles is not None else ",".join("x".join(map(str, t))
                                                                                 for t in GPU_TILES)
        tiles = kernel_tiles(bench, lm, args.context, parse_tiles(args.tiles), args.repeats,
                             parse_tiles(packed, rows="block_r"))
        atomic_write(out / f"kernel_tiles_{args.context}.json", json.dumps({"meta": meta, **tiles}, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    raise SystemExit(main())
