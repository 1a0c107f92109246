"""A feature head's drafts in one kernel call (``draft_chain``) against step by step, in one process.

The default pair decodes the story openings (SSp with the default drafter at each K; greedy, or sampled at
``--temperature`` with a seed per prompt), the two ways alternating per pass; the tokens must be equal. Writes the medians of the per-pass ms/token (after each
completion's first emission) and their ratio with the machine to a JSON file.
Usage: .venv/bin/python benchmarks/chain_ab.py OUT.json [--k 1,2,4] [--repeats 6] [--prompts 8] [--temperature T]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_pair  # noqa: E402

from lssp.decoding.generation import generate_regular  # noqa: E402
from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.decoding.speculative import speculative_decode  # noqa: E402
from lssp.drafters import entry_drafter  # noqa: E402
from lssp.drafters.model import FeatureHead  # noqa: E402
from lssp.models.loading import encode_prompt  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402
from lssp.workloads.prompts import LATENCY_PROMPTS  # noqa: E402


def one_pass(target, head, spec, ids: list[torch.Tensor], k: int | None, chains: bool,
             params: SamplingParams) -> tuple[float, list]:
    """ms/token over the prompts (after each first emission) and their tokens: SSp at ``k`` (None: RSp)."""
    FeatureHead.chains = chains
    spent, count, tokens = 0.0, 0, []
    for seed, prompt in enumerate(ids):
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        if k is None:
            out = generate_regular(target.model, prompt, 64, params, generator, time_forwards=False)
        else:
            drafter = entry_drafter(head)
            out = speculative_decode(target.model, drafter, prompt, 64, k, params, generator, time_forwards=False)
        spent += out.stats.total_time_s - out.stats.ttft_s
        count += out.stats.new_tokens - out.stats.first_emission_tokens
        tokens.append(out.tokens.tolist())
    return 1000 * spent / count, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--k", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature)
    target, spec, head = load_default_pair()
    ids = [torch.tensor([encode_prompt(target.tokenizer, text, False)]) for text in LATENCY_PROMPTS[:args.prompts]]
    rows = {}
    with torch.inference_mode():
        for k in [None, *(int(k) for k in args.k.split(","))]:
            one_pass(target, head, spec, ids[:1], k, True, params)  # warm up
            times: dict[str, list[float]] = {"chain": [], "steps": []}
            outputs: dict[str, list] = {"chain": [], "steps": []}
            for i in range(args.repeats):
                for name in (("chain", "steps") if i % 2 else ("steps", "chain")):
                    ms, tokens = one_pass(target, head, spec, ids, k, name == "chain", params)
                    times[name].append(ms)
                    outputs[name].append(tokens)
            ratios = [s / c for s, c in zip(times["steps"], times["chain"])]
            rows["rsp" if k is None else f"ssp k={k}"] = {
                "chain_ms": round(median(times["chain"]), 3), "steps_ms": round(median(times["steps"]), 3),
                "steps_over_chain": round(median(ratios), 3), "per_pass": [round(r, 3) for r in ratios],
                "equal": outputs["chain"] == outputs["steps"]}
    FeatureHead.chains = True
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "draft": spec.name, "prompts": args.prompts,
              "sampling": str(params),
              "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
