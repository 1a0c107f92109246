"""Print Markdown tables of chosen runs from the CSVs in benchmarks/results/ (for the README).

Usage: python benchmarks/tables.py [RESULTS_DIR] > benchmarks/results/README-tables.md
Prints every run of each kind (cost, latency, bench, eval), or only the run ids given with --runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lssp.report import markdown_table, read_csv_parts  # noqa: E402

LATENCY = ["mode", "k", "ms_per_token", "ms_per_token_median", "ms_per_token_min", "ms_per_token_max", "ttft_ms",
           "acceptance_rate", "alpha", "mean_accepted", "speedup"]
BENCH = ["engine", "ms_per_token", "ms_per_token_median", "ours_over_hf_median", "ours_over_hf_min", "ours_over_hf_max",
         "greedy_agreement"]
COST = ["model", "precision", "tokens", "ms", "relative"]
EVAL = ["mode", "trials", "successes", "success_rate", "wald_low", "wald_high", "wilson_low", "wilson_high", "diff_low",
        "diff_high", "mcnemar_p", "s_per_problem"]
TASKS = ["task", "prompt_format", "mode", "k", "ms_per_token", "alpha", "mean_accepted", "speedup", "specbench_speedup",
         "at_budget_share"]


def cost_pivot(rows: pd.DataFrame) -> pd.DataFrame:
    cells = rows.assign(cell=[f"{ms:.1f} (×{rel:.2f})" for ms, rel in zip(rows["ms"], rows["relative"])])
    if "forward" not in cells:  # runs from before the compact forward
        cells = cells.assign(forward="transformers")
    cells["forward"] = cells["forward"].fillna("transformers")
    table = cells.pivot_table(index=["model", "forward", "precision"], columns="tokens", values="cell", aggfunc="first",
                              sort=False)
    table.columns = [f"{n} token{'s' * (n > 1)}, ms (× 1 token)" for n in table.columns]
    return table.reset_index()


def runs_of(frame: pd.DataFrame, wanted: list[str] | None) -> list[str]:
    ids = list(dict.fromkeys(frame.sort_values("timestamp")["run_id"]))
    if wanted:
        return [r for r in ids if r in wanted]
    return ids


def describe(rows: pd.DataFrame, extra: str = "") -> str:
    r = rows.iloc[0]
    sampling = f" · T={r['temperature']:g}" if "temperature" in r else ""
    return (f"run `{r['run_id']}` · {r['device']} · torch {r['torch']} · transformers {r['transformers']} · commit "
            f"{r['git_commit']}{sampling}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="?", default="benchmarks/results")
    ap.add_argument("--runs", nargs="*", help="run ids to show (default: all)")
    args = ap.parse_args()
    root = Path(args.results)
    for name, columns in (("cost", COST), ("latency", LATENCY), ("bench", BENCH), ("eval", EVAL)):
        frame = read_csv_parts(root / f"{name}.csv")
        if frame.empty:
            continue
        for run_id in runs_of(frame, args.runs):
            rows = frame[frame["run_id"] == run_id]
            extra = f", {int(rows['prompts'].iloc[0])} prompts × {int(rows['max_new_tokens'].iloc[0])} tokens" if "prompts" in rows else ""
            if "prompt_format" in rows and rows["prompt_format"].iloc[0] == "chat":
                extra += " in the chat template"
            first = rows.iloc[0]
            if name == "eval" and pd.notna(first.get("op")):
                extra += f", `a {'+' if first['op'] == 'add' else '*'} b` with operands 1..{int(first['max_operand'])}"
            if name == "latency" and pd.notna(first.get("ignore_eos")):
                extra += ", end token ignored" if str(first["ignore_eos"]) == "True" else ", ending at the end token"
            models = (f"{rows['target'].iloc[0]} + {rows['draft'].fillna('').max() or '-'}" if "target" in rows
                      else " + ".join(dict.fromkeys(rows["model"])))
            print(f"#### {name}: {models}\n")
            print(describe(rows, extra) + "\n")
            if name == "cost":  # one row per model, forward and precision, one column per tokens-per-forward
                rows = cost_pivot(rows)
                columns = list(rows.columns)
            shown = [c for c in columns if c in rows]
            if name == "latency" and "task" in rows and (rows["task"] == "all").any():  # a run over several tasks
                shown = [c for c in TASKS if c in rows]
            for variant in ("confidence", "lookup"):  # early-stopping drafts (K a maximum), the context lookup
                if name == "latency" and variant in rows and rows[variant].fillna(0).any():
                    shown = shown[:2] + [variant] + shown[2:]
                    rows = rows.assign(**{variant: rows[variant].fillna(0)})
            print(markdown_table(rows.to_dict("records"), shown))


if __name__ == "__main__":
    main()
