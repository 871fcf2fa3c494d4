"""The studies' quality driver: ``fusionrag bench quality`` plus what only the studies need.

Run from the repository root: ``python -m studies.quality_cli --data FILE ... --out DIR``.
It takes every ``bench quality`` option and adds what only the studies use:

- the knowledge base and its offline stage (:mod:`studies.harness.stores`): ``--kb-limit`` (the passages of the
  first N questions, fixed apart from ``--limit``), ``--fuse-only-evaluated``, the ablations
  ``--neighbour-order`` and ``--same-document``, and ``--max-passage-words``;
- the Full Attention reference: ``--full-reference`` (a committed one), ``--reuse-full-cache``;
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
from pathlib import Path

from fusionrag.bench.cli import add_quality_args, quality_spec
from fusionrag.offline.preprocess import DEFAULT_NEIGHBOUR_ORDER, NEIGHBOUR_ORDERS, FuseSettings
from studies import peers
from studies.harness.stores import StudyStores
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


def add_study_args(p: argparse.ArgumentParser) -> None:
    """The knowledge-base, offline-ablation and reference options (not in ``fusionrag bench quality``)."""
    p.add_argument("--kb-limit", type=int, default=None,
                   help="knowledge base = passages of the first N questions (>= --limit; default --limit): "
                        "fix it at the study's target size so adding questions later keeps earlier records valid")
    p.add_argument("--max-passage-words", type=int, default=None, help="truncate passages (context length control)")
    p.add_argument("--neighbour-order", choices=NEIGHBOUR_ORDERS, default=DEFAULT_NEIGHBOUR_ORDER,
                   help="offline: where the most similar neighbour goes (right after S, or right before the chunk)")
    p.add_argument("--same-document", action="store_true",
                   help="offline: neighbours only from the chunk's own question (its passages' first question)")
    p.add_argument("--fuse-only-evaluated", action="store_true",
                   help="offline: fuse only the evaluated questions' chunks (a --limit below --kb-limit costs less)")
    p.add_argument("--full-reference", default=None,
                   help="compact Full Attention reference, meant to be committed (default OUT/full_reference)")
    p.add_argument("--reuse-full-cache", action="store_true",
                   help="let a cached Full Attention result serve the `full` cell too (its TTFT is then not reported)")
    p.add_argument("--neighbours", choices=NEIGHBOUR_SOURCES, default="corpus",
                   help="offline: where a chunk's neighbours come from")


def study_overrides(args: argparse.Namespace) -> dict:
    """The ``QualitySpec`` fields of :func:`add_study_args`' options."""
    source = None if args.neighbours == "corpus" else NeighbourSource(args.neighbours)
    return dict(
        kb_limit=args.kb_limit,
        max_passage_words=args.max_passage_words,
        fuse=FuseSettings(neighbour_order=args.neighbour_order, same_document=args.same_document,
                          min_similarity=args.min_similarity),
        stores=StudyStores(neighbours=source, fuse_only_evaluated=args.fuse_only_evaluated),
        full_reference=Path(args.full_reference) if args.full_reference else None,
        reuse_full_cache=args.reuse_full_cache,
        extra_meta={"neighbours": args.neighbours},
    )


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
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype of the methods' cells (default float32, as every committed study); stores "
                        "and Full Attention stay float32, and other dtypes' records are named METHOD@bf16")
    add_study_args(p)
    args = p.parse_args(argv)
    spec = quality_spec(args, **study_overrides(args), methods=study_methods(args.methods, args.kv), dtype=args.dtype)
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
