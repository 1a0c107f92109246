"""How stable is `load --max-rows auto`'s choice? The default target's row budget chosen again and again, with
fewer and more timing rounds (each count of positions in turns with a one-token forward), interleaved: the budgets
chosen, their ratios to one token's forward, and the seconds a choice takes.
Usage: .venv/bin/python benchmarks/row_budget_stability.py OUT.json [--rounds 7,21] [--choices 8] [--least 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from default_pair import load_default_target  # noqa: E402

from lssp.measure.cost import row_budget  # noqa: E402
from lssp.report.results import device_description, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", default="7,21")
    parser.add_argument("--choices", type=int, default=8)
    parser.add_argument("--least", type=int, default=3, help="one request's K + 1 (the default pair's K=2: 3)")
    args = parser.parse_args()
    target = load_default_target()
    counts = [int(r) for r in args.rounds.split(",")]
    picks: dict[int, list[dict]] = {r: [] for r in counts}
    for _ in range(args.choices):  # the round counts in turns, so that the host's drift reaches both
        for rounds in counts:
            start = time.perf_counter()
            chosen = row_budget(target.model, args.least, rounds=rounds)
            picks[rounds].append({"rows": chosen.rows, "ratio": round(chosen.ratio[chosen.rows], 3),
                                  "seconds": round(time.perf_counter() - start, 2)})
    summary = {"device": device_description("cpu"), "target": target.name, "least": args.least,
               "choices": args.choices, "by_rounds": {
                   str(r): {"rows_chosen": dict(Counter(p["rows"] for p in picks[r])),
                            "seconds_per_choice": round(sum(p["seconds"] for p in picks[r]) / len(picks[r]), 2),
                            "picks": picks[r]} for r in counts}}
    write_json(args.out, summary)
    for r in counts:
        said = summary["by_rounds"][str(r)]
        print(f"{r} rounds: budgets chosen {said['rows_chosen']}, {said['seconds_per_choice']} s a choice")


if __name__ == "__main__":
    main()
