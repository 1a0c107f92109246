"""One set of speculative-decoding metrics for every engine (docs/results-format.md, "Metrics"), and a replay that
recomputes them from the emitted tokens alone, to check what each engine's counters say.

Counts per completion: the target forwards that emitted tokens (a prefill that emits the first token counts; one
that emits nothing does not), the drafts proposed and accepted, the verification steps that ended on a rejection,
and per draft position i the steps that drafted it and those that accepted it. From them:

- acceptance rate = accepted ÷ drafted;
- α, the per-token acceptance of the i.i.d. model = accepted ÷ (accepted + rejections) (its maximum likelihood);
- τ, tokens per target forward, the bonus token counted = emitted tokens ÷ forwards;
- acceptance at position i = steps accepting draft i ÷ steps drafting it (vLLM's per-position rate);
- acceptance at i given i−1 accepted = steps accepting draft i ÷ steps accepting draft i−1 (the conditional rate).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lssp.report.stats import alpha_estimate

Proposer = Callable[[list[int], int], list[int]]  # (the text so far, how many) -> the greedy drafts


class SpecMetrics:
    """The derived metrics of a completion's counts: a class with ``new_tokens``, ``target_forwards``, ``drafted``,
    ``accepted``, ``rejections``, ``drafted_at`` and ``accepted_at`` gets them (``SpecCounts``, ``GenerationStats``)."""

    new_tokens: int
    target_forwards: int
    drafted: int
    accepted: int
    rejections: int
    drafted_at: list[int]
    accepted_at: list[int]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def alpha(self) -> float:
        """Per-token acceptance α of the i.i.d. model (its maximum-likelihood estimate)."""
        return alpha_estimate(self.accepted, self.rejections)

    @property
    def tokens_per_target_forward(self) -> float:
        """τ: emitted tokens per target forward, the target's own token of each step counted."""
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the steps that drafted position i, the share that kept draft i."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def acceptance_given_previous(self) -> list[float]:
        """Of the steps that kept draft i−1 (for i = 0: that drafted), the share that kept draft i."""
        reached = [self.drafted_at[0], *self.accepted_at[:-1]] if self.drafted_at else []
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, reached)]


@dataclass
class SpecCounts(SpecMetrics):
    """The raw counts of one or more completions."""

    k: int
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted_at = self.drafted_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def step(self, drafted: int, accepted: int) -> None:
        """One verification step: ``drafted`` drafts, the first ``accepted`` kept, then one token of the target's."""
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted


def counts_of(stats) -> SpecCounts:
    """An engine's own figures for a completion (``GenerationStats``, from its counters) as ``SpecCounts``."""
    return SpecCounts(len(stats.drafted_at), stats.new_tokens, stats.target_forwards, stats.drafted, stats.accepted,
                      stats.rejections, list(stats.drafted_at), list(stats.accepted_at))


def replay_greedy(prompt: Sequence[int], tokens: Sequence[int], k: int, propose: Proposer,
                  first_from_prefill: bool = False, drafts_past_budget: bool = False) -> SpecCounts:
    """The counts greedy SSp must have had to emit ``tokens``: each step the drafter proposes (``propose``, the
    draft's greedy continuation of the text so far) at most ``k`` and never more than the tokens left after one of
    the target's, keeps those equal to what was emitted, and the target adds one. ``first_from_prefill``: the
    engine's prefill emits the first token (vLLM, llama.cpp), else the first step drafts from the prompt (ours).
    ``drafts_past_budget``: every step drafts ``k`` however few tokens are left (vLLM), those past the last emitted
    token counted as drafted and not kept."""
    counts, done = SpecCounts(k, new_tokens=len(tokens)), 0
    if first_from_prefill and tokens:
        counts.target_forwards, done = 1, 1
    while done < len(tokens):
        budget = k if drafts_past_budget else min(k, len(tokens) - done - 1)
        drafts = propose(list(prompt) + list(tokens[:done]), budget) if budget else []
        kept = 0
        while kept < len(drafts) and done + kept < len(tokens) - 1 and drafts[kept] == tokens[done + kept]:
            kept += 1
        counts.step(len(drafts), kept)
        done += kept + 1
    return counts
