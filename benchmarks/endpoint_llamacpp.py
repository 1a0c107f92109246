"""Does `--endpoint` time a server as the server times itself? One interleaved latency run over two llama-servers of
the default pair (RSp; the draft model at K=3), each reached two ways: as `--engine llamacpp` reaches it (native
/completion, ms/token from llama-server's own ``timings``) and as `latency --endpoint` reaches a server already
running (OpenAI /v1/completions, ms/token from the streamed events as they reach the client, tokens from the usage,
acceptance from /metrics). Same servers, prompts, seeds and greedy tokens; the table sets each mode's two figures
side by side, per prompt and overall, with the ratio's 95% interval.
Usage: .venv/bin/python benchmarks/endpoint_llamacpp.py OUT [--nb-prompts 8] [--max-new-tokens 64] [--eval N]
       (./setup.sh --llamacpp; ~2 minutes on 2 cores, more with --eval)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from default_pair import default_llamacpp_servers, two_ways  # noqa: E402

from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.engines.endpoint import Endpoint, EndpointEngine, introduce  # noqa: E402
from lssp.engines.llamacpp import LlamacppEngine  # noqa: E402
from lssp.measure.latency import rsp_mode, run_latency  # noqa: E402
from lssp.report.results import device_description, markdown_table, write_json  # noqa: E402
from lssp.workloads.prompts import WARMUP_PROMPT  # noqa: E402
from lssp.workloads.tasks import task_prompts  # noqa: E402

K = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nb-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval", type=int, default=0, help="then `eval --endpoint` on N problems and `compare "
                        "--endpoint` on one prompt, against the same servers (0: not)")
    args = parser.parse_args()
    servers, target, draft = default_llamacpp_servers(K)
    try:
        native = LlamacppEngine(servers)
        endpoints = [introduce(Endpoint(label, f"http://127.0.0.1:{servers.servers[key].port}"))
                     for label, key in (("rsp", (0, 0)), (f"draft-k{K}", (K, 0)))]
        outside = EndpointEngine(endpoints, target.tokenizer)
        modes = [rsp_mode(native.name), LlamacppEngine.ssp_mode(native.name, K), *(e.mode for e in endpoints)]
        prompts = list(task_prompts("stories"))[:args.nb_prompts]
        run = run_latency(target, {native.name: native, outside.name: outside}, modes, prompts, WARMUP_PROMPT,
                          SamplingParams(0.0), args.max_new_tokens, 0, [draft], ignore_eos=True)
        if args.eval:  # the same servers through the commands a user runs against a deployment
            urls = [f"--endpoint={e.label}={e.url}" for e in endpoints]
            cli = [sys.executable, str(REPO / "llamassp.py"), "--results-dir", str(args.out)]
            env = {**os.environ, "COLUMNS": "80"}
            subprocess.run([*cli, "eval", *urls, "--nb-prompts", str(args.eval), "--json",
                            str(args.out / "eval-endpoint.json")], env=env, check=False)
            with open(args.out / "compare-endpoint.txt", "w") as sink:
                subprocess.run([*cli, "compare", *urls, "--nb-prompts", "1"], env=env, stdout=sink, check=False)
    finally:
        servers.close()
    table = two_ways(args.out, run, [("rsp", modes[0], modes[2]), (f"ssp k={K}", modes[1], modes[3])], "inside",
                     "outside")
    summary = {"run_id": run.info.run_id, "device": device_description("cpu") + " (servers and client)", "llamacpp": servers.version,
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "k": K, "pairs": table,
               "speedup_inside": next(m.speedup for m in run.overall if m.how == modes[1]),
               "speedup_outside": next(m.speedup for m in run.overall if m.how == modes[3])}
    write_json(args.out / "endpoint-llamacpp.json", summary)
    text = (f"# The same llama-servers timed from inside and from outside (run {run.info.run_id})\n\n"
            f"{summary['device']}; llama.cpp {servers.version}; {len(prompts)} story openings × "
            f"{args.max_new_tokens} tokens (end token ignored), greedy, one interleaved run. Inside: `--engine "
            "llamacpp` (native /completion, llama-server's `predicted_ms`); outside: `--endpoint` (OpenAI "
            "/v1/completions, the streamed events as they reach the client, tokens from `usage`). "
            "outside_over_inside: the geometric mean of the per-prompt ratios of ms/token, with its 95% interval.\n\n"
            + markdown_table(table, list(table[0])) + "\n")
    (args.out / "endpoint-llamacpp.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
