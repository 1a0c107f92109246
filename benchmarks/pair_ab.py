"""Two settings of the default pair against each other, in one process, alternating completion by completion.

The default pair decodes the story openings and task categories (by default RAG and summarization, long prompts):
RSp, and SSp with the default drafter at its K, greedy (or sampled at ``--temperature``, a seed per prompt), each
completion once in each arm. The arms (``--arms``): ``kv-cache``, the target's KV cache in float32 against float16;
``sampling``, sampling through torch's ops against our CPU kernel's (``lssp.decoding.sampling.on_kernel``);
``copy``, a copied token added as a logits row of -inf but at it (warped, drawn from: ``Picker.add``, as before
2026-11-28 afternoon) against one-hot directly (``Picker.add_certain``); ``verification``, the rule step by step
(argmaxes, or the softmax, the acceptance tests and the draw each a call, as before 2026-11-29) against our kernel's
one call (``verify_greedy``, ``verify_sampled``): the same tokens. Writes per
task and mode the median ms/token over the passes (after each completion's first emission), the ratio, and how many
completions gave the same tokens (another cache is another target law, another sampler other rounding, so equal
tokens are not expected everywhere), with the machine, to a JSON file.
Usage: .venv/bin/python benchmarks/pair_ab.py OUT.json [--arms kv-cache|sampling|copy|verification] [--repeats 3]
       [--prompts 8]
       [--tasks stories,rag,summarization] [--temperature T]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_pair  # noqa: E402

from lssp.decoding import sampling, verification  # noqa: E402
from lssp.decoding.drafting import Picker  # noqa: E402
from lssp.decoding.generation import generate_regular  # noqa: E402
from lssp.decoding.sampling import SamplingParams, warp  # noqa: E402
from lssp.decoding.speculative import speculative_decode  # noqa: E402
from lssp.drafters import entry_drafter  # noqa: E402
from lssp.models.loading import encode_prompt  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402
from lssp.workloads.tasks import task_prompts  # noqa: E402

KERNEL_SAMPLING = sampling.on_kernel
ONE_HOT = Picker.add_certain
ONE_CALL = verification.greedy_verification, verification.tempered_verification


def add_as_logits(picker: Picker, token: int) -> int:
    """A copied token as ``Picker.add`` takes any draft: logits of -inf but at it."""
    logits = torch.full((picker.vocab,), float("-inf"), device=picker.device)
    logits[token] = 0.0
    return picker.add(logits)


def sample_through(kernel: bool) -> None:
    """Sampling through our kernel's ops, or torch's."""
    on = KERNEL_SAMPLING if kernel else (lambda t: False)
    sampling.on_kernel = verification.on_kernel = on


def verify_in_one_call(one_call: bool) -> None:
    """Verification through our kernel's one call, or the rule step by step."""
    steps = (verification.greedy_rule, lambda logits, temperature, q, drafts, accept_u, next_u:
             verification.sampled_verification(warp(logits, SamplingParams(temperature)), q, drafts, accept_u, next_u))
    verification.greedy_verification, verification.tempered_verification = ONE_CALL if one_call else steps


def arms(name: str, model: torch.nn.Module) -> dict[str, Callable[[], None]]:
    """The two settings, each a function that puts it in place."""
    if name == "kv-cache":
        return {"float32": lambda: setattr(model, "cache_dtype", None),
                "float16": lambda: setattr(model, "cache_dtype", torch.float16)}
    if name == "copy":
        return {"logits": lambda: setattr(Picker, "add_certain", add_as_logits),
                "one-hot": lambda: setattr(Picker, "add_certain", ONE_HOT)}
    if name == "verification":
        return {"steps": lambda: verify_in_one_call(False), "one-call": lambda: verify_in_one_call(True)}
    return {"torch": lambda: sample_through(False), "kernel": lambda: sample_through(True)}


def seeded(params: SamplingParams, seed: int) -> torch.Generator | None:
    """A generator seeded per prompt where sampling draws, none where greedy."""
    return None if params.greedy else torch.Generator().manual_seed(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tasks", default="stories,rag,summarization")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--arms", choices=["kv-cache", "sampling", "copy", "verification"], default="kv-cache")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature)
    target, spec, head = load_default_pair()
    model = target.model
    default_cache = model.cache_dtype
    settings = arms(args.arms, model)
    first, second = settings
    rows = {}
    with torch.inference_mode():
        for task in args.tasks.split(","):
            prompts = task_prompts(task)[:args.prompts]
            ids = [torch.tensor([encode_prompt(target.tokenizer, p.turns[0], p.chat)]) for p in prompts]
            spent = {(c, m): [] for c in settings for m in ("rsp", "ssp")}
            tokens: dict[tuple[str, str], list] = {key: [] for key in spent}
            for i in range(args.repeats):
                per_pass = {key: [0.0, 0] for key in spent}
                for seed, prompt in enumerate(ids):
                    for arm in (list(settings) if i % 2 else list(settings)[::-1]):
                        settings[arm]()
                        drafter = entry_drafter(head)
                        rsp = generate_regular(model, prompt, 64, params, seeded(params, seed), time_forwards=False)
                        ssp = speculative_decode(model, drafter, prompt, 64, spec.k or 2, params, seeded(params, seed),
                                                 time_forwards=False)
                        for mode, out in (("rsp", rsp), ("ssp", ssp)):
                            per_pass[arm, mode][0] += out.stats.total_time_s - out.stats.ttft_s
                            per_pass[arm, mode][1] += out.stats.new_tokens - out.stats.first_emission_tokens
                            if i == 0:
                                tokens[arm, mode].append(out.tokens.tolist())
                for key, (s, n) in per_pass.items():
                    spent[key].append(1000 * s / n)
            for mode in ("rsp", "ssp"):
                a_ms, b_ms = spent[first, mode], spent[second, mode]
                rows[f"{task} {mode}"] = {
                    f"{first}_ms": round(median(a_ms), 3), f"{second}_ms": round(median(b_ms), 3),
                    f"{first}_over_{second}": round(median(a / b for a, b in zip(a_ms, b_ms)), 3),
                    "same_tokens": sum(a == b for a, b in zip(tokens[first, mode], tokens[second, mode])),
                    "completions": len(ids)}
            for arm in settings:
                rsp, ssp = spent[arm, "rsp"], spent[arm, "ssp"]
                rows[f"{task} {arm} ssp_speedup"] = round(median(a / b for a, b in zip(rsp, ssp)), 3)
            print(json.dumps({task: {k: v for k, v in rows.items() if k.startswith(task)}}), flush=True)
    model.cache_dtype = default_cache
    sample_through(True)
    Picker.add_certain = ONE_HOT
    verify_in_one_call(True)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "target": target.spec.name,
              "precision": target.precision, "draft": spec.name, "k": spec.k or 2, "sampling": str(params),
              "arms": args.arms, "prompts": args.prompts,
              "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
