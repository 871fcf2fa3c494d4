#!/usr/bin/env bash
# Everything a GPU loan checks and measures, in one command, under a total budget of TOTAL_S seconds
# (default 470: < 8 min on one H100/H200; expected ~5 min): the CUDA invariants (pytest -m gpu), then the
# Python steps of benchmarks/gpu/gpu_check.py, each in its own process under what is left of the budget:
#   doctor    `run_doctor` (fp32) for both tiny families x every sparse backend (reference, blocked, triton,
#             triton-packed): ratio 1 equals Full Attention within 1e-4 (doctor.jsonl, a line per run)
#   bench     gpu_bench.py: the kernels alone, per-head vs packed vs masked SDPA at 15% of 8K/16K/32K
#             (Qwen2.5-7B shape: 28 query / 4 KV heads of 128, bf16), then the TTFT table
#             (gpu_bench.json/.md, saved after each context)
#   assemble  assemble_bench.py: assembly chunk by chunk vs batched, 64 chunks x 512 tokens (7B shape, bf16)
#   profile   gpu_profile.py: FusionRAG 15%'s phases at 32K per backend, the kernels' tile sweeps
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
# Exit status 1 if any step failed; each step's status is printed as "[gpu_check] STEP: rc".
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
start=$SECONDS
total=${TOTAL_S:-470}
if compgen -G ".whl/*.whl" > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fusionrag-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/fusionrag-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rc=0
step() {  # NAME STATUS: remember a failure, say which step it was
  echo "[gpu_check] $1: $2 ($((SECONDS - start)) s elapsed)" >&2
  [ "$2" = 0 ] || rc=1
}
budget() {  # CAP: seconds a step may take, at most CAP and what is left of the total (at least 1)
  local left=$((total - (SECONDS - start)))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -gt 0 ] || left=1
  echo "$left"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/host.txt"
step host "$?"
timeout "$(budget 100)" $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_forward_backends.py 2>&1 \
  | tee "$out/pytest_gpu.log"
step "pytest -m gpu" "$?"
# Caps: the first run took doctor ~60 s (6 processes), gpu_bench 80 s, gpu_profile ~60 s on one H200; the packed
# kernel's autotuning adds a few seconds per query-count bucket. The profile goes last: it is the optional one.
for s in doctor:100 bench:210 assemble:45 profile:150; do
  timeout "$(budget "${s#*:}")" $py benchmarks/gpu/gpu_check.py --out "$out" --steps "${s%%:*}"
  step "${s%%:*}" "$?"
done
exit $rc
