#!/usr/bin/env bash
# Everything a GPU loan checks and measures, in one command, under a total budget of TOTAL_S seconds
# (default 470: < 8 min on one H100/H200; expected ~7.5 min): the CUDA invariants (pytest -m gpu), then the
# Python steps of benchmarks/gpu/gpu_check.py, each in its own process under what is left of the budget
# (the steps before `serve` leave SERVE_S seconds, default 150, to it):
#   doctor    `run_doctor` (fp32) for both tiny families x every sparse backend (reference, blocked, triton,
#             triton-packed): ratio 1 equals Full Attention within 1e-4 (doctor.jsonl, a line per run)
#   bench     gpu_bench.py: the kernels alone, per-head vs packed vs masked SDPA at 15% of 8K/16K/32K
#             (Qwen2.5-7B shape: 28 query / 4 KV heads of 128, bf16), then the TTFT table, FusionRAG 15% with
#             the chunks' KV on the GPU, in page-locked host memory and in a store's files on disk
#             (gpu_bench.json/.md, saved after each context)
#   assemble  assemble_bench.py: assembly chunk by chunk vs batched, 64 chunks x 512 tokens (7B shape, bf16)
#   profile   gpu_profile.py: FusionRAG 15%'s phases at 32K per backend, the kernels' tile sweeps
#   serve     gpu_serve.py: a random Qwen2.5-7B-shaped checkpoint saved to local disk (the 3B shape where
#             the budget, disk or GPU memory is short) with the tokenizer of benchmarks/gpu/qwen2_tokenizer/,
#             `fusionrag ingest` of ~200 synthetic chunks of 512 tokens on the GPU, the real `fusionrag serve
#             --device cuda --dtype bfloat16` on 127.0.0.1, then 8 concurrent clients (closed loop) streaming
#             16K-token RAG requests (32 stored chunks as `documents`, 32 new tokens), full then fusionrag 15%,
#             for what is left of the step's budget: TTFT p50/p99, requests/s, tokens/s, GPU memory (nvidia-smi),
#             the server's device KV tier (--device-kv-budget-mb) over its pinned host tier, sizes from /metrics
#             (gpu_serve.json/.md/.png after each method; the server's and ingest's logs beside them)
# gpu_check.json: each step's status, seconds and notes, written after every step. The same Python steps
# run on a CPU with tiny shapes: `python benchmarks/gpu/gpu_check.py --dry-run --out DIR` (a test does).
#
#   bash benchmarks/gpu/gpu_check.sh OUT_DIR
#
# The GPU image (torch 2.11, Triton 3.6, transformers 5.17, no internet) lacks transformers >= 5.24 and
# what it needs. Carry them as wheels in .whl/ (ignored by git); they are installed into a private folder
# that goes first on PYTHONPATH (the image's site-packages stay untouched). Fetched where there is internet:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 \
#     httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 tomlkit==0.15.3 regex==2026.11.19 click==8.5.1 \
#     idna==3.20 anyio==4.16.0 h11==0.16.0
# (18 MB; the first run's list, benchmarks/gpu/results/README.md). Add pytest (and pluggy, iniconfig,
# packaging) if the image has none: the CUDA tests are then reported as failed, the other steps still run.
# The serve step also imports what the image's package list (KINDS.md) lacks: the server's and the store's
# packages (those `fusionrag ingest` and `fusionrag serve` imported on a dry run, at this venv's versions):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl-serve fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.3 \
#     pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 faiss-cpu==1.15.1
# (22 MB, faiss-cpu 19 of them). Both folders and the checkout (~33 MB) exceed one call's 64 MiB, so put both
# folders in .git/info/exclude and install .whl-serve/ in a first call (carry it, run
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/fusionrag-site .whl-serve/*.whl
# ), then run this script in the next call on the same warm machine, carrying .whl/: what a call installed
# into /tmp/fusionrag-site stays there while the machine is held. Without them only the serve step fails
# (gpu_serve_server.log or gpu_serve_ingest.log names the missing import), after the others saved their files.
# Exit status 1 if any step failed; each step's status is printed as "[gpu_check] STEP: rc".
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
start=$SECONDS
total=${TOTAL_S:-470}
wheels=$(compgen -G ".whl/*.whl"; compgen -G ".whl-serve/*.whl")
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one wheel a word
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fusionrag-site \
    $wheels || exit 1
fi
if [ -d /tmp/fusionrag-site ]; then  # installed now or by an earlier call on this machine
  export PYTHONPATH=/tmp/fusionrag-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rc=0
step() {  # NAME STATUS: remember a failure, say which step it was
  echo "[gpu_check] $1: $2 ($((SECONDS - start)) s elapsed)" >&2
  [ "$2" = 0 ] || rc=1
}
serve_s=${SERVE_S:-150}
budget() {  # CAP [KEEP]: seconds a step may take: at most CAP and what is left of the total less KEEP (>= 1)
  local left=$((total - (SECONDS - start) - ${2:-0}))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -gt 0 ] || left=1
  echo "$left"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/host.txt"
step host "$?"
timeout "$(budget 100 "$serve_s")" $py -m pytest -q -p no:cacheprovider -m gpu \
  tests/execution/test_forward_backends.py 2>&1 | tee "$out/pytest_gpu.log"
step "pytest -m gpu" "$?"
# Caps: the first run took doctor ~60 s (6 processes), gpu_bench 80 s, gpu_profile ~60 s on one H200; the packed
# kernel's autotuning adds a few seconds per query-count bucket. The profile is the optional one: it gets what
# is left before the serving run's SERVE_S.
for s in doctor:100 bench:210 assemble:45 profile:150; do
  timeout "$(budget "${s#*:}" "$serve_s")" $py benchmarks/gpu/gpu_check.py --out "$out" --steps "${s%%:*}"
  step "${s%%:*}" "$?"
done
# The serving run: what is left (at least SERVE_S unless the steps above overran), at most 240 s. gpu_serve.py
# keeps 15 s of its budget to stop the server and save; SIGTERM (timeout) also saves what finished.
b=$(budget 240)
timeout -k 20 "$b" $py benchmarks/gpu/gpu_check.py --out "$out" --steps serve --budget-s "$((b > 15 ? b - 5 : b))"
step serve "$?"
exit $rc
