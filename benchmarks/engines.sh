#!/usr/bin/env bash
# Where does our engine stand against the engines CPU users pick? One interleaved `latency` run per sampling
# setting on the default pair: ours, vLLM (./setup.sh --vllm) and llama.cpp's llama-server (./setup.sh --llamacpp),
# each RSp, SSp with the shipped draft at K = 2, 3, 4 and the 4-gram lookup (ours: draft + lookup; vLLM and
# llama.cpp: their n-gram drafter alone), completions of exactly 64 tokens so that every engine does the same work.
# Usage: benchmarks/engines.sh [quick]   (benchmarks/run.sh runs it as its step 2c; ~20 minutes on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
OUT=${RESULTS_DIR:-benchmarks/results}
L=(--results-dir "$OUT")
if [ "${1:-}" = "quick" ]; then N=(--nb-prompts 2); else N=(--nb-prompts 8); fi
ENGINES=ours
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" && ENGINES+=,vllm \
    || echo "engines: vLLM is not installed (./setup.sh --vllm): left out" >&2
$PY -c "from lssp.engines.llamacpp_build import require_build; require_build()" 2>/dev/null && ENGINES+=,llamacpp \
    || echo "engines: llama.cpp is not built (./setup.sh --llamacpp): left out" >&2
for t in 0 0.7; do
    $PY llamassp.py "${L[@]}" latency --engine "$ENGINES" --k 2,3,4 --lookup 0,4 --ignore-eos --temperature "$t" \
        "${N[@]}" --json "$OUT/latency-engines-t$t.json"
done

# vLLM and llama.cpp load plain checkpoints: they run the shipped draft's full-width export (export-draft), whose
# rows outside the frequent-token head are held down at the texts it was probed on, not everywhere. Ours with the
# draft and with that export, greedy, in one run: how much of their lower acceptance is the export's doing.
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if $PY llamassp.py export-draft smollm2-135m-draft --out "$TMP/export" >/dev/null; then
    $PY - "$TMP" <<'PYEOF'
import sys
from pathlib import Path

import yaml

tmp = Path(sys.argv[1])
shipped = yaml.safe_load(Path("models.yaml").read_text())
models = {name: dict(shipped["models"][name]) for name in ("smollm2-135m-compact", "smollm2-135m-draft")}
models["smollm2-135m-draft"]["path"] = str(Path(models["smollm2-135m-draft"]["path"]).resolve())
models["smollm2-135m-draft-export"] = {**models["smollm2-135m-draft"], "path": str(tmp / "export")}
registry = {"default_target": "smollm2-135m-compact", "default_draft": "smollm2-135m-draft", "models": models}
(tmp / "models.yaml").write_text(yaml.safe_dump(registry))
PYEOF
    $PY llamassp.py --config "$TMP/models.yaml" "${L[@]}" latency --draft smollm2-135m-draft,smollm2-135m-draft-export \
        --k 2,3,4 --ignore-eos --temperature 0 "${N[@]}" --json "$OUT/latency-draft-export.json"
fi
