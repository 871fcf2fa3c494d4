#!/usr/bin/env bash
# The quality study's core methods on a second model, smollm2-135m (TriviaQA, 40 questions, 15%),
# as the issue asks when the default model's F1 gap between Full Attention and Full Reuse is
# too small to measure. Writes studies/second_model/results (resumable).
set -euo pipefail
cd "$(dirname "$0")/../.."
source studies/datasets.sh
.venv/bin/python -m studies.quality_cli --model smollm2-135m --max-new-tokens 16 --cache-dir runs/cache \
  --data "$TRI" --limit 40 --ratios 0.15 --methods full,reuse,cacheblend,cachecraft,query,fusionrag \
  --out studies/second_model/results
