#!/usr/bin/env bash
# The drafts issue's bars, for a candidate draft beside the shipped one (one interleaved run per setting,
# --repeats 3, both drafts in the same run so their ratios compare): every task category greedy and at
# T=0.7, the reference's story openings greedy, the target's cost at 1..32 tokens per forward (what tree
# drafts would cost), and verify on the candidate (greedy and T=1).
# Usage: benchmarks/drafts.sh CANDIDATES [quick]   (CANDIDATES: models.yaml entries or draft folders, comma-separated;
#   each is timed beside the shipped drafter, the registry's default_draft, in the same runs, and verified)
#   LOOKUP=0,3 also times each draft with the context lookup (n-gram length 3) in the same runs;
#   SHIPPED=0 leaves the shipped draft out (the candidates alone: a shorter run once they are chosen);
#   STEPS (tasks,tasks-t0.7,stories,cost,verify): the steps to run, e.g. STEPS=tasks for a first choice;
#   quick: one pass over NB_PROMPTS (2) prompts per task; give it a RESULTS_DIR of its own (a step found complete
#   there is not run again, whatever its prompt count).
# Bars (issue 30): --task all greedy >= 1.5x overall, at T=0.7 >= 1.3x; story openings >= 2.0x greedy.
# `python benchmarks/tables.py --drafts` prints the runs against the bars. Steps already complete are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOOKUP=${LOOKUP:-0}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
OUT=${RESULTS_DIR:-benchmarks/results}
CANDIDATES=${1:?usage: benchmarks/drafts.sh CANDIDATES [quick]}
mkdir -p "$OUT"
# A candidate given as a folder is timed as the shipped draft of its kind is run (dtype, quantization, forward):
# a registry beside the results adds an entry for it, named after the folder.
REGISTRY="$OUT/drafts-registry.yaml"
DRAFTS=$($PY - "$CANDIDATES" "$REGISTRY" "${SHIPPED:-1}" <<'PY'
import sys
from pathlib import Path

import yaml

from lssp.models.eagle import is_feature_head

root = yaml.safe_load(Path("models.yaml").read_text())
for spec in root["models"].values():  # the copy lives elsewhere: paths from the repository root
    if str(spec.get("path", "")).startswith("./"):
        spec["path"] = str(Path(spec["path"]).resolve())
names = [root["default_draft"]] if sys.argv[3] == "1" else []  # the drafter commands use when given none
for given in sys.argv[1].split(","):
    folder = Path(given)
    if given in root["models"] or not folder.is_dir():
        names.append(given)
        continue
    like = dict(root["models"][root["default_draft"] if is_feature_head(folder) else root["default_draft_model"]])
    like.update(path=str(folder.resolve()), description=f"candidate draft from {given} (benchmarks/drafts.sh)")
    root["models"][folder.name] = like
    names.append(folder.name)
Path(sys.argv[2]).write_text(yaml.safe_dump(root, sort_keys=False))
print(",".join(names))
PY
)
TARGET=$($PY -c "import yaml; print(yaml.safe_load(open('models.yaml'))['default_target'])")
CANDIDATE_NAMES=$DRAFTS; [ "${SHIPPED:-1}" = 0 ] || CANDIDATE_NAMES=${DRAFTS#*,}
L=(--results-dir "$OUT" --config "$REGISTRY")
if [ "${2:-}" = "quick" ]; then
    N=(--nb-prompts "${NB_PROMPTS:-2}"); REPEATS=(--repeats 1); SAMPLES=(--samples 100 --depth 2)
else
    N=(); REPEATS=(--repeats 3); SAMPLES=(--samples 600 --depth 2)
fi

# A step whose file is there, complete, for these drafts, is not run again (hours of CPU: several sittings);
# FORCE=1 runs every step.
complete() {
    [ "${FORCE:-0}" != 1 ] && [ -e "$1" ] && $PY - "$1" "$DRAFTS" "$LOOKUP" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
drafts = {r["draft"] for r in rows if r.get("draft")}
lookups = {int(r.get("lookup") or 0) for r in rows if r.get("draft")}
same = drafts == set(sys.argv[2].split(",")) and lookups == {int(n) for n in sys.argv[3].split(",")}
sys.exit(0 if same and not any(r.get("interrupted") for r in rows) else 1)
PY
}
STEPS=",${STEPS:-tasks,tasks-t0.7,stories,cost,verify},"
step() { [[ $STEPS == *",$1,"* ]]; }
latency_step() {  # the step, the JSON file, then latency's options beside the drafts, K, passes and prompts
    step "$1" || return 0
    local json=$2; shift 2
    if complete "$json"; then echo "drafts.sh: $json is complete; not run again (FORCE=1 runs it)" >&2; return; fi
    $PY llamassp.py "${L[@]}" latency --draft "$DRAFTS" --k 2,3,4 --lookup "$LOOKUP" "${REPEATS[@]}" "${N[@]}" "$@" --json "$json"
}
latency_step tasks "$OUT/drafts-tasks-greedy.json" --task all
latency_step tasks-t0.7 "$OUT/drafts-tasks-t0.7.json" --task all --temperature 0.7
latency_step stories "$OUT/drafts-stories-greedy.json"
if step cost && [ ! -e "$OUT/drafts-target-cost.json" ]; then  # the target's cost, once per results folder (remove it to redo)
    $PY llamassp.py "${L[@]}" cost --tokens 1,2,4,8,16,32 --json "$OUT/drafts-target-cost.json"
fi
IFS=, read -r -a EACH <<< "$CANDIDATE_NAMES"
step verify || EACH=()
for CANDIDATE in "${EACH[@]}"; do
    for t in 0 1.0; do
        json="$OUT/drafts-verify-$([ $t = 0 ] && echo greedy || echo t$t)-$CANDIDATE.json"
        if [ "${FORCE:-0}" != 1 ] && [ -e "$json" ]; then continue; fi
        more=(); [ "$t" = 0 ] || more=("${SAMPLES[@]}")
        $PY llamassp.py "${L[@]}" verify "$TARGET" "$CANDIDATE" --temperature "$t" "${more[@]}" \
            --json "$json" || true
    done
done
