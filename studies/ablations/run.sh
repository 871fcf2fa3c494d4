#!/usr/bin/env bash
# Offline-stage ablations on TriviaQA (12 questions, the cheapest dataset), all at 15% recompute.
# Each writes its own folder; compare with the triviaqa rows of (removed: superseded pilot) (defaults then:
# top-10, most similar neighbour nearest the chunk, neighbours from the whole knowledge base).
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/datasets.sh
A() { .venv/bin/python -m studies.quality_cli --max-new-tokens 16 --cache-dir runs/cache --data "$TRI" --limit 12 \
        --ratios 0.15 --methods full,reuse,fusionrag "$@"; }
A --out studies/ablations/results/neighbour_order --neighbour-order nearest_first
A --out studies/ablations/results/same_document --same-document --neighbour-order nearest_last
A --out studies/ablations/results/top_n --top-n 0,2,5,10,15 --neighbour-order nearest_last
