"""The paired difference of eval: Tango's score interval keeps a width where Wald's collapses."""
from __future__ import annotations

import random

import pytest

from lssp.report.stats import Z95, paired_difference, paired_score_difference


def test_with_no_discordant_pair_the_score_interval_is_plus_minus_z2_over_n_plus_z2():
    for n in (10, 1000):
        interval = paired_score_difference(0, 0, n)
        half = Z95 ** 2 / (n + Z95 ** 2)
        assert (interval.estimate, interval.low, interval.high) == (0.0, pytest.approx(-half), pytest.approx(half))
        assert paired_difference(0, 0, n).low == paired_difference(0, 0, n).high == 0.0  # Wald's: zero width


def test_the_score_interval_is_near_walds_with_many_discordant_pairs_and_mirrors_itself():
    score, wald = paired_score_difference(300, 200, 1000), paired_difference(300, 200, 1000)
    assert score.estimate == pytest.approx(0.1)
    assert score.low == pytest.approx(wald.low, abs=0.002) and score.high == pytest.approx(wald.high, abs=0.002)
    flipped = paired_score_difference(200, 300, 1000)
    assert (flipped.low, flipped.high) == (pytest.approx(-score.high), pytest.approx(-score.low))
    every = paired_score_difference(10, 0, 10)  # all pairs one way: the bound at 1
    assert every.high == 1.0 and 0 < every.low < 1


def test_the_score_interval_covers_the_true_difference_about_95_percent_of_the_time():
    rng = random.Random(0)
    n, only_first, only_second = 200, 0.03, 0.01
    covered = 0
    for _ in range(1000):
        draws = [rng.random() for _ in range(n)]
        b = sum(x < only_first for x in draws)
        c = sum(only_first <= x < only_first + only_second for x in draws)
        covered += paired_score_difference(b, c, n).contains(only_first - only_second)
    assert 0.93 <= covered / 1000 <= 0.98
