"""What does a gateway in front of the servers change? Two llama-servers of the default pair (RSp; the draft model
at K=3) reached directly and through a LiteLLM proxy that serves both under model ids of its own, asks for a key and
exports no /metrics, in one interleaved latency run: ms/token gateway ÷ direct per mode with its 95% interval, the
acceptance read directly and, through the gateway, from the server behind it (``,metrics=URL``), and greedy SSp's
text against RSp's each way.
Usage: .venv/bin/python benchmarks/endpoint_gateway.py OUT [--nb-prompts 8] [--max-new-tokens 64]
       [--litellm PATH]   (./setup.sh --llamacpp; LiteLLM's proxy in an environment of its own, e.g.
       python3 -m venv /tmp/gw && /tmp/gw/bin/pip install 'litellm[proxy]'; ~2 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.engines.endpoint import API_KEY_VARIABLE, Endpoint, EndpointEngine, introduce  # noqa: E402
from lssp.engines.llamacpp import LlamacppModel, LlamacppServers, free_port  # noqa: E402
from lssp.engines.llamacpp_build import find_build  # noqa: E402
from lssp.measure.latency import paired_speedup, run_latency  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.results import append_csv, device_description, markdown_table, write_json  # noqa: E402
from lssp.workloads.prompts import WARMUP_PROMPT  # noqa: E402
from lssp.workloads.tasks import task_prompts  # noqa: E402

K = 3
KEY = "sk-llamassp-benchmark"  # the proxy's master key: asked for on every request, as a gateway does
START_TIMEOUT_S = 180


class GatewayEngine(EndpointEngine):
    """The same engine under another name, so that the gateway's RSp and SSp are modes of their own in one run."""

    name = "gateway"

    def __init__(self, endpoints, tokenizer) -> None:
        super().__init__(endpoints, tokenizer)
        self.endpoints = {replace(mode, engine=self.name): e for mode, e in self.endpoints.items()}


def start_litellm(litellm: str, servers: dict[str, str], workdir: Path) -> tuple[subprocess.Popen, str]:
    """LiteLLM's proxy on a free loopback port serving each (model id -> llama-server URL); its URL once it lists
    them."""
    config = workdir / "litellm.yaml"
    config.write_text("model_list:\n" + "".join(
        f"  - model_name: {name}\n    litellm_params:\n      model: text-completion-openai/{name}\n"
        f"      api_base: {url}/v1\n      api_key: none\n" for name, url in servers.items())
        + f"general_settings:\n  master_key: {KEY}\n")
    port = free_port()
    log = open(workdir / "litellm.log", "w")
    process = subprocess.Popen([litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LITELLM_LOG": "ERROR"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"litellm exited at start with code {process.returncode}; its log: {workdir / 'litellm.log'}")
        try:
            introduce(Endpoint("probe", url, next(iter(servers))))
            return process, url
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    process.kill()
    sys.exit(f"litellm did not answer /v1/models within {START_TIMEOUT_S} s; its log: {workdir / 'litellm.log'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nb-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--litellm", default=shutil.which("litellm"), help="LiteLLM's command (default: on PATH)")
    args = parser.parse_args()
    build = find_build()
    if build is None:
        sys.exit("llama.cpp is not built here (./setup.sh --llamacpp)")
    if not args.litellm:
        sys.exit("no litellm command: python3 -m venv /tmp/gw && /tmp/gw/bin/pip install 'litellm[proxy]', then "
                 "--litellm /tmp/gw/bin/litellm")
    registry = load_registry(REPO / "models.yaml")
    target = LlamacppModel(registry.get(registry.target_name(None)), build)
    draft = LlamacppModel(registry.get(registry.draft_name(None, heads=False)), build, target)
    servers = LlamacppServers(target, draft, [(0, 0), (K, 0)])
    proxy = None
    try:
        rsp_url, ssp_url = (f"http://127.0.0.1:{servers.servers[key].port}" for key in ((0, 0), (K, 0)))
        os.environ[API_KEY_VARIABLE] = KEY  # sent to the llama-servers too, which ignore it
        proxy, gateway = start_litellm(args.litellm, {"smol": rsp_url, f"smol-draft-k{K}": ssp_url},
                                       Path(tempfile.mkdtemp(prefix="litellm-")))
        direct = EndpointEngine([introduce(Endpoint("rsp", rsp_url)), introduce(Endpoint(f"k{K}", ssp_url))],
                                target.tokenizer)
        through = GatewayEngine([introduce(Endpoint("rsp", gateway, "smol")),
                                 introduce(Endpoint(f"k{K}", gateway, f"smol-draft-k{K}", metrics=(ssp_url,)))],
                                target.tokenizer)
        modes = [*direct.endpoints, *through.endpoints]
        prompts = list(task_prompts("stories"))[:args.nb_prompts]
        run = run_latency(target, {direct.name: direct, through.name: through}, modes, prompts, WARMUP_PROMPT,
                          SamplingParams(0.0), args.max_new_tokens, 0, [draft], ignore_eos=True)
        said = subprocess.run([args.litellm, "--version"], capture_output=True, text=True).stdout.split()
        version = said[-1] if said else ""  # "LiteLLM: Current Version = 1.108.7"
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        servers.close()
    args.out.mkdir(parents=True, exist_ok=True)
    append_csv(args.out / "latency.csv", run.rows())
    append_csv(args.out / "latency_prompts.csv", run.prompt_rows())
    (args.out / f"latency-{run.info.run_id}.md").write_text(run.markdown())
    table = []
    for name, ours, theirs in (("rsp", modes[0], modes[2]), (f"ssp k={K}", modes[1], modes[3])):
        ratio, _ = paired_speedup(run.timings, theirs, ours)  # gateway ms/token ÷ direct, per prompt
        near = next(m for m in run.overall if m.how == ours)
        far = next(m for m in run.overall if m.how == theirs)
        table.append({"mode": name, "direct_ms_per_token": round(near.ms_per_token, 3),
                      "gateway_ms_per_token": round(far.ms_per_token, 3), "gateway_over_direct": ratio.estimate,
                      "low": ratio.low, "high": ratio.high, "direct_acceptance": near.acceptance_rate,
                      "gateway_acceptance": far.acceptance_rate, "direct_same_as_rsp": near.same_as_rsp,
                      "gateway_same_as_rsp": far.same_as_rsp, "direct_tokens": near.new_tokens,
                      "gateway_tokens": far.new_tokens})
    summary = {"run_id": run.info.run_id, "device": device_description("cpu") + " (servers, proxy and client)",
               "llamacpp": servers.version, "litellm": version, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "k": K, "pairs": table}
    write_json(args.out / "endpoint-gateway.json", summary)
    text = (f"# The same llama-servers reached directly and through a gateway (run {run.info.run_id})\n\n"
            f"{summary['device']}; llama.cpp {servers.version}; LiteLLM {version or '?'} (proxy, a master key, no "
            f"/metrics); {len(prompts)} story openings × {args.max_new_tokens} tokens (end token ignored), greedy, "
            "one interleaved run. Through the gateway the SSp acceptance is read from the llama-server behind it "
            "(`,metrics=URL`). gateway_over_direct: the geometric mean of the per-prompt ratios of ms/token, with "
            "its 95% interval.\n\n" + markdown_table(table, list(table[0])) + "\n")
    (args.out / "endpoint-gateway.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
