"""Charts from the CSVs in a results folder (matplotlib, headless)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lssp.errors import UserError  # noqa: E402
from lssp.report.results import read_csv_parts  # noqa: E402
from lssp.report.stats import alpha_from_tokens_per_iteration, predicted_speedup  # noqa: E402

KINDS = ("latency", "speedup", "acceptance", "tasks", "eval")


def _caption(fig: Figure, frame: pd.DataFrame) -> None:
    devices = sorted(set(frame["device"].dropna().astype(str))) if "device" in frame else []
    runs = sorted(set(frame["run_id"].astype(str)))
    text = "; ".join(devices) + (f" — run {runs[0]}" if len(runs) == 1 else f" — runs {', '.join(runs)}")
    fig.text(0.01, 0.01, text, fontsize=7, color="0.35")


def _filter(frame: pd.DataFrame, run_id: str | None, target: str | None, draft: str | None,
            machine: str | None = None) -> pd.DataFrame:
    """The selected rows, from one machine: ``machine`` (a part of the device description; "all" keeps every
    machine) or, by default, the machine of the newest row, so that a chart never mixes two computers."""
    if machine != "all" and "device" in frame and not frame.empty:
        if machine:
            frame = frame[frame["device"].astype(str).str.contains(machine, regex=False)]
        elif run_id is None:
            newest = frame.sort_values("timestamp")["device"].iloc[-1] if "timestamp" in frame else frame["device"].iloc[-1]
            frame = frame[frame["device"] == newest]
    if run_id:
        frame = frame[frame["run_id"].astype(str) == run_id]
    if target:
        frame = frame[frame["target"] == target]
    if draft:
        runs = frame.loc[frame["draft"].fillna("") == draft, "run_id"]
        frame = frame[frame["run_id"].isin(runs)]
    return frame


def _finish(fig: Figure, ax, frame: pd.DataFrame, title: str, xlabel: str | None, ylabel: str, legend: bool = False) -> Figure:
    ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    bottom = 0.04  # the caption's line
    if legend:  # below the axes, one entry a line, so it never covers the data
        handles, labels = ax.get_legend_handles_labels()
        width, height = fig.get_size_inches()
        room, caption = 0.15 * len(labels) + 0.1, 0.3  # inches
        fig.set_size_inches(width, height + room)
        fig.legend(handles, labels, fontsize=7, loc="lower left", bbox_to_anchor=(0.01, caption / (height + room)),
                   frameon=False)
        bottom = (room + caption) / (height + room)
    _caption(fig, frame)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def _latest_run_per_pair(frame: pd.DataFrame) -> pd.DataFrame:
    """The newest run for each (target, draft, sampling parameters); a run's draft is its SSp draft, if any."""
    params = [c for c in ("temperature", "top_k", "top_p", "prompt_format") if c in frame]
    if "prompt_format" in frame:
        frame = frame.assign(prompt_format=frame["prompt_format"].fillna("raw"))
    runs = frame.groupby("run_id").agg(target=("target", "first"), draft=("draft", lambda d: ",".join(sorted(set(d.dropna()) - {""}))),
                                      timestamp=("timestamp", "max"), **{c: (c, "first") for c in params})
    latest = runs.sort_values("timestamp").groupby(["target", "draft", *params]).tail(1).index
    return frame[frame["run_id"].isin(latest)]


def _setting(row: pd.Series) -> str:
    """T=0.7, top-k 50: the sampling parameters of a row, short."""
    if "temperature" not in row:
        return ""
    text = "greedy" if row["temperature"] == 0 else f"T={row['temperature']:g}"
    if row.get("top_k", 0):
        text += f", top-k {int(row['top_k'])}"
    if row.get("top_p", 1.0) < 1:
        text += f", top-p {row['top_p']:g}"
    if row.get("prompt_format") == "chat":
        text += ", chat prompts"
    return text


def latency_figure(frame: pd.DataFrame) -> Figure:
    """ms/token per mode for each target/draft pair, error bars from the per-prompt min and max."""
    frame = _latest_run_per_pair(frame)
    labels, values, low, high, colours, pairs = [], [], [], [], [], set()
    for _run_id, rows in frame.groupby("run_id", sort=False):
        for _, r in rows.iterrows():
            if r["mode"] == "ssp":
                pairs.add(f"{r['target']} + {r['draft']}")
            vllm = r.get("engine") == "vllm"
            kind = f" {r['method']}" if r["mode"] == "ssp" and str(r.get("method", "draft")).startswith("eagle") else ""
            labels.append(("vLLM " if vllm else "") + ("RSp" if r["mode"] == "rsp" else f"SSp{kind} K={int(r['k'])}")
                          + f"\n{_setting(r)}")
            values.append(r["ms_per_token"])
            low.append(max(0.0, r["ms_per_token"] - r["ms_per_token_min"]))
            high.append(max(0.0, r["ms_per_token_max"] - r["ms_per_token"]))
            colours.append(("silver" if vllm else "tab:gray") if r["mode"] == "rsp" else "tab:olive" if vllm else "tab:green")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4.4))
    ax.bar(range(len(values)), values, yerr=[low, high], capsize=4, color=colours)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    title = f"RSp vs SSp: {', '.join(sorted(pairs)) or frame['target'].iloc[0]}\n(bars: all prompts; whiskers: per-prompt min–max)"
    return _finish(fig, ax, frame, title, None, "decode time per token (ms)")


def _alpha(ssp: pd.DataFrame) -> float:
    """Per-token α of the SSp rows: the recorded estimate, or inverted from tokens per target forward."""
    if "alpha" in ssp and ssp["alpha"].notna().all():
        return float(ssp["alpha"].mean())
    return float(np.nanmean([alpha_from_tokens_per_iteration(m, int(k)) for m, k in zip(ssp["mean_accepted"], ssp["k"])]))


def verification_slope(rsp: pd.DataFrame, ssp: pd.DataFrame) -> float:
    """s in v(K) = 1 + s·K, fitted through the origin to each K's target forward ÷ RSp's one-token forward."""
    ks = ssp["k"].to_numpy(float)
    extra = ssp["target_ms_per_forward"].to_numpy(float) / float(rsp["target_ms_per_forward"].iloc[0]) - 1.0
    keep = np.isfinite(extra)
    return float((ks[keep] * extra[keep]).sum() / (ks[keep] ** 2).sum()) if keep.any() else 0.0


def speedup_figure(frame: pd.DataFrame) -> Figure:
    """Measured speedup against K, with the standard model's curve from the measured α, c and verification cost."""
    frame = _latest_run_per_pair(frame)
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    # One curve per run and draft (a run may time several drafts against the same RSp).
    curves = [(rows[rows["mode"] == "rsp"], ssp.sort_values("k"))
              for _, rows in frame.groupby("run_id", sort=False)
              for _, ssp in rows[rows["mode"] == "ssp"].groupby("draft", sort=False)]
    for color, (rsp, ssp) in enumerate(curves):
        if rsp.empty:
            continue
        label = f"{ssp['target'].iloc[0]} + {ssp['draft'].iloc[0]}, {_setting(ssp.iloc[0])}"
        ax.plot(ssp["k"], ssp["speedup"], "o", color=f"C{color % 10}", label=f"{label}: measured")
        alpha = _alpha(ssp)
        c = float(ssp["draft_ms_per_forward"].median() / rsp["target_ms_per_forward"].iloc[0])
        ks = np.arange(1, max(int(ssp["k"].max()), 8) + 1)
        slope = verification_slope(rsp, ssp)
        ax.plot(ks, [predicted_speedup(alpha, int(k), c, 1.0 + slope * k) for k in ks], "--", color=f"C{color % 10}",
                label=f"{label}: model, α={alpha:.2f}, c={c:.2f}, v=1+{slope:.3f}K")
    ax.axhline(1.0, color="0.6", lw=0.8)
    return _finish(fig, ax, frame, "SSp speedup against K", "draft length K (tokens)", "speedup over RSp (×)", legend=True)


def acceptance_figure(frame: pd.DataFrame) -> Figure:
    """Acceptance rate at each draft position, one group of bars per K."""
    frame = _latest_run_per_pair(frame)
    ssp = frame[frame["mode"] == "ssp"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    width = 0.8 / max(1, len(ssp))
    for i, (_, r) in enumerate(ssp.iterrows()):
        rates = [float(x) for x in str(r["acceptance_by_position"]).split(";") if x not in ("", "nan")]
        ax.bar(np.arange(1, len(rates) + 1) + (i - (len(ssp) - 1) / 2) * width, rates, width,
               label=f"{r['target']} + {r['draft']}, K={int(r['k'])}, {_setting(r)}")
    ax.set_ylim(0, 1)
    return _finish(fig, ax, frame, "Acceptance by draft position", "draft position i",
                   "share of iterations accepting draft i", legend=True)


def overall_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Each run's summary over all its prompts: a run over several tasks also has one row per task and mode."""
    if "task" not in frame:
        return frame
    task = frame["task"].fillna("all")
    several = set(frame.loc[task == "all", "run_id"])
    return frame[(task == "all") | ~frame["run_id"].isin(several)]


def task_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The per-task rows of the newest run that has them."""
    if "task" not in frame:
        return frame.iloc[0:0]
    task = frame["task"].fillna("all")
    several = frame[frame["run_id"].isin(set(frame.loc[task == "all", "run_id"])) & (task != "all")]
    if several.empty:
        return several
    newest = several.sort_values("timestamp")["run_id"].iloc[-1]
    return several[several["run_id"] == newest]


def tasks_figure(frame: pd.DataFrame) -> Figure:
    """Speedup over RSp per task category, one bar per K (the plain draft), α written above each bar."""
    ssp = frame[frame["mode"] == "ssp"]
    tasks = list(dict.fromkeys(ssp["task"]))
    ks = sorted(set(ssp["k"]))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.45 * len(tasks) * len(ks)), 4.4))
    width = 0.8 / max(1, len(ks))
    for j, k in enumerate(ks):
        rows = ssp[ssp["k"] == k].set_index("task").reindex(tasks)
        x = np.arange(len(tasks)) + (j - (len(ks) - 1) / 2) * width
        ax.bar(x, rows["speedup"], width, label=f"K={int(k)}")
        for xi, speedup, alpha in zip(x, rows["speedup"], rows["alpha"]):
            if np.isfinite(speedup):
                ax.text(xi, speedup, f"α{alpha:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="0.6", lw=0.8)
    formats = ssp.groupby("task", sort=False)["prompt_format"].first() if "prompt_format" in ssp else {}
    ax.set_xticks(range(len(tasks)), [f"{t}\n({formats[t]})" if t in formats else t for t in tasks], fontsize=8)
    first = ssp.iloc[0]
    title = f"SSp speedup by task: {first['target']} + {first['draft']}, {_setting(first.drop('prompt_format', errors='ignore'))}"
    return _finish(fig, ax, frame, title, None, "speedup over RSp (×)", legend=True)


def eval_figure(frame: pd.DataFrame) -> Figure:
    """Success rate with its 95% Wald interval, RSp and SSp side by side."""
    frame = _latest_run_per_pair(frame)
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(frame)), 4.2))
    labels = [f"{r['target']}\n{r['mode'].upper()}" + (f" ({r['draft']})" if r["mode"] == "ssp" else "")
              for _, r in frame.iterrows()]
    rates = frame["success_rate"].to_numpy() * 100
    err = [rates - frame["wald_low"].to_numpy() * 100, frame["wald_high"].to_numpy() * 100 - rates]
    ax.bar(range(len(rates)), rates, yerr=err, capsize=5,
           color=["tab:gray" if m == "rsp" else "tab:green" for m in frame["mode"]])
    ax.set_xticks(range(len(rates)), labels, fontsize=7)
    return _finish(fig, ax, frame, "Eval success rate with 95% Wald intervals", None, "multiplications correct (%)")


def plot_results(results_dir: Path, out_dir: Path | None = None, run_id: str | None = None, target: str | None = None,
                 draft: str | None = None, kinds: Sequence[str] = (), machine: str | None = None) -> list[Path]:
    """Write the charts the selected rows allow; returns the PNG paths."""
    out_dir = out_dir or results_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = tuple(kinds) or KINDS
    written: list[Path] = []
    makers = {"latency": ("latency.csv", latency_figure), "speedup": ("latency.csv", speedup_figure),
              "acceptance": ("latency.csv", acceptance_figure), "tasks": ("latency.csv", tasks_figure),
              "eval": ("eval.csv", eval_figure)}
    if "latency" in kinds:
        kinds = tuple(dict.fromkeys(kinds + ("speedup", "acceptance", "tasks")))
    for kind in kinds:
        csv, make = makers[kind]
        frame = read_csv_parts(results_dir / csv)
        if frame.empty:
            continue
        frame = _filter(frame, run_id, target, draft, machine)
        if kind != "eval":  # the task chart draws the rows of each task, the others a run's rows over all prompts
            frame = task_rows(frame) if kind == "tasks" else overall_rows(frame)
        if kind not in ("eval", "latency") and "engine" in frame:  # the model curves and α are our engine's
            frame = frame[frame["engine"].fillna("ours") == "ours"]
        for variant in ("confidence", "lookup"):  # latency charts: the plain draft at fixed K, as the model curve assumes
            if kind != "eval" and variant in frame:
                frame = frame[frame[variant].fillna(0) == 0]
        if kind in ("speedup", "acceptance") and not (frame["mode"] == "ssp").any():
            continue
        if kind == "speedup" and not (frame["mode"] == "rsp").any():
            continue
        if frame.empty:
            continue
        fig = make(frame)
        suffix = f"-{run_id}" if run_id else ""
        png = out_dir / f"{kind}{suffix}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    if not written:
        raise UserError(f"nothing to plot in {results_dir} with these filters")
    return written
