"""How fast could SSp be with a better draft? The default pair's loop, greedy, with an oracle that knows the target's
own continuation (from an RSp run of the same prompt) and proposes it right with probability alpha per draft (else
a wrong token), against RSp, the shipped drafter and its head alone (no lookup), interleaved in one process.

The oracle pays what drafting costs: a plain feature head (the default drafter's, no lookup) drafts each iteration
alongside it, its picks thrown away, so the target's forwards, the head's and the loop's own work are all real; only
which drafts are right is set. Each iteration it proposes exactly K drafts, each right with probability alpha alone
(a Bernoulli draw per draft, seeded), so it emits 1 + alpha + ... + alpha^K tokens per forward on average, and its
greedy output is the target's (checked: every completion against the RSp one).

Writes, per task and over all, RSp's ms/token, and for the shipped drafter and its head alone (at each K) and the oracle (at each
alpha and K) the ms/token, the speedup (median over the passes of RSp's time / SSp's time), tokens per forward and
the measured acceptance; and, for each K and each bar in ``--bars``, the alpha where the oracle's speedup crosses
it (linear between the alphas measured; null where no alpha measured reaches it).
The oracle is ``lssp.drafters.oracle.Oracle``; ``llamassp.py ceiling`` runs the same measurement with the
registry's pairs (without the head-alone arms). Usage: .venv/bin/python benchmarks/ssp_ceiling.py OUT.json [--repeats 2] [--prompts 4] [--ks 2,3,4,6]
       [--alphas 0.6,0.7,0.8,0.9,1.0] [--tasks all] [--bars all:1.5,stories:2.0]
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

from lssp.decoding.generation import GenerationOutput, generate_regular  # noqa: E402
from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.decoding.speculative import speculative_decode  # noqa: E402
from lssp.drafters import drafter_for, entry_drafter  # noqa: E402
from lssp.drafters.oracle import Oracle  # noqa: E402
from lssp.measure.ceiling import crossing  # noqa: E402
from lssp.models.loading import encode_prompt  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402
from lssp.workloads.tasks import TASKS, task_prompts  # noqa: E402

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0)


def per_token_ms(outs: list[GenerationOutput]) -> float:
    """ms per token after each completion's first emission, over the completions."""
    spent = sum(o.stats.total_time_s - o.stats.ttft_s for o in outs)
    return 1000 * spent / sum(o.stats.new_tokens - o.stats.first_emission_tokens for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--ks", default="2,3,4,6")
    parser.add_argument("--alphas", default="0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--bars", default="all:1.5,stories:2.0")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    tasks = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    target, spec, head = load_default_pair()
    model = target.model
    arms = ([("rsp", None, 0)] + [(kind, None, k) for kind in ("shipped", "head") for k in ks]
            + [("oracle", a, k) for a in alphas for k in ks])
    times: dict[tuple[str, tuple], list[float]] = {}  # (task, arm) -> ms/token per pass
    counts: dict[tuple[str, tuple], list[int]] = {}  # (task, arm) -> [tokens, forwards, drafted, accepted]
    differing = 0
    with torch.inference_mode():
        prompts = {t: [torch.tensor([encode_prompt(target.tokenizer, p.turns[0], p.chat)])
                       for p in task_prompts(t)[:args.prompts]] for t in tasks}
        references = {(t, i): generate_regular(model, ids, NEW_TOKENS, GREEDY, time_forwards=False).tokens.tolist()
                      for t in tasks for i, ids in enumerate(prompts[t])}
        for rep in range(args.repeats):
            for t in tasks:
                outs: dict[tuple, list[GenerationOutput]] = {arm: [] for arm in arms}
                for i, ids in enumerate(prompts[t]):
                    order = arms[(i + rep) % len(arms):] + arms[:(i + rep) % len(arms)]
                    for arm in order:
                        kind, alpha, k = arm
                        if kind == "rsp":
                            out = generate_regular(model, ids, NEW_TOKENS, GREEDY, time_forwards=False)
                        else:
                            drafter = (entry_drafter(head) if kind == "shipped" else drafter_for(head.model)
                                       if kind == "head" else Oracle(drafter_for(head.model), references[t, i],
                                                                            ids.shape[1], alpha, 1000 * rep + i))
                            out = speculative_decode(model, drafter, ids, NEW_TOKENS, k, GREEDY, time_forwards=False)
                        differing += out.tokens.tolist() != references[t, i]
                        outs[arm].append(out)
                        c = counts.setdefault((t, arm), [0, 0, 0, 0])
                        for j, v in enumerate((out.stats.new_tokens, out.stats.target_forwards, out.stats.drafted,
                                               out.stats.accepted)):
                            c[j] += v
                for arm in arms:
                    times.setdefault((t, arm), []).append(per_token_ms(outs[arm]))
            print(f"pass {rep + 1} of {args.repeats} done", file=sys.stderr, flush=True)
    for arm in arms:  # over all tasks: each pass's total time over its total tokens, by the tasks' mean ms/token
        times["all", arm] = [sum(times[t, arm][r] for t in tasks) / len(tasks) for r in range(args.repeats)]
        counts["all", arm] = [sum(counts[t, arm][j] for t in tasks) for j in range(4)]
    rows = {}
    for t in tasks + ["all"]:
        rsp = times[t, arms[0]]
        row = {"rsp_ms": round(median(rsp), 3)}
        for arm in arms[1:]:
            kind, alpha, k = arm
            tokens, forwards, drafted, accepted = counts[t, arm]
            row[f"{kind} K={k}" + (f" alpha={alpha}" if alpha is not None else "")] = {
                "ms": round(median(times[t, arm]), 3),
                "speedup": round(median(r / s for r, s in zip(rsp, times[t, arm])), 3),
                "tokens_per_forward": round(tokens / forwards, 3), "acceptance": round(accepted / max(drafted, 1), 3)}
        rows[t] = row
    needed = {}
    for bar_text in args.bars.split(","):
        task, bar = bar_text.split(":")
        if task in rows:
            needed[bar_text] = {f"K={k}": crossing([(a, rows[task][f"oracle K={k} alpha={a}"]["speedup"])
                                                    for a in alphas], float(bar)) for k in ks}
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "target": target.spec.name,
              "precision": target.precision, "draft": spec.name, "shipped_k": spec.k or 2, "new_tokens": NEW_TOKENS,
              "prompts_per_task": args.prompts, "repeats": args.repeats, "sampling": "greedy",
              "completions_not_equal_to_rsp": differing, "alpha_needed": needed, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"alpha_needed": needed, "all": rows["all"]}, indent=1))


if __name__ == "__main__":
    main()
