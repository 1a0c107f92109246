"""`verify` catches broken verifiers on tiny models (the `plot` tests are in test_plot.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import char_tokenizer, tiny_llama

import lssp.decoding.verification as verification
from lssp.decoding.sampling import SamplingParams, inverse_cdf
from lssp.engines import OursEngine, TransformersEngine
from lssp.measure.verify import verify_greedy, verify_sampled
from lssp.models.loading import LoadedModel
from lssp.models.registry import ModelSpec

PROMPTS = ["ab", "hello", "12 * 3"]


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    target = LoadedModel(ModelSpec("t"), tiny_llama(30, vocab_size=64, scale=12.0), tok)
    draft = LoadedModel(ModelSpec("d"), tiny_llama(31, vocab_size=64, hidden=16, layers=1, scale=12.0), tok)
    return target, draft


def sampled(pair, samples: int = 500, **kw):
    target, draft = pair
    return verify_sampled(target, draft, PROMPTS[:2], SamplingParams(1.0), k=3, samples=samples, depth=2, seed=0,
                          vocab=64, **kw)


@pytest.mark.slow
def test_verify_passes_the_real_speculative_sampler(pair):
    rep = sampled(pair)
    assert rep.lossless
    assert {c.position for c in rep.positions} == {0, 1}  # a deeper position was tested too
    assert all(c.samples >= 20 and 0 <= c.exact_alpha <= 1 for c in rep.positions)
    assert all(c.tv < c.tv_null_mean + 5 * c.tv_null_sd for c in rep.positions)
    assert rep.threshold == pytest.approx(0.01 / len(rep.positions))


@pytest.mark.slow
def test_verify_fails_an_always_accept_verifier(pair, monkeypatch):
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "accepted_prefix", lambda p, q, drafts, gen: drafts.shape[0])
    rep = sampled(pair)
    assert not rep.lossless
    assert min(c.chi2_p_value for c in rep.positions) < rep.threshold


@pytest.mark.slow
def test_verify_fails_a_residual_without_max0(pair, monkeypatch):
    # Without max(0, .) the replacement token can only be drawn from p itself (clamping is what removes q's mass).
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "residual_draw", lambda p, q, u: inverse_cdf(p, u))
    assert not sampled(pair).lossless


def test_greedy_report_identical_and_planted_divergence(pair, monkeypatch):
    target, draft = pair
    rep = verify_greedy(target, draft, PROMPTS, k=3, max_new_tokens=20, vocab=64, tie_tolerance=1e-3)
    assert rep.lossless and rep.identical_share == 1.0
    # Plant a bug: after a rejection, emit the draft's token instead of the target's.
    def wrong_token(logits, drafts):
        n, extra = real(logits, drafts)
        return n, drafts[n] if n < drafts.shape[0] else extra

    real = verification.greedy_verification
    monkeypatch.setattr(verification, "greedy_verification", wrong_token)
    rep = verify_greedy(target, draft, PROMPTS, k=3, max_new_tokens=20, vocab=64, tie_tolerance=1e-3)
    assert not rep.lossless and rep.identical_share < 1.0
    bad = [g for g in rep.greedy if not g.identical]
    assert all(g.first_difference is not None and g.top2_gap > 1e-3 and not g.near_tie for g in bad)


class IgnoresTemperature(OursEngine):
    """A planted engine bug: SSp samples at T=1 whatever the request asks."""

    def complete(self, mode, request):
        if mode.mode == "ssp":
            request = replace(request, params=SamplingParams(1.0))
        return super().complete(mode, request)


@pytest.mark.slow
def test_verify_audits_transformers_and_catches_an_engine_that_ignores_temperature(pair):
    target, draft = pair
    params = SamplingParams(0.5)
    hf = verify_sampled(target, draft, PROMPTS[:1], params, k=2, samples=300, depth=1, seed=0, vocab=64,
                        engine=TransformersEngine(target, draft), two_sample=True)
    assert hf.engine == "hf" and hf.lossless and all(c.two_sample_p == c.two_sample_p for c in hf.positions)
    broken = verify_sampled(target, draft, PROMPTS[:1], params, k=2, samples=300, depth=1, seed=0, vocab=64,
                            engine=IgnoresTemperature(target, [draft], [64]), two_sample=True)
    assert not broken.lossless
    assert all(c.chi2_p_value < broken.threshold and c.two_sample_p < broken.threshold for c in broken.positions)
    greedy = verify_greedy(target, draft, PROMPTS, 3, 16, 64, 1e-3, engine=TransformersEngine(target, draft))
    assert greedy.engine == "hf" and greedy.identical_share == 1.0
    assert all(g.same_as_ours for g in greedy.greedy)  # the same fp32 arithmetic: transformers' RSp equals ours


def test_too_few_runs_make_the_verdict_inconclusive_with_the_runs_that_would_do(pair):
    few = sampled(pair, samples=60)
    assert all(c.passed for c in few.positions) and few.verdict == "inconclusive" and not few.lossless
    assert few.underpowered and few.runs_needed > 60
    assert all(c.power < 0.8 and c.runs_needed for c in few.positions if c.power == c.power and c.power < 0.8)
    # A failed test fails the verdict whatever the power.
    assert replace(few, positions=[replace(few.positions[0], passed=False)]).verdict == "not lossless"
    # Following its advice (an estimate: a deeper position's share of the runs and its cells move with the runs)
    # reaches a conclusive verdict within two reruns.
    rerun = sampled(pair, samples=few.runs_needed)
    if rerun.verdict == "inconclusive":
        assert rerun.runs_needed > few.runs_needed
        rerun = sampled(pair, samples=rerun.runs_needed)
    assert rerun.verdict == "lossless", rerun.underpowered


def test_chi_square_power_and_samples_needed():
    from lssp.report.stats import chi_square_power, chi_square_samples_needed

    assert chi_square_power(0, 3, 0.5, 0.01) == 0.0
    assert chi_square_power(50, 3, 0.5, 0.01) < chi_square_power(100, 3, 0.5, 0.01) < chi_square_power(100, 1, 0.5, 0.01)
    n = chi_square_samples_needed(4, 0.3, 0.001)
    assert chi_square_power(n, 4, 0.3, 0.001) >= 0.8 > chi_square_power(n - 1, 4, 0.3, 0.001)
    assert 150 < n < 300  # noncentrality ~19 for 4 dof at 0.001 and power 0.8: 19 / 0.09


def test_verify_refuses_too_few_samples_before_loading_anything(run, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("lssp.cli.verify"), "load_pair",
                        lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = run("verify", "--samples", "30", "--nb-prompts", "3")
    assert code == 2 and "--samples 30 is too few" in err and "Traceback" not in err


def test_the_two_sample_test():
    from lssp.report.stats import chi_square_homogeneity

    same = chi_square_homogeneity([1] * 50 + [2] * 50 + [3] * 3, [2] * 50 + [1] * 50 + [4] * 2)
    assert same.p_value > 0.9 and same.cells == 3  # tokens 3 and 4 pooled into the tail
    apart = chi_square_homogeneity([1] * 80 + [2] * 20, [1] * 20 + [2] * 80)
    assert apart.p_value < 1e-10 and apart.dof == 1


class DrawsOnceOutsideTopK(OursEngine):
    """A planted engine bug: of all SSp completions, the first emits ``token`` first, a token top-k excludes."""

    def __init__(self, *args, token: int):
        super().__init__(*args)
        self.token, self.planted = token, False

    def complete_many(self, mode, rows, request, seeds, concurrency=0, arrivals=()):
        outs = super().complete_many(mode, rows, request, seeds, concurrency, arrivals)
        if mode.mode == "ssp" and not self.planted:
            outs[0] = replace(outs[0], tokens=torch.cat([torch.tensor([self.token]), outs[0].tokens[1:]]))
            self.planted = True
        return outs


def test_one_draw_outside_top_k_in_2000_fails_verify_whatever_the_chi_square_says(pair):
    from lssp.measure.verify import next_token_law

    target, draft = pair
    params = SamplingParams(1.0, top_k=4)
    law = next_token_law(target, target.encode(PROMPTS[0]), params, 64, prompt_length=len(PROMPTS[0]))
    outside = int(torch.nonzero(law == 0)[0])
    engine = DrawsOnceOutsideTopK(target, [draft], [64], token=outside)
    rep = verify_sampled(target, draft, PROMPTS[:1], params, k=2, samples=2000, depth=1, seed=0, vocab=64,
                         engine=engine)
    assert engine.planted and rep.verdict == "not lossless"
    [bad] = rep.impossible
    assert (bad.position, bad.impossible_tokens, bad.impossible_draws) == (0, [outside], 1)
    assert bad.chi2_p_value > rep.threshold  # the χ² alone would have let it pass


@pytest.mark.slow
def test_verify_stops_at_the_first_prompt_whose_tests_already_decide(pair):
    """A sequential look after each prompt: a planted bug fails the first prompt at the level of every test the run
    could make, so the other prompts are not run, and the verdict is what it would have been."""
    target, draft = pair
    params = SamplingParams(0.5)
    broken = verify_sampled(target, draft, PROMPTS, params, k=2, samples=300, depth=1, seed=0, vocab=64,
                            engine=IgnoresTemperature(target, [draft], [64]), two_sample=True)
    assert broken.verdict == "not lossless" and broken.prompts_done == 1
    assert broken.stopped_early.startswith("prompt 1 of 3") and "2 prompt(s) were not run" in broken.stopped_early
    fine = verify_sampled(target, draft, PROMPTS, params, k=2, samples=300, depth=1, seed=0, vocab=64)
    assert not fine.stopped_early and fine.prompts_done == 3


def test_verify_sizes_its_runs_to_the_time_budget_and_says_so(run, monkeypatch):
    import lssp.measure.verify

    args = ("verify", "tiny-target", "tiny-draft", "--temperature", "1", "--nb-prompts", "1", "--depth", "1", "--k", "2")
    code, out, err = run(*args, "--time-budget", "60")  # a tiny pair: the default 1000 runs fit an hour
    assert code in (0, 3) and "1000 runs per prompt × 1 prompt, the default, within --time-budget 60 min" in \
        " ".join(err.split()), err
    monkeypatch.setattr(lssp.measure.verify, "seconds_per_run", lambda *args, **kwargs: 0.01)  # a slow machine
    code, out, err = run(*args, "--time-budget", "0.1")  # 6 s: 600 runs of 10 ms
    assert "600 runs per prompt × 1 prompt, the most that fit --time-budget 0.1 min" in " ".join(err.split()), err
    code, out, err = run(*args, "--time-budget", "0.001")  # too short for the power: the fewest that give it
    said = " ".join(err.split())
    assert "runs per prompt × 1 prompt, the fewest that give the tests their power, beyond --time-budget" in said
    code, _, err = run("verify", "--time-budget", "0")
    assert code == 2 and "--time-budget must be above 0 minutes" in err
