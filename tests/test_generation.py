"""The two samplers: KV-cache correctness, greedy equivalence, statistics, losslessness."""
from __future__ import annotations

import itertools

import pytest
import torch

import lssp.generation as generation
from conftest import tiny_llama
from lssp.generation import ContextLookup, Stopping, generate_regular, generate_speculative
from lssp.sampling import SamplingParams, argmax, sample, warp
from lssp.stats import chi_square_gof

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[0, 5, 9, 3], [0, 17], [0, 40, 41, 42, 43, 44, 45, 46], [7]]


def naive_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding that re-runs the whole prefix at every step (no cache)."""
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def soft_target():
    return tiny_llama(10, scale=4.0)


@pytest.fixture(scope="module")
def soft_draft():
    return tiny_llama(11, hidden=16, layers=1, scale=4.0)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cached_regular_sampling_matches_recomputation(soft_target, prompt):
    ids = torch.tensor([prompt])
    out = generate_regular(soft_target, ids, 24, GREEDY)
    assert out.tokens.tolist() == naive_greedy(soft_target, ids, 24)
    assert out.stats.target_forwards == 24 and out.stats.new_tokens == 24


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_greedy_regular(soft_target, soft_draft, k):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = generate_regular(soft_target, ids, 30, GREEDY).tokens.tolist()
        other = generate_speculative(soft_target, soft_draft, ids, 30, k, GREEDY)
        same = generate_speculative(soft_target, soft_target, ids, 30, k, GREEDY)
        assert other.tokens.tolist() == expected
        assert same.tokens.tolist() == expected
        assert same.stats.acceptance_rate == 1.0 and same.stats.rejections == 0 and same.stats.alpha == 1.0
        assert same.stats.target_forwards == -(-30 // (k + 1))  # every iteration emits k + 1


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)])
def test_statistics_are_consistent(soft_target, soft_draft, params):
    for k, n in itertools.product([1, 3, 5], [1, 7, 20]):
        out = generate_speculative(soft_target, soft_draft, torch.tensor([[0, 3, 4]]), n, k, params,
                                   torch.Generator().manual_seed(k * n))
        s = out.stats
        assert len(out.tokens) == n == s.new_tokens
        assert 0 <= s.accepted <= s.drafted
        assert s.new_tokens == s.accepted + s.target_forwards  # nothing trimmed: each forward adds accepted + 1
        assert s.drafted == sum(s.drafted_at) and s.accepted == sum(s.accepted_at)
        assert all(a <= d for a, d in zip(s.accepted_at, s.drafted_at))
        assert s.draft_forwards == s.drafted
        assert s.rejections <= s.target_forwards  # at most one rejection per iteration
        assert s.accepted + s.rejections <= s.drafted
        assert s.total_time_s >= s.target_time_s + s.draft_time_s > 0


def test_sampled_speculative_is_reproducible_with_a_generator(soft_target, soft_draft):
    params = SamplingParams(1.0)
    runs = [generate_speculative(soft_target, soft_draft, torch.tensor([[0, 3]]), 20, 3, params,
                                 torch.Generator().manual_seed(5)).tokens.tolist() for _ in range(2)]
    assert runs[0] == runs[1]


def test_stops_at_a_stop_token_and_reports_it(soft_target, soft_draft):
    ids = torch.tensor([[0, 5, 9, 3]])
    full = generate_regular(soft_target, ids, 30, GREEDY).tokens.tolist()
    stop_id = full[6]
    cut = full.index(stop_id) + 1
    rsp = generate_regular(soft_target, ids, 30, GREEDY, stopping=Stopping(token_ids={stop_id}))
    ssp = generate_speculative(soft_target, soft_draft, ids, 30, 4, GREEDY, stopping=Stopping(token_ids={stop_id}))
    assert rsp.tokens.tolist() == ssp.tokens.tolist() == full[:cut]
    assert rsp.stopped and ssp.stopped


def test_callback_sees_every_token_and_which_were_drafted(soft_target):
    seen: list[tuple[int, bool]] = []
    out = generate_speculative(soft_target, soft_target, torch.tensor([[0, 1]]), 10, 4, GREEDY,
                               on_tokens=lambda toks, drafted: seen.extend(zip(toks, drafted)))
    assert [t for t, _ in seen] == out.tokens.tolist()
    # draft == target: every iteration is k accepted drafts then one target token (the last block is cut to budget)
    assert [d for _, d in seen] == [True] * 4 + [False] + [True] * 4 + [False]


# --- Distribution recovery -------------------------------------------------------------
# With an 8-token vocabulary the law of the first two emitted tokens has 64 cells that can be
# enumerated exactly. SSp's empirical frequencies over N seeded runs must fit it; the test
# rejects at SIGNIFICANCE (fixed seeds make the outcome deterministic).
SIGNIFICANCE = 0.001
N_RUNS = 3000
VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_llama(20, vocab_size=VOCAB, scale=8.0), tiny_llama(21, vocab_size=VOCAB, hidden=16, layers=1, scale=8.0)


def exact_two_token_law(model, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], params)
        rows = [warp(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1], params) for x in range(VOCAB)]
    return (p1[:, None] * torch.stack(rows)).flatten()


def two_token_counts(target, draft, prompt, params, k: int = 3, **options) -> list[int]:
    counts = [0] * VOCAB * VOCAB
    gen = torch.Generator()
    for seed in range(N_RUNS):
        gen.manual_seed(seed)
        first, second = generate_speculative(target, draft, prompt, 4, k, params, gen, **options).tokens[:2].tolist()
        counts[first * VOCAB + second] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4)], ids=["t1.0", "t0.7-topk4"])
def test_speculative_sampling_recovers_the_target_distribution(small_vocab_pair, params):
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    law = exact_two_token_law(target, prompt, params)
    draft_law = exact_two_token_law(draft, prompt, params)
    assert 0.5 * (law - draft_law).abs().sum() > 0.2  # the draft is really different
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_distribution_test_rejects_an_always_accept_verifier(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])
    monkeypatch.setattr(generation, "accepted_prefix", lambda p, q, drafts, gen: drafts.shape[0])
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), exact_two_token_law(target, prompt, params).tolist())
    assert result.p_value < SIGNIFICANCE, result


def test_distribution_test_rejects_a_residual_without_max0(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])
    monkeypatch.setattr(generation, "residual_distribution", lambda p, q: p)  # resample from p: biased
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), exact_two_token_law(target, prompt, params).tolist())
    assert result.p_value < SIGNIFICANCE, result


def test_a_confident_draft_stops_early_and_greedy_output_is_unchanged(soft_target, soft_draft):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = generate_regular(soft_target, ids, 30, GREEDY).tokens.tolist()
        fixed = generate_speculative(soft_target, soft_draft, ids, 30, 4, GREEDY)
        early = generate_speculative(soft_target, soft_draft, ids, 30, 4, GREEDY, confidence=0.9)
        assert early.tokens.tolist() == expected
        assert early.stats.drafted < fixed.stats.drafted  # it stopped before K some of the time
        assert early.stats.drafted_at[0] >= early.stats.target_forwards - 1  # but drafts one (the last may have no room)


def test_speculative_sampling_with_early_stopping_recovers_the_target_distribution(small_vocab_pair):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])
    stops = generate_speculative(target, draft, prompt, 40, 3, params, torch.Generator().manual_seed(0), confidence=0.6)
    assert stops.stats.drafted < 3 * stops.stats.target_forwards  # the threshold does cut drafting short here
    result = chi_square_gof(two_token_counts(target, draft, prompt, params, confidence=0.6),
                            exact_two_token_law(target, prompt, params).tolist())
    assert result.p_value > SIGNIFICANCE, result


# --- Context lookup ----------------------------------------------------------------------
REPEATING = [0, 5, 9, 3, 12, 5, 9, 3, 12, 5, 9]  # every 2-gram of its tail occurred before


def test_context_lookup_proposes_what_followed_the_latest_occurrence():
    lookup = ContextLookup(2, [1, 2, 5, 1, 2, 7, 4])
    assert lookup.propose() is None  # (7, 4) is new
    assert lookup.propose([1, 2]) == 7  # the latest "1 2" was followed by 7, not 5
    assert lookup.propose([9]) is None
    lookup.extend([1, 2, 3])
    assert lookup.propose([1, 2]) == 3 and lookup.propose([4, 1]) == 2  # drafts and emitted tokens both count
    assert ContextLookup(3, [1, 2]).propose() is None  # shorter than n
    with pytest.raises(ValueError):
        ContextLookup(0, [])


def test_greedy_speculative_with_the_lookup_equals_greedy_regular(soft_target, soft_draft):
    looked_up = 0
    for prompt in [*PROMPTS, REPEATING]:
        ids = torch.tensor([prompt])
        expected = generate_regular(soft_target, ids, 30, GREEDY).tokens.tolist()
        for n in (1, 2, 3):
            out = generate_speculative(soft_target, soft_draft, ids, 30, 3, GREEDY, lookup=n)
            assert out.tokens.tolist() == expected
            assert out.stats.looked_up_accepted <= out.stats.looked_up <= out.stats.drafted
            looked_up += out.stats.looked_up
    assert looked_up > 0  # the lookup did propose


def test_speculative_sampling_with_the_lookup_recovers_the_target_distribution(small_vocab_pair):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])  # the lookup proposes 3 at the first draft, 1 after it
    hinted = generate_speculative(target, draft, prompt, 40, 3, params, torch.Generator().manual_seed(0), lookup=2)
    assert hinted.stats.looked_up > 0
    law = exact_two_token_law(target, prompt, params)
    result = chi_square_gof(two_token_counts(target, draft, prompt, params, lookup=2), law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_argmax_matches_torch_with_ties_slices_and_other_dtypes():
    logits = torch.randn(4, 1000)
    logits[1, [7, 500]] = 100.0  # a tie: the first maximum wins, as in torch
    logits[2, 3] = float("nan")
    for x in (logits, logits[0], logits[:, 10:900], logits.T.contiguous().T, logits.to(torch.bfloat16)):
        assert torch.equal(argmax(x), x.argmax(-1))
    assert int(argmax(logits[1])) == 7


def test_sample_draws_the_given_law_and_never_a_zero_probability_token():
    law = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 1e-3, 0.0])
    law = law / law.sum()
    draws = sample(law.expand(20000, 8), SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert draws.shape == (20000,)
    counts = torch.bincount(draws, minlength=8)
    assert counts[law == 0].sum() == 0
    assert chi_square_gof(counts.tolist(), law.tolist()).p_value > 0.001
    assert sample(law, SamplingParams(1.0), None).shape == ()  # one row in, one token out
