"""The default feature head with its output rows in 4-bit blocks (Q4_1, what ``quantization: q4_1``/``auto`` gives
every Linear but an ``lm_head``) against 8-bit ones (Q8_0: the target's own output rows as its GGUF stores them),
drafting as the default entry does, in one process, alternating prompt by prompt: ms/token after the first emission,
tokens per target forward and the first draft's acceptance, per task category, greedy. Writes a JSON file.
Usage: .venv/bin/python benchmarks/head_output_bits.py OUT.json [--prompts 6] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_pair  # noqa: E402

import lssp.models.loading as loading  # noqa: E402
from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.decoding.speculative import speculative_decode  # noqa: E402
from lssp.drafters import entry_drafter  # noqa: E402
from lssp.models.draft_head import SubsetHead  # noqa: E402
from lssp.models.loading import encode_prompt, load_model  # noqa: E402
from lssp.models.weight_only import BlockLinear, weight_only_quantize  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402
from lssp.workloads.tasks import TASKS, task_prompts  # noqa: E402


def eight_bit_rows(model: torch.nn.Module, kind: str, dtype: torch.dtype = torch.float32) -> tuple:
    """``weight_only_quantize`` with a SubsetHead's rows in 8 bits."""
    model = model.to(dtype)
    rows = [(m, m.linear.weight.detach().clone()) for m in model.modules() if isinstance(m, SubsetHead)]
    model, kept = weight_only_quantize(model, kind, dtype)
    for m, weight in rows:
        m.linear = BlockLinear(weight, bits=8)
    return model, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    target, spec, four = load_default_pair()
    loading.weight_only_quantize = eight_bit_rows
    eight = load_model(spec, draft=True, target=target)
    heads = {"q4_1 rows": four, "q8_0 rows": eight}
    greedy = SamplingParams(temperature=0.0)
    result: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "draft": spec.name, "k": spec.k or 2,
                    "prompts_per_task": args.prompts, "tokens": args.tokens, "tasks": {}}
    totals = {name: [0.0, 0, 0, 0, 0] for name in heads}
    for task in TASKS:
        spent = {name: [0.0, 0, 0, 0, 0] for name in heads}  # seconds, tokens, forwards, first drafts, accepted
        for i, prompt in enumerate(task_prompts(task)[:args.prompts]):
            ids = torch.tensor([encode_prompt(target.tokenizer, prompt.text, prompt.chat)])
            for name in (list(heads) if i % 2 else list(heads)[::-1]):
                s = speculative_decode(target.model, entry_drafter(heads[name]), ids, args.tokens, spec.k or 2,
                                       greedy).stats
                for acc in (spent[name], totals[name]):
                    acc[0] += s.total_time_s - s.ttft_s
                    acc[1] += s.new_tokens - s.first_emission_tokens
                    acc[2] += s.target_forwards
                    acc[3] += s.drafted_at[0]
                    acc[4] += s.accepted_at[0]
        result["tasks"][task] = summary(spent)
        print(task, result["tasks"][task], flush=True)
    result["all"] = summary(totals)
    print("all", result["all"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def summary(spent: dict) -> dict:
    return {name: {"ms_per_token": round(1000 * s / max(n, 1), 3), "tokens_per_forward": round(n / max(f, 1), 3),
                   "first_draft_acceptance": round(a / max(d, 1), 3)} for name, (s, n, f, d, a) in spent.items()}


if __name__ == "__main__":
    main()
