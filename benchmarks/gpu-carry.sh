#!/usr/bin/env bash
# Packs what a lent GPU machine lacks (bitsandbytes, gguf) into .gpusite/site.tar.xz, small enough to travel
# with the working tree (64 MiB in all): bitsandbytes' wheel (43 MB) keeps only the CUDA library the GPU's torch
# loads. benchmarks/gpu.sh unpacks it there; name .gpusite in the device call's carry.
# Usage: benchmarks/gpu-carry.sh [CUDA]   (CUDA: the library suffix bitsandbytes picks, e.g. 130 for torch +cu130)
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
CUDA=${1:-130}
PY=python3; [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/wheels" bitsandbytes gguf
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do (cd "$work/site" && "$PY" -m zipfile -e "$wheel" .); done
find "$work/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name "libbitsandbytes_cuda$CUDA.so" \
    ! -name 'libbitsandbytes_cpu.so' -delete
[ -e "$work/site/bitsandbytes/libbitsandbytes_cuda$CUDA.so" ] || { echo "no libbitsandbytes_cuda$CUDA.so in the wheel" >&2; exit 1; }
mkdir -p .gpusite .git/info
grep -qx '/.gpusite/' .git/info/exclude 2>/dev/null || echo '/.gpusite/' >> .git/info/exclude
tar cJf .gpusite/site.tar.xz -C "$work/site" .
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
extra=$(du -b .gpusite/site.tar.xz | cut -f1)
echo "wrote .gpusite/site.tar.xz ($((extra / 1024)) KiB); tracked tree + it: $(((tree + extra) / 1048576)) MiB of 64"
if [ $(((tree + extra) / 1048576)) -ge 64 ]; then
    echo "over 64 MiB: the suite needs no shipped draft; for the trip, take drafts/ out of git's index:" \
        "git rm -r -q --cached drafts && echo /drafts/ >> .git/info/exclude (undo: git reset -q drafts)" >&2
fi
