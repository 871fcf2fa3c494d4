#!/usr/bin/env bash
# Offline-stage ablations on TriviaQA (12 questions, the cheapest dataset), all at 15% recompute.
# Each writes its own folder; compare with the triviaqa rows of docs/results/quality_pilot (defaults then:
# top-10, most similar neighbour nearest the chunk, neighbours from the whole knowledge base).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/datasets.sh
A() { .venv/bin/fusionrag bench quality --max-new-tokens 16 --cache-dir runs/cache --data "$TRI" --limit 12 \
        --ratios 0.15 --methods full,reuse,fusionrag "$@"; }
A --out docs/results/ablation_neighbour_order --neighbour-order nearest_first
A --out docs/results/ablation_same_document --same-document --neighbour-order nearest_last
A --out docs/results/ablation_top_n --top-n 0,2,5,10,15 --neighbour-order nearest_last
