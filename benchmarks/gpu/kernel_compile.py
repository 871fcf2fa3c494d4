"""Compile the Q-Sparse-Attn kernels for a GPU without one: registers, spills and shared memory per tile.

Triton compiles for a named target on any machine (its wheel carries ptxas and cuobjdump), so a tile set
can be screened before a GPU loan: a tile whose registers spill (``STACK`` > 0) is unlikely to win. The
packed kernel's ``GPU_TILES`` were chosen this way (Qwen2.5-7B: head size 128, group size 7, bf16, sm_90);
the GPU run's autotuner and tile sweep then time them. Needs ``TRITON_INTERPRET`` unset (the interpreter
cannot compile). Writes ``kernel_compile.json`` to ``--out``.

``python benchmarks/gpu/kernel_compile.py --out DIR [--arch 90] [--head-dim 128] [--groups 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _signature(fn, consts: dict, dtype: str) -> dict[str, str]:
    kinds = {"pos_ptr": "*i32", "stale_ptr": "*i8", "scale": "fp32"}
    return {a: "constexpr" if a in consts else kinds.get(a, f"*{dtype}" if a.endswith("_ptr") else "i32")
            for a in fn.arg_names}


def resources(fn, consts: dict, warps: int, stages: int, arch: int, dtype: str) -> dict:
    """Compile ``fn`` with ``consts`` for ``sm_<arch>``: ptxas's registers, stack (spills) and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=_signature(fn, consts, dtype), constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                              "num_stages": stages})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"registers": int(found.get("REG", -1)), "stack_bytes": int(found.get("STACK", -1)),
            "shared_bytes": kernel.metadata.shared}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", type=int, default=90, help="compute capability: 90 (H100/H200), 80 (A100)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--groups", type=int, default=7, help="query heads per KV head")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--packed-tiles", default=None, help="rows x keys x warps x stages, comma-separated "
                   "(default: the packed kernel's GPU_TILES)")
    p.add_argument("--tiles", default="64x64x4x2", help="the per-head kernel's tiles, same form")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: the interpreter cannot compile for a GPU")
    from fusionrag.execution.attention_backends import qsparse_packed, qsparse_triton

    parse = lambda text: [tuple(map(int, t.split("x"))) for t in text.split(",") if t]  # noqa: E731
    packed_tiles = parse(args.packed_tiles) if args.packed_tiles else list(qsparse_packed.GPU_TILES)
    jitted, _ = qsparse_packed._kernels()
    common = {"GROUPS": args.groups, "D": args.head_dim, "BLOCK_D": max(16, 1 << (args.head_dim - 1).bit_length()),
              "PRECISION": "ieee" if args.dtype == "fp32" else "tf32", "DOT_F32": False}
    rows = []
    for kernel, fn, rows_key, tiles in (("triton", qsparse_triton._kernel(), "BLOCK_M", parse(args.tiles)),
                                        ("triton-packed", jitted, "BLOCK_R", packed_tiles)):
        for r, n, warps, stages in tiles:
            consts = {**common, rows_key: r, "BLOCK_N": n}
            row = {"kernel": kernel, "rows": r, "keys": n, "num_warps": warps, "num_stages": stages,
                   **resources(fn, consts, warps, stages, args.arch, args.dtype)}
            rows.append(row)
            print(f"[kernel_compile] {row}", file=sys.stderr, flush=True)
    doc = {"arch": args.arch, "head_dim": args.head_dim, "groups": args.groups, "dtype": args.dtype, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_compile.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    raise SystemExit(main())
