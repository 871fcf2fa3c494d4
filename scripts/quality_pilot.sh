#!/usr/bin/env bash
# The pilot quality study in docs/results/quality_pilot (resumable: rerunning skips finished cells).
# Sized for a 2-core CPU session: 15% recompute for every dataset; HotpotQA's first
# questions also have 5% and 30%. Raise --limit / add ratios when more CPU time is available.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/quality_pilot}
source scripts/datasets.sh
# These results were made with the neighbour order nearest_last (the default then).
Q() { .venv/bin/fusionrag bench quality --max-new-tokens 16 --cache-dir runs/cache --out "$OUT" --neighbour-order nearest_last "$@"; }
Q --data "$HOT_DEV20" --limit 12 --ratios 0.15
Q --data "$TRI" --limit 12 --ratios 0.15
Q --data "$MUS" --limit 6 --ratios 0.15 --methods full,reuse,cacheblend,cachecraft,fusionrag
Q --data "$WIKI" --limit 8 --ratios 0.15 --methods full,reuse,cacheblend,cachecraft,fusionrag
# Softmax ablation: the per-chunk normalisation (the default is global)
Q --data "$HOT_DEV20" --limit 12 --ratios 0.15 --methods full,reuse,fusionrag-perchunk
Q --data "$TRI" --limit 12 --ratios 0.15 --methods full,reuse,fusionrag-perchunk
.venv/bin/fusionrag bench report --out "$OUT" --model qwen2.5-0.5b --data "$HOT_DEV20" "$TRI" "$MUS" "$WIKI"
