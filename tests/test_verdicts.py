"""latency's verdict: a paired interval on the per-prompt speedup, and a K not chosen on the data that estimates it."""
from __future__ import annotations

import math
import random

import pytest
from scipy import stats as scipy_stats

from lssp.decoding.generation import GenerationStats
from lssp.engines import Mode
from lssp.measure.latency import GAIN, LOSS, NO_CLEAR_GAIN, PromptTiming, choose_and_estimate, summaries_by_task
from lssp.report.stats import ratio_interval

RSP, K2, K4 = Mode("rsp"), Mode("ssp", 2), Mode("ssp", 4)


def timing(index: int, how: Mode, ms_per_token: float, repeat: int = 0) -> PromptTiming:
    """A completion of 40 tokens whose ms/token is ``ms_per_token`` (no timed first emission: the whole time)."""
    stats = GenerationStats(how.mode, how.k, new_tokens=40, target_forwards=20, forwards_timed=False,
                            drafted_at=[0] * how.k, accepted_at=[0] * how.k,
                            total_time_s=0.04 * ms_per_token, prefill_time_s=0.0)
    return PromptTiming(index, how.mode, how.k, stats, repeat=repeat)


def verdict_of(timings: list[PromptTiming], modes: list[Mode]):
    summaries = summaries_by_task(timings, modes)
    return choose_and_estimate(timings, RSP, [s for s in summaries if s.mode == "ssp"]), summaries


def test_the_ratio_interval_is_the_t_interval_of_the_log_ratios():
    pairs = [(20.0, 14.0), (21.0, 15.5), (19.0, 13.0), (22.0, 16.0)]
    logs = [math.log(a / b) for a, b in pairs]
    low, high = scipy_stats.t.interval(0.95, len(logs) - 1, loc=sum(logs) / 4, scale=scipy_stats.sem(logs))
    interval = ratio_interval(pairs)
    assert interval.estimate == pytest.approx(math.exp(sum(logs) / 4))
    assert (interval.low, interval.high) == (pytest.approx(math.exp(low)), pytest.approx(math.exp(high)))
    one = ratio_interval(pairs[:1])
    assert one.estimate == pytest.approx(20 / 14) and math.isnan(one.low) and math.isnan(one.high)
    assert math.isnan(ratio_interval([(1.0, float("nan"))]).estimate)


def test_ssp_timed_as_rsp_gets_no_clear_gain():
    """A planted equal-speed run: each prompt's SSp completion takes RSp's time with a little noise either way."""
    rng = random.Random(0)
    base = [15 + rng.random() * 5 for _ in range(8)]
    timings = [t for i, ms in enumerate(base) for t in (timing(i, RSP, ms), timing(i, K2, ms * rng.uniform(0.95, 1.05)))]
    verdict, _ = verdict_of(timings, [RSP, K2])
    assert verdict.outcome == NO_CLEAR_GAIN and verdict.speedup.low < 1 < verdict.speedup.high
    assert verdict.pairs == 8 and verdict.basis == "one SSp mode, nothing chosen"


def test_a_clear_gain_and_a_clear_loss():
    rng = random.Random(1)
    for factor, outcome in ((0.6, GAIN), (1.5, LOSS)):
        timings = [t for i in range(6) for ms in [15 + rng.random() * 5]
                   for t in (timing(i, RSP, ms), timing(i, K2, ms * factor * rng.uniform(0.97, 1.03)))]
        verdict, summaries = verdict_of(timings, [RSP, K2])
        assert verdict.outcome == outcome
        ssp = next(s for s in summaries if s.mode == "ssp")  # the table's interval: over every prompt
        assert ssp.speedup_low < 1 / factor < ssp.speedup_high


def test_the_k_is_chosen_on_some_prompts_and_its_speedup_estimated_on_the_others():
    """K=2 is the faster on the 1st, 3rd, 5th… prompts, K=4 on the others: the verdict picks K=2 there and reports
    K=2's speedup on the other prompts, where it is slow (not the flattering figure of the prompts that chose it)."""
    timings = []
    for i in range(8):
        chooser = i % 2 == 0
        timings += [timing(i, RSP, 20.0), timing(i, K2, 10.0 if chooser else 25.0 + i * 0.1),
                    timing(i, K4, 15.0 if chooser else 12.0)]
    verdict, _ = verdict_of(timings, [RSP, K2, K4])
    assert verdict.mode.k == 2 and verdict.pairs == 4 and "estimated on the others" in verdict.basis
    assert verdict.speedup.estimate < 1 and verdict.outcome == LOSS  # 20 / ~25.4 on the held-out prompts


def test_with_several_passes_the_k_is_chosen_on_the_first_half_of_them():
    timings = []
    for repeat in range(3):
        for i in range(3):
            timings += [timing(i, RSP, 20.0, repeat), timing(i, K2, (10.0 if repeat == 0 else 18.0) + i * 0.1, repeat),
                        timing(i, K4, (12.0 if repeat == 0 else 11.0) + i * 0.2, repeat)]
    verdict, _ = verdict_of(timings, [RSP, K2, K4])
    assert verdict.mode.k == 2 and verdict.pairs == 6
    assert verdict.basis == "chosen on pass 1, estimated on passes 2–3"
    assert verdict.speedup.estimate == pytest.approx(20 / 18.1, rel=0.01)


def test_too_few_prompts_to_split_say_so():
    timings = [t for i in range(2) for t in (timing(i, RSP, 20.0), timing(i, K2, 10.0 + i), timing(i, K4, 12.0))]
    verdict, _ = verdict_of(timings, [RSP, K2, K4])
    assert verdict.mode.k == 2 and "too few to split" in verdict.basis and verdict.pairs == 2
