"""Statistical check that SSp samples from the target's distribution, on real models.

Sampled mode: for each prompt, the exact next-token law p after a prefix comes from one
target forward. SSp runs many times from the prompt with independent seeds; the token it
emits at position j, among the runs whose first j tokens equal a prefix (the commonest
emitted tokens; choosing it from earlier positions leaves position j's conditional law
untouched), must follow p(· | prompt + prefix). Positions j >= 1 are often produced
after a rejection and a cache rollback, so rollback bugs show there.

A verdict of LOSSLESS needs power: every prompt's position 0 and at least one later position (where the bonus
token, the residual draw and the cache rollback show) must each have a POWER chance of seeing a deviation of
Cohen's ``effect`` w; without it the verdict is INCONCLUSIVE and says how many runs would do. A failed test fails
the verdict whatever the power.

Greedy mode: SSp's and RSp's continuations must be identical; where they differ, the
target's top-2 logit gap at the first difference tells a numerical near-tie from a bug.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from lssp.decoding.kv import feed, forward_logits, new_cache
from lssp.decoding.sampling import SamplingParams, warp
from lssp.drafters.model import draft_logits
from lssp.engines import Engine, Mode, OursEngine, Request, request_seed
from lssp.models.loading import LoadedModel
from lssp.report.results import RunInfo, mode_name
from lssp.report.stats import POWER, chi_square_gof, chi_square_homogeneity, chi_square_power, chi_square_samples_needed

Progress = Callable[[str], None]
MIN_SAMPLES = 20  # runs sharing a prefix below which a position is not tested
EFFECT = 0.5  # Cohen's w a LOSSLESS verdict must be able to see (0.5: "large"; the deviations found so far: w > 2)
LOSSLESS, NOT_LOSSLESS, INCONCLUSIVE = "lossless", "not lossless", "inconclusive"
BATCH = 32  # runs of one prompt per batch, where the engine batches them


@dataclass
class PositionCheck:
    prompt_index: int
    position: int  # 0: first emitted token
    prefix: list[int]  # the emitted tokens conditioned on
    samples: int
    chi2_p_value: float
    chi2_cells: int
    tv: float  # total-variation distance between empirical and exact laws
    tv_null_mean: float  # the same distance expected from sampling noise alone
    tv_null_sd: float
    exact_alpha: float  # sum_x min(p(x), q(x)) at this position
    passed: bool = True
    rsp_samples: int = 0  # the engine's own RSp tokens at this position (two-sample test)
    two_sample_p: float = float("nan")  # chi-square homogeneity of SSp's and RSp's tokens (nan: not run)
    two_sample_cells: int = 0
    power: float = float("nan")  # of the deciding tests (the weaker), against a deviation of the report's effect
    runs_needed: int = 0  # SSp runs per prompt that would give this position POWER (0: it has it)
    impossible_draws: int = 0  # SSp's tokens here that the target's law (warped alike) gives probability 0
    impossible_tokens: list[int] = field(default_factory=list)  # which tokens those were


@dataclass
class GreedyCheck:
    prompt_index: int
    identical: bool
    first_difference: int | None = None
    top2_gap: float | None = None  # target logit gap between its two best tokens there
    near_tie: bool = False
    same_as_ours: bool | None = None  # another engine's RSp tokens equal ours (None: ours, or not compared)


@dataclass
class VerifyReport:
    mode: str  # "sampled" or "greedy"
    significance: float
    correction: str
    positions: list[PositionCheck] = field(default_factory=list)
    greedy: list[GreedyCheck] = field(default_factory=list)
    acceptance_rate: float = float("nan")
    tie_tolerance: float = 0.0
    skipped: list[str] = field(default_factory=list)
    lookup: int = 0  # n-gram length of SSp's context lookup (0: off)
    ngram: int = 0  # n-gram length of the engine's n-gram drafter, drafting alone (0: the draft model)
    looked_up: int = 0  # drafts the lookup proposed
    engine: str = "ours"  # whose SSp was audited
    exact_law_counts: bool = True  # False: the engine's arithmetic is its own; the two-sample test decides
    k: int = 0
    effect: float = EFFECT
    underpowered: list[str] = field(default_factory=list)  # why a passing report cannot say LOSSLESS
    runs_needed: int = 0  # SSp runs per prompt that would make it conclusive (0: unknown or not needed)
    prompts_done: int = 0  # prompts whose runs all completed (fewer than asked: interrupted, or stopped early)
    stopped_early: str = ""  # why the remaining prompts were not run: the evidence already decided
    interrupted: bool = False  # Ctrl-C or SIGTERM: the checks cover the prompts done

    def rows(self, info: RunInfo, target: LoadedModel, draft: LoadedModel, params: SamplingParams) -> list[dict[str, Any]]:
        """One CSV row per check (a position in sampled mode, a prompt in greedy mode)."""
        base = {**info.head(), "engine": self.engine, "target": target.name, "draft": draft.name, "k": self.k,
                "lookup": self.lookup, "ngram": self.ngram, "looked_up": self.looked_up, **params.as_dict(), "verdict": self.verdict,
                "effect": self.effect if self.mode == "sampled" else None,
                "acceptance_rate": self.acceptance_rate, "interrupted": self.interrupted, "target_precision": target.precision,
                "draft_precision": draft.precision, **info.env}
        # The same columns in both modes, so that every verify run appends to one file.
        blank = {f.name: None for kind in (PositionCheck, GreedyCheck) for f in fields(kind)}
        return ([{**base, **blank, **asdict(c), "prefix": " ".join(map(str, c.prefix)),
                  "impossible_tokens": " ".join(map(str, c.impossible_tokens))} for c in self.positions]
                + [{**base, **blank, **asdict(g)} for g in self.greedy])

    def summary_json(self, info: RunInfo) -> dict[str, Any]:
        return {"engine": self.engine, "k": self.k, "mode": self.mode, "verdict": self.verdict, "lossless": self.lossless,
                "effect": self.effect, "power": POWER, "underpowered": self.underpowered, "runs_needed": self.runs_needed,
                "prompts_done": self.prompts_done, "interrupted": self.interrupted,
                "stopped_early": self.stopped_early or None,
                "significance": self.significance,
                "correction": self.correction, "exact_law_counts": self.exact_law_counts,
                "acceptance_rate": self.acceptance_rate, "lookup": self.lookup, "ngram": self.ngram,
                "looked_up": self.looked_up, "checks": [asdict(c) for c in self.positions] + [asdict(g) for g in self.greedy],
                "run_id": info.run_id, "device": info.env.get("device")}

    @property
    def tests(self) -> int:
        """Tests the significance is shared by: one per position, two where the two-sample test ran."""
        return sum(self.exact_law_counts + (p.two_sample_p == p.two_sample_p) for p in self.positions)

    @property
    def threshold(self) -> float:
        return self.significance / max(1, self.tests)

    @property
    def verdict(self) -> str:
        if self.mode == "greedy":
            if not self.greedy:
                return INCONCLUSIVE  # interrupted before the first prompt
            return LOSSLESS if all(g.identical or g.near_tie for g in self.greedy) else NOT_LOSSLESS
        if not all(p.passed for p in self.positions):
            return NOT_LOSSLESS
        return INCONCLUSIVE if self.underpowered else LOSSLESS

    @property
    def lossless(self) -> bool:
        return self.verdict == LOSSLESS

    @property
    def impossible(self) -> list[PositionCheck]:
        """The positions where SSp drew a token the target cannot make: each fails the verdict by itself."""
        return [c for c in self.positions if c.impossible_draws]

    @property
    def identical_share(self) -> float:
        return sum(g.identical for g in self.greedy) / len(self.greedy) if self.greedy else float("nan")


@torch.inference_mode()
def next_token_law(model: LoadedModel, ids: torch.Tensor, params: SamplingParams, vocab: int,
                   target: LoadedModel | None = None, prompt_length: int = 0) -> torch.Tensor:
    """The warped law of the token after ``ids``; a draft's (``target`` given: a feature head reads its features).
    With ``prompt_length``, computed the way RSp computes it: the prompt but its last token prefilled, then one token
    per forward (a model with int8 activations, ``q4_1``, gives slightly other logits in a forward of many tokens
    through other kernels, and the law must be the one the completions were drawn from)."""
    if target is not None:  # a draft's law over the target's width: 0 beyond its own logits
        logits = draft_logits(target.model, model.model, ids.to(target.device))[0, :vocab].float()
        full = torch.full((vocab,), float("-inf"), device=logits.device)
        full[:logits.shape[-1]] = logits
        return warp(full, params).cpu()
    ids = ids.to(model.device)
    kv = new_cache(model.model)
    start = max(1, min(prompt_length, ids.shape[1]))
    if start > 1:
        feed(model.model, ids[:, :start - 1], kv)
    for i in range(start - 1, ids.shape[1] - 1):
        feed(model.model, ids[:, i:i + 1], kv)
    logits = forward_logits(model.model, ids[:, -1:], kv, 1)[0, :vocab]
    return warp(logits.float(), params).cpu()


def _tv_null(p: torch.Tensor, n: int, generator: torch.Generator, reps: int = 200) -> tuple[float, float]:
    """Mean and sd of TV(empirical, p) for n exact draws from p: the distance noise alone gives."""
    draws = torch.multinomial(p.double(), n * reps, replacement=True, generator=generator).view(reps, n)
    freq = torch.zeros(reps, p.numel(), dtype=torch.float64).scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64)) / n
    tv = 0.5 * (freq - p.double()).abs().sum(-1)
    return float(tv.mean()), float(tv.std())


def batches_runs(engine: Engine, mode: Mode) -> bool:
    """Whether ``engine`` runs several completions of ``mode`` in one batch, each row as it would run alone with its
    seed (``Engine.batch_reason``)."""
    return engine.batch_reason(mode) is None


def _samples(engine: Engine, mode: Mode, ids: torch.Tensor, runs: int, tokens: int, params: SamplingParams,
             seeds: int, progress: Progress | None, what: str, batch: int = BATCH) -> tuple[list[list[int]], list[Any]]:
    """``runs`` completions of ``tokens`` tokens, seeded ``seeds``, ``seeds + 1``, …: their tokens and stats. Where
    the engine batches ``mode`` (``batches_runs``), ``batch`` runs at a time, rows of the same prompt each with its
    own seed: the samples of the runs one at a time (up to the order of floating-point sums in batched kernels)."""
    size = max(1, batch) if batches_runs(engine, mode) else 1
    outputs, stats = [], []
    for start in range(0, runs, size):
        seeds_now = [seeds + run for run in range(start, min(runs, start + size))]
        request = Request(ids, tokens, params, seeds_now[0])
        outs = ([engine.complete(mode, request)] if size == 1 else
                engine.complete_many(mode, ids.repeat(len(seeds_now), 1), request, seeds_now))
        for out in outs:
            outputs.append(out.tokens.tolist())
            stats.append(out.stats)
            if progress and len(outputs) % 50 == 0:
                progress(f"{what}: {len(outputs)}/{runs} {mode_name(mode.mode)} runs")
    return outputs, stats


def _check(index: int, position: int, prefix: list[int], kept: list[int], p: torch.Tensor, q: torch.Tensor,
           null_gen: torch.Generator, rsp_kept: list[int] | None) -> PositionCheck:
    """One position's tests: SSp's tokens against the exact law ``p``, and against the engine's own RSp tokens."""
    drawn = Counter(kept)
    impossible = sorted(t for t in drawn if t >= p.numel() or not p[t] > 0)  # outside top-k/top-p or the vocabulary
    counts = Counter({t: c for t, c in drawn.items() if t < p.numel()})
    support = sorted(set(torch.nonzero(p > 0).flatten().tolist()) | set(counts))
    chi = chi_square_gof([counts.get(t, 0) for t in support], p[support].tolist())
    freq = torch.zeros_like(p, dtype=torch.float64)
    for token, c in counts.items():
        freq[token] = c / len(kept)
    null_mean, null_sd = _tv_null(p, len(kept), null_gen)
    check = PositionCheck(index, position, list(prefix), len(kept), chi.p_value, chi.cells,
                          float(0.5 * (freq - p.double()).abs().sum()), null_mean, null_sd, float(torch.minimum(p, q).sum()),
                          impossible_draws=sum(drawn[t] for t in impossible), impossible_tokens=impossible)
    if rsp_kept is not None and len(rsp_kept) >= MIN_SAMPLES:
        two = chi_square_homogeneity(kept, rsp_kept)
        check.rsp_samples, check.two_sample_p, check.two_sample_cells = len(rsp_kept), two.p_value, two.cells
    return check


def _power(check: PositionCheck, runs: int, effect: float, alpha: float, exact_law_counts: bool) -> None:
    """The check's power against ``effect`` (its weaker deciding test) and, short of POWER, the SSp runs per prompt
    that would give it: a position reached by a share s of the runs needs the test's sample size ÷ s."""
    tests = []  # (effective sample size, degrees of freedom, SSp samples per unit of effective size)
    if exact_law_counts:
        tests.append((check.samples, check.chi2_cells - 1, 1.0))
    if check.two_sample_p == check.two_sample_p:
        tests.append((check.samples * check.rsp_samples / (check.samples + check.rsp_samples),
                      check.two_sample_cells - 1, 2.0))
    if not tests:
        return
    check.power = min(chi_square_power(n, dof, effect, alpha) for n, dof, _ in tests)
    if check.power < POWER:
        share = check.samples / runs
        check.runs_needed = max(math.ceil(chi_square_samples_needed(dof, effect, alpha) * per / share)
                                for _, dof, per in tests)


def _assess_power(report: VerifyReport, prompts: int, runs: int, depth: int, unreached: list[int]) -> None:
    """INCONCLUSIVE unless every prompt's position 0 and at least one later position have POWER; ``unreached``:
    how many of the runs reached each later position that was skipped (too few to test)."""
    for check in report.positions:
        _power(check, runs, report.effect, report.threshold, report.exact_law_counts)
    if not report.positions:
        report.underpowered.append("nothing was tested")
    needed = []
    for index in range(prompts):
        first = next((c for c in report.positions if c.prompt_index == index and c.position == 0), None)
        if first is not None and first.power < POWER:
            report.underpowered.append(f"prompt {index + 1} position 0 has power {first.power:.2f}")
            needed.append(first.runs_needed)
    later = [c for c in report.positions if c.position > 0]
    if depth > 1 and not any(c.power >= POWER for c in later):
        report.underpowered.append("no later position (bonus token, residual draw, rollback) has power "
                                   f"{POWER:.0%}" + (f" (best {max(c.power for c in later):.2f})" if later else ""))
        at_best = chi_square_samples_needed(1, report.effect, report.threshold)  # one degree of freedom
        per = 1 if report.exact_law_counts else 2  # a two-sample test needs about twice the samples
        options = [c.runs_needed for c in later if c.runs_needed] + [math.ceil(max(MIN_SAMPLES, per * at_best) * runs / n)
                                                                     for n in unreached]
        if options:
            needed.append(min(options))
    report.runs_needed = max(needed, default=0)


def samples_needed_upfront(prompts: int, depth: int, two_sample: bool, exact_law_counts: bool, effect: float,
                           significance: float) -> int:
    """The fewest SSp runs per prompt with which position 0 (reached by every run) can have POWER against
    ``effect``, at best (one degree of freedom): fewer cannot give a LOSSLESS verdict."""
    tests = prompts * depth * (exact_law_counts + two_sample)
    n = chi_square_samples_needed(1, effect, significance / max(1, tests))
    return max(MIN_SAMPLES, 2 * n if two_sample and not exact_law_counts else n)


def seconds_per_run(engine: Engine, mode: Mode, ids: torch.Tensor, tokens: int, params: SamplingParams, seed: int,
                    batch: int = BATCH) -> float:
    """Wall seconds per completion of ``mode`` as an audit runs them (``batch`` at a time where the engine batches
    ``mode``): a pilot of up to 16 runs (2 where one runs at a time), after one untimed run."""
    runs = min(max(1, batch), 16) if batches_runs(engine, mode) else 2
    _samples(engine, mode, ids, 1, tokens, params, seed, None, "pilot", batch)
    start = time.perf_counter()
    _samples(engine, mode, ids, runs, tokens, params, seed + 1, None, "pilot", batch)
    return (time.perf_counter() - start) / runs


def verify_sampled(
    target: LoadedModel, draft: LoadedModel, prompts: Sequence[str], params: SamplingParams, k: int, samples: int,
    depth: int, seed: int, vocab: int, significance: float = 0.01, progress: Progress | None = None, lookup: int = 0,
    engine: Engine | None = None, two_sample: bool = False, effect: float = EFFECT, batch: int = BATCH,
) -> VerifyReport:
    """Chi-square and TV checks of SSp's emitted tokens at positions 0..depth-1 against the exact law computed from
    our ``target`` (and ``draft``, for α); the runs go through ``engine`` (ours by default). ``two_sample`` also draws
    as many RSp runs from the engine and tests SSp's tokens against them (independent of the engine's rounding). An
    engine that computes with weights of its own (vLLM) always gets the two-sample test, and its verdict rests on
    it: the exact-law test is then reported, as a reference, not counted. The runs of a prompt go ``batch`` at a
    time where the engine batches them (``_samples``): the same samples, seed for seed."""
    engine = engine or OursEngine(target, [draft], [vocab])
    two_sample = two_sample or not engine.runs_our_weights
    # A sequential look after each prompt: a test that already fails at the level of every test the run could make
    # (Bonferroni over all prompts, positions and tests: the error rate holds however often it looks) decides.
    planned = significance / max(1, len(prompts) * depth * (engine.runs_our_weights + two_sample))
    ssp, rsp = engine.ssp_mode(engine.name, k, lookup), Mode("rsp", engine=engine.name)
    report = VerifyReport("sampled", significance, "Bonferroni", lookup=ssp.lookup, engine=engine.name, k=k,
                          effect=effect, ngram=ssp.ngram)
    null_gen = torch.Generator().manual_seed(seed)
    drafted = accepted = 0
    unreached: list[int] = []  # per later position skipped: how many runs reached it
    for index, text in enumerate(prompts):
        ids = target.encode(text)
        what = f"{engine.name} K={k}, prompt {index + 1}/{len(prompts)}"
        try:
            outputs, stats = _samples(engine, ssp, ids, samples, depth + k, params,
                                      request_seed(seed, index * 100_003), progress, what, batch)
            rsp_outputs = _samples(engine, rsp, ids, samples, depth, params, request_seed(seed + 1, index * 100_003),
                                   progress, what, batch)[0] if two_sample else None
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the prompts done are tested, this one is dropped
            report.interrupted = True
            break
        report.prompts_done += 1
        report.looked_up += sum(s.looked_up for s in stats)
        drafted += sum(s.drafted for s in stats)
        accepted += sum(s.accepted for s in stats)
        prefix: list[int] = []
        for position in range(depth):
            context = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], 1) if prefix else ids
            kept = [o[position] for o in outputs if len(o) > position and o[:position] == prefix]
            rsp_kept = [o[position] for o in rsp_outputs if len(o) > position and o[:position] == prefix] \
                if rsp_outputs is not None else None
            if len(kept) >= MIN_SAMPLES:
                p = next_token_law(target, context, params, vocab, prompt_length=ids.shape[1])
                q = next_token_law(draft, context, params, vocab, target)
                report.positions.append(_check(index, position, prefix, kept, p, q, null_gen, rsp_kept))
            else:
                report.skipped.append(f"prompt {index + 1} position {position}: only {len(kept)} runs share the prefix")
                if position and kept:
                    unreached.append(len(kept))
            if not kept:
                break
            prefix.append(Counter(kept).most_common(1)[0][0])  # condition deeper on the commonest emitted token
        decided = [c for c in report.positions if c.prompt_index == index and (
            c.impossible_draws or c.two_sample_p <= planned or (engine.runs_our_weights and c.chi2_p_value <= planned))]
        if decided and index + 1 < len(prompts):
            c = decided[0]
            report.stopped_early = (f"prompt {index + 1} of {len(prompts)}, position {c.position}, already fails at "
                                    f"p < {planned:.2g} (the level of every test the run could make): the other "
                                    f"{len(prompts) - index - 1} prompt(s) were not run")
            break
    report.exact_law_counts = engine.runs_our_weights
    report.correction = f"Bonferroni over {report.tests} tests"
    for check in report.positions:
        law_ok = check.chi2_p_value > report.threshold or not report.exact_law_counts
        check.passed = law_ok and not check.two_sample_p <= report.threshold and not check.impossible_draws
    _assess_power(report, report.prompts_done, samples, depth, unreached)
    report.acceptance_rate = accepted / drafted if drafted else float("nan")
    return report


def verify_greedy(
    target: LoadedModel, draft: LoadedModel, prompts: Sequence[str], k: int, max_new_tokens: int, vocab: int,
    tie_tolerance: float, progress: Progress | None = None, lookup: int = 0, engine: Engine | None = None,
) -> VerifyReport:
    """SSp and RSp continuations (through ``engine``, ours by default) must match token for token, except at
    numerical near-ties. Another engine's RSp is also compared with ours (equal where the arithmetic is)."""
    ours = OursEngine(target, [draft], [vocab])
    engine = engine or ours
    params = SamplingParams(temperature=0)
    mode = engine.ssp_mode(engine.name, k, lookup)
    report = VerifyReport("greedy", 0.0, "none (deterministic)", tie_tolerance=tie_tolerance, lookup=mode.lookup,
                          engine=engine.name, k=k, ngram=mode.ngram)
    drafted = accepted = 0
    for index, text in enumerate(prompts):
        ids = target.encode(text)
        request = Request(ids, max_new_tokens, params, seed=0)
        try:
            rsp = engine.complete(Mode("rsp", engine=engine.name), request).tokens.tolist()
            out = engine.complete(mode, request)
        except KeyboardInterrupt:  # the prompts done keep their checks
            report.interrupted = True
            break
        report.prompts_done += 1
        ssp = out.tokens.tolist()
        report.looked_up += out.stats.looked_up
        drafted += out.stats.drafted
        accepted += out.stats.accepted
        same_as_ours = None if engine is ours else rsp == ours.complete(Mode("rsp"), request).tokens.tolist()
        if rsp == ssp:
            report.greedy.append(GreedyCheck(index, True, same_as_ours=same_as_ours))
        else:
            at = next(i for i, (a, b) in enumerate(zip(rsp, ssp)) if a != b)
            context = torch.cat([ids, torch.tensor([rsp[:at]], dtype=torch.long)], 1)
            with torch.inference_mode():
                raw = forward_logits(target.model, context.to(target.device), new_cache(target.model), 1)[0, :vocab]
            top2 = raw.float().topk(2).values
            gap = float(top2[0] - top2[1])
            # Two units in the last place of the logits' dtype at this magnitude are a rounding tie too.
            rounding = 2 * torch.finfo(raw.dtype).eps * float(top2[0].abs())
            report.greedy.append(GreedyCheck(index, False, at, gap, gap <= max(tie_tolerance, rounding), same_as_ours))
        if progress:
            progress(f"{engine.name} K={k}, prompt {index + 1}/{len(prompts)}")
    report.acceptance_rate = accepted / drafted if drafted else float("nan")
    return report
