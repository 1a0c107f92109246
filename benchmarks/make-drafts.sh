#!/usr/bin/env bash
# The chat drafts of issue 30, made the way they were made: two collections of the default target's own answers
# (ShareGPT conversations, and the built-in prompt set so that the draft keeps the stories), then a plain draft
# (going on from the shipped one) and a feature head (from scratch) trained on both. Every step is resumable: rerun
# the same command after a stop. Hours of CPU on 2 cores; nothing else should run meanwhile.
# Usage: benchmarks/make-drafts.sh [collect|draft|head|all|more]   (default: all)
#   DATA (~/.cache/llamassp/distill): where the collections and checkpoints go, outside the repository
#   OUT (drafts/candidates): where the draft and the head are written
#   SHAREGPT_TOKENS (2400000), BUILTIN_TOKENS (600000), DRAFT_MINUTES (50), HEAD_MINUTES (60)
# more (issue 48, item 2): new collections (seed 1: other ShareGPT contexts and built-in prompts) and the shipped
#   head trained on from where it stopped, under the training-time test over 3 drafting steps (--unroll 3);
#   MORE_SHAREGPT_TOKENS (1500000), MORE_BUILTIN_TOKENS (150000), MORE_MINUTES (40). Each collection's token ids
#   land in its data/tokens.npz (commit them: `--tokens-from` writes the collection again from them).
# fused (issue 48, item 1): the "more" collections written again from their token ids with the target's hidden states
#   after layers FEATURE_LAYERS (2,15) too, and the "more" head trained on from them reading those layers
#   (--feature-layers: its fuse starts as the identity on the final feature); FUSED_MINUTES (40).
# Then: benchmarks/drafts.sh "$OUT/smollm2-135m-chat-draft" (and the head) measures them against the shipped draft.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
DATA=${DATA:-$HOME/.cache/llamassp/distill}
OUT=${OUT:-drafts/candidates}
SHAREGPT="$DATA/sharegpt-smollm2-135m"
BUILTIN="$DATA/builtin-smollm2-135m"
SHAREGPT_TOKENS=${SHAREGPT_TOKENS:-2400000}
BUILTIN_TOKENS=${BUILTIN_TOKENS:-600000}
STEP=${1:-all}

if [ "$STEP" = collect ] || [ "$STEP" = all ]; then
    # Features kept (--kind eagle) so that both kinds train on the same collections.
    $PY llamassp.py distill --source sharegpt --kind eagle --collect-only --data-dir "$SHAREGPT" \
        --data-tokens "$SHAREGPT_TOKENS" --batch-prompts 128 --new-tokens 192 --max-prompt-tokens 384
    $PY llamassp.py distill --source built-in --kind eagle --collect-only --data-dir "$BUILTIN" \
        --data-tokens "$BUILTIN_TOKENS" --batch-prompts 128 --new-tokens 96
fi
if [ "$STEP" = draft ] || [ "$STEP" = all ]; then
    $PY llamassp.py distill --source sharegpt --data-dir "$SHAREGPT" --also-data "$BUILTIN" \
        --data-tokens "$SHAREGPT_TOKENS" --init-draft drafts/smollm2-135m-draft --out "$OUT/smollm2-135m-chat-draft" \
        --max-seq-len 384 --train-minutes "${DRAFT_MINUTES:-50}" --epochs 3 --lr 1e-3 --hard-weight 0.5
fi
if [ "$STEP" = head ] || [ "$STEP" = all ]; then
    $PY llamassp.py distill --kind eagle --source sharegpt --data-dir "$SHAREGPT" --also-data "$BUILTIN" \
        --data-tokens "$SHAREGPT_TOKENS" --out "$OUT/smollm2-135m-chat-eagle" --head-tokens 8192 \
        --max-seq-len 384 --train-minutes "${HEAD_MINUTES:-60}" --epochs 3 --lr 2e-3
fi
if [ "$STEP" = more ]; then
    MORE_SHAREGPT="$DATA/sharegpt-smollm2-135m-s1"
    MORE_BUILTIN="$DATA/builtin-smollm2-135m-s1"
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --source sharegpt --kind eagle --collect-only \
        --data-dir "$MORE_SHAREGPT" --data-tokens "${MORE_SHAREGPT_TOKENS:-1500000}" --batch-prompts 128 \
        --new-tokens 192 --max-prompt-tokens 384
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --source built-in --kind eagle --collect-only \
        --data-dir "$MORE_BUILTIN" --data-tokens "${MORE_BUILTIN_TOKENS:-150000}" --batch-prompts 128 --new-tokens 96
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --kind eagle --source sharegpt --data-dir "$MORE_SHAREGPT" \
        --also-data "$MORE_BUILTIN" --data-tokens "${MORE_SHAREGPT_TOKENS:-1500000}" --init-draft drafts/smollm2-135m-eagle \
        --out "$OUT/smollm2-135m-eagle-more" --max-seq-len 384 --unroll 3 --train-minutes "${MORE_MINUTES:-40}" \
        --epochs 2 --lr 1e-3
fi
if [ "$STEP" = fused ]; then
    LAYERS=${FEATURE_LAYERS:-2,15}
    FUSED_SHAREGPT="$DATA/sharegpt-smollm2-135m-s1-l${LAYERS//,/-}"
    FUSED_BUILTIN="$DATA/builtin-smollm2-135m-s1-l${LAYERS//,/-}"
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --source sharegpt --kind eagle --collect-only \
        --data-dir "$FUSED_SHAREGPT" --tokens-from drafts/collections/sharegpt-smollm2-135m-s1.tokens.npz \
        --data-tokens 733315 --feature-layers "$LAYERS" --max-prompt-tokens 384
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --source built-in --kind eagle --collect-only \
        --data-dir "$FUSED_BUILTIN" --tokens-from drafts/collections/builtin-smollm2-135m-s1.tokens.npz \
        --data-tokens 101728 --feature-layers "$LAYERS"
    $PY llamassp.py --seed 1 distill smollm2-135m-compact --kind eagle --source sharegpt --data-dir "$FUSED_SHAREGPT" \
        --also-data "$FUSED_BUILTIN" --data-tokens 733315 --feature-layers "$LAYERS" \
        --init-draft drafts/smollm2-135m-eagle-more --out "$OUT/smollm2-135m-eagle-fused" --max-seq-len 384 \
        --unroll 3 --train-minutes "${FUSED_MINUTES:-40}" --epochs 2 --lr 1e-3
fi
