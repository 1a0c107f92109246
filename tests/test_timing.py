"""Decode ms/token: one definition for every engine, from the first emission to the last token, and the
completions that cannot be timed that way marked as falling back to the whole completion."""
from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from lssp.decoding.generation import (
    DECODE_TIMING,
    FIRST_TO_LAST,
    WHOLE_COMPLETION,
    GenerationStats,
    combined,
    generate_regular,
    timing_basis,
)
from lssp.decoding.sampling import SamplingParams
from lssp.drafters import generate_speculative
from lssp.engines import ENGINES, Mode
from lssp.measure.latency import PromptTiming, summaries_by_task


def ssp_stats(tokens: int = 10, first: int = 3, ttft_s: float = 0.5, total_s: float = 1.2) -> GenerationStats:
    """An SSp completion whose first emission (prefill, then one verification) carried ``first`` tokens."""
    return GenerationStats("ssp", 2, new_tokens=tokens, prefill_time_s=0.2, total_time_s=total_s, ttft_s=ttft_s,
                           first_emission_tokens=first, after_first_s=total_s - ttft_s, drafted_at=[0, 0],
                           accepted_at=[0, 0])


def test_ms_per_token_runs_from_the_first_emission_to_the_last_token():
    stats = ssp_stats()  # 3 tokens at 0.5 s, the 7 others by 1.2 s
    assert not stats.timing_fallback and stats.timing_basis == FIRST_TO_LAST
    assert (stats.timed_tokens, stats.timed_s) == (7, pytest.approx(0.7))
    assert stats.ms_per_token == pytest.approx(1000 * 0.7 / 7)
    assert stats.decode_time_s == pytest.approx(1.0)  # the time after the prefill, which the shares divide, unchanged


def test_a_completion_without_a_timed_second_emission_falls_back_to_the_whole_completion_and_says_so():
    one = GenerationStats("rsp", new_tokens=1, total_time_s=0.3, ttft_s=0.3, first_emission_tokens=1, after_first_s=0.0)
    assert one.timing_fallback and one.timing_basis == WHOLE_COMPLETION
    assert one.ms_per_token == pytest.approx(300)  # the whole completion, prefill included, ÷ 1 token
    all_at_once = ssp_stats(tokens=3, first=3, ttft_s=0.5, total_s=0.5)  # SSp: every token in the first emission
    assert all_at_once.timing_fallback and all_at_once.ms_per_token == pytest.approx(500 / 3)
    untimed = GenerationStats("rsp", new_tokens=8, total_time_s=0.8)  # an engine that gave no first emission time
    assert untimed.timing_fallback and untimed.ms_per_token == pytest.approx(100)
    assert [timing_basis(0, 4), timing_basis(4, 4), timing_basis(1, 4)] == [
        FIRST_TO_LAST, WHOLE_COMPLETION, f"mixed: 1 of 4 {WHOLE_COMPLETION}"]


def test_turns_are_each_timed_from_their_own_first_emission():
    two = combined([ssp_stats(10, 3, 0.5, 1.2), ssp_stats(6, 2, 0.4, 0.8)])
    assert two.ms_per_token == pytest.approx(1000 * (0.7 + 0.4) / (7 + 4)) and two.ttft_s == 0.5
    with_untimed = combined([ssp_stats(), GenerationStats("ssp", 2, new_tokens=5, total_time_s=1.0, drafted_at=[0, 0],
                                                          accepted_at=[0, 0])])
    assert with_untimed.timing_fallback and with_untimed.ms_per_token == pytest.approx(1000 * 2.2 / 15)


def test_every_engine_states_the_same_definition():
    assert {ENGINES[name].decode_timing for name in ("ours", "hf", "vllm")} == {DECODE_TIMING}


def test_ours_records_its_first_emission(target):
    """RSp's first emission is one token; SSp's carries the accepted drafts and one more (a twin draft: all K)."""
    ids = torch.tensor([[0, 5, 6, 7]])
    rsp = generate_regular(target, ids, 12, SamplingParams(0)).stats
    assert rsp.first_emission_tokens == 1 and not rsp.timing_fallback
    assert rsp.ms_per_token == pytest.approx(1000 * (rsp.total_time_s - rsp.ttft_s) / 11)
    ssp = generate_speculative(target, copy.deepcopy(target), ids, 12, 3, SamplingParams(0)).stats
    assert ssp.first_emission_tokens == 4 and ssp.timing_basis == FIRST_TO_LAST
    assert ssp.ms_per_token == pytest.approx(1000 * (ssp.total_time_s - ssp.ttft_s) / 8)


def test_latency_summaries_pool_the_timed_spans_and_count_the_fallbacks():
    how = Mode("ssp", 2)
    timings = [PromptTiming(0, "ssp", 2, ssp_stats(10, 3, 0.5, 1.2)), PromptTiming(1, "ssp", 2, ssp_stats(10, 2, 0.3, 1.1)),
               PromptTiming(2, "ssp", 2, ssp_stats(3, 3, 0.6, 0.6))]  # the last one: one emission, falls back
    (summary,) = summaries_by_task(timings, [how])
    assert summary.ms_per_token == pytest.approx(1000 * (0.7 + 0.8 + 0.6) / (7 + 8 + 3))
    assert summary.timing_fallbacks == 1 and summary.timing_basis == f"mixed: 1 of 3 {WHOLE_COMPLETION}"
    assert summary.ms_per_token_max == pytest.approx(200)  # the fallback's 0.6 s ÷ 3 tokens


def test_latency_marks_completions_that_fell_back(run, tmp_path):
    """A one-token budget leaves nothing after the first emission: every row falls back and the table says so."""
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "1", "--k", "1", "--ignore-eos")
    assert code == 0, err
    assert "  ms/token of 4 completions is whole completion ÷ tokens (timing_basis)" in out.splitlines()
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert (rows["timing_basis"] == WHOLE_COMPLETION).all() and (rows["timing_fallbacks"] == 2).all()
    assert (rows["decode_timing"] == DECODE_TIMING).all()
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    assert (prompts["timing_basis"] == WHOLE_COMPLETION).all()
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "2", "--ignore-eos")
    assert code == 0, err
    assert "whole completion ÷ tokens" not in " ".join(out.split())
