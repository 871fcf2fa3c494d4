#!/usr/bin/env bash
# The fidelity cost of bfloat16. FusionRAG 15% (the studies' `fusionrag`: fused KV, corpus top-10
# neighbours) computed in bfloat16 and in float32 on the first 50 questions of 2WikiMQA and HotpotQA, the
# paper-shaped study's setting (10 passages per question, a 100-question knowledge base), first-token KL to
# the committed float32 Full Attention reference. The stores are built in float32 (as every study's) and
# read by both dtypes; --dtype bfloat16 names its records `fusionrag@bf16`. Resumable: a rerun skips
# finished cells. Single-threaded on one core (CORE, default 1), niced.
set -euo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../.."
source studies/datasets.sh
OUT=studies/bf16/results
Q() {
  nice -n 5 taskset -c "${CORE:-1}" .venv/bin/python -m studies.quality_cli \
    --full-reference studies/paper/results/full_reference --cache-dir runs/cache --max-new-tokens 16 \
    --limit 50 --kb-limit 100 --fuse-only-evaluated --ratios 0.15 --methods fusionrag --no-decode --out $OUT "$@"
}
mkdir -p runs
for data in "$WIKI" "$HOT"; do
  Q --data "$data" --dtype bfloat16
  Q --data "$data"  # float32 on the same store and code: the control beside the paper's committed records
done
# Each call rewrites the folder's report with its own dataset only: rebuild it from all the records.
.venv/bin/fusionrag bench report --out $OUT --model qwen2.5-0.5b --data "$WIKI" "$HOT"
.venv/bin/python studies/bf16/summarize.py
