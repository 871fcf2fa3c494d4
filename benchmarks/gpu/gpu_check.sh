#!/usr/bin/env bash
# Everything #15 checks on a GPU host, in one command (~5 min on one H200): the CUDA invariants
# (pytest -m gpu), `fusionrag doctor` on CUDA with every sparse backend (fp32: ratio 1 equals Full
# Attention within 1e-4), benchmarks/gpu/gpu_bench.py (7B shape, bf16, 8K/16K/32K; it saves after each
# step, so a run stopped at a time limit keeps what finished), then benchmarks/gpu/gpu_profile.py (where
# FusionRAG 15%'s time goes at 32K, the kernel's tile sweep). Eight files in OUT_DIR.
#
#   bash benchmarks/gpu/gpu_check.sh OUT_DIR
#
# A host without the project's Python packages (a bare GPU image) gets them from wheels in .whl/
# (transformers and what it needs there), installed into a private folder that goes first on
# PYTHONPATH: the image's site-packages stay untouched, but these versions are the ones imported.
# Exit status 1 if any step failed; each step's status is printed as "[gpu_check] STEP: rc".
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fusionrag-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/fusionrag-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rc=0
step() {  # NAME STATUS: remember a failure, say which step it was
  echo "[gpu_check] $1: $2" >&2
  [ "$2" = 0 ] || rc=1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/host.txt"
step host "$?"
timeout 120 $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_forward_backends.py 2>&1 | tee "$out/pytest_gpu.log"
step "pytest -m gpu" "$?"
: > "$out/doctor.jsonl"
for model in tiny-qwen2 tiny-llama; do
  for backend in reference blocked triton; do
    # run_doctor directly: the CLI also loads the retrieval stack (faiss), which a bare GPU image lacks
    timeout 120 $py -c "import json, torch; torch.set_grad_enabled(False)
from fusionrag.doctor import run_doctor; from fusionrag.models import load_model
r = run_doctor(load_model('$model', device='cuda', attention='$backend')); print(json.dumps(r)); raise SystemExit(not r['ok'])" \
      >> "$out/doctor.jsonl"
    step "doctor $model $backend" "$?"
  done
done
# gpu_bench took 80 s on one H200 (model build, 3 contexts x 6 methods x 4 calls, the kernel alone);
# the timeouts leave room for a slower GPU, and gpu_bench keeps every finished step if stopped.
timeout "${BENCH_TIMEOUT:-420}" $py benchmarks/gpu/gpu_bench.py --out "$out"
step gpu_bench "$?"
timeout "${PROFILE_TIMEOUT:-180}" $py benchmarks/gpu/gpu_profile.py --out "$out"
step gpu_profile "$?"
exit $rc
