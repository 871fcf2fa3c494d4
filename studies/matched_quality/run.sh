#!/usr/bin/env bash
# Speed at matched quality (issue 50): every method's recompute-ratio curve in bfloat16 (as users run it on this
# CPU), scored against the committed float32 Full Attention reference of the paper-shaped study, on the same
# 100-question knowledge bases (10 passages per question, ~1.8K context tokens). Full Attention in bfloat16 is a
# cell too (`full@bf16`): the exact prefill a user would run instead, and the agreement every method is held to.
# Resumable, single-threaded lanes: `bash studies/matched_quality/run.sh LANE`; then
# `.venv/bin/python -m studies.matched_quality.summarize`.
#   wiki / hotpot / musique: the curve (ratios 5-90%) of FusionRAG (fused KV), ProphetKV (fused and plain),
#     CacheBlend, EPIC, with Full Reuse (plain and fused) and Full Attention, 100 questions, greedy answers.
#   auto-DATASET: `ratio="auto"` on the same questions (after `fusionrag calibrate` of that store).
set -euo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../.."
source studies/datasets.sh
MUS_TRAIN=$D/musique/musique_train_paragraphs_hipporag.jsonl
OUT=studies/matched_quality/results
RATIOS=0.05,0.1,0.15,0.2,0.3,0.5,0.7,0.9,auto,auto:0.5,auto:0.7,auto:0.8,auto:0.9  # auto: the store's calibration (fusionrag calibrate)
METHODS=full,reuse,fusionrag:fused,prophetkv:fused,prophetkv,cacheblend,epic
Q() { .venv/bin/python -m studies.quality_cli --full-reference studies/paper/results/full_reference \
        --cache-dir runs/cache --max-new-tokens 16 --limit 100 --kb-limit 100 --fuse-only-evaluated \
        --dtype bfloat16 --out $OUT "$@"; }
curve() { Q --data "$@" --ratios $RATIOS --methods $METHODS; }
mkdir -p runs
case "${1:-}" in
  wiki) curve "$WIKI" > runs/mq_wiki.log 2>&1 ;;
  hotpot) curve "$HOT" > runs/mq_hotpot.log 2>&1 ;;
  musique) curve "$MUS_TRAIN" --max-passages 10 > runs/mq_musique.log 2>&1 ;;
  *) echo "usage: $0 wiki|hotpot|musique" >&2; exit 2 ;;
esac
