#!/usr/bin/env bash
# vLLM across two hosts on one machine: two network namespaces (lssp-h0 10.213.0.1, lssp-h1 10.213.0.2) joined by
# a veth pair, private addresses inside them only; benchmarks/multihost.py runs in lssp-h0 and measures one
# process, two workers on one host and one worker on each host (vLLM's --nnodes 2 launch). Needs root (ip netns)
# and ./setup.sh --vllm. Everything it made is removed when it ends, however it ends. ~15 minutes on 2 cores.
# Usage: benchmarks/multihost.sh [--requests N] [--out FILE] [--logs DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} VLLM_TARGET_DEVICE=cpu
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
    echo "multihost: needs root and iproute2 (ip netns) to make two network namespaces" >&2
    exit 2
fi
cleanup() {
    for ns in lssp-h0 lssp-h1; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cleanup
make_hosts() {
    ip netns add lssp-h0 && ip netns add lssp-h1 &&
        ip link add lssp-v0 type veth peer name lssp-v1 &&
        ip link set lssp-v0 netns lssp-h0 && ip link set lssp-v1 netns lssp-h1 &&
        ip -n lssp-h0 addr add 10.213.0.1/24 dev lssp-v0 && ip -n lssp-h1 addr add 10.213.0.2/24 dev lssp-v1 ||
        return 1
    for n in 0 1; do ip -n "lssp-h$n" link set lo up && ip -n "lssp-h$n" link set "lssp-v$n" up || return 1; done
}
if ! make_hosts; then
    echo "multihost: could not make the namespaces" >&2
    exit 2
fi
ip netns exec lssp-h0 "$PY" benchmarks/multihost.py --peer lssp-h1 "$@"
