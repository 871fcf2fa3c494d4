#!/usr/bin/env bash
# The quality study in studies/quality/results/main (resumable: rerunning skips finished cells).
#
# Sized for 2 CPU cores: two single-threaded lanes in parallel (two 1-thread processes decode
# ~1.7x faster in total than one 2-thread process; prefill ~1.1x), appending to the same
# records.jsonl (appends are locked). `bash studies/quality/run.sh a` or `... b` runs one lane;
# `... n100` runs the 100-question core comparison (studies/quality/results/n100).
#
# Every dataset: 50 questions (--limit) on a knowledge base fixed at the passages of the first 50
# (--kb-limit), so raising --limit later keeps every earlier record valid; a changed knowledge
# base moves the cells that read the store (fused KV, Cache-Craft) to records.superseded.jsonl
# and recomputes them. Building a 50-question store takes one lane 9 min (TriviaQA, 172 chunks)
# to 56 min (MuSiQue, 942 chunks: plain KV 27 min, fusion 29 min); a run whose cells all read
# plain KV (query-only, EPIC/CacheBlend on plain KV) builds only the plain KV.
# A Full Attention result cached by an earlier run (runs/cache/full) serves the `full` cell
# without a TTFT (--reuse-full-cache), so every reported TTFT was measured under the same
# conditions (1 thread, the other lane busy).
set -euo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-studies/quality/results/main}
source studies/datasets.sh
CORE=full,reuse,cacheblend,cachecraft,query,fusionrag
Q() { OMP_NUM_THREADS=1 .venv/bin/python -m studies.quality_cli --max-new-tokens 16 --cache-dir runs/cache \
        --reuse-full-cache --out "$OUT" "$@"; }
TRI_N=(--data "$TRI" --limit 50 --kb-limit 50)
HOT_N=(--data "$HOT" --limit 50 --kb-limit 50)
WIKI_N=(--data "$WIKI" --limit 50 --kb-limit 50)
MUS_N=(--data "$MUS" --limit 50 --kb-limit 50)
# One dataset's method x ratio matrix, the most informative cells first (an interrupted run
# leaves the 15% comparison complete): the core methods at 15%, CacheBlend's and Cache-Craft's
# selections on plain and fused KV (Figure 16), the ratio curve of CacheBlend and FusionRAG
# (Figure 13), then Cache-Craft, query-only and EPIC at every ratio.
matrix() {
  Q "$@" --ratios 0.15 --methods $CORE --kv both
  Q "$@" --ratios 0.05,0.1,0.3 --methods cacheblend,fusionrag
  Q "$@" --ratios 0.05,0.1,0.15,0.3 --methods cachecraft,query,epic
}
# The 20 HotpotQA dev distractor questions (the main study's HotpotQA file is HippoRAG's train
# distractor set), kept as a cross-check in their own folder.
hotpot_dev20() {
  local OUT=studies/quality/results/hotpotqa_dev20
  Q --data "$HOT_DEV20" --limit 24 --ratios 0.15 --methods $CORE
  Q --data "$HOT_DEV20" --limit 24 --ratios 0.15 --methods cacheblend --kv both
  Q --data "$HOT_DEV20" --limit 24 --ratios 0.05,0.1,0.3 --methods cacheblend,fusionrag
  .venv/bin/fusionrag bench report --out "$OUT" --model qwen2.5-0.5b --data "$HOT_DEV20"
}
# 100 questions (TriviaQA, 2WikiMQA), the core methods at 15%, in their own folder with a
# 100-question knowledge base (here it would supersede the 50-question study's store cells).
n100() {  # $1: the data file
  local OUT=studies/quality/results/n100
  Q --data "$1" --limit 100 --kb-limit 100 --ratios 0.15 \
    --methods full,reuse,cacheblend,cachecraft,epic,query,fusionrag
}
lane_a() {
  matrix "${TRI_N[@]}"
  # TriviaQA only: the other selection policies on fused KV (Figure 16)
  Q "${TRI_N[@]}" --ratios 0.05,0.1,0.3 --methods cacheblend --kv both
  Q "${TRI_N[@]}" --ratios 0.15 --methods epic --kv both
  matrix "${HOT_N[@]}"
  bash studies/second_model/run.sh  # smollm2-135m, its own folder
}
lane_b() {
  matrix "${WIKI_N[@]}"
  matrix "${MUS_N[@]}"
  bash studies/ablations/run.sh  # TriviaQA offline ablations incl. the top-n sweep, their own folders
  hotpot_dev20
}
# For the paper-shaped study: the 50-question study's cells at 15% again, with the teacher-forced
# metrics (gold NLL, KL along Full Attention's answer) against a committed Full Attention reference;
# same files, same knowledge bases. `bash studies/quality/run.sh teacher-forced TRI WIKI`
# (variable names of datasets.sh: TRI HOT WIKI MUS).
teacher_forced() {  # $1: the data file
  local OUT=studies/quality/results/teacher_forced
  .venv/bin/python studies/quality/full_reference.py --reference "$OUT/full_reference" --cache-dir runs/cache \
    --max-new-tokens 16 --data "$1" --limit 50
  Q --data "$1" --limit 50 --kb-limit 50 --ratios 0.15 --methods full,reuse,cacheblend,cachecraft,epic,query,fusionrag \
    --full-reference "$OUT/full_reference" --no-decode
  .venv/bin/fusionrag bench report --out "$OUT" --model qwen2.5-0.5b --data "$TRI" "$HOT" "$WIKI" "$MUS"
}
mkdir -p runs
case "${1:-both}" in
  teacher-forced) shift; for name in "$@"; do
      file=$(declare -p "$name" >/dev/null 2>&1 && echo "${!name}") || { echo "unknown dataset $name" >&2; exit 2; }
      teacher_forced "$file" > "runs/teacher_forced_$name.log" 2>&1
    done
    exit 0 ;;
  a) lane_a > runs/lane_a.log 2>&1 ;;
  b) lane_b > runs/lane_b.log 2>&1 ;;
  n100) n100 "$TRI" > runs/n100_tri.log 2>&1 &
        n100 "$WIKI" > runs/n100_wiki.log 2>&1 &
        wait
        .venv/bin/fusionrag bench report --out studies/quality/results/n100 --model qwen2.5-0.5b \
          --data "$TRI" "$WIKI"
        exit 0 ;;
  *) lane_a > runs/lane_a.log 2>&1 &
     lane_b > runs/lane_b.log 2>&1 &
     wait ;;
esac
.venv/bin/fusionrag bench report --out "$OUT" --model qwen2.5-0.5b --data "$TRI" "$HOT" "$WIKI" "$MUS"
