#!/usr/bin/env bash
# fp16 vs int8 KV storage on TriviaQA (studies/kv_int8/results/summary): Full Reuse (plain and fused KV) and
# FusionRAG at 15%, the same 50 questions on both stores, compared paired by question.
#
# The fp16 store is built here (plain + fused KV, one thread: ~25 min on this machine when idle).
# The int8 store is that store converted (`preprocess --kv-dtype int8`: every entry re-encoded, no
# model run), so both stores hold the same computation and differ only in storage; its fused KV was
# fused on fp16 neighbours (a store built with --kv-dtype int8 from the start fuses on int8-dequantised
# neighbours: one more rounding inside each fused entry). Full Attention is computed once (the cache
# is shared), so the int8 run evaluates only the cells that read stored KV.
set -euo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../.."
source studies/datasets.sh
CACHE=${CACHE:-runs/cache}
RES=studies/kv_int8/results
OUT=$RES/fp16
Q() { .venv/bin/python -m studies.quality_cli --data "$TRI" --limit 50 --kb-limit 50 --ratios 0.15 \
        --methods full,reuse,fusionrag --max-new-tokens 4 --cache-dir "$CACHE" "$@"; }
Q --out "$OUT"
S16=$CACHE/stores/qwen2.5-0.5b-triviaqa-n50-top10-nearest_first
S8=$S16-int8
if [ ! -d "$S8" ]; then
  rm -rf "$S8.tmp" && cp -r "$S16" "$S8.tmp"
  .venv/bin/fusionrag preprocess --store "$S8.tmp" --kv-dtype int8 --quiet
  mv "$S8.tmp" "$S8"
fi
Q --kv-dtype int8 --methods reuse,fusionrag --out "$RES/int8"  # Full Attention: from the shared cache
.venv/bin/python studies/kv_int8/compare.py --fp16 "$OUT" --int8 "$RES/int8" \
  --fp16-store "$S16" --int8-store "$S8" --out studies/kv_int8/results/summary \
  --command "bash studies/kv_int8/run.sh  # CACHE=$CACHE"
# int8 from the start (studies/kv_int8/results/summary_scratch): a store built with --kv-dtype int8 fuses on
# int8-dequantised neighbours, the path a user of `fusionrag ingest` (int8 by default) takes. Its own
# cache folder so it does not reuse the converted store of the same name; Full Attention is shared.
SCRATCH=$CACHE/int8-from-scratch
mkdir -p "$SCRATCH" && ln -sfn "$(realpath "$CACHE/full")" "$SCRATCH/full"
Q --kv-dtype int8 --methods reuse,fusionrag --cache-dir "$SCRATCH" --out "$RES/int8_scratch"
.venv/bin/python studies/kv_int8/compare.py --fp16 "$OUT" --int8 "$RES/int8_scratch" \
  --fp16-store "$S16" --int8-store "$SCRATCH/stores/$(basename "$S8")" --out studies/kv_int8/results/summary_scratch \
  --title "fp16 vs int8 KV storage, the int8 store built from scratch" \
  --command "bash studies/kv_int8/run.sh  # CACHE=$CACHE"
