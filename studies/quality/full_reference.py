"""Compute the Full Attention reference of a quality study ahead of it, without any store.

Full Attention reads no stored KV (every passage is prefilled with the question), so its
reference (docs/results/<study>/full_reference, committed) can be computed while the study's
stores are still being built, on another core. `python -m studies.quality_cli --reuse-full-cache` then serves
the `full` cell from it.

    OMP_NUM_THREADS=1 .venv/bin/python studies/quality/full_reference.py --data FILE --limit 100 \\
        --reference studies/paper/results/full_reference --cache-dir runs/cache
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tqdm import tqdm

from fusionrag.bench.cells import full_attention, keep_full
from fusionrag.bench.datasets import load_questions
from fusionrag.bench.full_reference import FullReference
from fusionrag.bench.records import FullCache, example_sha
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.prompt import SHORT_ANSWER_PROMPT
from fusionrag.retrieval.embedder import HashingEmbedder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--max-passages", type=int, default=None)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--cache-dir", default="runs/cache")
    args = ap.parse_args()
    lm = load_model(args.model)
    examples = load_questions(args.data, args.limit, max_passages=args.max_passages)
    ref = FullReference(Path(args.reference), lm.name)
    cache = FullCache(Path(args.cache_dir), lm.name)
    with tempfile.TemporaryDirectory() as tmp:  # an empty store: the engine needs one, Full Attention reads none
        engine = Engine(build.create_store(Path(tmp) / "empty", lm, embedder=HashingEmbedder(),
                                               system_prompt=SHORT_ANSWER_PROMPT), lm)
        for ex in tqdm(examples, desc="Full Attention reference", unit="question"):
            sha = example_sha(ex)
            if ref.get(ex.dataset, ex.id, args.max_new_tokens, sha) is not None:
                continue
            result, prep = full_attention(engine, ex, args.max_new_tokens)
            keep_full(ref, cache, ex.dataset, ex.id, args.max_new_tokens, result, prep)


if __name__ == "__main__":
    main()
