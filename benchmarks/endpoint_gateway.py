"""What does a gateway in front of the servers change? Two llama-servers of the default pair (RSp; the draft model
at K=3) reached directly and through a LiteLLM proxy that serves both under model ids of its own, asks for a key and
exports no /metrics, in one interleaved latency run: ms/token gateway ÷ direct per mode with its 95% interval, the
acceptance read directly and, through the gateway, from the server behind it (``,metrics=URL``), and greedy SSp's
text against RSp's each way.
Usage: .venv/bin/python benchmarks/endpoint_gateway.py OUT [--nb-prompts 8] [--max-new-tokens 64]
       [--litellm PATH] [--api chat]   (./setup.sh --llamacpp; LiteLLM's proxy in an environment of its own, e.g.
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

from default_pair import default_llamacpp_servers, two_ways  # noqa: E402

from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.engines.endpoint import API_KEY_VARIABLE, Endpoint, EndpointEngine, introduce  # noqa: E402
from lssp.engines.llamacpp import free_port  # noqa: E402
from lssp.measure.latency import run_latency  # noqa: E402
from lssp.report.results import device_description, markdown_table, write_json  # noqa: E402
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


def start_litellm(litellm: str, servers: dict[str, str], workdir: Path, chat: bool) -> tuple[subprocess.Popen, str]:
    """LiteLLM's proxy on a free loopback port serving each (model id -> llama-server URL), passing on completions
    or (``chat``) chat completions; its URL once it lists them."""
    config = workdir / "litellm.yaml"
    provider = "openai" if chat else "text-completion-openai"
    config.write_text("model_list:\n" + "".join(
        f"  - model_name: {name}\n    litellm_params:\n      model: {provider}/{name}\n"
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
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="chat: every server reached over its chat completions (api=chat), directly and through "
                        "the proxy")
    args = parser.parse_args()
    if not args.litellm:
        sys.exit("no litellm command: python3 -m venv /tmp/gw && /tmp/gw/bin/pip install 'litellm[proxy]', then "
                 "--litellm /tmp/gw/bin/litellm")
    servers, target, draft = default_llamacpp_servers(K)
    proxy = None
    try:
        rsp_url, ssp_url = (f"http://127.0.0.1:{servers.servers[key].port}" for key in ((0, 0), (K, 0)))
        os.environ[API_KEY_VARIABLE] = KEY  # sent to the llama-servers too, which ignore it
        chat = args.api == "chat"
        proxy, gateway = start_litellm(args.litellm, {"smol": rsp_url, f"smol-draft-k{K}": ssp_url},
                                       Path(tempfile.mkdtemp(prefix="litellm-")), chat)
        direct = EndpointEngine([introduce(Endpoint("rsp", rsp_url, chat=chat)),
                                 introduce(Endpoint(f"k{K}", ssp_url, chat=chat))], target.tokenizer)
        through = GatewayEngine([introduce(Endpoint("rsp", gateway, "smol", chat=chat)),
                                 introduce(Endpoint(f"k{K}", gateway, f"smol-draft-k{K}", metrics=(ssp_url,), chat=chat))],
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
    table = two_ways(args.out, run, [("rsp", modes[0], modes[2]), (f"ssp k={K}", modes[1], modes[3])], "direct",
                     "gateway")
    summary = {"run_id": run.info.run_id, "device": device_description("cpu") + " (servers, proxy and client)",
               "llamacpp": servers.version, "litellm": version, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "k": K, "api": args.api, "pairs": table}
    name = "endpoint-gateway" + ("-chat" if chat else "")
    write_json(args.out / f"{name}.json", summary)
    text = (f"# The same llama-servers reached directly and through a gateway (run {run.info.run_id})\n\n"
            f"{summary['device']}; llama.cpp {servers.version}; LiteLLM {version or '?'} (proxy, a master key, no "
            f"/metrics); {'the chat API, each server its own template; ' if chat else ''}{len(prompts)} story "
            f"openings × {args.max_new_tokens} tokens (end token ignored), greedy, "
            "one interleaved run. Through the gateway the SSp acceptance is read from the llama-server behind it "
            "(`,metrics=URL`). gateway_over_direct: the geometric mean of the per-prompt ratios of ms/token, with "
            "its 95% interval.\n\n" + markdown_table(table, list(table[0])) + "\n")
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
