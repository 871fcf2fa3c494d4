"""Assembly (RoPE re-positioning of every retrieved chunk's stored KV): chunk by chunk vs one batched rotation.

Random KV of a model's shape (``--config``: layers, KV heads, head size, RoPE theta of
``gpu_bench.qwen_config``): ``S`` (fp32) and ``--chunks`` chunks of ``--chunk-tokens`` tokens stored as
the store keeps them (``--stored``: fp16, which int8 entries are dequantised to on load) and computed
right after ``S`` (plain KV), assembled into the compute ``--dtype`` on ``--device``. Variants, interleaved
(each round runs each once; medians over ``--rounds``):

- ``per_chunk``: ``tests/kvcache/assemble_reference.py`` (the previous path: move, widen, rotate, cast per chunk, then
  one concatenation);
- ``batched``: ``kv.assemble`` (one concatenation, the rotation of every token formed once, one
  rotate-half per layer written into the result);
- ``batched_stacked``: the same rotation over all layers in one op (larger fp32 temporaries), to
  show what the per-layer loop costs or saves.

Every variant's result is compared with ``per_chunk`` (max abs difference; 0 means bit for bit).
Writes ``assemble_bench.json`` to ``--out``.

CPU (the decision record's numbers): ``python benchmarks/gpu/assemble_bench.py --config qwen2.5-0.5b
--device cpu --dtype float32 --threads 1 --out DIR``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SYSTEM_TOKENS = 64


def _stacked(prefix, chunks, inv_freq, device, dtype):
    """``kv.assemble`` with one rotation over the stacked ``[layers, ...]`` keys instead of one per layer."""
    from fusionrag.kvcache.kv import KV, assemble
    from fusionrag.models.rope import rotate_into, rotation

    base, spans = assemble(prefix, [], inv_freq, device=device, dtype=dtype)
    dev, p = base.keys.device, len(prefix)
    spans, deltas, pos = [], [], p
    for c in chunks:
        spans.append((pos, pos + len(c)))
        deltas.append(pos + prefix.base_position - c.base_position)
        pos += len(c)
    stored = torch.cat([c.keys.to(device=dev) for c in chunks], dim=2)
    cos, sin = rotation(torch.tensor(deltas), inv_freq, dev)
    which = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([len(c) for c in chunks])).to(dev)
    keys = torch.empty(*base.keys.shape[:2], pos, base.keys.shape[3], dtype=dtype, device=dev)
    keys[:, :, :p] = base.keys
    rotate_into(keys[:, :, p:], stored, cos[which], sin[which])
    values = torch.cat([base.values, torch.cat([c.values.to(device=dev) for c in chunks], dim=2).to(dtype)], dim=2)
    return KV(keys, values, prefix.base_position), spans


def inputs(config_name: str, chunks: int, chunk_tokens: int, stored: torch.dtype, device: str):
    """``(prefix, chunk KVs, inv_freq)``: random KV of the config's shape, chunks computed right after ``S``."""
    sys.path.insert(0, str(HERE))
    import gpu_bench

    from fusionrag.kvcache.kv import KV

    cfg = gpu_bench.qwen_config(config_name)
    layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    torch.manual_seed(0)  # made on the device: 2 GB of random KV at the 7B shape would take seconds on a CPU
    rand = lambda t, dt: torch.randn(layers, hkv, t, dim, device=device).to(dt)  # noqa: E731
    prefix = KV(rand(SYSTEM_TOKENS, torch.float32), rand(SYSTEM_TOKENS, torch.float32), 0)
    kvs = [KV(rand(chunk_tokens, stored), rand(chunk_tokens, stored), SYSTEM_TOKENS) for _ in range(chunks)]
    return prefix, kvs, inv_freq


def run(args: argparse.Namespace) -> dict:
    from fusionrag.kvcache.kv import assemble

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kvcache"))
    from assemble_reference import assemble_per_chunk  # the previous path, kept as the tests' reference

    from fusionrag.models.devices import DTYPES

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, stored = DTYPES[args.dtype], DTYPES[args.stored]
    prefix, kvs, inv_freq = inputs(args.config, args.chunks, args.chunk_tokens, stored, args.device)
    gpu_bench = sys.modules["gpu_bench"]
    variants = {"per_chunk": assemble_per_chunk, "batched": assemble, "batched_stacked": _stacked}
    call = {name: (lambda fn=fn: fn(prefix, kvs, inv_freq, args.device, dtype)) for name, fn in variants.items()}
    ref = call["per_chunk"]()[0]
    diffs = {}
    for name, fn in call.items():  # warm-up, and the exactness check
        got = fn()[0]
        diffs[name] = max(float((got.keys.float() - ref.keys.float()).abs().max()),
                          float((got.values.float() - ref.values.float()).abs().max()))
        del got
    samples: dict[str, list[float]] = {name: [] for name in call}
    for _ in range(args.rounds):
        for name, fn in call.items():
            samples[name].append(gpu_bench.timed(args.device, fn)[0])
    rows = [{"variant": name, "ms": statistics.median(ts), "samples_ms": ts, "max_abs_diff_vs_per_chunk": diffs[name]}
            for name, ts in samples.items()]
    before = rows[0]["ms"]
    for r in rows:
        r["speedup_vs_per_chunk"] = before / r["ms"]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    meta = {"command": " ".join(["assemble_bench.py", *sys.argv[1:]]), "config": args.config, "device": args.device,
            "gpu": gpu, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "dtype": args.dtype, "stored": args.stored, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
            "system_tokens": SYSTEM_TOKENS, "rounds": args.rounds, "torch": torch.__version__,
            "layers": ref.num_layers, "kv_heads": ref.keys.shape[1], "head_dim": ref.keys.shape[3]}
    return {"meta": meta, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", choices=["qwen2.5-7b", "qwen2.5-0.5b", "tiny"], default="qwen2.5-7b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--stored", choices=["float16", "float32"], default="float16", help="the chunks' stored dtype")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    doc = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fusionrag.files import atomic_write

    atomic_write(out / "assemble_bench.json", json.dumps(doc, indent=2))
    for r in doc["rows"]:
        print(f"[assemble_bench] {r['variant']}: {r['ms']:.1f} ms ({r['speedup_vs_per_chunk']:.2f}x), "
              f"max abs diff vs per_chunk {r['max_abs_diff_vs_per_chunk']:.1e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    raise SystemExit(main())
