#!/usr/bin/env bash
# The paper-shaped study (studies/paper/results, studies/neighbours/results): 10 passages per
# question, a knowledge base of 100 questions' passages, teacher-forced metrics (gold-answer NLL, KL
# to Full Attention along its answer). Resumable: rerunning skips finished cells.
#
# Two single-threaded lanes (`bash studies/paper/run.sh a` / `... b`), sharing one committed Full
# Attention reference (studies/paper/results/full_reference), so a new machine never recomputes it.
# Stores (plain + fused KV, gigabytes) live in runs/cache and are rebuilt by the same line.
#   a: 2WikiMQA, the core methods at 15% on 100 questions (with greedy answers), then the selection
#      variants at 15% and the 5%/30% curve on the first 50 (teacher-forced metrics only).
#   b: where neighbours come from (2WikiMQA, the first 50 questions, the same 100-question knowledge
#      base; only the evaluated chunks are fused), then HotpotQA's core methods at 15% on the 100
#      questions of a 100-question knowledge base.
# Full Attention is computed ahead, without a store (studies/quality/full_reference.py), so `full` cells are
# served from the reference (--reuse-full-cache: no TTFT; this study measures quality).
# MuSiQue (`... musique`): HippoRAG's 100 train questions cut to 10 passages (--max-passages keeps the
# supporting ones), the core methods at 15%.
#   c: MuSiQue's and 2WikiMQA's 5%/30% curve (first 50), then MuSiQue's neighbour sources.
#   d: TriviaQA's teacher-forced cells, HotpotQA's 5%/30% curve, its neighbour sources, MuSiQue's sim0.5.
#   e: the same question's and the preceding passages at 100 questions (HotpotQA, MuSiQue), HotpotQA's sim0.5.
#   f: MuSiQue dev's old 50-question cells (quality_teacher_forced); at 100 questions 2WikiMQA's
#      same-question, preceding and other questions' passages and similarity floor, the rest elsewhere.
set -euo pipefail
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../.."
source studies/datasets.sh
MUS_TRAIN=$D/musique/musique_train_paragraphs_hipporag.jsonl
OUT=studies/paper/results
REF=(--full-reference "$OUT/full_reference" --cache-dir runs/cache --max-new-tokens 16)
CORE=full,reuse,cacheblend,cachecraft,query,fusionrag
VARIANTS=fusionrag-authors,query-authors,fusionrag-plainfirst,epic  # + fusionrag-sinks,fusionrag-floor when measured (removed since)
Q() { .venv/bin/python -m studies.quality_cli "${REF[@]}" "$@"; }
ref() { .venv/bin/python studies/quality/full_reference.py --reference "$OUT/full_reference" --cache-dir runs/cache "$@"; }
lane_a() {
  ref --data "$WIKI" --limit 100
  Q --data "$WIKI" --limit 100 --kb-limit 100 --ratios 0.15 --methods $CORE --reuse-full-cache --out $OUT
  Q --data "$WIKI" --limit 50 --kb-limit 100 --ratios 0.15 --methods $VARIANTS --no-decode --out $OUT
  Q --data "$WIKI" --limit 50 --kb-limit 100 --ratios 0.05,0.3 --methods fusionrag,fusionrag-authors,cacheblend \
    --no-decode --out $OUT
}
neighbours() {  # [--data FILE] [--max-passages N] then the settings (default: all four); NB_LIMIT questions (50)
  # preceding question other-questions sim0.5; e.g. NB_LIMIT=100 ... neighbours --data "$HOT" question
  local data=(--data "$WIKI")
  [ "${1:-}" != --data ] || { data=(--data "$2"); shift 2; }
  [ "${1:-}" != --max-passages ] || { data+=(--max-passages "$2"); shift 2; }
  local settings=("$@") one
  [ ${#settings[@]} -gt 0 ] || settings=(preceding question other-questions sim0.5)
  for one in "${settings[@]}"; do
    # sim0.5: a similarity floor instead of a fixed top-10. 0.5 is set from this knowledge base's
    # similarities alone (MiniLM cosine of a chunk's top-10: median 0.39, 1st 0.56, 10th 0.36): it
    # keeps 2.5 neighbours per chunk on average, only the close ones.
    local source=(--neighbours "$one") out=$one
    [ "$one" != sim0.5 ] || { source=(--min-similarity 0.5); out=corpus-sim0.5; }
    Q "${data[@]}" --limit "${NB_LIMIT:-50}" --kb-limit 100 "${source[@]}" --fuse-only-evaluated --ratios 0.15 \
      --methods reuse,fusionrag --no-decode --out "studies/neighbours/results/$out"
  done
}
lane_b() {
  ref --data "$HOT" --limit 100
  neighbours
  Q --data "$HOT" --limit 100 --kb-limit 100 --fuse-only-evaluated --ratios 0.15 --methods $CORE --reuse-full-cache \
    --out $OUT
}
musique() {
  ref --data "$MUS_TRAIN" --max-passages 10 --limit 100
  Q --data "$MUS_TRAIN" --max-passages 10 --limit 100 --kb-limit 100 --ratios 0.15 --methods $CORE --reuse-full-cache --out $OUT
}
# The 5%/30% curve and the variants on all three datasets (first 50 questions, teacher-forced metrics
# only, fused KV only for the evaluated chunks). Each call is one group, so a stop leaves whole groups:
# the variants at 15%, then the selection decision's curve (ours, the authors', CacheBlend), then the rest.
CURVE_FIRST=fusionrag,fusionrag-authors,cacheblend  # as lane a ran on 2WikiMQA
METHODS_FIRST="query epic query-authors"  # plain-KV cells: no fusion needed
CURVE_REST="$METHODS_FIRST cachecraft fusionrag-plainfirst"  # one group each
curves() {  # DATA [--max-passages N]; CURVE_GROUPS=... runs only those groups after the first
  local data=(--data "$@") group
  Q "${data[@]}" --limit 50 --kb-limit 100 --fuse-only-evaluated --ratios 0.15 --methods $VARIANTS --no-decode --out $OUT
  for group in $CURVE_FIRST ${CURVE_GROUPS:-$CURVE_REST}; do
    Q "${data[@]}" --limit 50 --kb-limit 100 --fuse-only-evaluated --ratios 0.05,0.3 --methods "$group" --no-decode \
      --out $OUT
  done
}
# Earlier runs covered every curve method but Cache-Craft on 2WikiMQA and plain-first at 5%/30%, and the
# same-question/preceding neighbour sources; c and d (resumable) finish the rest in about two hours each.
lane_c() {  # MuSiQue's and 2WikiMQA's remaining curve points, then MuSiQue's neighbour sources
  curves "$MUS_TRAIN" --max-passages 10
  curves "$WIKI"
  neighbours --data "$MUS_TRAIN" --max-passages 10 question preceding other-questions
}
lane_d() {  # TriviaQA's 50-question cells, HotpotQA's remaining curve points and neighbour sources
  bash studies/quality/run.sh teacher-forced TRI
  curves "$HOT"
  neighbours --data "$HOT" question preceding other-questions sim0.5
  neighbours --data "$MUS_TRAIN" --max-passages 10 sim0.5
}
lane_e() {  # the same-question source at 100 questions, and MuSiQue's upper bound
  NB_LIMIT=100 neighbours --data "$HOT" question preceding sim0.5
  NB_LIMIT=100 neighbours --data "$MUS_TRAIN" --max-passages 10 question preceding
}
lane_f() {  # MuSiQue dev's old 50-question cells, then more neighbour sources at 100 questions
  bash studies/quality/run.sh teacher-forced MUS
  NB_LIMIT=100 neighbours --data "$WIKI" question preceding sim0.5 other-questions
  NB_LIMIT=100 neighbours --data "$MUS_TRAIN" --max-passages 10 other-questions sim0.5
  NB_LIMIT=100 neighbours --data "$HOT" other-questions
}
# The newest peers on the same stores and questions (ProphetKV at 5/15/30% on plain and fused KV,
# APE at 0% on plain and fused KV), all on the 100 questions (the other methods' 5%/30% cells cover the first 50).
APE_SWEEP=$(.venv/bin/python -c 'from studies.peers import sweep_methods; print(",".join(sweep_methods()))')
peers() {  # DATA [--max-passages N]
  local data=(--data "$@")
  Q "${data[@]}" --limit 100 --kb-limit 100 --fuse-only-evaluated --ratios 0.15 \
    --methods prophetkv,prophetkv:fused,ape,ape:fused --no-decode --out $OUT
}
peers_curve() {  # DATA [--max-passages N]
  local data=(--data "$@")
  Q "${data[@]}" --limit 100 --kb-limit 100 --fuse-only-evaluated --ratios 0.05,0.3 \
    --methods prophetkv,prophetkv:fused --no-decode --out $OUT
}
ape_sweep() {  # APE's short sweep: 2WikiMQA's first 20 (dev) questions, plain KV; its own folder
  Q --data "$WIKI" --limit 20 --kb-limit 100 --ratios 0.15 --methods "$APE_SWEEP" --no-decode \
    --out studies/peers/results/ape_sweep
}
# FusionRAG's selection from an earlier layer's attention (a cheaper pre-pass), fused KV,
# 15%, the first 50 questions of each dataset (paired with the fusionrag cells there).
layers() {  # DATA [--max-passages N]
  Q --data "$@" --limit 50 --kb-limit 100 --fuse-only-evaluated --ratios 0.15 \
    --methods fusionrag-layer12,fusionrag-layer15 --no-decode --out $OUT
}
lane_l() { layers "$WIKI"; layers "$HOT"; layers "$MUS_TRAIN" --max-passages 10; }
lane_p1() { ape_sweep; peers "$WIKI"; peers "$HOT"; peers_curve "$WIKI"; }
lane_p2() { peers "$MUS_TRAIN" --max-passages 10; peers_curve "$HOT"; peers_curve "$MUS_TRAIN" --max-passages 10; }
mkdir -p runs
case "${1:-both}" in
  a) lane_a > runs/paper_a.log 2>&1 ;;
  b) lane_b > runs/paper_b.log 2>&1 ;;
  musique) musique > runs/paper_musique.log 2>&1 ;;
  c) lane_c > runs/paper_c.log 2>&1 ;;
  d) lane_d > runs/paper_d.log 2>&1 ;;
  e) lane_e > runs/paper_e.log 2>&1 ;;
  f) lane_f > runs/paper_f.log 2>&1 ;;
  p1) lane_p1 > runs/paper_p1.log 2>&1 ;;
  p2) lane_p2 > runs/paper_p2.log 2>&1 ;;
  l) lane_l > runs/paper_l.log 2>&1 ;;
  neighbours) shift; neighbours "$@" > "runs/paper_neighbours_$(basename -- "${*:-all}" | tr -c 'a-z0-9.\n' _).log" 2>&1 ;;
  # e.g. neighbours preceding; neighbours --data "$HOT" question
  report) ;;
  *) lane_a > runs/paper_a.log 2>&1 &
     lane_b > runs/paper_b.log 2>&1 &
     wait ;;
esac
# Each `bench quality` call rewrites its folder's report with its own dataset only: rebuild every folder's
# report from all its records, then the cross-folder summary.
for out in $OUT studies/neighbours/results/*/; do
  .venv/bin/fusionrag bench report --out "$out" --model qwen2.5-0.5b --data "$WIKI" "$HOT" "$MUS_TRAIN"
done
.venv/bin/python studies/paper/summarize.py
