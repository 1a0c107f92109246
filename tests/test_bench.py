"""bench: the four engines agree token for token when greedy; the summary is consistent."""
from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
from conftest import char_tokenizer, tiny_llama

import lssp.decoding.timing as timing
import lssp.measure.bench as bench
from lssp.cli import main
from lssp.decoding.generation import FIRST_TO_LAST, WHOLE_COMPLETION, GenerationStats
from lssp.decoding.sampling import SamplingParams
from lssp.engines import Mode, Request, TransformersEngine
from lssp.measure.bench import ENGINES, BenchSetup, EngineRun, copy_bandwidth, run_bench, summarize
from lssp.measure.cost import model_floor
from lssp.models.loading import LoadedModel, load_model
from lssp.models.registry import ModelSpec, load_registry
from lssp.report.stats import predicted_speedup

nan = float("nan")


@pytest.fixture(scope="module")
def pair():
    # No EOS in the config: hf generate then needs no EOS suppression and samples what ours samples.
    tok = char_tokenizer()
    return (LoadedModel(ModelSpec("t"), tiny_llama(40, scale=6.0, eos=None), tok),
            LoadedModel(ModelSpec("d"), tiny_llama(41, hidden=16, layers=1, scale=6.0, eos=None), tok))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_four_engines_agree_token_for_token_when_greedy(pair, k):
    target, draft = pair
    run = run_bench(target, draft, ["hello there", "12 * 4 = ", "abc"], "warm", k, SamplingParams(0), 24, seed=0)
    by_prompt = {}
    for r in run.runs:
        assert len(r.tokens) == 24
        by_prompt.setdefault(r.prompt_index, {})[r.engine] = r.tokens
    for tokens in by_prompt.values():
        assert set(tokens) == set(ENGINES)
        assert all(t == tokens["ours-rsp"] for t in tokens.values())
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}
    ours_rsp, hf_gen = (next(s for s in run.summaries if s.engine == e) for e in ("ours-rsp", "hf-generate"))
    assert ours_rsp.ratio_min <= ours_rsp.ratio_median <= ours_rsp.ratio_max
    assert 0 <= run.ssp_overhead_share < 1 and run.cost_ratio > 0 and run.verify_ratio > 0
    assert hf_gen.ms_per_token > 0


def test_hf_assisted_schedule_state_does_not_leak_between_calls(pair):
    target, draft = pair
    before = draft.model.generation_config.to_dict()
    run_bench(target, draft, ["hello"], "warm", 3, SamplingParams(0), 10, seed=0, engines=("hf-assisted",))
    assert draft.model.generation_config.to_dict() == before


def test_copy_bandwidth_counts_bytes_read_and_written_over_the_fastest_untimed_warm_copy(monkeypatch):
    class ScriptedClock:  # the copies took 0.5 s, 0.25 s and 0.4 s; the warm-up copy is not timed
        readings = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.4])

        def __init__(self, device) -> None:
            pass

        def now(self) -> float:
            return next(self.readings)

    monkeypatch.setattr(timing, "Clock", ScriptedClock)
    assert copy_bandwidth("cpu", megabytes=2, repeats=3) == pytest.approx(2 * 2 * 2**20 / 0.25)
    assert next(ScriptedClock.readings, None) is None  # two readings per timed copy, none for the warm-up


def test_summary_figures_against_hand_computed_values():
    """Two prompts x four engines with round timings: every figure of the summary worked out by hand."""
    same, other = [1, 2, 3, 4], [1, 2, 3, 9]
    runs = [
        EngineRun("ours-rsp", 0, same, 0.04, target_ms_per_forward=10.0),
        EngineRun("hf-generate", 0, same, 0.05),
        EngineRun("ours-ssp", 0, same, 0.02, ssp_other_s=0.002, ssp_decode_s=0.018, acceptance_rate=0.5, accepted=3,
                  rejections=1, draft_ms_per_forward=2.0, target_ms_per_forward=12.0),
        EngineRun("hf-assisted", 0, same, 0.04),
        EngineRun("ours-rsp", 1, same, 0.08, target_ms_per_forward=20.0),
        EngineRun("hf-generate", 1, other, 0.08),
        EngineRun("ours-ssp", 1, same, 0.04, ssp_other_s=0.006, ssp_decode_s=0.036, acceptance_rate=0.75, accepted=5,
                  rejections=1, draft_ms_per_forward=4.0, target_ms_per_forward=24.0),
        EngineRun("hf-assisted", 1, same, 0.04),
    ]
    run = summarize(3, runs)
    by = {x.engine: x for x in run.summaries}
    assert [x.engine for x in run.summaries] == list(ENGINES)
    rsp, ssp = by["ours-rsp"], by["ours-ssp"]
    assert (rsp.ms_per_token, rsp.ms_per_token_median, rsp.ms_per_token_min, rsp.ms_per_token_max) == pytest.approx((15, 15, 10, 20))
    assert (rsp.ratio_median, rsp.ratio_min, rsp.ratio_max) == pytest.approx((0.9, 0.8, 1.0))  # 10/12.5 and 20/20
    assert (ssp.ms_per_token, ssp.ratio_min, ssp.ratio_max) == pytest.approx((7.5, 0.5, 1.0))  # 5/10 and 10/10
    assert by["hf-generate"].ratio_median != by["hf-generate"].ratio_median  # nan: hf rows have no rival
    assert run.ssp_overhead_share == pytest.approx(0.008 / 0.054)
    assert run.acceptance_rate == pytest.approx(0.625)  # median over prompts
    assert run.alpha == pytest.approx(8 / 10)  # accepted / (accepted + rejections), all prompts
    assert run.cost_ratio == pytest.approx(3 / 15) and run.verify_ratio == pytest.approx(18 / 15)  # medians over rsp's 15 ms
    assert run.forward_spread == pytest.approx(20 / 15) and not run.noisy  # slowest ÷ median ms per target forward (ours-rsp)
    assert run.greedy_agreement == {"ours-rsp": 1.0, "hf-generate": 0.5, "ours-ssp": 1.0, "hf-assisted": 1.0}
    assert run.measured_speedup == pytest.approx(2.0)
    assert run.predicted_speedup == pytest.approx((1 - 0.8**4) / (0.2 * (3 * 0.2 + 1)))
    assert run.predicted_speedup_v == pytest.approx((1 - 0.8**4) / (0.2 * (3 * 0.2 + 1.2)))
    run.setup = BenchSetup("T", "D", "float32", "float32", 2 * 10**9, SamplingParams(0), 4, 2)
    run.bandwidth = 10**12
    assert run.floor_ms == pytest.approx(2.0)
    rows = {r["engine"]: r for r in run.rows()}
    assert rows["hf-generate"]["greedy_agreement"] == 0.5 and rows["ours-ssp"]["ours_over_hf_min"] == pytest.approx(0.5)
    assert all(r["bandwidth_floor_ms"] == pytest.approx(2.0) and r["k"] == 3 and not r["noisy"] for r in rows.values())
    text = run.markdown()
    assert "α 0.800; c = 0.200; v = 1.200; SSp speedup measured 2.00x" in text and "floor 2.00 ms/token" in text
    assert f"predicted {run.predicted_speedup:.2f}x (v = 1), {run.predicted_speedup_v:.2f}x (measured v)" in text
    assert "ours-rsp 7.50x the floor" in text and "Noisy" not in text
    # Records without stats: only the whole completion's time is known, and every row says so.
    assert all(r["timing_basis"] == WHOLE_COMPLETION and r["timing_fallbacks"] == 2 for r in rows.values())
    assert "Fallback: 8 completions" in text
    run.noise_spread = 2.0  # as if one completion had taken twice its typical time per iteration
    assert run.noisy and "Noisy: a completion's time per iteration stood 2.0x" in run.markdown()


def test_rival_engines_share_one_path_ratios_version_acceptance_agreement():
    """vLLM and llama.cpp go through the same code: ours ÷ each per prompt on ours' rows, and per rival its α,
    acceptance and SSp = RSp agreement on its SSp row, its version on its rows."""
    same, other = [1, 2, 3, 4], [1, 2, 3, 9]
    runs = [EngineRun(e, i, other if (e, i) == ("llamacpp-ssp", 1) else same, seconds, acceptance_rate=rate,
                      accepted=accepted, rejections=rejections)
            for e, i, seconds, rate, accepted, rejections in (
                ("ours-rsp", 0, 0.04, nan, 0, 0), ("vllm-rsp", 0, 0.02, nan, 0, 0), ("llamacpp-rsp", 0, 0.01, nan, 0, 0),
                ("ours-ssp", 0, 0.02, 0.5, 3, 1), ("vllm-ssp", 0, 0.04, 0.5, 2, 2), ("llamacpp-ssp", 0, 0.01, 0.25, 1, 3),
                ("ours-rsp", 1, 0.08, nan, 0, 0), ("vllm-rsp", 1, 0.08, nan, 0, 0), ("llamacpp-rsp", 1, 0.02, nan, 0, 0),
                ("ours-ssp", 1, 0.04, 0.5, 3, 1), ("vllm-ssp", 1, 0.02, 0.75, 6, 2), ("llamacpp-ssp", 1, 0.02, 0.75, 3, 1))]
    engines = bench.engines_for(("vllm", "llamacpp"))
    assert engines == ("ours-rsp", "vllm-rsp", "llamacpp-rsp", "ours-ssp", "vllm-ssp", "llamacpp-ssp")
    run = summarize(3, runs, engines)
    by = {x.engine: x for x in run.summaries}
    def spread(ratio):
        return ratio.median, ratio.min, ratio.max

    assert spread(by["ours-rsp"].rival_ratio("vllm")) == pytest.approx((1.5, 1.0, 2.0))
    assert spread(by["ours-rsp"].rival_ratio("llamacpp")) == pytest.approx((4.0, 4.0, 4.0))
    assert spread(by["ours-ssp"].rival_ratio("vllm")) == pytest.approx((1.25, 0.5, 2.0))
    # The verdict's figure: the geometric mean of the per-prompt ratios with its 95% t interval (1 degree of freedom).
    vllm = by["ours-rsp"].rival_ratio("vllm")
    assert vllm.mean == pytest.approx(2 ** 0.5) and vllm.low < 1.0 < vllm.high
    assert (vllm.low, vllm.high) == pytest.approx((2 ** 0.5 * math.exp(-12.7062 * math.log(2) / 2),
                                                  2 ** 0.5 * math.exp(12.7062 * math.log(2) / 2)), rel=1e-4)
    assert by["ours-rsp"].rival_ratio("llamacpp").low == pytest.approx(4.0)  # the same ratio on both prompts
    assert (run.ssp_speedup.mean, run.ssp_speedup.low) == pytest.approx((2.0, 2.0))  # our RSp ÷ SSp: 2 and 2
    assert by["vllm-rsp"].rival_ratio("vllm").median != by["vllm-rsp"].rival_ratio("vllm").median  # nan: not ours
    assert list(run.rivals) == ["vllm", "llamacpp"]
    assert (run.rivals["vllm"].alpha, run.rivals["vllm"].acceptance_rate, run.rivals["vllm"].agreement) == \
        pytest.approx((8 / 12, 0.625, 1.0))
    assert (run.rivals["llamacpp"].alpha, run.rivals["llamacpp"].agreement) == pytest.approx((4 / 8, 0.5))
    run.rivals["llamacpp"].version = "0.3.36"
    run.setup = BenchSetup("T", "D", "float32", "float32", 10**9, SamplingParams(0), 4, 2)
    rows = {r["engine"]: r for r in run.rows()}
    assert rows["ours-ssp"]["ours_over_llamacpp_median"] == pytest.approx(2.0)  # 2/1 and 4/2
    assert rows["llamacpp-ssp"]["llamacpp_ssp_equals_llamacpp_rsp"] == 0.5 and rows["llamacpp-rsp"]["llamacpp"] == "0.3.36"
    assert rows["llamacpp-ssp"]["llamacpp_alpha"] == pytest.approx(0.5) and rows["ours-rsp"]["llamacpp"] == ""
    assert rows["vllm-ssp"]["vllm_acceptance_rate"] == pytest.approx(0.625)
    assert rows["llamacpp-rsp"]["llamacpp_alpha"] != rows["llamacpp-rsp"]["llamacpp_alpha"]  # nan: SSp row only
    assert len({tuple(r) for r in rows.values()}) == 1  # every row has the same columns


def test_the_table_keeps_engine_names_whole_in_80_columns_whatever_the_rivals(capsys):
    """Ours ÷ each rival on its row, with [min–max] only where that fits: slow runs (wide numbers) with hf, vLLM and
    llama.cpp still give whole engine names and lines of 80 columns at most."""
    from lssp.cli.bench import render

    for rivals, scale in ((("hf",), 1.0), (("llamacpp",), 1.0), (("llamacpp",), 100.0), (("hf", "vllm", "llamacpp"), 100.0)):
        engines = bench.engines_for(rivals)
        runs = [_timed(e, i, (10.0 + 7 * i + len(e)) * scale) for i in range(2) for e in engines]
        run = summarize(3, runs, engines)
        run.setup = BenchSetup("a-target", "a-draft", "float32", "float32", 10**9, SamplingParams(0), 40, 2)
        run.bandwidth = 1e10
        render(run, [], False)
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines), (rivals, scale)
        cells = {line.split()[1]: [c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│ ")}
        assert list(cells) == list(engines) and cells["ours-rsp"][-1] == "100%"
        ranged = "ours÷it [95%]" in out
        assert ranged == (scale == 1.0) and ("geometric mean [its 95% t interval];" in " ".join(out.split())) == ranged
        rival = rivals[-1] + ("-generate" if rivals[-1] == "hf" else "-rsp")
        mean = next(x for x in run.summaries if x.engine == 'ours-rsp').rival_ratio(rivals[-1]).mean
        assert cells[rival][3].split()[0] == f"{mean:.2f}" + ("×" if ranged else "")


def _timed(engine: str, index: int, per_iteration_ms: float, split: bool = False,
           target_ms: float = float("nan")) -> EngineRun:
    """A hand-made run of 40 tokens: 40 iterations for RSp, 20 for SSp, each ``per_iteration_ms`` long."""
    mode = bench.LABELS[engine][1]
    forwards = 20 if mode == "ssp" else 40
    total = forwards * per_iteration_ms / 1000
    first = total / forwards  # the first emission: prefill and one iteration
    stats = GenerationStats(mode, 3 if mode == "ssp" else 0, new_tokens=40, drafted_at=[0] * 3, accepted_at=[0] * 3,
                            target_forwards=0 if engine.startswith("hf-") else forwards, total_time_s=total,
                            ttft_s=first, first_emission_tokens=1 if mode == "rsp" else 2, after_first_s=total - first,
                            forwards_timed=split)
    return EngineRun(engine, index, list(range(40)), total, split_pass=split, target_ms_per_forward=target_ms,
                     stats=stats)


def test_the_bench_noise_flag_reads_the_headline_passes_of_every_engine():
    """As latency's: a long prompt that slows every engine alike is not noise, one headline completion slowed 3x is,
    whichever engine ran it; a slow prompt in ours' split pass alone (the old forward spread) is not."""
    engines = bench.engines_for(("hf", "vllm", "llamacpp"))
    base = {"ours-rsp": 20.0, "hf-generate": 25.0, "vllm-rsp": 15.0, "llamacpp-rsp": 12.0, "ours-ssp": 30.0,
            "hf-assisted": 40.0, "vllm-ssp": 22.0, "llamacpp-ssp": 18.0}

    def records(slowed: tuple[str, int] | None) -> list[EngineRun]:
        runs = [_timed(e, i, base[e] * (1.4 if i == 3 else 1.0) * (3.0 if (e, i) == slowed else 1.0))
                for i in range(5) for e in engines]
        return runs + [_timed(e, i, base[e], split=True, target_ms=10.0 * (3.0 if i == 2 else 1.0))
                       for i in range(5) for e in ("ours-rsp", "ours-ssp")]  # one prompt slow in the split pass only

    quiet = summarize(3, records(None), engines)
    assert quiet.forward_spread == pytest.approx(3.0) and quiet.noise_spread == pytest.approx(1.0)
    assert not quiet.noisy  # the split pass's slow prompt does not count
    for slowed in (("vllm-rsp", 1), ("hf-generate", 4), ("ours-ssp", 0), ("vllm-ssp", 3), ("llamacpp-rsp", 2),
                   ("llamacpp-ssp", 1)):
        busy = summarize(3, records(slowed), engines)
        assert busy.noisy and busy.noise_spread > 2.5, slowed
    assert {x.timing_basis for x in quiet.summaries} == {FIRST_TO_LAST} and quiet.timing_fallbacks == 0


def test_transformers_engine_records_its_first_emission(pair):
    """A streamer notes when generate() emits: RSp's first emission is one token; assisted generation's carries
    the drafts the target accepted (a twin of the target as the draft: all K of them) and the target's own."""
    target, draft = pair
    twin = LoadedModel(ModelSpec("twin"), copy.deepcopy(target.model), target.tokenizer)
    request = Request(target.encode("hello there"), 12, SamplingParams(0), seed=0)
    rsp = TransformersEngine(target, draft).complete(Mode("rsp", engine="hf"), request).stats
    assert rsp.first_emission_tokens == 1 and 0 < rsp.ttft_s < rsp.total_time_s and not rsp.timing_fallback
    assert rsp.ms_per_token == pytest.approx(1000 * rsp.after_first_s / 11)
    ssp = TransformersEngine(target, twin).complete(Mode("ssp", 3, engine="hf"), request).stats
    assert ssp.new_tokens == 12 and ssp.first_emission_tokens == 4 and ssp.timing_basis == FIRST_TO_LAST
    assert ssp.ms_per_token == pytest.approx(1000 * ssp.after_first_s / 8)
    one = TransformersEngine(target, draft).complete(Mode("rsp", engine="hf"),
                                                     Request(request.ids, 1, SamplingParams(0), seed=0)).stats
    assert one.timing_fallback and one.ms_per_token == pytest.approx(1000 * one.total_time_s)  # one token: marked


def test_bench_cli_writes_table_and_predictions(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path), "bench", "--nb-prompts", "2",
                 "--max-new-tokens", "8", "--k", "2", "--alpha", "0.6,0.8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Predicted SSp speedup" in out and "floor" in out
    rows = pd.read_csv(tmp_path / "bench.csv")
    assert list(rows["engine"]) == list(ENGINES)
    assert (rows[["k", "prompts", "max_new_tokens", "temperature"]].values == [2, 2, 8, 0]).all()
    assert (rows["greedy_agreement"] == 1.0).all()  # greedy: the four engines emit the same tokens
    ms = rows.set_index("engine")["ms_per_token"]
    assert (ms > 0).all()
    assert rows["ssp_speedup_measured"].tolist() == pytest.approx([ms["ours-rsp"] / ms["ours-ssp"]] * 4)
    assert rows["ours_over_hf_median"].isna().tolist() == [False, True, False, True]  # ours rows only
    ours = rows[rows["engine"].str.startswith("ours-")]
    assert (ours["ours_over_hf_min"] <= ours["ours_over_hf_median"]).all() and (ours["ours_over_hf_median"] <= ours["ours_over_hf_max"]).all()
    # The floor as latency counts it: the Linear layers as stored, and the cache at the mean context, read once.
    floor, _ = model_floor(load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target")), 1e9)
    assert (rows["target_weight_bytes"] == floor.weight_bytes).all()
    assert (rows["bandwidth_floor_ms"] > 1000 * floor.weight_bytes / (rows["copy_bandwidth_gbs"] * 1e9)).all()
    assert f"target weights {floor.weight_bytes / 1e6:.0f} MB + " in " ".join(out.split())
    row = rows.iloc[0]
    assert 0 <= row["alpha"] <= 1 and 0 <= row["ssp_overhead_share"] < 1
    assert row["ssp_speedup_predicted"] == pytest.approx(predicted_speedup(row["alpha"], 2, row["cost_ratio"]))
    assert row["ssp_speedup_predicted_v"] == pytest.approx(
        predicted_speedup(row["alpha"], 2, row["cost_ratio"], row["verify_ratio"]))
    assert "measured cost of a (K+1)-token verification" in " ".join(out.split())  # the console wraps at 80 columns
    # The prediction table: one line per --alpha, the model's figure for each K at the run's c.
    for a in (0.6, 0.8):
        line = next(x for x in out.splitlines() if x.strip(" │|").startswith(f"{a:g} "))
        assert [f"{predicted_speedup(a, kk, row['cost_ratio']):.2f}×" for kk in (1, 2, 3, 4, 6, 8)] == [
            cell.strip() for cell in line.strip(" │|").split("│")[1:]]


def test_bench_with_a_compact_draft_gives_transformers_the_wrapped_model(tiny_dir):
    registry = load_registry(tiny_dir / "models.yaml")
    target, draft = load_model(registry.get("tiny-target")), load_model(registry.get("tiny-draft-compact"))
    run = run_bench(target, draft, ["hello there", "abc"], "warm", 3, SamplingParams(0), 16, seed=0)
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}


def test_random_init_pair_warns_that_acceptance_means_nothing(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "m.yaml"
    cfg.write_text((tiny_dir / "models.yaml").read_text().replace("./tiny-", str(tiny_dir) + "/tiny-"))
    code = main(["--config", str(cfg), "--results-dir", str(tmp_path), "bench", "tiny-random", "tiny-draft",
                 "--nb-prompts", "1", "--max-new-tokens", "6", "--alpha", "0.7"])
    assert code == 0
    assert "acceptance and measured speedup mean nothing" in " ".join(capsys.readouterr().out.split())


def test_four_engines_agree_on_dynamically_quantized_models(pair):
    from dataclasses import replace

    from lssp.models.loading import cpu_quantize

    quantized = [LoadedModel(replace(m.spec, quantization=q), cpu_quantize(copy.deepcopy(m.model), replace(m.spec, quantization=q)),
                             m.tokenizer) for m, q in zip(pair, ("dynamic-fp16", "dynamic-int8"))]
    run = run_bench(*quantized, ["hello there", "abc"], "warm", 3, SamplingParams(0), 16, seed=0)
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}
    assert quantized[0].weight_bytes < pair[0].weight_bytes


def test_ctrl_c_keeps_the_prompts_every_engine_completed(pair):
    target, draft = pair

    def interrupt_at(moment: str):
        def progress(message: str, done: int, total: int) -> None:
            if message == moment:
                raise KeyboardInterrupt
        return progress

    run = run_bench(target, draft, ["hello there", "abc", "xyz"], "warm", 2, SamplingParams(0), 8, seed=0,
                    progress=interrupt_at("prompt 2/3 hf-generate"))  # Ctrl-C after the second prompt's first engine
    assert run.interrupted and run.setup.prompts == 1
    assert sorted(r.engine for r in run.runs) == sorted(ENGINES) and {r.prompt_index for r in run.runs} == {0}
    assert all(row["interrupted"] for row in run.rows())
    with pytest.raises(KeyboardInterrupt):  # nothing complete yet: the interruption goes on up
        run_bench(target, draft, ["hello"], "warm", 2, SamplingParams(0), 8, seed=0,
                  progress=interrupt_at("prompt 1/1 hf-generate"))
