"""``fusionrag bench ttft`` with the pre-pass before decision 048 beside today's, in one interleaved run.

Registers ``fusionrag-reference`` (FusionRAG scored by ``tests/online/prepass_reference.py``: the question's
whole forward, every layer, the final norm and the LM head; same KV kind, same selection) and
runs ``bench ttft`` with the arguments given, so the two pre-passes and the baselines share every
round. Add ``fusionrag-reference`` to ``--methods``:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ttft/prepass_ttft.py --data FILE --model qwen2.5-0.5b \\
        --context-tokens 2048,4096 --methods full,fusionrag,fusionrag-reference --ratios 0.15 --tiers memory \\
        --repeats 3 --loader-requests 0 --device cpu --out benchmarks/ttft/results/prepass/interleaved
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The whole-forward pre-pass (before decision 048) is the tests' reference, kept beside them.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "online"))


def main(argv: list[str]) -> int:
    from prepass_reference import ReferenceQueryGuided

    from fusionrag.cli import main as cli_main
    from fusionrag.online.methods import register_policy

    register_policy("fusionrag-reference", ReferenceQueryGuided,
                    kv="plain-first", description="fusionrag, pre-pass through the whole forward (before 048)")
    sys.argv = [sys.argv[0], "bench", "ttft", *argv]  # the report's command line: bench ttft's own arguments
    return cli_main(["bench", "ttft", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
