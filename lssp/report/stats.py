"""Confidence intervals, goodness-of-fit tests and the speculative speedup model."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import optimize as _scipy_optimize
from scipy import stats as _scipy

Z95 = 1.959963984540054
Z80 = 0.8416212335729143  # the one-sided quantile for 80% power


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def wald(successes: int, trials: int, z: float = Z95) -> Interval:
    """p ± z·sqrt(p(1−p)/n), clipped to [0, 1] (a rate has no other values). Zero width at p = 0 or 1."""
    p = successes / trials
    half = z * math.sqrt(p * (1 - p) / trials)
    return Interval(p, max(0.0, p - half), min(1.0, p + half))


def wilson(successes: int, trials: int, z: float = Z95) -> Interval:
    """Wilson score interval; stays inside [0, 1] and is sensible near 0 and 1."""
    n, p = trials, successes / trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, centre - half, centre + half)


def difference(s1: int, n1: int, s2: int, n2: int, z: float = Z95) -> Interval:
    """p1 − p2 with the independent-samples Wald interval."""
    p1, p2 = s1 / n1, s2 / n2
    half = z * math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    return Interval(p1 - p2, p1 - p2 - half, p1 - p2 + half)


def paired_difference(only_first: int, only_second: int, pairs: int, z: float = Z95) -> Interval:
    """p1 − p2 on the same items (a paired comparison, as McNemar's test is) with its Wald interval: from the
    discordant pairs b (only the first right) and c (only the second), (b − c)/n ± z·sqrt(b + c − (b − c)²/n)/n."""
    if pairs == 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    b, c = only_first, only_second
    estimate = (b - c) / pairs
    half = z * math.sqrt(max(0.0, b + c - (b - c) ** 2 / pairs)) / pairs
    return Interval(estimate, estimate - half, estimate + half)


def ratio_interval(pairs: Sequence[tuple[float, float]], level: float = 0.95) -> Interval:
    """The geometric mean of paired ratios a/b with a t interval on the mean of log(a/b): a speedup from per-prompt
    timings of two modes on the same prompts. Bounds are nan under two pairs (no spread to measure)."""
    logs = [math.log(a / b) for a, b in pairs if a > 0 and b > 0 and math.isfinite(a / b)]
    if not logs:
        return Interval(float("nan"), float("nan"), float("nan"))
    n, mean = len(logs), sum(logs) / len(logs)
    if n < 2:
        return Interval(math.exp(mean), float("nan"), float("nan"))
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = _scipy.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def ratio_of_medians_interval(pairs: Sequence[tuple[float, float]], level: float = 0.95, draws: int = 2000,
                              seed: int = 0) -> Interval:
    """median(a) ÷ median(b) over paired values (a, b) with a percentile bootstrap interval: the pairs resampled
    with replacement ``draws`` times (seeded), the same pairs for both medians. Bounds are nan under five pairs."""
    import numpy as np

    kept = np.array([(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0],
                    dtype=float).reshape(-1, 2)
    if not len(kept):
        return Interval(float("nan"), float("nan"), float("nan"))
    estimate = float(np.median(kept[:, 0]) / np.median(kept[:, 1]))
    if len(kept) < 5:
        return Interval(estimate, float("nan"), float("nan"))
    picks = np.random.default_rng(seed).integers(0, len(kept), (draws, len(kept)))
    ratios = np.median(kept[picks, 0], axis=1) / np.median(kept[picks, 1], axis=1)
    low, high = np.quantile(ratios, [0.5 - level / 2, 0.5 + level / 2])
    return Interval(estimate, float(low), float(high))


def paired_score_difference(only_first: int, only_second: int, pairs: int, z: float = Z95) -> Interval:
    """p1 − p2 on the same items with Tango's score interval (Stat Med 1998;17:891): every Δ whose score statistic
    (b − c − nΔ) / sqrt(n(2·q21(Δ) + Δ(1 − Δ))) stays within ±z, q21(Δ) the constrained maximum-likelihood share of
    second-only pairs. Unlike Wald's it keeps a width with no discordant pair (then ±z²/(n + z²))."""
    if pairs == 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    b, c, n = only_first, only_second, pairs

    def score(delta: float) -> float:
        w = -b - c + (2 * n - b + c) * delta
        q21 = (math.sqrt(max(0.0, w * w + 8 * n * c * delta * (1 - delta))) - w) / (4 * n)
        variance, excess = n * (2 * q21 + delta * (1 - delta)), b - c - n * delta
        return excess / math.sqrt(variance) if variance > 0 else 0.0 if excess == 0 else math.copysign(math.inf, excess)

    estimate, edge = (b - c) / n, 1 - 1e-12
    low = -1.0 if score(-edge) <= z else _scipy_optimize.brentq(lambda d: score(d) - z, -edge, estimate)
    high = 1.0 if score(edge) >= -z else _scipy_optimize.brentq(lambda d: score(d) + z, estimate, edge)
    return Interval(estimate, low, high)


def mcnemar(only_first: int, only_second: int) -> float:
    """Exact two-sided McNemar p-value from the discordant pairs of a paired comparison."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    return min(1.0, 2 * _scipy.binom.cdf(min(only_first, only_second), n, 0.5))


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int  # categories tested, the tail bucket included


def chi_square_gof(counts: Sequence[int], probs: Sequence[float], min_expected: float = 5.0) -> ChiSquare:
    """Pearson goodness of fit of observed ``counts`` to ``probs``.

    Categories whose expected count is below ``min_expected`` are pooled into one tail bucket
    (kept only if its expected count reaches ``min_expected`` too, else merged into the
    smallest kept cell).
    """
    n = sum(counts)
    cells: list[tuple[float, float]] = []  # (observed, expected)
    tail_obs = tail_exp = 0.0
    for c, p in zip(counts, probs):
        if n * p >= min_expected:
            cells.append((c, n * p))
        else:
            tail_obs += c
            tail_exp += n * p
    if tail_exp >= min_expected or (tail_exp > 0 and not cells):
        cells.append((tail_obs, tail_exp))
    elif tail_obs or tail_exp:
        i = min(range(len(cells)), key=lambda j: cells[j][1])
        cells[i] = (cells[i][0] + tail_obs, cells[i][1] + tail_exp)
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    dof = max(1, len(cells) - 1)
    return ChiSquare(statistic, dof, float(_scipy.chi2.sf(statistic, dof)), len(cells))


def chi_square_homogeneity(first: Sequence[int], second: Sequence[int], min_expected: float = 5.0) -> ChiSquare:
    """Whether two samples of tokens come from one law: the chi-square test of a 2 × m table of counts, tokens
    whose expected count falls below ``min_expected`` in either row pooled into one tail cell."""
    a, b = Counter(first), Counter(second)
    n_a, n_b = len(first), len(second)
    share = min(n_a, n_b) / (n_a + n_b)
    cells, tail = [], [0, 0]
    for token in sorted(set(a) | set(b)):
        row = [a.get(token, 0), b.get(token, 0)]
        if sum(row) * share >= min_expected:
            cells.append(row)
        else:
            tail = [tail[0] + row[0], tail[1] + row[1]]
    if sum(tail):
        cells.append(tail)
    if len(cells) < 2:
        return ChiSquare(0.0, 0, 1.0, len(cells))
    result = _scipy.chi2_contingency(list(zip(*cells)), correction=False)
    return ChiSquare(float(result.statistic), int(result.dof), float(result.pvalue), len(cells))


POWER = 0.8  # a verdict of "lossless" needs this chance of seeing the smallest deviation it vouches for


def chi_square_power(n: float, dof: int, effect: float, alpha: float) -> float:
    """The chance a chi-square test with ``dof`` degrees of freedom at level ``alpha`` rejects when the truth
    deviates by Cohen's ``effect`` w (w² = Σ (q − p)² / p) over ``n`` samples: noncentrality n·w². For a two-sample
    test pass the effective size n₁n₂/(n₁ + n₂)."""
    if n <= 0:
        return 0.0
    return float(_scipy.ncx2.sf(_scipy.chi2.isf(alpha, max(1, dof)), max(1, dof), n * effect ** 2))


def chi_square_samples_needed(dof: int, effect: float, alpha: float, power: float = POWER) -> int:
    """The fewest samples with which ``chi_square_power`` reaches ``power``."""
    low, high = 1, 2
    while chi_square_power(high, dof, effect, alpha) < power:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if chi_square_power(mid, dof, effect, alpha) < power else (low, mid)
    return high


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α): tokens emitted per target forward (Leviathan et al. 2022)."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + v)) for draft/target cost ratio c.

    ``v`` is what a (k+1)-token verification forward costs in 1-token forwards: 1 in the
    papers' model, measured by ``bench``.
    """
    return expected_tokens_per_iteration(alpha, k) / (k * c + v)


def alpha_estimate(accepted: int, rejections: int) -> float:
    """α of the i.i.d. acceptance model from SSp counts: each draft is a trial until the first rejection.

    ``accepted / drafted`` (vLLM's draft acceptance rate) is lower: drafts after a rejection
    are never tried, yet counted.
    """
    trials = accepted + rejections
    return accepted / trials if trials else float("nan")


def alpha_from_tokens_per_iteration(tokens: float, k: int) -> float:
    """Invert (1 − α^(k+1)) / (1 − α) = tokens for α in [0, 1] (bisection)."""
    if not 1.0 <= tokens <= k + 1:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens_per_iteration(mid, k) < tokens:
            low = mid
        else:
            high = mid
    return (low + high) / 2
