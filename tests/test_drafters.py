"""Every drafter through the same exactness tests: greedy SSp equals greedy RSp, and sampled SSp's first two tokens
follow the target's exact law (chi-square), for the draft model, the feature head, the n-gram drafter and the
policies over them; a drafter that misreports its q must fail the same test. Every drafter's law is drawn in one
batched loop (2,000 seeded rows, whose tokens equal single completions': tests/test_batched.py); the single-request
loop draws the draft model's and the feature head's law under transformers' forward, and every planted bug under the
compact forward (the same logits, less overhead), one completion at a time."""
from __future__ import annotations

import pytest
import torch
from conftest import random_head, tiny_llama

from lssp.decoding import sampling, verification
from lssp.decoding.batched import speculative_decode_batch
from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams, inverse_cdf, on_kernel, warp
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import ConfidenceStop, CopyFirst, DraftModel, FeatureHead, LookupHint, NgramDrafter, Picker, Proposal
from lssp.drafters.base import DrafterWrapper
from lssp.drafters.model import draft_logits
from lssp.models.compact import CompactLlama
from lssp.models.eagle import FeatureDraft
from lssp.report.stats import chi_square_gof

VOCAB, RUNS, SIGNIFICANCE = 8, 2000, 0.001
GREEDY = SamplingParams(0)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(40, vocab_size=VOCAB, hidden=16, layers=1, scale=3.0)
    return target, tiny_llama(41, vocab_size=VOCAB, hidden=16, layers=1, scale=3.0), \
        FeatureDraft(random_head(target, 42, scale=2.0), target)


DRAFTERS = {  # name: how to build it from (draft model, feature head)
    "draft-model": lambda draft, head: DraftModel(draft),
    "feature-head": lambda draft, head: FeatureHead(head),
    "lookup(draft-model)": lambda draft, head: DraftModel(draft, [LookupHint(1)]),
    "lookup(feature-head)": lambda draft, head: FeatureHead(head, [LookupHint(1)]),
    "confidence(draft-model)": lambda draft, head: DraftModel(draft, [ConfidenceStop(0.3)]),
    "confidence(lookup(feature-head))": lambda draft, head: FeatureHead(head, [LookupHint(1), ConfidenceStop(0.3)]),
    "n-gram": lambda draft, head: NgramDrafter(1),
    "copy-first(draft-model)": lambda draft, head: CopyFirst(DraftModel(draft), 1),
    "copy-first(confidence(feature-head))": lambda draft, head: CopyFirst(FeatureHead(head, [ConfidenceStop(0.3)]), 1),
    "copy-first(feature-head), chains past K": lambda draft, head: CopyFirst(FeatureHead(head), 1, chain=5),
    "copy-first(draft-model), tails of 2 then 1": lambda draft, head: CopyFirst(DraftModel(draft), 2, 3, shortest=1),
}


def _exact_law(model, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], params)
        rows = [warp(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1], params) for x in range(VOCAB)]
    return (p1[:, None] * torch.stack(rows)).flatten()


def _two_token_counts(target, make, params: SamplingParams, prompt: torch.Tensor, k: int = 2,
                      batched: bool = False) -> list[int]:
    """The first two tokens of many SSp runs (seeds 0, 1, …), one completion at a time (``speculative_decode``), or
    with ``batched`` in one batched loop where the drafter batches (``speculative_decode_batch``, whose seeded rows
    equal single completions token for token: tests/test_batched.py). At K=2 they are drafts or residual draws; at
    K=1 the second token is the bonus wherever the first draft passed."""
    generators = [torch.Generator().manual_seed(seed) for seed in range(RUNS)]
    if batched and make().rows_reason(target) is None:
        outs = speculative_decode_batch(target, make(), [prompt] * RUNS, 3, k, params, generators)
    else:
        outs = [speculative_decode(target, make(), prompt, 3, k, params, g) for g in generators]
    counts = [0] * VOCAB * VOCAB
    for out in outs:
        first, second = out.tokens[:2].tolist()
        counts[first * VOCAB + second] += 1
    return counts


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_keeps_greedy_ssp_equal_to_greedy_rsp(models, name):
    target, draft, head = models
    for prompt in ([0, 5, 3, 1], [2, 2, 2, 2, 2, 7], [4]):
        ids = torch.tensor([prompt])
        want = generate_regular(target, ids, 20, GREEDY).tokens
        for k in (1, 3):
            assert torch.equal(speculative_decode(target, DRAFTERS[name](draft, head), ids, 20, k, GREEDY).tokens, want)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2], ids=["K=1 (bonus)", "K=2"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_keeps_the_target_law(models, name, k):
    target, draft, head = models
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    counts = _two_token_counts(CompactLlama(target), lambda: DRAFTERS[name](draft, head), params, prompt, k,
                               batched=True)  # the compact forward: the target's logits, feature heads batched too
    assert chi_square_gof(counts, _exact_law(target, prompt, params).tolist()).p_value > SIGNIFICANCE


class UniformQ(DrafterWrapper):
    """A planted bug: proposes the inner drafter's tokens but reports a uniform q to the verification."""

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        proposal = self.inner.propose(seq, picker)
        proposal.q = torch.full_like(proposal.q, 1 / VOCAB)
        return proposal


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft-model", "feature-head"])
def test_the_law_test_catches_a_drafter_that_misreports_q(models, name):
    target, draft, head = models
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    counts = _two_token_counts(CompactLlama(target), lambda: UniformQ(DRAFTERS[name](CompactLlama(draft), head)), params,
                               prompt)
    assert chi_square_gof(counts, _exact_law(target, prompt, params).tolist()).p_value < SIGNIFICANCE


def test_policies_report_what_they_did(models):
    target, draft, _ = models
    ids = torch.tensor([[2, 3, 2, 3, 2, 3, 2]])
    looked = speculative_decode(target, DraftModel(draft, [LookupHint(2)]), ids, 30, 3, SamplingParams(1.0),
                                torch.Generator().manual_seed(0)).stats
    plain = speculative_decode(target, DraftModel(draft), ids, 30, 3, GREEDY).stats
    stopped = speculative_decode(target, DraftModel(draft, [ConfidenceStop(0.9)]), ids, 30, 3, GREEDY).stats
    assert looked.looked_up > 0 and plain.looked_up == 0
    assert stopped.drafted < plain.drafted  # K became a maximum


def test_the_ngram_drafter_proposes_the_texts_own_continuations_and_nothing_where_the_ngram_is_new(models):
    target, _, _ = models
    ids = torch.tensor([[2, 3, 2, 3, 2, 3, 2]])
    stats = speculative_decode(target, NgramDrafter(2), ids, 20, 3, GREEDY).stats
    assert stats.drafted > 0 and stats.draft_forwards == stats.drafted  # no model: drafts are lookups alone
    new = speculative_decode(target, NgramDrafter(2), torch.tensor([[1, 2]]), 1, 3, GREEDY).stats
    assert new.drafted == 0


class Recorded(CopyFirst):
    """CopyFirst that records, per iteration, whether it copied, the text and the proposal."""

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        proposal = super().propose(seq, picker)
        self.choices = [*getattr(self, "choices", []), (self.copied, seq.clone(), proposal)]
        return proposal


@pytest.mark.parametrize("inner", ["draft-model", "feature-head"])
def test_copy_first_copies_where_the_ngram_recurs_and_its_draft_catches_up_elsewhere(models, inner):
    """After iterations it did not draft, the draft's first q is the one it computes from scratch for the text."""
    target, draft, head = models
    params = SamplingParams(1.0)
    switches = 0
    for seed in range(4):
        drafter = Recorded(DRAFTERS[inner](draft, head), 1)
        speculative_decode(target, drafter, torch.tensor([[1, 2, 3, 1, 2]]), 30, 2, params,
                           torch.Generator().manual_seed(seed))
        copied = [c for c, _, p in drafter.choices if len(p)]
        assert any(copied) and not all(copied)
        for (before, _, _), (now, seq, proposal) in zip(drafter.choices, drafter.choices[1:]):
            if before and not now and len(proposal):  # the draft's turn after a copy: it caught up
                switches += 1
                with torch.inference_mode():
                    want = warp(draft_logits(target, draft if inner == "draft-model" else head, seq)[0], params)
                assert torch.allclose(proposal.q[0], want, atol=1e-5)
    assert switches >= 3


def test_copied_chains_run_up_to_their_own_length_and_the_draft_to_k(models):
    target, draft, head = models
    drafter = Recorded(FeatureHead(head), 1, chain=6)
    out = speculative_decode(target, drafter, torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1]]), 40, 2, GREEDY)
    lengths = {copied: max(len(p) for c, _, p in drafter.choices if c == copied) for copied in (True, False)}
    assert lengths[False] <= 2 < lengths[True] <= 6
    assert len(out.stats.drafted_at) == 6 and sum(out.stats.drafted_at[2:]) > 0  # counted at every position


def _planted(law):
    """sampled_verification with the token after the drafts drawn from ``law(p, q, n, k)``."""
    def verify(p, q, drafts, accept_u, next_u):
        k = drafts.shape[0]
        n = verification.accepted_prefix(p, q, drafts, accept_u)
        return n, inverse_cdf(law(p, q, n, k), next_u).reshape(())
    return verify


PLANTED = {
    "bonus from p at the last draft's position": lambda p, q, n, k: (
        verification.residual_distribution(p[n], q[n]) if n < k else p[k - 1]),
    "bonus from the draft's q": lambda p, q, n, k: (
        verification.residual_distribution(p[n], q[n]) if n < k else q[k - 1] if k else p[0]),
    "residual from q - p": lambda p, q, n, k: (
        verification.residual_distribution(q[n], p[n]) if n < k else p[k]),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", PLANTED)
@pytest.mark.parametrize("name", ["draft-model", "feature-head"])
def test_the_law_test_at_k1_catches_planted_bonus_and_residual_bugs(models, name, bug, monkeypatch):
    target, draft, head = models
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "sampled_verification", _planted(PLANTED[bug]))
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    counts = _two_token_counts(CompactLlama(target), lambda: DRAFTERS[name](CompactLlama(draft), head), params, prompt,
                               k=1, batched=True)  # the batched loop verifies through the same function
    assert chi_square_gof(counts, _exact_law(target, prompt, params).tolist()).p_value < SIGNIFICANCE


@pytest.mark.skipif(not on_kernel(torch.zeros(1)), reason="our CPU kernel does not run on this CPU")
def test_warp_on_a_cpu_is_the_kernels_softmax_torchs_up_to_rounding():
    """At a temperature alone (no top-k or top-p) ``warp`` is ``softmax_rows`` (the softmax the kernel's drafting
    chain draws by): torch's softmax up to float32 rounding, a -inf logit's probability exactly 0."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, :7] = float("-inf")
    for temperature in (0.3, 0.7, 1.0, 2.5):
        probs = warp(logits, SamplingParams(temperature))
        assert torch.equal(probs, torch.ops.lssp.softmax_rows(logits, temperature))
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1), rtol=2e-5, atol=1e-8)
        assert not probs[:, :7].any()


@pytest.mark.skipif(not on_kernel(torch.zeros(1)), reason="our CPU kernel does not run on this CPU")
def test_the_kernels_draw_picks_the_tokens_torchs_inverse_cdf_picks(monkeypatch):
    """``draw_from`` (float64 sums by blocks, then a scan) picks the token torch's float64 cumsum and searchsorted
    pick, never a zero-probability one, over rows wider and narrower than its blocks; from a residual too."""
    gen = torch.Generator().manual_seed(1)
    cases = []
    for trial in range(300):
        width = (40, 1000, 49152)[trial % 3]
        probs = torch.softmax(torch.randn(width, generator=gen) * 4, -1)
        probs[torch.rand(width, generator=gen) < 0.3] = 0.0
        cases.append((probs, torch.rand(1, 1, dtype=torch.float64, generator=gen)))
    kernel = [int(inverse_cdf(probs, u)) for probs, u in cases]
    minus = [torch.ops.lssp.draw_from(probs, probs.flip(0), float(u)) for probs, u in cases]
    monkeypatch.setattr(sampling, "on_kernel", lambda t: False)
    assert kernel == [int(inverse_cdf(probs, u)) for probs, u in cases]
    assert all(probs[token] > 0 for (probs, _), token in zip(cases, kernel))
    residuals = [verification.residual_distribution(probs, probs.flip(0)) for probs, _ in cases]
    assert minus == [int(inverse_cdf(law, u)) for law, (_, u) in zip(residuals, cases)]


@pytest.mark.skipif(not on_kernel(torch.zeros(1)), reason="our CPU kernel does not run on this CPU")
def test_the_kernels_verification_in_one_call_is_the_rule_step_by_step():
    """``verify_sampled`` (softmax, acceptance tests and the draw in one call) gives the (n, token) the rule gives
    step by step over the kernel's softmax and draws, at k 0 to 4, rejections, full acceptances and a bonus; and
    ``verify_greedy`` the argmax rule's, ties and NaN included."""
    gen = torch.Generator().manual_seed(3)
    outcomes = set()
    for trial in range(240):
        k, width, temperature = trial % 5, (40, 1000, 49152)[trial % 3], (0.3, 0.7, 1.0, 2.0)[trial % 4]
        logits = torch.randn(k + 1, width, generator=gen) * 3
        q = torch.softmax(torch.randn(k, width, generator=gen) * 3, -1)
        # drafts the target likes often enough that some runs pass whole
        drafts = torch.where(torch.rand(k, generator=gen) < 0.7, logits[:k].argmax(-1),
                             torch.randint(width, (k,), generator=gen))
        accept_u, next_u = verification.draw_uniforms(k, torch.device("cpu"), gen)
        got = verification.tempered_verification(logits, temperature, q, drafts, accept_u, next_u)
        want = verification.sampled_verification(warp(logits, SamplingParams(temperature)), q, drafts, accept_u, next_u)
        assert (got[0], int(got[1])) == (want[0], int(want[1]))
        outcomes.add("all" if got[0] == k else "rejected")
        logits[:, :3] = logits[:, 3:6]  # ties: the first maximum
        if trial % 7 == 0:
            logits[trial % (k + 1), 5] = float("nan")  # NumPy's argmax: the NaN
        greedy, rule = verification.greedy_verification(logits, drafts), verification.greedy_rule(logits, drafts)
        assert (greedy[0], int(greedy[1])) == (rule[0], int(rule[1]))
    assert outcomes == {"all", "rejected"}
    nan, inf = float("nan"), float("inf")
    for row in ([1.0], [-inf, -inf, -inf], [-0.0, 0.0, 0.0], [0.0] * 17 + [nan], [2.0] + [1.0] * 30 + [2.0, nan],
                [-inf] * 20 + [3.0] + [-inf] * 11, [nan] + [5.0] * 40, list(range(33)) + [32.0]):
        logits = torch.tensor([row])
        assert torch.ops.lssp.verify_greedy(logits, torch.empty(0, dtype=torch.long)) == (0, int(logits.numpy().argmax()))


class DraftsAtTemperatureOne(DrafterWrapper):
    """A planted bug (z-lab/dflash#74): the draft samples at T=1 whatever the request asks, while the verification
    is told the law at the request's temperature."""

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        asked, picker.params = picker.params, SamplingParams(1.0)
        try:
            proposal = self.inner.propose(seq, picker)
        finally:
            picker.params = asked
        proposal.q = warp(proposal.q.log(), asked)  # the law the verification believes the drafts came from
        return proposal


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft-model", "feature-head"])
def test_the_law_test_catches_a_draft_sampler_that_ignores_temperature(models, name):
    target, draft, head = models
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(0.5)
    right = _two_token_counts(CompactLlama(target), lambda: DRAFTERS[name](draft, head), params, prompt, batched=True)
    assert chi_square_gof(right, _exact_law(target, prompt, params).tolist()).p_value > SIGNIFICANCE
    counts = _two_token_counts(CompactLlama(target), lambda: DraftsAtTemperatureOne(DRAFTERS[name](CompactLlama(draft),
                                                                                                   head)), params, prompt)
    assert chi_square_gof(counts, _exact_law(target, prompt, params).tolist()).p_value < SIGNIFICANCE
