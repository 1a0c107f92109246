"""The two samplers: KV-cache correctness, greedy equivalence, statistics, losslessness."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import lssp.decoding.verification as verification
from lssp.decoding.batched import speculative_decode_batch
from lssp.decoding.drafting import Picker
from lssp.decoding.generation import Stopping, generate_regular
from lssp.decoding.sampling import SamplingParams, argmax, inverse_cdf, sample, warp
from lssp.drafters import drafter_for, generate_speculative
from lssp.drafters.lookup import ContextLookup, copy_room
from lssp.report.stats import chi_square_gof

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
#
# SSp is exact for any pair of causal LMs, so these tests run on PrefixTableLM below, whose
# forward is a table lookup instead of a transformers forward of a tiny Llama: the same 3000
# runs per test take seconds instead of about a minute each. Its logits are a fixed random
# function of the whole prefix, so a target scoring the wrong context (a cache not rolled back,
# a token skipped) reads an unrelated row and moves the law a lot. transformers' caches under
# sampling stay covered by test_compact's subset-head law test (a real draft layout) and by
# test_verify_plot's sampled verification; the greedy tests above cover them token for token.
#
# Power: N is the same for the exactness tests and the planted-bug tests below, so those show
# what the exactness tests catch. At T = 1, 56 of the 64 cells expect >= 5 counts (55 degrees of
# freedom, critical value 93.2 at 0.001). A bug moving the law by total variation d adds at least
# 4·N·d² to the statistic's mean (Cauchy-Schwarz): d = 0.07 gives >= 59, caught 88% of the time
# at N = 3000. The planted bugs below give statistics of 370 (residual) to 2500 (always accept).
SIGNIFICANCE = 0.001
N_RUNS = 3000
VOCAB = 8


class PrefixCache:
    """What the samplers ask of a KV cache: the running prefix hash after every position it has seen."""

    def __init__(self) -> None:
        self.hashes: list[int] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.hashes)

    def crop(self, tokens: int) -> None:
        """Drop the last ``-tokens`` positions (transformers 5's DynamicCache.crop: 0 keeps all, > 0 is refused)."""
        if tokens > 0:
            raise ValueError(f"crop takes the negative number of positions to drop, got {tokens}")
        if tokens:
            del self.hashes[tokens:]


@dataclass
class TableOutput:
    logits: torch.Tensor


class PrefixTableLM(nn.Module):
    """A causal LM whose next-token logits are row hash(prefix) of a fixed random table.

    ``like`` and ``mix`` make a draft: its table is ``mix`` x the other's plus fresh noise, so
    the two laws agree in part and SSp both accepts and rejects at every draft position.
    """

    MOD = (1 << 61) - 1

    def __init__(self, seed: int, vocab: int = VOCAB, scale: float = 1.0, rows: int = 4096,
                 like: PrefixTableLM | None = None, mix: float = 0.0) -> None:
        super().__init__()
        table = scale * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
        if like is not None:
            table = mix * like.table + (1 - mix) * table
        self.register_buffer("table", table)
        self.embed = nn.Embedding(vocab, 1)  # where ids go in (model_device)
        self.head = nn.Linear(1, vocab, bias=False)  # how wide the logits are (logit_width)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def new_cache(self) -> PrefixCache:
        return PrefixCache()

    def forward(self, input_ids: torch.Tensor, past_key_values: PrefixCache | None = None, use_cache: bool = True,
                logits_to_keep: int = 0) -> TableOutput:
        kv = past_key_values if past_key_values is not None else PrefixCache()
        start = len(kv.hashes)
        h = kv.hashes[-1] if kv.hashes else 0
        for token in input_ids[0].tolist():
            h = (h * 1_000_003 + token + 1) % self.MOD
            kv.hashes.append(h)
        rows = [x % self.table.shape[0] for x in kv.hashes[start:]]
        return TableOutput(self.table[rows[-logits_to_keep:] if logits_to_keep else rows][None])


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = PrefixTableLM(20)
    return target, PrefixTableLM(21, like=target, mix=0.6)


def exact_two_token_law(model, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], params)
        rows = [warp(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1], params) for x in range(VOCAB)]
    return (p1[:, None] * torch.stack(rows)).flatten()


def two_token_counts(target, draft, prompt, params, k: int = 3, runs: int = N_RUNS, batched: bool = False,
                     **options) -> list[int]:
    """The first two tokens of ``runs`` seeded SSp completions, one at a time, or with ``batched`` in one batched
    loop (whose seeded rows give the same tokens: tests/test_batched.py)."""
    counts = [0] * VOCAB * VOCAB
    generators = [torch.Generator().manual_seed(seed) for seed in range(runs)]
    if batched:
        outs = speculative_decode_batch(target, drafter_for(draft, **options), [prompt] * runs, 4, k, params, generators)
    else:
        outs = [generate_speculative(target, draft, prompt, 4, k, params, gen, **options) for gen in generators]
    for out in outs:
        first, second = out.tokens[:2].tolist()
        counts[first * VOCAB + second] += 1
    return counts


def test_the_table_lm_is_a_causal_lm_its_cache_rolls_back(small_vocab_pair):
    target, _ = small_vocab_pair
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    full = target(ids).logits
    kv = target.new_cache()
    steps = [target(ids[:, :4], past_key_values=kv, logits_to_keep=4).logits,
             target(ids[:, 4:], past_key_values=kv, logits_to_keep=1).logits]
    assert torch.equal(torch.cat([steps[0], steps[1]], 1), full[:, [0, 1, 2, 3, 5]])
    kv.crop(-3)
    kv.crop(0)
    assert kv.get_seq_length() == 3
    assert torch.equal(target(ids[:, 3:], past_key_values=kv).logits, full[:, 3:])
    assert not torch.equal(target(torch.tensor([[2, 1]])).logits[0, 1], target(torch.tensor([[1, 1]])).logits[0, 1])
    with pytest.raises(ValueError):
        kv.crop(2)


def test_the_law_test_pair_exercises_every_branch(small_vocab_pair):
    """Acceptance and rejection at every draft position, and the bonus token: all of them feed the law tests."""
    target, draft = small_vocab_pair
    drafted, accepted, bonus = [0] * 3, [0] * 3, 0
    for seed in range(200):
        s = generate_speculative(target, draft, torch.tensor([[1, 2, 3]]), 4, 3, SamplingParams(1.0),
                                 torch.Generator().manual_seed(seed)).stats
        drafted = [a + b for a, b in zip(drafted, s.drafted_at)]
        accepted = [a + b for a, b in zip(accepted, s.accepted_at)]
        bonus += s.accepted_at[2] > 0  # the first iteration accepted all three: the fourth token is the bonus
    assert all(0.3 < a / d < 0.9 for a, d in zip(accepted, drafted)), (accepted, drafted)  # 0.79, 0.58, 0.47
    assert 50 < bonus < 150


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4)], ids=["t1.0", "t0.7-topk4"])
def test_speculative_sampling_recovers_the_target_distribution(small_vocab_pair, params):
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    law = exact_two_token_law(target, prompt, params)
    draft_law = exact_two_token_law(draft, prompt, params)
    assert 0.5 * (law - draft_law).abs().sum() > 0.2  # the draft is really different
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def narrower(draft: PrefixTableLM, width: int) -> PrefixTableLM:
    """``draft`` with logits for the first ``width`` tokens only (a smaller padded vocabulary); it still reads every id."""
    draft.table = draft.table[:, :width].clone()
    draft.head = nn.Linear(1, width, bias=False)
    return draft


def test_a_draft_with_fewer_logits_keeps_the_targets_whole_law(small_vocab_pair):
    """The draft's logits cover 5 of the 8 tokens: it never drafts the other 3, and SSp still emits them as RSp
    would (verified against the target's whole width; the residual draws them), not truncated to the draft's 5."""
    target, _ = small_vocab_pair
    draft = narrower(PrefixTableLM(21, like=target, mix=0.6), VOCAB - 3)
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    law = exact_two_token_law(target, prompt, params)
    assert law.view(VOCAB, VOCAB)[VOCAB - 3:].sum() > 0.2  # the tokens beyond the draft's width carry real mass
    counts = two_token_counts(target, draft, prompt, params, runs=2000)
    assert chi_square_gof(counts, law.tolist()).p_value > SIGNIFICANCE


def test_a_draft_reading_fewer_ids_than_the_target_emits_reads_them_all():
    """Padded vocabularies of different sizes (Qwen2.5's 0.5B and 7B, say): the draft's embeddings take every id the
    target can emit, and greedy SSp still equals RSp."""
    from conftest import tiny_llama

    from lssp.models.loading import read_any_token

    target, draft = tiny_llama(0, scale=30.0), tiny_llama(1, vocab_size=48, hidden=16, layers=1, scale=30.0)
    assert read_any_token(draft, 64) and not read_any_token(draft, 64)  # installed once
    assert draft(torch.tensor([[63, 47, 5]])).logits.shape == (1, 3, 48)
    prompt = torch.tensor([[0, 5, 50, 60, 9]])
    rsp = generate_regular(target, prompt, 30, SamplingParams(0))
    assert torch.equal(generate_speculative(target, draft, prompt, 30, 3, SamplingParams(0)).tokens, rsp.tokens)


def test_distribution_test_rejects_an_always_accept_verifier(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "accepted_prefix", lambda p, q, drafts, gen: drafts.shape[0])
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), exact_two_token_law(target, prompt, params).tolist())
    assert result.p_value < SIGNIFICANCE, result


def test_distribution_test_rejects_a_residual_without_max0(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "residual_draw", lambda p, q, u: inverse_cdf(p, u))  # resample from p: biased
    result = chi_square_gof(two_token_counts(target, draft, prompt, params), exact_two_token_law(target, prompt, params).tolist())
    assert result.p_value < SIGNIFICANCE, result


def test_distribution_test_rejects_a_verifier_that_counts_passes_instead_of_the_leading_run(small_vocab_pair, monkeypatch):
    """A subtler bug: a draft after a failed one still counts, so a rejected draft is emitted when a later one passes."""
    target, draft = small_vocab_pair
    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 2, 3]])

    def passes(p, q, drafts, uniforms):
        rows = torch.arange(drafts.shape[0])
        return int((uniforms * q[rows, drafts] < p[rows, drafts]).sum())

    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "accepted_prefix", passes)
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
    stops = generate_speculative(target, draft, prompt, 100, 3, params, torch.Generator().manual_seed(0), confidence=0.2)
    drafted_at = stops.stats.drafted_at
    assert drafted_at[0] > drafted_at[1] > drafted_at[2] > 0  # the threshold cuts drafting short, at varying depths
    result = chi_square_gof(two_token_counts(target, draft, prompt, params, confidence=0.2),
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


def test_context_lookup_falls_back_to_shorter_tails_longest_first():
    text = [1, 2, 3, 8, 9, 2, 3, 5, 7, 3]
    assert ContextLookup(3, text).propose() is None  # (5, 7, 3) and nothing shorter
    lookup = ContextLookup(3, text, shortest=1)
    assert lookup.propose() == 5  # "3" last followed by 5; no 3- or 2-gram tail occurred before
    assert lookup.propose([9]) == 2  # "3 9": new as a pair; "9" was followed by 2
    pairs = ContextLookup(3, [4, 6, 1, 6, 3, 7], shortest=1)
    assert pairs.propose([4, 6]) == 1 and pairs.propose([6]) == 3  # "4 6" was followed by 1, the latest "6" by 3
    assert ContextLookup(3, text, shortest=2).propose() is None  # no pair tail ("7 3") occurred before
    with pytest.raises(ValueError):
        ContextLookup(2, [], shortest=3)


def test_copy_first_copies_past_k_only_after_the_whole_tail():
    picker = Picker(2, 50, SamplingParams(0.0), None, torch.device("cpu"), room=5)
    assert copy_room(ContextLookup(2, [1, 2, 3, 4, 1, 2], shortest=1), picker) == 5  # "1 2" occurred before
    assert copy_room(ContextLookup(2, [1, 2, 3, 4, 9, 2], shortest=1), picker) == 2  # only "2" did: up to K
    assert copy_room(ContextLookup(2, [7, 8], shortest=1), picker) == 0  # nothing did: the draft's turn
    assert copy_room(ContextLookup(2, [1, 2, 1, 2]), Picker(0, 50, SamplingParams(0.0), None, torch.device("cpu"))) == 0


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


def test_acceptance_counts_stop_at_the_stop_token(soft_target):
    """The target as its own draft accepts everything; with a stop token among the drafts, the drafts after it
    are neither drafted nor accepted in the counts."""
    ids = torch.tensor([[0, 3, 4]])
    free = generate_speculative(soft_target, soft_target, ids, 12, 4, GREEDY).tokens.tolist()
    stop = free[2]  # the third token: a draft of the first iteration
    out = generate_speculative(soft_target, soft_target, ids, 12, 4, GREEDY, stopping=Stopping(token_ids={stop}))
    first = free.index(stop) + 1
    assert out.tokens.tolist() == free[:first] and out.stopped
    assert out.stats.accepted == out.stats.drafted == first and out.stats.rejections == 0
    assert out.stats.draft_forwards == 4  # the work done is still counted
