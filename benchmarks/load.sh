#!/usr/bin/env bash
# Speculative decoding under load, the whole matrix on the default pair: ShareGPT first turns, 64 requests per level,
# concurrency 1, 2, 4, 8, 16, greedy and T=0.7; through our engine (continuous batching) and through vLLM servers
# (./setup.sh --vllm, its own serving client). Per engine and temperature two `load` runs, each with its own RSp
# (ratios always come from one interleaved run): the draft model (with --lookup 3: ours the draft plus our context
# lookup, vLLM its n-gram drafter alone), then the feature head, each at its registry k (K=N: at N); ours once more in static batches
# (greedy, the draft), to show what continuous batching changes. Each run writes
# load-matrix-ENGINE-DRAFT-tT.json; `python benchmarks/tables.py --load` prints the table docs/load.md shows.
# Usage: benchmarks/load.sh [quick] [ENGINES]   (ENGINES: ours,vllm by default; several hours on 2 cores, quick
# takes minutes: 4 requests, levels 1 and 2, 16 tokens; REPEATS=3: three passes a level, thr× with an interval). A run whose file is there, complete, is not run again
# (the matrix can take several sittings): FORCE=1 runs everything.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
OUT=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$OUT"
KOPT=()
[ -n "${K:-}" ] && KOPT=(--k "$K")  # else each draft at its own k in models.yaml
[ -n "${REPEATS:-}" ] && KOPT+=(--repeats "$REPEATS")  # passes per level: thr×'s interval (R times as long)
DRAFT=${DRAFT:-$($PY -c "from lssp.models.registry import load_registry; print(load_registry('models.yaml').draft_name(None, heads=False))")}  # the draft model
HEAD=${HEAD:-$($PY -c "from lssp.models.registry import load_registry; print(load_registry('models.yaml').default_draft)")}  # the feature head
if [ "${1:-}" = "quick" ]; then
    SIZE=(--requests 4 --concurrency "1,2" --max-new-tokens 16); shift
else
    SIZE=(--requests 64 --concurrency "1,2,4,8,16" --max-new-tokens 64)
fi
ENGINES=${1:-ours,vllm}
status=0
# Whether a run's file is there, with every level, neither interrupted nor failed (then it is not run again).
done_already() {
    [ "${FORCE:-0}" != 1 ] && [ -e "$1" ] && $PY - "$1" "${SIZE[3]}" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
wanted = {int(c) for c in sys.argv[2].split(",")}
sys.exit(0 if not run["interrupted"] and not run["failure"] and wanted <= set(run["levels"]) else 1)
PY
}
run_load() {  # the JSON file, then load's options
    local json=$1; shift
    if done_already "$json"; then echo "load.sh: $json is complete; not run again (FORCE=1 runs it)" >&2; return; fi
    $PY llamassp.py --results-dir "$OUT" load "$@" --json "$json" || status=1
}
for engine in ${ENGINES//,/ }; do
    if [ "$engine" = vllm ] && ! $PY -c "import vllm" 2>/dev/null; then
        echo "load.sh: vLLM is not installed (./setup.sh --vllm): --engine vllm left out" >&2
        continue
    fi
    for t in 0 0.7; do
        for draft in "$DRAFT" "$HEAD"; do
            extra=()
            [ "$draft" = "$DRAFT" ] && extra=(--lookup 3)
            run_load "$OUT/load-matrix-$engine-$draft-t$t.json" --engine "$engine" --draft "$draft" "${KOPT[@]}" \
                "${extra[@]}" --task sharegpt --temperature "$t" "${SIZE[@]}"
        done
    done
    if [ "$engine" = ours ]; then  # what continuous batching changes: the same greedy run in static batches
        run_load "$OUT/load-matrix-ours-static-$DRAFT-t0.json" --engine ours --draft "$DRAFT" "${KOPT[@]}" \
            --batching static --task sharegpt "${SIZE[@]}"
    fi
done
exit $status
