"""The studies' quality driver: ``fusionrag bench quality`` plus what only the studies need.

Run from the repository root: ``python -m studies.quality_cli --data FILE ... --out DIR``.
It takes every ``bench quality`` option and adds:

- the selection variants of :mod:`studies.selection.variants` (``query``, ``fusionrag-authors``, ...);
- APE's sweep settings ``ape-t{T}-s{S}`` (:mod:`studies.peers`);
- ``--neighbours corpus|question|preceding|other-questions`` (:mod:`studies.neighbours.sources`);
- ``--kv both``: the baseline policies on fused KV as well (the offline stage on/off ablation);
- ``--dtype bfloat16``: the methods' cells computed in bfloat16 (``studies/bf16``); the stores are built and
  Full Attention (the KL reference) computed in float32 as always, and the records name the method
  ``METHOD@bf16`` (run key ``fusionrag@bf16|fused|...``), so a summary never mixes the two dtypes.

The studies' records predate ``fusionrag``'s product default (plain-first), so here the name
``fusionrag`` keeps the studies' meaning, query-guided selection on **fused** KV (record key
``fusionrag|fused|...``); the product default is ``fusionrag-plainfirst`` (``...|plain-first|...``).
Stores default to float16, as every committed study was run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fusionrag.bench.cli import add_quality_args, quality_spec
from studies import peers
from studies.neighbours.sources import NEIGHBOUR_SOURCES, NeighbourSource
from studies.selection import variants

BASELINES = ("cacheblend", "cachecraft", "epic", "random", "query-authors")


def study_methods(methods: Sequence[str], kv: str) -> list[str]:
    """The studies' method names as ``bench quality`` spells them (see the module docstring)."""
    out: list[str] = []
    for m in methods:
        out.append("fusionrag:fused" if m == "fusionrag" else m)
        if kv == "both" and m in BASELINES:
            out.append(f"{m}:fused")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from fusionrag.bench.quality import plan_runs, run_quality

    variants.register()
    peers.register()
    p = argparse.ArgumentParser(prog="python -m studies.quality_cli", description=__doc__.splitlines()[0])
    add_quality_args(p)
    p.set_defaults(kv_dtype="float16",
                   methods=["full", "reuse", "cacheblend", "cachecraft", "epic", "query", "fusionrag"])
    p.add_argument("--kv", choices=["default", "both"], default="default",
                   help="'both' also runs the baseline policies on fused KV")
    p.add_argument("--neighbours", choices=NEIGHBOUR_SOURCES, default="corpus",
                   help="offline: where a chunk's neighbours come from")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype of the methods' cells (default float32, as every committed study); stores "
                        "and Full Attention stay float32, and other dtypes' records are named METHOD@bf16")
    args = p.parse_args(argv)
    spec = quality_spec(args, methods=study_methods(args.methods, args.kv),
                        neighbours=None if args.neighbours == "corpus" else NeighbourSource(args.neighbours),
                        dtype=args.dtype)
    spec.command = "python -m studies.quality_cli " + " ".join(sys.argv[1:] if argv is None else argv)
    plan_runs(spec)
    run_quality(spec)
    print(f"[study quality] wrote {spec.out}/results.json, results.md and plots")
    return 0


if __name__ == "__main__":
    from fusionrag.errors import FusionRAGError

    try:
        sys.exit(main())
    except FusionRAGError as exc:
        print(f"fusionrag: error: {exc}", file=sys.stderr)
        sys.exit(2)
