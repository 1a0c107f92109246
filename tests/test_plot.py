"""`plot` draws the data it is given, and no chart can be misread: one workload, budget and machine per series with
its own legend, busy runs drawn as such, nothing cut or overlapping, and a malformed CSV part costs only its bad lines."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from lssp.errors import UserError
from lssp.report.plot import (
    _filter,
    acceptance_figure,
    distinct_labels,
    draw_charts,
    eval_figure,
    latency_figure,
    newest_series,
    plot_results,
    read_results,
    speedup_figure,
    tasks_figure,
)
from lssp.report.stats import expected_tokens_per_iteration, predicted_speedup

TASKS = ["chat", "translation", "summarization", "qa", "math", "rag", "code", "stories"]


def latency_rows(run_id: str = "r1", timestamp: str = "2026-01-01T00:00:00", ks: tuple[int, ...] = (2, 4, 8),
                 **columns) -> pd.DataFrame:
    """One run: RSp at 10 ms/token, SSp at each K; ``columns`` set on every row."""
    base = {"timestamp": timestamp, "run_id": run_id, "target": "T", "temperature": 0.0, "device": "CPU: test",
            "ms_per_token_min": 8.0, "ms_per_token_max": 12.0, "target_ms_per_forward": 10.0}
    rows = [{**base, "mode": "rsp", "draft": "", "k": 0, "ms_per_token": 10.0, "speedup": float("nan"),
             "acceptance_rate": float("nan"), "draft_ms_per_forward": float("nan"), "acceptance_by_position": ""}]
    for k, ms in zip(ks, [7.0, 6.0, 6.5, 6.8]):
        rows.append({**base, "mode": "ssp", "draft": "D", "k": k, "ms_per_token": ms, "speedup": 10.0 / ms,
                     "acceptance_rate": 0.5, "alpha": 0.7, "draft_ms_per_forward": 1.0,
                     "acceptance_by_position": ";".join(["0.8"] + ["0.6"] * (k - 1))})
    return pd.DataFrame(rows).assign(**columns)


def task_run(run_id: str = "rt", busy_rsp_task: str | None = None) -> pd.DataFrame:
    """A run over every task: its rows over all prompts (task "all") and one RSp and one SSp row per task."""
    parts = [latency_rows(run_id, ks=(2,), task="all", prompts=32, max_new_tokens=16, noisy=False)]
    for i, task in enumerate(TASKS):
        part = latency_rows(run_id, ks=(2,), task=task, prompts=4, max_new_tokens=16, noisy=False)
        part.loc[part["mode"] == "ssp", "speedup"] = 0.8 + 0.1 * i
        part.loc[part["mode"] == "rsp", "noisy"] = task == busy_rsp_task
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def texts_of(fig: Figure) -> list[str]:
    """Every piece of text the figure shows: titles, caption, legend, labels."""
    fig.canvas.draw()
    return [t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]


def legend_texts(fig: Figure) -> list[str]:
    return [t.get_text().replace("\n", " ").replace("\u00a0", " ") for t in fig.legends[0].get_texts()]


def caption(fig: Figure) -> str:
    return fig.axes[0].get_title(loc="left").replace("\n", " ")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# --- what each chart draws ---------------------------------------------------------------------------------------

def test_latency_figure_has_a_bar_per_mode_with_error_bars():
    fig = latency_figure(latency_rows())
    bars = [p for p in fig.axes[0].patches if p.get_width() > 0]
    assert [p.get_width() for p in bars] == [10.0, 7.0, 6.0, 6.5]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["RSp", "SSp K=2", "SSp K=4", "SSp K=8"]
    assert "ms" in fig.axes[0].get_xlabel() and "CPU: test" in caption(fig)


def test_speedup_figure_plots_measured_points_and_model_curve():
    ax = speedup_figure(latency_rows()).axes[0]
    measured, model = ax.lines[0], ax.lines[1]
    assert list(measured.get_xdata()) == [2, 4, 8]
    assert list(measured.get_ydata()) == pytest.approx([10 / 7, 10 / 6, 10 / 6.5])
    assert model.get_ydata()[3] == pytest.approx(predicted_speedup(0.7, 4, 0.1))  # K=4, c = 1 ms / 10 ms


def test_speedup_model_counts_the_measured_cost_of_verification():
    rows = latency_rows()
    ssp = rows["mode"] == "ssp"
    rows.loc[ssp, "target_ms_per_forward"] = 10.0 + 0.5 * rows.loc[ssp, "k"]  # a (K+1)-token forward: 1 + 0.05 K
    fig = speedup_figure(rows)
    model = fig.axes[0].lines[1]
    assert model.get_ydata()[3] == pytest.approx(predicted_speedup(0.7, 4, 0.1, 1.2))
    assert "v=1+0.050K" in model.get_label() and "v=1+0.050K" in legend_texts(fig)[0]


def test_speedup_model_falls_back_to_alpha_from_tokens_per_forward():
    rows = latency_rows().drop(columns=["alpha"])
    rows["mean_accepted"] = [float("nan")] + [expected_tokens_per_iteration(0.6, k) for k in (2, 4, 8)]
    model = speedup_figure(rows).axes[0].lines[1]
    assert model.get_ydata()[0] == pytest.approx(predicted_speedup(0.6, 1, 0.1))


def test_acceptance_figure_has_one_line_per_k_over_its_positions():
    ax = acceptance_figure(latency_rows()).axes[0]
    assert [len(line.get_ydata()) for line in ax.lines] == [2, 4, 8]
    assert max(max(line.get_ydata()) for line in ax.lines) == pytest.approx(0.8)


def test_eval_figure_bars_and_intervals():
    frame = pd.DataFrame([
        {"timestamp": "t", "run_id": "e1", "mode": m, "target": "T", "draft": d, "k": k, "success_rate": r,
         "wald_low": r - 0.05, "wald_high": r + 0.05, "device": "CPU: test"}
        for m, d, k, r in [("rsp", "", 0, 0.30), ("ssp", "D", 4, 0.28)]])
    ax = eval_figure(frame).axes[0]
    assert [p.get_width() for p in ax.patches] == pytest.approx([30.0, 28.0])
    segments = [c.lines[2][0].get_segments()[0] for c in ax.containers if getattr(c, "has_xerr", False)]
    assert [(s[0][0], s[1][0]) for s in segments] == [pytest.approx((25.0, 35.0)), pytest.approx((23.0, 33.0))]


def test_tasks_figure_has_a_bar_per_task_and_draft():
    frame = task_run()
    frame = pd.concat([frame, frame[frame["mode"] == "ssp"].assign(draft="E")], ignore_index=True)  # two drafts
    fig = tasks_figure(frame[frame["task"] != "all"])
    ax = fig.axes[0]
    assert len([p for p in ax.patches if p.get_height() > 0]) == 2 * len(TASKS)
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == TASKS
    assert {"D K=2", "E K=2"} <= set(legend_texts(fig))


def test_plot_results_writes_pngs_and_filters(tmp_path):
    latency_rows().to_csv(tmp_path / "latency.csv", index=False)
    paths = plot_results(tmp_path)
    assert {p.name for p in paths} == {"latency.png", "speedup.png", "acceptance.png"}
    assert all(p.stat().st_size > 5000 for p in paths)
    with pytest.raises(UserError, match="nothing to plot"):
        plot_results(tmp_path, run_id="no-such-run")


def test_a_chart_keeps_to_one_machine():
    rows = latency_rows()
    other = rows.assign(run_id="r-other", device="CPU: another machine", timestamp="2099-01-01T00:00:00")
    frame = pd.concat([rows, other], ignore_index=True)
    assert set(_filter(frame, None, None, None)["device"]) == {"CPU: another machine"}  # the newest row's machine
    assert set(_filter(frame, None, None, None, machine="another")["run_id"]) == {"r-other"}
    assert len(_filter(frame, None, None, None, machine="all")) == len(frame)
    assert set(_filter(frame, str(rows["run_id"].iloc[0]), None, None)["run_id"]) == {rows["run_id"].iloc[0]}


# --- series that cannot be mistaken for one another ---------------------------------------------------------------

def two_workloads() -> pd.DataFrame:
    """The case of the issue: the same pair and sampling, stories at 64 tokens and all tasks at 16."""
    stories = latency_rows("r-stories", task="stories", max_new_tokens=64, prompts=16)
    tasks = latency_rows("r-tasks", "2026-01-02T00:00:00", task="all", max_new_tokens=16, prompts=32)
    return pd.concat([stories, tasks], ignore_index=True)


def test_series_from_different_workloads_get_distinct_legends():
    frame = two_workloads()
    speedup = legend_texts(speedup_figure(frame))[:2]
    acceptance = legend_texts(acceptance_figure(frame))[:2]
    for labels in (speedup, acceptance):
        assert len(set(labels)) == 2
        assert "stories" in labels[0] and "64 new tokens" in labels[0] and "16 prompts" in labels[0]
        assert "all tasks" in labels[1] and "16 new tokens" in labels[1] and "32 prompts" in labels[1]
    headers = [t for t in texts_of(latency_figure(frame)) if "tokens" in t and "prompts" in t]
    assert len(set(headers)) == 2  # a header over each run's bars
    title = speedup_figure(frame).get_suptitle().replace("\n", " ").replace("\u00a0", " ")
    assert "T + D" in title and "greedy" in title  # what the series share is said once, in the title


def test_series_on_two_machines_say_which_and_alike_series_get_their_run_id():
    frame = pd.concat([latency_rows("r1"), latency_rows("r2", "2026-01-02T00:00:00", device="CUDA: 1x H100")],
                      ignore_index=True)
    labels = legend_texts(speedup_figure(frame))[:2]
    assert "test" in labels[0] and "H100" in labels[1]
    alike = {"target": "T", "draft": "D", "sampling": "greedy", "machine": "m", "run": "run r1"}
    labels, common = distinct_labels([alike, {**alike, "run": "run r2"}, {**alike, "sampling": "T=0.7"}])
    assert labels == ["greedy, run r1", "greedy, run r2", "T=0.7"] and common == "T\u00a0+\u00a0D"


def test_only_the_newest_run_of_a_series_is_drawn():
    older = latency_rows("old", "2026-01-01T00:00:00")
    newer = latency_rows("new", "2026-01-03T00:00:00")
    other_budget = latency_rows("other", "2026-01-02T00:00:00", max_new_tokens=16)
    kept = newest_series(pd.concat([older, newer, other_budget], ignore_index=True))
    assert set(kept["run_id"]) == {"new", "other"}
    assert len(legend_texts(speedup_figure(kept))) == 3  # two series and the key


# --- busy runs ------------------------------------------------------------------------------------------------------

def test_a_busy_run_is_drawn_hollow_and_hatched():
    quiet = latency_rows("quiet", task="stories", noisy=False)
    busy = latency_rows("busy", "2026-01-02T00:00:00", task="stories", max_new_tokens=16, noisy=True)
    frame = pd.concat([quiet, busy], ignore_index=True)
    fig = speedup_figure(frame)
    hollow = [line for line in fig.axes[0].lines if line.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0))]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2, 4, 8]  # the busy run's points only
    labels = legend_texts(fig)
    assert "(busy)" in labels[1] and "(busy)" not in labels[0] and any(t.startswith("hollow: flagged busy") for t in labels)
    latency = latency_figure(frame)
    hatched = [p for p in latency.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 4 and all(p.get_width() > 0 for p in hatched)  # RSp and 3 SSp bars of the busy run
    assert any(t.startswith("hatched: flagged busy") for t in legend_texts(latency))
    assert not any("busy" in t for t in legend_texts(latency_figure(quiet)))


def test_a_task_whose_rsp_was_busy_has_its_speedup_bars_hatched():
    frame = task_run(busy_rsp_task="math")
    ax = tasks_figure(frame[frame["task"] != "all"]).axes[0]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_x() + hatched[0].get_width() / 2 == pytest.approx(TASKS.index("math"))


# --- nothing cut, nothing overlapping -------------------------------------------------------------------------------

def crowded() -> pd.DataFrame:
    """Long model names, many series, several workloads: what a real results folder holds."""
    runs = []
    for i, (task, tokens) in enumerate([("stories", 64), ("all", 16), ("prompts", 128), ("stories", 32)] * 3):
        runs.append(latency_rows(f"20260101-0000{i:02d}-abcdef", f"2026-01-01T00:00:{i:02d}", task=task,
                                 max_new_tokens=tokens, temperature=[0.0, 0.7, 1.0][i % 3], prompts=16 + i,
                                 target="a-rather-long-target-model-name-compact", noisy=i % 4 == 0,
                                 draft="a-rather-long-draft-model-name-v2" if i < 6 else "another-draft"))
    frame = pd.concat(runs, ignore_index=True)
    frame.loc[frame["mode"] == "rsp", "draft"] = ""
    return frame


@pytest.mark.parametrize("make", [latency_figure, speedup_figure, acceptance_figure])
def test_titles_captions_and_legends_lie_inside_the_figure(make):
    fig = make(crowded())
    fig.canvas.draw()
    renderer, inside = fig.canvas.get_renderer(), fig.bbox.padded(1)
    ticks = {id(t) for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()}
    pieces = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and id(t) not in ticks] + fig.legends
    assert len(pieces) > 10
    for piece in pieces:  # titles, caption, legend, axis labels, group headers
        box = piece.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, (
            getattr(piece, "get_text", lambda: "legend")())
    drawn = fig.get_tightbbox(renderer)  # in inches: everything drawn, tick labels included
    width, height = fig.get_size_inches()
    assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= width + 0.01 and drawn.y1 <= height + 0.01
    assert len(set(legend_texts(fig))) == len(legend_texts(fig))


def test_task_labels_do_not_overlap():
    frame = task_run()
    fig = tasks_figure(frame[frame["task"] != "all"])
    fig.canvas.draw()
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in fig.axes[0].get_xticklabels()]
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))
    assert "16 new tokens" in fig.get_suptitle().replace("\u00a0", " ")


# --- a malformed part ---------------------------------------------------------------------------------------------

def write_with_a_bad_line(folder: Path) -> None:
    """latency.csv: a stories run; latency.1.csv: a run over every task with one line cut in the middle."""
    folder.mkdir(parents=True, exist_ok=True)
    latency_rows(task="stories", prompts=16, max_new_tokens=64, noisy=False).to_csv(folder / "latency.csv", index=False)
    part = folder / "latency.1.csv"
    task_run().assign(timestamp="2026-02-01T00:00:00").to_csv(part, index=False)
    lines = part.read_text().splitlines(keepends=True)
    lines.insert(5, lines[5][:40] + "\n")
    part.write_text("".join(lines))


def test_a_malformed_part_keeps_its_good_rows_with_a_warning(tmp_path):
    write_with_a_bad_line(tmp_path)
    frame, warnings = read_results(tmp_path / "latency.csv")
    assert len(frame) == 4 + len(task_run())
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "latency.1.csv" in warnings[0] and "line 6" in warnings[0] and f"{len(task_run())} good rows" in warnings[0]
    charts = draw_charts(tmp_path)
    assert {p.name for p in charts.paths} == {"latency.png", "speedup.png", "acceptance.png", "tasks.png"}
    assert charts.warnings == warnings


def test_a_part_cut_short_loses_only_its_last_line(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    latency_rows().to_csv(tmp_path / "latency.csv", index=False)
    text = (tmp_path / "latency.csv").read_text()
    (tmp_path / "latency.csv").write_text(text[:-10])  # the last row loses its end
    frame, warnings = read_results(tmp_path / "latency.csv")
    assert len(frame) == 3 and "cut short" in warnings[0]


def test_plot_command_warns_in_one_line_and_still_draws(run, tmp_path):
    results = tmp_path / "results"
    write_with_a_bad_line(results)
    code, out, err = run("plot")
    assert code == 0
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "latency.1.csv" in warning[0] and "skipped 1 malformed line" in warning[0]
    assert "plots/tasks.png" in out and (results / "plots" / "tasks.png").stat().st_size > 5000


def test_text_in_a_number_cell_skips_that_row_names_file_and_line_and_draws_the_rest(tmp_path):
    rows = latency_rows()
    rows["ms_per_token"] = rows["ms_per_token"].astype(object)
    rows.loc[1, "ms_per_token"] = "fast"
    rows.to_csv(tmp_path / "latency.csv", index=False)
    frame, warnings = read_results(tmp_path / "latency.csv")
    assert len(frame) == len(rows) - 1 and frame["ms_per_token"].dtype.kind == "f"
    assert warnings == [f"{tmp_path / 'latency.csv'}: skipped 1 row with text where numbers go (line 3, column "
                        "ms_per_token)"]
    charts = draw_charts(tmp_path)
    assert "latency.png" in {p.name for p in charts.paths} and charts.warnings == warnings


def test_a_charts_folder_that_cannot_take_files_is_one_line_before_drawing(run, tmp_path):
    """A read-only folder (or, as here, since tests may run as root, a file where the charts folder goes)."""
    latency_rows().to_csv(tmp_path / "latency.csv", index=False)
    (tmp_path / "plots").write_text("not a folder")
    code, _, err = run("--results-dir", str(tmp_path), "plot")
    assert code == 2 and "is not writable" in err and len(err.strip().splitlines()) <= 2
