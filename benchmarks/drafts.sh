#!/usr/bin/env bash
# The drafts issue's bars, for a candidate draft beside the shipped one (one interleaved run per setting,
# --repeats 3, both drafts in the same run so their ratios compare): every task category greedy and at
# T=0.7, the reference's story openings greedy, the target's cost at 1..32 tokens per forward (what tree
# drafts would cost), and verify on the candidate (greedy and T=1).
# Usage: benchmarks/drafts.sh CANDIDATES [quick]   (CANDIDATES: models.yaml entries or draft folders, comma-separated;
#   each is timed beside the shipped draft in the same runs, and verified)
# Bars (issue 30): --task all greedy >= 1.5x overall, at T=0.7 >= 1.3x; story openings >= 2.0x greedy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
OUT=${RESULTS_DIR:-benchmarks/results}
CANDIDATES=${1:?usage: benchmarks/drafts.sh CANDIDATES [quick]}
mkdir -p "$OUT"
# A candidate given as a folder is timed as the shipped draft of its kind is run (dtype, quantization, forward):
# a registry beside the results adds an entry for it, named after the folder.
REGISTRY="$OUT/drafts-registry.yaml"
DRAFTS=$($PY - "$CANDIDATES" "$REGISTRY" <<'PY'
import sys
from pathlib import Path

import yaml

from lssp.models.eagle import is_feature_head

root = yaml.safe_load(Path("models.yaml").read_text())
for spec in root["models"].values():  # the copy lives elsewhere: paths from the repository root
    if str(spec.get("path", "")).startswith("./"):
        spec["path"] = str(Path(spec["path"]).resolve())
names = ["smollm2-135m-draft"]
for given in sys.argv[1].split(","):
    folder = Path(given)
    if given in root["models"] or not folder.is_dir():
        names.append(given)
        continue
    like = dict(root["models"]["smollm2-135m-eagle" if is_feature_head(folder) else "smollm2-135m-draft"])
    like.update(path=str(folder.resolve()), description=f"candidate draft from {given} (benchmarks/drafts.sh)")
    root["models"][folder.name] = like
    names.append(folder.name)
Path(sys.argv[2]).write_text(yaml.safe_dump(root, sort_keys=False))
print(",".join(names))
PY
)
L=(--results-dir "$OUT" --config "$REGISTRY")
if [ "${2:-}" = "quick" ]; then
    N=(--nb-prompts 2); REPEATS=(--repeats 1); SAMPLES=(--samples 100 --depth 2)
else
    N=(); REPEATS=(--repeats 3); SAMPLES=(--samples 600 --depth 2)
fi

$PY llamassp.py "${L[@]}" latency --draft "$DRAFTS" --task all --k 2,3,4 "${REPEATS[@]}" "${N[@]}" \
    --json "$OUT/drafts-tasks-greedy.json"
$PY llamassp.py "${L[@]}" latency --draft "$DRAFTS" --task all --k 2,3,4 --temperature 0.7 "${REPEATS[@]}" "${N[@]}" \
    --json "$OUT/drafts-tasks-t0.7.json"
$PY llamassp.py "${L[@]}" latency --draft "$DRAFTS" --k 2,3,4 "${REPEATS[@]}" "${N[@]}" \
    --json "$OUT/drafts-stories-greedy.json"
if [ ! -e "$OUT/drafts-target-cost.json" ]; then  # the target's cost, once per results folder (remove it to redo)
    $PY llamassp.py "${L[@]}" cost --tokens 1,2,4,8,16,32 --json "$OUT/drafts-target-cost.json"
fi
IFS=, read -r -a EACH <<< "${DRAFTS#*,}"
for CANDIDATE in "${EACH[@]}"; do
    NAME=$CANDIDATE
    $PY llamassp.py "${L[@]}" verify smollm2-135m-compact "$CANDIDATE" --temperature 0 \
        --json "$OUT/drafts-verify-greedy-$NAME.json" || true
    $PY llamassp.py "${L[@]}" verify smollm2-135m-compact "$CANDIDATE" --temperature 1.0 "${SAMPLES[@]}" \
        --json "$OUT/drafts-verify-t1.0-$NAME.json" || true
done
