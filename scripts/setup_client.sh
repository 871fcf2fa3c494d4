#!/usr/bin/env bash
# The client environment (.venv-client): the fusionrag-client distribution (clients/python: the framework
# integrations, no engine) with its LangChain, LlamaIndex and Haystack extras, litellm and DSPy (used unchanged,
# pasting their context), and no torch, for tests/packaging/test_client_install.py and
# benchmarks/frameworks/pasted_ttft.py. Pinned here (not in the package's metadata) at the versions tested.
# Reinstalled on every run, so it holds the integrations as they are in this checkout. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
V=.venv-client
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/python" -m pip install --quiet --upgrade pip
"$V/bin/python" -m pip install --quiet "httpx==0.29.0" "langchain-core==1.8.3" "langchain-openai==1.8.1" "langchain-text-splitters==1.1.3" \
    "llama-index-core==0.14.25" "llama-index-llms-openai-like==0.8.1" "haystack-ai==3.4.1" \
    "litellm==1.110.2" "dspy==3.4.1"
"$V/bin/python" -m pip install --quiet --force-reinstall --no-deps ./clients/python
"$V/bin/python" -m pip install --quiet "./clients/python[langchain,llamaindex,haystack]"  # the extras resolve
rm -rf clients/python/build  # setuptools' staging copy of the integrations (gitignored)
if "$V/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: error: torch got into .venv-client (a client dependency pulled it)" >&2; exit 1
fi
LITELLM_LOCAL_MODEL_COST_MAP=True "$V/bin/python" -c "import litellm, dspy, fusionrag.integrations.langchain, fusionrag.integrations.llamaindex, fusionrag.integrations.haystack; print('setup: .venv-client ready (no torch)')"
