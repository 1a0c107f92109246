"""Charts from the CSVs in a results folder (matplotlib, headless).

A series is one run (or one draft in it): one workload, token budget and machine. Its legend entry names what
sets it apart from the other series of the chart, the title what they share, the caption the machine and the
runs. Timings of a run flagged busy (``noisy``) are drawn hollow (points) or hatched (bars), with a key entry.
"""
from __future__ import annotations

import csv
import io
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.legend_handler import HandlerTuple  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from lssp.errors import UserError  # noqa: E402
from lssp.report.results import csv_problem, plural  # noqa: E402
from lssp.report.stats import alpha_from_tokens_per_iteration, predicted_speedup  # noqa: E402

KINDS = ("latency", "speedup", "acceptance", "tasks", "eval")
BUSY = "flagged busy (noisy: other work on the machine slowed some completions), timing unreliable"
HATCH = "////"
MARKERS = "osD^vPXh<>"
UNSET = {"engine": "ours", "draft": "no draft", "workload": "task not recorded"}  # a facet's text where a series has none and others do
# What makes two rows the same series (the newest run of each is drawn), for latency and eval rows.
SERIES_KEY = ("target", "draft", "method", "engine", "temperature", "top_k", "top_p", "prompt_format", "task",
              "max_new_tokens", "ignore_eos", "device", "confidence", "lookup")
EVAL_KEY = ("target", "draft", "k", "lookup", "temperature", "top_k", "top_p", "op", "max_operand", "max_new_tokens",
            "device")


# --- reading ---------------------------------------------------------------------------------------------------

def _part_paths(path: Path) -> list[Path]:
    """``name.csv`` and the parts ``append_csv`` puts beside it (``name.1.csv``, ``name.2.csv``, …) on disk."""
    parts = [path] if path.exists() else []
    n = 1
    while (part := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        parts.append(part)
        n += 1
    return parts


def _records(text: str) -> list[tuple[int, list[str] | None]]:
    """(line number, fields) of every CSV record; fields None for a line that does not parse."""
    try:
        reader, records, start = csv.reader(io.StringIO(text)), [], 1
        for fields in reader:
            records.append((start, fields))
            start = reader.line_num + 1
        return records
    except csv.Error:  # parse line by line: our rows never span lines
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                records.append((number, next(csv.reader([line]), [])))
            except csv.Error:
                records.append((number, None))
        return records


def _read_part(part: Path) -> tuple[pd.DataFrame, str | None]:
    """The rows of one CSV part; a malformed part gives its well-formed lines and a one-line warning."""
    if part.stat().st_size == 0:
        return pd.DataFrame(), None
    problem = csv_problem(part)
    if problem is None:
        return _numbers_only_where_numbers_go(part, pd.read_csv(part), None)
    text = part.read_text(errors="replace")
    records = _records(text)
    if not records or not records[0][1]:
        return pd.DataFrame(), f"{part}: skipped the whole file, its header is unreadable ({problem})"
    header = records[0][1]
    good, bad = [], []
    for number, fields in records[1:]:
        if fields is None:
            bad.append(f"line {number} does not parse")
        elif number == records[-1][0] and not text.endswith("\n"):
            bad.append(f"line {number} is cut short")
        elif len(fields) != len(header):
            bad.append(f"line {number} has {len(fields)} fields where its header has {len(header)}")
        else:
            good.append((number, fields))
    if not good:
        return pd.DataFrame(), f"{part}: skipped the whole file, no well-formed row in it ({bad[0] if bad else problem})"
    buffer = io.StringIO()
    csv.writer(buffer).writerows([header, *(fields for _, fields in good)])
    buffer.seek(0)
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    frame, text_warning = _numbers_only_where_numbers_go(part, pd.read_csv(buffer), [number for number, _ in good])
    warning = (f"{part}: skipped {plural(len(bad), 'malformed line')} ({bad[0]}{more}); "
               f"drawing from its {plural(len(good), 'good row')}")
    return frame, warning + (f"; {text_warning.split(': ', 1)[1]}" if text_warning else "")


def _numbers_only_where_numbers_go(part: Path, frame: pd.DataFrame,
                                   lines: list[int] | None) -> tuple[pd.DataFrame, str | None]:
    """``frame`` without the rows that hold text in a column of numbers (one where most filled cells are numbers), those columns made numeric; and a one-line warning naming the first such line (``lines``: each
    row's line in the file; None: the row after the header)."""
    bad: dict[int, str] = {}
    for column in frame.columns:
        if pd.api.types.is_numeric_dtype(frame[column]) or pd.api.types.is_bool_dtype(frame[column]):
            continue
        numbers = pd.to_numeric(frame[column], errors="coerce")
        filled = int(frame[column].notna().sum())
        text = frame[column].notna() & numbers.isna()
        if filled and 0 < int(text.sum()) < filled / 2:
            for row in frame.index[text]:
                bad.setdefault(int(row), column)
            frame[column] = numbers
    if not bad:
        return frame, None
    first = min(bad)
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return frame.drop(index=list(bad)), (f"{part}: skipped {plural(len(bad), 'row')} with text where numbers go "
                                         f"(line {lines[first] if lines else first + 2}, column {bad[first]}{more})")


def read_results(path: Path) -> tuple[pd.DataFrame, list[str]]:
    """A results CSV with its parts, like ``read_csv_parts``, except that a malformed part keeps its good rows:
    the rows, and one warning per part with lines skipped."""
    frames, warnings = [], []
    for part in _part_paths(path):
        frame, warning = _read_part(part)
        if not frame.empty:
            frames.append(frame)
        if warning:
            warnings.append(warning)
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), warnings


# --- what a series is ------------------------------------------------------------------------------------------

def _text(value: Any) -> str:
    """A cell as text; "" for a missing one."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _number(value: Any) -> str:
    """12.0 -> "12"; "" for a missing one."""
    return "" if not _text(value) else f"{float(value):g}"


def _setting(row: pd.Series) -> str:
    """greedy, or T=0.7, top-k 50: the sampling parameters of a row, short."""
    if not _text(row.get("temperature")):
        return ""
    text = "greedy" if float(row["temperature"]) == 0 else f"T={float(row['temperature']):g}"
    if _text(row.get("top_k")) and float(row["top_k"]):
        text += f", top-k {int(row['top_k'])}"
    if _text(row.get("top_p")) and float(row["top_p"]) < 1:
        text += f", top-p {float(row['top_p']):g}"
    return text


def _workload(row: pd.Series) -> str:
    """The prompts a row timed: a task, all tasks, the user's own prompts ("" where not recorded)."""
    task, form = _text(row.get("task")), _text(row.get("prompt_format"))
    name = {"all": "all tasks", "prompts": "own prompts"}.get(task, task)
    if form == "chat" and task not in ("chat", "translation", "summarization", "qa", "math", "rag", "code"):
        name = f"{name or 'prompts'} in the chat template"
    return name


def _budget(row: pd.Series) -> str:
    """max 64 new tokens, or 64 new tokens (--ignore-eos): how long each completion could run."""
    tokens = _number(row.get("max_new_tokens"))
    if not tokens:
        return ""
    return f"{tokens} new tokens (--ignore-eos)" if _text(row.get("ignore_eos")).lower() in ("true", "1") \
        else f"max {tokens} new tokens"


def short_device(device: Any) -> str:
    """The device description without trademarks and filler words."""
    text = _text(device)
    for noise in ("(R)", "(TM)", " Processor", " CPU @", "CPU: "):
        text = text.replace(noise, "")
    return text.strip()


def describe(rows: pd.DataFrame) -> dict[str, str]:
    """A series' facets (the rows of one run, or one draft in it), in legend order."""
    first = rows.iloc[0]
    drafts = sorted(set(rows["draft"].dropna().astype(str)) - {""}) if "draft" in rows else []
    engines = sorted(set(rows["engine"].fillna("ours"))) if "engine" in rows else ["ours"]
    prompts = _number(first.get("prompts"))
    return {"target": str(first["target"]), "draft": " / ".join(drafts),
            "engine": "" if engines == ["ours"] else " and ".join(engines).replace("vllm", "vLLM"),
            "sampling": _setting(first), "workload": _workload(first),
            "prompts": f"{prompts} prompts" if prompts else "", "budget": _budget(first),
            "machine": short_device(first.get("device")), "run": f"run {first['run_id']}"}


def describe_eval(rows: pd.DataFrame) -> dict[str, str]:
    """An eval run's facets: the models, sampling, the problems and their number, the budget."""
    facets = describe(rows)
    first = rows.iloc[0]
    operands = _number(first.get("max_operand"))
    symbol = {"mul": "*", "add": "+"}.get(_text(first.get("op")) or "mul", _text(first.get("op")))
    trials = _number(first.get("trials"))
    tokens = _number(first.get("max_new_tokens"))
    return {**facets, "workload": f"a {symbol} b" + (f", operands 1..{operands}" if operands else ""),
            "prompts": f"{trials} problems" if trials else "", "budget": f"max {tokens} new tokens" if tokens else ""}


def _joined(description: dict[str, str], facets: Sequence[str], unset: bool) -> list[str]:
    """The texts of ``facets`` ("target + draft" where both are there); ``unset``: a placeholder for a missing one."""
    texts = {f: description[f] or (UNSET.get(f, f"{f} ?") if unset else "") for f in facets}
    if "target" in texts and texts.get("draft") and description["draft"]:
        texts["target"] = f"{texts['target']} + {texts.pop('draft')}"
    elif description["draft"] and texts.get("draft") and not unset:  # a title under series of several targets
        texts["draft"] = f"draft {texts['draft']}"
    return [t.replace(" ", "\u00a0") for t in texts.values() if t]  # lines break between facets, not inside


def distinct_labels(descriptions: Sequence[dict[str, str]]) -> tuple[list[str], str]:
    """Each series' label from the facets that differ between series (with the run id where they leave two labels
    alike), and the facets they all share, for the title (the machine and runs go in the caption)."""
    if not descriptions:
        return [], ""
    facets = [f for f in descriptions[0] if f != "run"]
    differ = [f for f in facets if len({d[f] for d in descriptions}) > 1]
    labels = [", ".join(_joined(d, differ, unset=True)) for d in descriptions]
    labels = [", ".join(x for x in (label, d["run"] if labels.count(label) > 1 else "") if x)
              for label, d in zip(labels, descriptions)]
    shared = [f for f in facets if f not in differ and f != "machine"]
    return labels, ", ".join(_joined(descriptions[0], shared, unset=False))


def noisy(rows: pd.DataFrame) -> pd.Series:
    """Whether each row's run was flagged busy (False where not recorded)."""
    if "noisy" not in rows:
        return pd.Series(False, index=rows.index)
    return rows["noisy"].map(lambda v: _text(v).lower() in ("true", "1", "1.0")).astype(bool)


def _series_keys(frame: pd.DataFrame, key: Sequence[str]) -> pd.Series:
    """One string per row naming its series; rows from before a column existed count as its default."""
    defaults = {"method": frame["mode"].map({"rsp": "none"}).fillna("draft"), "engine": "ours", "confidence": 0,
                "lookup": 0, "prompt_format": "raw"}
    columns = {c: frame[c].fillna(defaults[c]) if c in defaults else frame[c] for c in key if c in frame}
    texts = pd.DataFrame(columns, index=frame.index).map(lambda v: _number(v) if isinstance(v, (int, float)) else _text(v))
    return texts.agg("|".join, axis=1) + "|" + frame["mode"].astype(str)


def newest_series(frame: pd.DataFrame, key: Sequence[str] = SERIES_KEY) -> pd.DataFrame:
    """The newest run of each series (same models, method, sampling, workload, budget, machine): its SSp rows, and
    the RSp rows of the runs kept (of a run with no SSp row, the newest one's)."""
    if frame.empty or "timestamp" not in frame:
        return frame
    series = _series_keys(frame, key)
    newest = frame.assign(_series=series).sort_values("timestamp").groupby("_series")["run_id"].last()
    latest = frame["run_id"] == series.map(newest)
    ssp = frame["mode"] == "ssp"
    runs_with_ssp = set(frame.loc[ssp, "run_id"])
    kept_runs = set(frame.loc[ssp & latest, "run_id"])
    keep = (ssp & latest) | (~ssp & frame["run_id"].isin(kept_runs)) | (latest & ~frame["run_id"].isin(runs_with_ssp))
    return frame[keep]


# --- layout ----------------------------------------------------------------------------------------------------

def _wrap(text: str, inches: float, fontsize: float) -> str:
    """``text`` wrapped to about ``inches`` at ``fontsize`` points."""
    chars = max(24, int(inches * 72 / (0.58 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) if line else line for line in text.split("\n"))


def _style(i: int, n: int) -> tuple[Any, str]:
    """The colour and marker of series ``i`` of ``n``: no two alike (tab20's dark shades first, then its light)."""
    if n <= 10:
        return plt.get_cmap("tab10")(i), MARKERS[i]
    shade = i % 20
    return plt.get_cmap("tab20")(2 * shade if shade < 10 else 2 * (shade - 10) + 1), MARKERS[i % len(MARKERS)]


def _caption_text(frame: pd.DataFrame) -> str:
    devices = sorted(set(frame["device"].dropna().astype(str))) if "device" in frame else []
    runs = sorted(set(frame["run_id"].astype(str)))
    return "; ".join(devices) + (" — " if devices else "") + (f"run {runs[0]}" if len(runs) == 1
                                                             else f"runs {', '.join(runs)}")


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    return fig, ax


def _finish(fig: Figure, ax: Axes, frame: pd.DataFrame, title: str, xlabel: str | None, ylabel: str | None,
            legend: tuple[list[Any], list[str]] | None = None) -> Figure:
    """The title (what the series share) on top, the caption (machine, runs) under it, the legend below the axes;
    all wrapped to the figure's width, which grows in height to hold them."""
    width, height = fig.get_size_inches()
    title = _wrap(title, width - 0.3, 11)
    fig.suptitle(title, fontsize=11)
    caption = _wrap(_caption_text(frame), width - 0.6, 7)
    ax.set_title(caption, fontsize=7, color="0.35", loc="left")
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    extra = 0.19 * title.count("\n") + 0.11 * caption.count("\n")
    if legend and legend[0]:
        labels = [_wrap(label, width - 0.9, 7) for label in legend[1]]
        box = fig.legend(legend[0], labels, loc="outside lower left", fontsize=7, frameon=False,
                         handler_map={tuple: HandlerTuple(ndivide=None)})
        extra += box.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi + 0.1
    fig.set_size_inches(width, height + extra)
    return fig


def save_figure(fig: Figure, path: Path) -> None:
    """A PNG of the figure (cropped to what it draws, so that nothing that reaches past an edge is cut)."""
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.12)
    plt.close(fig)


@dataclass
class _Bar:
    label: str
    value: float
    low: float = 0.0  # whisker lengths
    high: float = 0.0
    colour: Any = "tab:green"
    busy: bool = False


def _barh(ax: Axes, groups: Sequence[tuple[str, Sequence[_Bar]]]) -> None:
    """Horizontal bars, top to bottom, each group under its header (none for a lone group); the figure's height
    grows with them (0.24 inch a bar)."""
    fig = ax.get_figure()
    width = fig.get_figwidth()
    y, ticks, names = 0.0, [], []
    place = blended_transform_factory(ax.transAxes, ax.transData)
    for header, bars in groups:
        if header:
            header = _wrap(header, width - 2.3, 7)
            y += 0.5 * (header.count("\n") + 1) + 0.2
            ax.text(0.005, y - 0.5, header, transform=place, va="bottom", ha="left", fontsize=7, fontweight="bold")
        for bar in bars:
            ax.barh(y, bar.value, xerr=[[bar.low], [bar.high]], capsize=3, color=bar.colour, height=0.75,
                    hatch=HATCH if bar.busy else None, edgecolor="white" if bar.busy else None)
            ticks.append(y)
            names.append(bar.label)
            y += 1
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_ylim(y - 0.4, -0.6)
    fig.set_size_inches(width, 1.6 + 0.24 * (y + 0.2))


def _busy_key(kind: str) -> tuple[Any, str]:
    """The legend entry for busy runs: a hollow marker or a hatched bar."""
    if kind == "marker":
        return Line2D([], [], marker="o", ls="none", mfc="white", mec="0.3"), f"hollow: {BUSY}"
    return Patch(facecolor="0.5", hatch=HATCH, edgecolor="white"), f"hatched: {BUSY}"


# --- charts ----------------------------------------------------------------------------------------------------

def _mode_label(r: pd.Series) -> str:
    vllm = r.get("engine") == "vllm"
    kind = f" {r['method']}" if r["mode"] == "ssp" and str(r.get("method", "draft")).startswith("eagle") else ""
    return ("vLLM " if vllm else "") + ("RSp" if r["mode"] == "rsp" else f"SSp{kind} K={int(r['k'])}")


def latency_figure(frame: pd.DataFrame) -> Figure:
    """ms/token per mode, one group of bars per run, whiskers from the per-prompt min and max."""
    frame = newest_series(frame)
    groups = list(frame.groupby("run_id", sort=False))
    headers, common = distinct_labels([describe(rows) for _, rows in groups])
    busy = noisy(frame)
    bars = []
    for (_, rows), header in zip(groups, headers):
        group = []
        for i, r in rows.iterrows():
            vllm = r.get("engine") == "vllm"
            colour = ("silver" if vllm else "tab:gray") if r["mode"] == "rsp" else "tab:olive" if vllm else "tab:green"
            group.append(_Bar(_mode_label(r), r["ms_per_token"], max(0.0, r["ms_per_token"] - r["ms_per_token_min"]),
                              max(0.0, r["ms_per_token_max"] - r["ms_per_token"]), colour, bool(busy[i])))
        bars.append((header if len(groups) > 1 else "", group))
    fig, ax = _figure(7.0, 3.0)
    _barh(ax, bars)
    title = "RSp vs SSp: decode time per token" + (f"\n{common}" if common else "")
    handles: list[Any] = [Patch(color="tab:gray"), Patch(color="tab:green")]
    labels = ["RSp (bars: all prompts; whiskers: per-prompt min–max)", "SSp"]
    if "engine" in frame and (frame["engine"] == "vllm").any():
        handles += [Patch(color="silver"), Patch(color="tab:olive")]
        labels += ["vLLM RSp", "vLLM SSp"]
    if busy.any():
        handles.append(_busy_key("bar")[0])
        labels.append(_busy_key("bar")[1])
    return _finish(fig, ax, frame, title, "decode time per token (ms)", None, (handles, labels))


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


def _speedup_curves(frame: pd.DataFrame) -> list[tuple[pd.DataFrame, pd.DataFrame]]:
    """(RSp rows, SSp rows by K) of each run and draft (a run may time several drafts against one RSp)."""
    return [(rows[rows["mode"] == "rsp"], ssp.sort_values("k"))
            for _, rows in frame.groupby("run_id", sort=False)
            for _, ssp in rows[rows["mode"] == "ssp"].groupby("draft", sort=False, dropna=False)
            if (rows["mode"] == "rsp").any()]


def speedup_figure(frame: pd.DataFrame) -> Figure:
    """Measured speedup against K (points), with the standard model's curve (dashed) from the measured α, the
    draft's cost c and the verification cost v; one colour and marker per series."""
    curves = _speedup_curves(newest_series(frame))
    labels, common = distinct_labels([describe(ssp) for _, ssp in curves])
    fig, ax = _figure(7.0, 4.4)
    handles, texts, any_busy = [], [], False
    for i, ((rsp, ssp), label) in enumerate(zip(curves, labels)):
        colour, marker = _style(i, len(curves))
        busy = (noisy(ssp) | noisy(rsp).any()).to_numpy()
        measured, = ax.plot(ssp["k"], ssp["speedup"], marker, ls="none", color=colour)
        if busy.any():  # hollow over the filled points
            ax.plot(ssp["k"][busy], ssp["speedup"][busy], marker, ls="none", mfc="white", mec=colour, zorder=3)
            any_busy = True
        alpha = _alpha(ssp)
        c = float(ssp["draft_ms_per_forward"].median() / rsp["target_ms_per_forward"].iloc[0])
        ks = np.arange(1, max(int(ssp["k"].max()), 8) + 1)
        slope = verification_slope(rsp, ssp)
        params = f"α={alpha:.2f}, c={c:.2f}, v=1+{slope:.3f}K"
        model, = ax.plot(ks, [predicted_speedup(alpha, int(k), c, 1.0 + slope * k) for k in ks], "--", color=colour,
                         label=f"model, {params}")
        handles.append((measured, model))
        texts.append(f"{label}{' (busy)' if busy.any() else ''}: {params}" if label else params)
    ax.axhline(1.0, color="0.6", lw=0.8)
    handles.append((Line2D([], [], marker="o", ls="none", color="0.3"), Line2D([], [], ls="--", color="0.3")))
    texts.append("points: measured; dashed: model (1−α^(K+1)) / ((1−α)(K·c + v)), α per-token acceptance, "
                 "c draft ÷ target forward, v verification ÷ target forward")
    if any_busy:
        handles.append(_busy_key("marker")[0])
        texts.append(_busy_key("marker")[1])
    title = "SSp speedup against K" + (f"\n{common}" if common else "")
    drawn = pd.concat([part for curve in curves for part in curve]) if curves else frame
    return _finish(fig, ax, drawn, title, "draft length K (tokens)", "speedup over RSp (×)", (handles, texts))


def acceptance_figure(frame: pd.DataFrame) -> Figure:
    """Share of iterations accepting the draft at each position: a line per series and K (colour: series, or K for
    a lone series; line style: K). Acceptance counts tokens, not time: a busy run's lines are as good as others'."""
    frame = newest_series(frame)
    ssp = frame[frame["mode"] == "ssp"]
    series = [rows for _, rows in ssp.groupby(["run_id", "draft"], sort=False, dropna=False)]
    labels, common = distinct_labels([describe(rows) for rows in series])
    ks = sorted({int(k) for k in ssp["k"]})
    styles = dict(zip(ks, ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3))] * 4))
    fig, ax = _figure(7.0, 4.2)
    handles, texts = [], []
    for i, (rows, label) in enumerate(zip(series, labels)):
        colour, marker = _style(i, len(series))
        for _, r in rows.iterrows():
            rates = [float(x) for x in str(r["acceptance_by_position"]).split(";") if x not in ("", "nan")]
            dodge = 0.05 * (ks.index(int(r["k"])) - (len(ks) - 1) / 2)
            ax.plot(np.arange(1, len(rates) + 1) + dodge, rates, marker=marker, ls=styles[int(r["k"])],
                    color=colour if len(series) > 1 else f"C{ks.index(int(r['k'])) % 10}", markersize=4,
                    label=f"{label}, K={int(r['k'])}")
        handles.append(Line2D([], [], color=colour, marker=marker))
        texts.append(label)
    if len(series) < 2:
        handles, texts = [], []
    handles += [Line2D([], [], color="0.3" if len(series) > 1 else f"C{j % 10}", ls=styles[k]) for j, k in enumerate(ks)]
    texts += [f"K={k}" for k in ks]
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    title = "Acceptance by draft position" + (f"\n{common}" if common else "")
    return _finish(fig, ax, ssp, title, "draft position i", "share of iterations accepting draft i",
                   (handles, texts))


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


def _task_label(rows: pd.DataFrame, task: str) -> str:
    """chat / 12 prompts, chat: a task's tick label."""
    r = rows[rows["task"] == task].iloc[0]
    details = [x for x in (f"{_number(r.get('prompts'))} prompts" if _number(r.get("prompts")) else "",
                           _text(r.get("prompt_format"))) if x]
    return f"{task}\n{', '.join(details)}" if details else task


def tasks_figure(frame: pd.DataFrame) -> Figure:
    """Speedup over RSp per task category, one bar per draft and K (the plain draft), α written above each bar."""
    ssp = frame[frame["mode"] == "ssp"]
    tasks = list(dict.fromkeys(ssp["task"]))
    drafts = list(dict.fromkeys(ssp["draft"].fillna("")))
    bars = [(d, int(k)) for d in drafts for k in sorted(set(ssp.loc[ssp["draft"].fillna("") == d, "k"]))]
    names = [_task_label(ssp, t) for t in tasks]
    group = max(0.28 * len(bars) + 0.25, 0.058 * max(len(line) for n in names for line in n.split("\n")) + 0.15)
    fig, ax = _figure(max(6.5, group * len(tasks) + 1.2), 4.4)
    width = 0.8 / max(1, len(bars))
    rsp = frame[frame["mode"] == "rsp"]
    busy_rsp = set(rsp.loc[noisy(rsp), "task"])  # a speedup is RSp's time ÷ SSp's: either one busy spoils it
    busy_any = False
    for j, (d, k) in enumerate(bars):
        rows = ssp[(ssp["draft"].fillna("") == d) & (ssp["k"] == k)]
        busy = noisy(rows) | rows["task"].isin(busy_rsp)
        rows = rows.assign(_busy=busy).drop_duplicates("task", keep="last").set_index("task").reindex(tasks)
        x = np.arange(len(tasks)) + (j - (len(bars) - 1) / 2) * width
        hatched = rows["_busy"].fillna(False).astype(bool).to_numpy()
        busy_any |= bool(hatched.any())
        ax.bar(x, rows["speedup"], width, color=f"C{j % 10}", label=f"{d} K={k}" if len(drafts) > 1 else f"K={k}",
               hatch=[HATCH if h else None for h in hatched], edgecolor=["white" if h else f"C{j % 10}" for h in hatched])
        for xi, speedup, alpha in zip(x, rows["speedup"], rows.get("alpha", pd.Series(np.nan, index=rows.index))):
            if np.isfinite(speedup) and np.isfinite(alpha):
                ax.text(xi, speedup, f"α{alpha:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xticks(range(len(tasks)), names, fontsize=7.5)
    facets = describe(ssp)
    models = facets["target"] + (f" + {facets['draft']}" if len(drafts) == 1 and facets["draft"] else "")
    common = ", ".join(x for x in (models, facets["sampling"], facets["budget"]) if x)
    handles, labels = ax.get_legend_handles_labels()
    if busy_any:
        handles.append(_busy_key("bar")[0])
        labels.append(_busy_key("bar")[1])
    return _finish(fig, ax, frame, f"SSp speedup by task\n{common}", None, "speedup over RSp (×)", (handles, labels))


def eval_figure(frame: pd.DataFrame) -> Figure:
    """Success rate with its 95% Wald interval, RSp and SSp side by side, one group per run."""
    frame = newest_series(frame, EVAL_KEY)
    groups = list(frame.groupby("run_id", sort=False))
    headers, common = distinct_labels([describe_eval(rows) for _, rows in groups])
    bars = []
    for (_, rows), header in zip(groups, headers):
        group = []
        for _, r in rows.iterrows():
            rate = 100 * r["success_rate"]
            label = "RSp" if r["mode"] == "rsp" else f"SSp K={int(r['k'])}" if _text(r.get("k")) else "SSp"
            group.append(_Bar(label, rate, rate - 100 * r["wald_low"], 100 * r["wald_high"] - rate,
                              "tab:gray" if r["mode"] == "rsp" else "tab:green"))
        bars.append((header if len(groups) > 1 else "", group))
    fig, ax = _figure(6.5, 3.0)
    _barh(ax, bars)
    title = "Eval success rate with 95% Wald intervals" + (f"\n{common}" if common else "")
    return _finish(fig, ax, frame, title, "problems correct (%)", None)


# --- the command -----------------------------------------------------------------------------------------------

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


def _chart_rows(kind: str, frame: pd.DataFrame) -> pd.DataFrame:
    """The rows a chart of ``kind`` draws from the selected ones (empty: no chart)."""
    if kind != "eval":  # the task chart draws the rows of each task, the others a run's rows over all prompts
        frame = task_rows(frame) if kind == "tasks" else overall_rows(frame)
    if kind not in ("eval", "latency") and "engine" in frame:  # the model curves and α are our engine's
        frame = frame[frame["engine"].fillna("ours") == "ours"]
    for variant in ("confidence", "lookup"):  # latency charts: the plain draft at fixed K, as the model curve assumes
        if kind != "eval" and variant in frame:
            frame = frame[frame[variant].fillna(0) == 0]
    if kind in ("speedup", "acceptance", "tasks") and not (frame["mode"] == "ssp").any():
        return frame.iloc[0:0]
    if kind == "speedup" and not (frame["mode"] == "rsp").any():
        return frame.iloc[0:0]
    return frame


@dataclass
class Charts:
    """The PNGs written, and what was skipped on the way (one line each, for the CLI to show)."""

    results_dir: Path
    paths: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def require(self) -> list[Path]:
        """The paths; a UserError when there are none."""
        if not self.paths:
            raise UserError(f"nothing to plot in {self.results_dir} with these filters")
        return self.paths


MAKERS: dict[str, tuple[str, Callable[[pd.DataFrame], Figure]]] = {
    "latency": ("latency.csv", latency_figure), "speedup": ("latency.csv", speedup_figure),
    "acceptance": ("latency.csv", acceptance_figure), "tasks": ("latency.csv", tasks_figure),
    "eval": ("eval.csv", eval_figure)}


def draw_charts(results_dir: Path, out_dir: Path | None = None, run_id: str | None = None, target: str | None = None,
                draft: str | None = None, kinds: Sequence[str] = (), machine: str | None = None) -> Charts:
    """Write the charts the selected rows allow, from the good rows of every CSV part."""
    out_dir = out_dir or results_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = tuple(kinds) or KINDS
    if "latency" in kinds:
        kinds = tuple(dict.fromkeys(kinds + ("speedup", "acceptance", "tasks")))
    charts, frames = Charts(results_dir), {}
    for kind in kinds:
        csv_name, make = MAKERS[kind]
        if csv_name not in frames:
            frames[csv_name], warnings = read_results(results_dir / csv_name)
            charts.warnings += warnings
        frame = frames[csv_name]
        if frame.empty:
            continue
        frame = _chart_rows(kind, _filter(frame, run_id, target, draft, machine))
        if frame.empty:
            continue
        png = out_dir / f"{kind}{f'-{run_id}' if run_id else ''}.png"
        save_figure(make(frame), png)
        charts.paths.append(png)
    return charts


def plot_results(results_dir: Path, out_dir: Path | None = None, run_id: str | None = None, target: str | None = None,
                 draft: str | None = None, kinds: Sequence[str] = (), machine: str | None = None) -> list[Path]:
    """Write the charts the selected rows allow; returns the PNG paths (a UserError if none)."""
    return draw_charts(results_dir, out_dir, run_id, target, draft, kinds, machine).require()
