"""``fusionrag bench ttft`` with the pre-pass before decision 048 beside today's, in one interleaved run.

Registers ``fusionrag-reference`` (FusionRAG with ``QueryGuided(reference=True)``: the question's
whole forward, every layer, the final norm and the LM head; same KV kind, same selection) and
runs ``bench ttft`` with the arguments given, so the two pre-passes and the baselines share every
round. Add ``fusionrag-reference`` to ``--methods``:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ttft/prepass_ttft.py --data FILE --model qwen2.5-0.5b \\
        --context-tokens 2048,4096 --methods full,fusionrag,fusionrag-reference --ratios 0.15 --tiers memory \\
        --repeats 3 --loader-requests 0 --device cpu --out benchmarks/ttft/results/prepass/interleaved
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from fusionrag.cli import main as cli_main
    from fusionrag.online.methods import register_policy
    from fusionrag.online.policies import QueryGuided

    register_policy("fusionrag-reference", lambda: QueryGuided("fusionrag-reference", reference=True),
                    kv="plain-first", description="fusionrag, pre-pass through the whole forward (before 048)")
    sys.argv = [sys.argv[0], "bench", "ttft", *argv]  # the report's command line: bench ttft's own arguments
    return cli_main(["bench", "ttft", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
