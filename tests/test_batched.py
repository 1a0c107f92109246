"""Batched SSp (``speculative_decode_batch``): every row gives the tokens ``speculative_decode`` gives it alone with
the same generator (greedy and seeded sampled, rows of different prompt lengths leaving the batch at different
iterations; so each row follows the law that tests/test_drafters.py checks for one completion), and a planted bug
where rows share their acceptance breaks that equality. Eval and verify give the same records and samples
batched."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import char_tokenizer, random_head, tiny_llama

import lssp.decoding.batched as batched
from lssp.decoding.batched import speculative_decode_batch
from lssp.decoding.generation import NO_STOP, Stopping, generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import ConfidenceStop, CopyFirst, DraftModel, LookupHint, NgramDrafter, drafter_for
from lssp.drafters.model import FeatureHead
from lssp.engines import Engine, Mode, OursEngine, Request
from lssp.measure.evals import run_eval
from lssp.models.compact import CompactLlama
from lssp.models.eagle import FeatureDraft
from lssp.models.loading import LoadedModel
from lssp.models.registry import ModelSpec

GREEDY = SamplingParams(0)
PROMPTS = [[0, 5, 3], [4, 1, 6, 2], [7], [2, 2, 2, 2, 2, 7, 3], [1, 9]]  # different lengths, in one batch


@pytest.fixture(scope="module")
def pair():
    """A target and a draft that agree often but not always (vocabulary 64): the draft is the target with noise
    added to every weight (two random models of their own agree on too few greedy tokens to exercise acceptance)."""
    target, draft = tiny_llama(50, scale=6.0), tiny_llama(50, scale=6.0)
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(0.2 * weight.std() * torch.randn(weight.shape, generator=noise))
    return target, draft


def _alone(target, draft, prompt, budget, k, params, seed, stopping=NO_STOP):
    generator = None if params.greedy else torch.Generator().manual_seed(seed)
    return speculative_decode(target, DraftModel(draft), torch.tensor([prompt]), budget, k, params, generator,
                              stopping)


def _batch(target, draft, prompts, budget, k, params, seeds, stopping=NO_STOP):
    generators = [None if params.greedy else torch.Generator().manual_seed(s) for s in seeds]
    return speculative_decode_batch(target, drafter_for(draft), [torch.tensor(p) for p in prompts], budget, k, params,
                                    generators,
                                    stopping)


def _stop_token(target, prompts, budget) -> int:
    """A token that ends some prompts' greedy continuations early and not others'."""
    runs = [generate_regular(target, torch.tensor([p]), budget, GREEDY).tokens.tolist() for p in prompts]
    for token in sorted({t for run in runs for t in run[1:budget - 2]}):
        if 0 < sum(token in run for run in runs) < len(runs):
            return token
    raise AssertionError("no token ends only some rows")


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact (rows prefilled alone)"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_equal_ssp_alone_and_rsp(pair, k, compact):
    target, draft = (CompactLlama(m).eval() for m in pair) if compact else pair
    budget = 17  # not a multiple of K + 1: rows end at their budget in different iterations
    stopping = Stopping(token_ids={_stop_token(target, PROMPTS, budget)})
    outs = _batch(target, draft, PROMPTS, budget, k, GREEDY, [0] * len(PROMPTS), stopping)
    for prompt, out in zip(PROMPTS, outs):
        alone = _alone(target, draft, prompt, budget, k, GREEDY, 0, stopping)
        rsp = generate_regular(target, torch.tensor([prompt]), budget, GREEDY, stopping=stopping)
        assert out.tokens.tolist() == alone.tokens.tolist() == rsp.tokens.tolist()
        assert out.stopped == alone.stopped
        assert (out.stats.drafted, out.stats.accepted, out.stats.target_forwards) == \
            (alone.stats.drafted, alone.stats.accepted, alone.stats.target_forwards)
    assert 0 < sum(out.stopped for out in outs) < len(outs)  # some rows left the batch at the stop token
    assert len({out.stats.target_forwards for out in outs}) > 1  # rows ended in different iterations


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5)], ids=["T=1", "T=0.7 top-k 5"])
@pytest.mark.parametrize("k", [1, 3])
def test_seeded_sampled_rows_equal_ssp_alone(pair, k, params):
    """Exact equality: on these fp32 models the batched forwards give each row's logits as alone (no mismatch from
    the order of floating-point sums has been seen; if one ever shows, it is a near-tie, not a broken row)."""
    target, draft = pair
    stopping = Stopping(token_ids={1})
    for trial in range(3):
        seeds = [100 * trial + r for r in range(len(PROMPTS))]
        outs = _batch(target, draft, PROMPTS, 20, k, params, seeds, stopping)
        for prompt, seed, out in zip(PROMPTS, seeds, outs):
            alone = _alone(target, draft, prompt, 20, k, params, seed, stopping)
            assert out.tokens.tolist() == alone.tokens.tolist(), (trial, prompt)
            assert (out.stats.drafted, out.stats.accepted) == (alone.stats.drafted, alone.stats.accepted)


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact (rows prefilled alone)"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0), SamplingParams(0.7, top_k=5)],
                         ids=["greedy", "T=1", "T=0.7 top-k 5"])
def test_rsp_rows_of_any_lengths_equal_rsp_alone(pair, params, compact):
    target = CompactLlama(pair[0]).eval() if compact else pair[0]
    stopping = Stopping(token_ids={_stop_token(target, PROMPTS, 17)})
    seeds = list(range(len(PROMPTS)))
    generators = [None if params.greedy else torch.Generator().manual_seed(s) for s in seeds]
    outs = batched.generate_regular_rows(target, [torch.tensor(p) for p in PROMPTS], 17, params, generators, stopping)
    for prompt, seed, out in zip(PROMPTS, seeds, outs):
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        alone = generate_regular(target, torch.tensor([prompt]), 17, params, generator, stopping)
        assert out.tokens.tolist() == alone.tokens.tolist() and out.stopped == alone.stopped, prompt
        assert out.stats.target_forwards == len(out.tokens) and 0 < out.stats.ttft_s <= out.stats.total_time_s * 5
    if params.greedy:
        assert 0 < sum(out.stopped for out in outs) < len(outs)


@pytest.fixture(scope="module")
def head_pair():
    """A compact-forward target and a feature head that is right often but not always: test_eagle's planted pair,
    the target's first MLP given small random weights again (its features then stray from what the head expects)."""
    from test_eagle import planted_right

    model, head = planted_right()
    with torch.no_grad():
        weight = model.model.layers[0].mlp.down_proj.weight
        weight.copy_(0.2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)))
    target = CompactLlama(model).eval()
    return target, FeatureDraft(head, target)


def _head_alone(target, draft, prompt, budget, k, params, seed, stopping=NO_STOP):
    generator = None if params.greedy else torch.Generator().manual_seed(seed)
    return speculative_decode(target, FeatureHead(draft), torch.tensor([prompt]), budget, k, params, generator, stopping)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_with_a_feature_head_equal_the_head_alone_and_rsp(head_pair, k):
    """Rows of lengths 1 to 7 (a prompt of one token has no feature yet: its first iteration drafts nothing)."""
    target, draft = head_pair
    budget = 17
    stopping = Stopping(token_ids={_stop_token(target, PROMPTS, budget)})
    outs = _batch(target, draft, PROMPTS, budget, k, GREEDY, [0] * len(PROMPTS), stopping)
    for prompt, out in zip(PROMPTS, outs):
        alone = _head_alone(target, draft, prompt, budget, k, GREEDY, 0, stopping)
        rsp = generate_regular(target, torch.tensor([prompt]), budget, GREEDY, stopping=stopping)
        assert out.tokens.tolist() == alone.tokens.tolist() == rsp.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted, out.stats.target_forwards) == \
            (alone.stats.drafted, alone.stats.accepted, alone.stats.target_forwards), prompt
    assert sum(out.stats.accepted for out in outs) > 0 and any(o.stats.accepted < o.stats.drafted for o in outs)
    assert 0 < sum(out.stopped for out in outs) < len(outs)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.8)], ids=["greedy", "T=0.8"])
def test_rows_with_a_fused_head_equal_the_head_alone(params):
    """A head reading the target's hidden states of a layer too (EAGLE-3's fused features): each row as alone."""
    from test_eagle import _fused_pair

    target, head = _fused_pair(True, (1,))
    draft = FeatureDraft(head, target)
    seeds = list(range(len(PROMPTS)))
    outs = _batch(target, draft, PROMPTS, 16, 3, params, seeds, Stopping(token_ids={1}))
    for prompt, seed, out in zip(PROMPTS, seeds, outs):
        alone = _head_alone(target, draft, prompt, 16, 3, params, seed, Stopping(token_ids={1}))
        assert out.tokens.tolist() == alone.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted) == (alone.stats.drafted, alone.stats.accepted), prompt
    assert sum(out.stats.drafted for out in outs) > 0


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5)], ids=["T=1", "T=0.7 top-k 5"])
def test_seeded_sampled_rows_with_a_feature_head_equal_the_head_alone(head_pair, params):
    target, draft = head_pair
    for trial in range(2):
        seeds = [100 * trial + r for r in range(len(PROMPTS))]
        outs = _batch(target, draft, PROMPTS, 20, 3, params, seeds, Stopping(token_ids={1}))
        for prompt, seed, out in zip(PROMPTS, seeds, outs):
            alone = _head_alone(target, draft, prompt, 20, 3, params, seed, Stopping(token_ids={1}))
            assert out.tokens.tolist() == alone.tokens.tolist(), (trial, prompt)
            assert (out.stats.drafted, out.stats.accepted) == (alone.stats.drafted, alone.stats.accepted)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0)], ids=["greedy", "T=1"])
def test_rows_copying_first_with_a_feature_head_equal_their_runs_alone(head_pair, params, monkeypatch):
    """Copy first over the head, in a batch: each row copies or lets the head draft as it would alone, and the head
    catches up with the rows' copied iterations (their features queued)."""
    from lssp.drafters.lookup import CopyRows

    choices: list[list[bool]] = []  # per batched iteration, which rows copied
    draft_rows = CopyRows.draft

    def recorded(self, seqs, pickers):
        proposals = draft_rows(self, seqs, pickers)
        choices.append([copied and picker.k > 0 for copied, picker in zip(self.copied, pickers)])
        return proposals

    monkeypatch.setattr(CopyRows, "draft", recorded)
    target, draft = head_pair
    prompts = [p * 3 for p in PROMPTS]  # repeats for the lookup to find
    seeds = list(range(len(prompts)))
    make = lambda: CopyFirst(FeatureHead(draft), 1)  # noqa: E731
    generators = [None if params.greedy else torch.Generator().manual_seed(s) for s in seeds]
    outs = speculative_decode_batch(target, make(), [torch.tensor(p) for p in prompts], 20, 2, params, generators)
    for prompt, seed, out in zip(prompts, seeds, outs):
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        alone = speculative_decode(target, make(), torch.tensor([prompt]), 20, 2, params, generator)
        assert out.tokens.tolist() == alone.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted, out.stats.drafted_at) == \
            (alone.stats.drafted, alone.stats.accepted, alone.stats.drafted_at), prompt
    assert any(any(c) and not all(c) for c in choices)  # rows copying beside rows drafting, in one iteration
    assert "one completion at a time" in CopyFirst(FeatureHead(draft), 1, chain=5).rows_reason(target)


def test_a_feature_head_is_batched_only_over_a_compact_target(head_pair):
    target, draft = head_pair
    assert FeatureHead(draft).rows_reason(target) is None
    assert "compact" in FeatureHead(draft).rows_reason(target.hf)
    with pytest.raises(ValueError, match="compact"):
        speculative_decode_batch(target.hf, FeatureHead(draft), [torch.tensor(PROMPTS[0])], 4, 2, GREEDY, [None])


POLICIES = {  # name: how to build the drafter from a draft model
    "lookup": lambda draft: DraftModel(draft, [LookupHint(1)]),
    "confidence": lambda draft: DraftModel(draft, [ConfidenceStop(0.5)]),
    "lookup and confidence": lambda draft: DraftModel(draft, [LookupHint(2), ConfidenceStop(0.3)]),
    "n-gram drafter": lambda draft: NgramDrafter(1),
    "copy first": lambda draft: CopyFirst(DraftModel(draft), 1),
}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0)], ids=["greedy", "T=1"])
@pytest.mark.parametrize("name", POLICIES)
def test_rows_with_policies_or_no_model_give_what_they_give_alone(pair, name, params):
    """The context lookup, the confidence stop and the n-gram drafter run in batches too: each row gives the tokens,
    drafts, acceptances and lookups it gives alone with its generator."""
    target, draft = pair
    prompts = [p * 3 for p in PROMPTS]  # repeats for the lookup to find
    seeds = list(range(len(prompts)))
    generators = [None if params.greedy else torch.Generator().manual_seed(s) for s in seeds]
    outs = speculative_decode_batch(target, POLICIES[name](draft), [torch.tensor(p) for p in prompts], 16, 3, params,
                                    generators)
    for prompt, seed, out in zip(prompts, seeds, outs):
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        alone = speculative_decode(target, POLICIES[name](draft), torch.tensor([prompt]), 16, 3, params, generator)
        assert out.tokens.tolist() == alone.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted, out.stats.looked_up) == \
            (alone.stats.drafted, alone.stats.accepted, alone.stats.looked_up), prompt
    assert sum(o.stats.drafted for o in outs) > 0
    if "lookup" in name:
        assert sum(o.stats.looked_up for o in outs) > 0


def test_rows_sharing_their_acceptance_no_longer_equal_their_runs_alone(pair, monkeypatch):
    """A planted bug: every row keeps as many drafts as the batch's first row accepted (up to its own count), with
    its own next token. The seeded equality with each row alone catches it (so it stands in for a law test)."""
    target, draft = pair
    real = batched.verify_rows

    def shared(logits, proposals, params, generators, vocab):
        verdicts = real(logits, proposals, params, generators, vocab)
        first = verdicts[0][0]
        return [verdicts[0]] + [(min(first, len(p)), extra) for p, (_, extra) in zip(proposals[1:], verdicts[1:])]

    monkeypatch.setattr(batched, "verify_rows", shared)
    params, seeds = SamplingParams(1.0), list(range(len(PROMPTS)))
    outs = _batch(target, draft, PROMPTS, 20, 3, params, seeds)
    alone = [_alone(target, draft, p, 20, 3, params, s) for p, s in zip(PROMPTS, seeds)]
    assert [o.tokens.tolist() for o in outs] != [a.tokens.tolist() for a in alone]


JOINING = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [6], [8, 8, 1]]  # 8 rows through 3 places


@pytest.fixture(scope="module")
def compact_pair(pair):
    return tuple(CompactLlama(m).eval() for m in pair)


@pytest.fixture
def repacks(monkeypatch):
    """How often a cache was repacked (rows that join and leave leave holes behind)."""
    count = [0]
    real = batched.repack_rows

    def counted(cache):
        before = cache.slots
        real(cache)
        count[0] += cache.slots < before
    monkeypatch.setattr(batched, "repack_rows", counted)
    return count


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0), SamplingParams(0.7, top_k=5)],
                         ids=["greedy", "T=1", "T=0.7 top-k 5"])
@pytest.mark.parametrize("drafting", ["RSp", "draft K=3", "feature head K=2"])
def test_rows_joining_a_running_batch_give_what_they_give_alone(compact_pair, head_pair, params, drafting, repacks):
    """Continuous batching: 8 requests, at most 3 at once, each new one joining (prefilled alone, merged into the
    running caches) as one leaves; each gives the tokens and counts it gives alone with its generator."""
    target, draft = head_pair if "head" in drafting else compact_pair
    stopping = Stopping(token_ids={_stop_token(target, JOINING, 20)}) if params.greedy else Stopping(token_ids={1})
    seeds = list(range(len(JOINING)))
    generators = [None if params.greedy else torch.Generator().manual_seed(s) for s in seeds]
    prompts = [torch.tensor(p) for p in JOINING]
    k = 3 if drafting == "draft K=3" else 2
    if drafting == "RSp":
        outs = batched.generate_regular_rows(target, prompts, 20, params, generators, stopping, concurrency=3)
    else:
        outs = speculative_decode_batch(target, drafter_for(draft), prompts, 20, k, params, generators, stopping,
                                        concurrency=3)
    for prompt, seed, out in zip(JOINING, seeds, outs):
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        if drafting == "RSp":
            alone = generate_regular(target, torch.tensor([prompt]), 20, params, generator, stopping)
        else:
            drafter = FeatureHead(draft) if "head" in drafting else DraftModel(draft)
            alone = speculative_decode(target, drafter, torch.tensor([prompt]), 20, k, params, generator, stopping)
            assert (out.stats.drafted, out.stats.accepted) == (alone.stats.drafted, alone.stats.accepted), prompt
        assert out.tokens.tolist() == alone.tokens.tolist() and out.stopped == alone.stopped, prompt
    if drafting != "RSp":
        assert repacks[0] > 0  # holes were dropped on the way, and the rows still came out exact


def test_joining_rows_wait_for_a_place_and_time_from_their_arrival(compact_pair):
    """One place: the requests run one after another, each timed from when it joined (not from the run's start),
    so their waits add up to no more than the run."""
    target, _ = compact_pair
    outs = batched.generate_regular_rows(target, [torch.tensor(p) for p in JOINING], 6, GREEDY,
                                         [None] * len(JOINING), concurrency=1)
    each = [o.stats.ttft_s + o.stats.after_first_s for o in outs]
    assert all(t > 0 for t in each) and sum(each) <= outs[0].stats.total_time_s * len(outs)
    assert max(o.stats.ttft_s for o in outs) < sum(each) / 2  # the last to join did not count the others' time


def test_rows_join_not_before_their_arrival_and_an_idle_run_waits(compact_pair):
    """Open loop: the second row arrives after the first is done; the run waits for it, and times it from then."""
    target, draft = compact_pair
    waited = []
    run = batched.SpeculativeRows(target, drafter_for(draft), 2, GREEDY, NO_STOP, 5, 64, None, batched.Clock(), batched.Clock().now())
    rows = batched._rows([torch.tensor(p) for p in PROMPTS[:2]], [None, None], lambda: batched.GenerationStats(mode="ssp", k=2, drafted_at=[0, 0], accepted_at=[0, 0]))

    def wait(seconds):
        waited.append(seconds)
        time.sleep(seconds)
    batched.run_rows(run, rows, 0, [0.0, 0.3], wait)
    assert waited and 0 < sum(waited) <= 0.3 and rows[1].arrived_s >= 0.3 > rows[0].finished_s
    assert rows[1].stats.ttft_s < 0.3  # from its arrival, not from the run's start
    for prompt, row in zip(PROMPTS, rows):
        alone = _alone(target, draft, prompt, 5, 2, GREEDY, 0)
        assert row.tokens == alone.tokens.tolist()


def test_a_row_arriving_during_a_slow_iteration_is_timed_from_its_arrival(compact_pair, monkeypatch):
    """A planted slow iteration (0.3 s): rows arriving while it runs join only after it, and their time to first
    token counts that wait (from their scheduled arrival, as a user would see it), not from their admission."""
    target, draft = compact_pair
    slow = batched.SpeculativeRows.step

    def step(self):
        time.sleep(0.3)
        slow(self)
    monkeypatch.setattr(batched.SpeculativeRows, "step", step)
    arrivals = [0.0, 0.05, 0.1, 0.15]
    outs = speculative_decode_batch(target, drafter_for(draft), [torch.tensor(p) for p in JOINING[:4]], 4, 2, GREEDY,
                                    [None] * 4, concurrency=4, arrivals=arrivals)
    first_token_at = [at + o.stats.ttft_s for at, o in zip(arrivals, outs)]
    assert outs[0].stats.ttft_s >= 0.3  # its own first iteration
    for at, o in zip(arrivals[1:], outs[1:]):  # each waited for the first row's iteration, then ran its own
        assert o.stats.ttft_s >= 0.6 - at, (at, o.stats.ttft_s)
    assert max(first_token_at[1:]) - min(first_token_at[1:]) < 0.1  # the three joined together


def test_a_running_batch_takes_rows_only_under_the_compact_forward(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="compact forward"):
        speculative_decode_batch(target, drafter_for(draft), [torch.tensor(p) for p in PROMPTS], 6, 2, GREEDY,
                                 [None] * len(PROMPTS), concurrency=2)


@pytest.fixture(scope="module")
def loaded(pair):
    """The ``pair`` as loaded models with a character tokenizer, and a random feature head for the target."""
    tok = char_tokenizer()
    target, draft = pair
    return (LoadedModel(ModelSpec("t"), target, tok), LoadedModel(ModelSpec("d"), draft, tok),
            LoadedModel(ModelSpec("h"), FeatureDraft(random_head(target, 52, scale=2.0), target), tok))


def _records(run) -> list[dict]:
    from lssp.measure.evals import read_records

    return [{**vars(r), "seconds": None} for r in read_records(run.records_path)]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0)], ids=["greedy", "T=1"])
def test_eval_records_batched_equal_one_at_a_time(loaded, tmp_path, params):
    """eval's SSp problems in batches of 4 (prompts of different lengths, the few-shot prefix cached): the same
    records, problem by problem, as one at a time."""
    target, draft, _ = loaded
    engine = OursEngine(target, [draft], [64])
    runs = {size: run_eval(target, draft, engine, ["ssp"], 12, 0, params, 8, 3, tmp_path / str(size), ssp_batch=size)
            for size in (1, 4)}
    assert runs[4].setup.ssp_batch == 4 and runs[1].setup.ssp_batch == 1
    one, four = _records(runs[1]), _records(runs[4])
    assert len(one) == 12 and one == four
    assert len({len(target.encode(r["prompt"])[0]) for r in four}) > 1  # batches of different prompt lengths


def test_complete_many_runs_unbatchable_modes_one_at_a_time(loaded):
    """A feature head over a target outside the compact forward cannot run batched: ``complete_many`` runs the
    rows one after another, with the tokens ``complete`` gives each, so callers can always call it. The context
    lookup and the confidence stop run batched, with the same tokens."""
    target, draft, head = loaded
    engine = OursEngine(target, [draft, head], [64, 64])
    prompts = [torch.tensor([p]) for p in PROMPTS]
    for mode in (Mode("ssp", 3, draft="h"), Mode("ssp", 3, lookup=2, draft="d"), Mode("ssp", 3, confidence=0.4)):
        request = Request(prompts[0], 12, GREEDY, 0)
        outs = engine.complete_many(mode, prompts, request, list(range(len(prompts))))
        for p, seed, out in zip(prompts, range(len(prompts)), outs):
            alone = engine.complete(mode, Request(p, 12, GREEDY, seed))
            assert out.tokens.tolist() == alone.tokens.tolist()
    assert engine.batch_reason(Mode("ssp", 3, draft="h"))
    assert engine.batch_reason(Mode("ssp", 3, draft="d")) is None
    assert engine.batch_reason(Mode("ssp", 3, lookup=2, draft="d")) is None


@pytest.mark.parametrize("mode", [Mode("ssp", 3), Mode("rsp")], ids=["SSp", "RSp"])
def test_verify_samples_batched_equal_one_at_a_time(loaded, mode):
    """verify's runs of one prompt in batches of 32 (the last one short): seed for seed the samples, counts and
    progress ticks of the runs one at a time."""
    from lssp.measure.verify import _samples, batches_runs

    target, draft, _ = loaded
    engine = OursEngine(target, [draft], [64])
    ids, params = target.encode("12 * 3"), SamplingParams(1.0)
    assert batches_runs(engine, mode)
    got = {}
    for size in (1, 32):
        ticks: list[str] = []
        outputs, stats = _samples(engine, mode, ids, 70, 6, params, 1234, ticks.append, "p", size)
        got[size] = outputs, [(s.drafted, s.accepted, s.new_tokens) for s in stats], ticks
    assert got[1] == got[32]
    assert len(set(map(tuple, got[1][0]))) > 10  # really sampled


def test_verify_batches_only_what_the_engine_batches(loaded):
    """A feature head over a target outside the compact forward runs one at a time; so does an engine whose own
    ``complete`` overrides ours (a wrapper, a planted bug: its ``complete`` is what is audited)."""
    from lssp.measure.verify import batches_runs

    target, draft, head = loaded

    class Wrapped(OursEngine):
        def complete(self, mode, request):
            return super().complete(mode, request)

    engine = OursEngine(target, [draft, head], [64, 64])
    assert batches_runs(engine, Mode("ssp", 2, draft="d")) and batches_runs(engine, Mode("ssp", 2, lookup=2, draft="d"))
    assert not batches_runs(engine, Mode("ssp", 2, draft="h"))
    assert not batches_runs(Wrapped(target, [draft], [64]), Mode("ssp", 2))
    assert not batches_runs(Wrapped(target, [draft], [64]), Mode("rsp"))


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
@pytest.mark.parametrize("drafting", ["RSp", "draft K=3"])
def test_a_one_row_batch_leaves_the_shared_prefix_whole(pair, compact, drafting):
    """A batch of one row over a cached prefix once got the prefix's own cache and emptied it when the row left
    (``eval --ssp-batch 3 --nb-prompts 66`` crashed on the next problem): every later batch, of one row or more,
    gives what it gives without the prefix."""
    from lssp.decoding.batched import generate_regular_rows
    from lssp.decoding.kv import PrefixCache

    target, draft = (CompactLlama(m).eval() for m in pair) if compact else pair
    shared = [3, 1, 4, 1, 5]
    prompts = [torch.tensor(shared + p) for p in PROMPTS]

    def run(rows, prefix):
        if drafting == "RSp":
            return generate_regular_rows(target, rows, 8, GREEDY, [None] * len(rows), prefix=prefix)
        return speculative_decode_batch(target, DraftModel(draft), rows, 8, 3, GREEDY, [None] * len(rows), prefix=prefix)

    prefix = PrefixCache(shared)
    for rows in ([prompts[0]], [prompts[1]], prompts[2:4], [prompts[4]]):
        with_prefix, without = run(rows, prefix), run(rows, None)
        assert [o.tokens.tolist() for o in with_prefix] == [o.tokens.tolist() for o in without]


def test_rows_with_a_feature_head_start_from_the_shared_prefix_and_equal_them_without(head_pair):
    """Batched SSp with a feature head starts from the shared prefix's keys, values and features (eval's few-shot
    lines, computed once), and the head from its own pairs over the prefix (computed once, copied to each row): every
    batch, of one row or more, gives what it gives without the prefix."""
    from lssp.decoding.kv import PrefixCache

    target, draft = head_pair
    shared = [3, 1, 4, 1, 5]
    prompts = [torch.tensor(shared + p) for p in PROMPTS]
    prefix = PrefixCache(shared)
    for rows in ([prompts[0]], prompts[1:4], [prompts[4]]):
        with_prefix, without = (speculative_decode_batch(target, FeatureHead(draft), rows, 8, 3, GREEDY,
                                                         [None] * len(rows), prefix=p) for p in (prefix, None))
        assert [o.tokens.tolist() for o in with_prefix] == [o.tokens.tolist() for o in without]
    assert ("features", target) in prefix._caches  # the prefix's features were computed and kept
    head_cache = prefix._caches[("head", draft)]  # and the head's pairs over them, whole after every batch
    assert head_cache.length == len(shared) - 1


def test_eval_with_a_last_batch_of_one_row_runs_on_and_records_as_one_at_a_time(loaded, tmp_path):
    """``eval --both --ssp-batch 3`` over 7 problems: the third SSp batch has one row, and RSp's problems after it
    use the same cached prefix (the CLI case of the crash above)."""
    target, draft, _ = loaded
    engine = OursEngine(target, [draft], [64])
    runs = {size: run_eval(target, draft, engine, ["ssp", "rsp"], 7, 0, GREEDY, 8, 3, tmp_path / str(size),
                           ssp_batch=size) for size in (1, 3)}
    one, three = _records(runs[1]), _records(runs[3])
    assert len(three) == 14 and one == three


def test_a_lookup_length_means_a_hint_for_ours_and_the_ngram_drafter_alone_elsewhere(loaded):
    """``Mode.lookup`` is our context lookup over a draft's picks, ``Mode.ngram`` an n-gram drafter with no model:
    ``--lookup N`` maps to the first where the engine takes it (ours with a draft), else to the second (vLLM,
    llama.cpp; ours with no draft). Ours runs its n-gram drafter alone, batched as one at a time, and greedy SSp
    through it equals RSp."""
    from lssp.measure.latency import latency_modes

    modes = latency_modes(["ours", "vllm", "hf"], ["d"], [2], lookups=[0, 3])
    assert {(m.engine, m.lookup, m.ngram) for m in modes if m.mode == "ssp"} == {
        ("ours", 0, 0), ("ours", 3, 0), ("vllm", 0, 0), ("vllm", 0, 3), ("hf", 0, 0)}
    alone = latency_modes(["ours"], [], [2], lookups=[3])
    assert [m.name for m in alone] == ["rsp", "ssp k=2 ngram=3"]
    target, draft, _ = loaded
    engine = OursEngine(target, [], [])
    assert engine.supports(Mode("ssp", 2)) and engine.supports(alone[1]) is None
    prompts = [torch.tensor([p]) for p in PROMPTS]
    outs = engine.complete_many(alone[1], prompts, Request(prompts[0], 12, GREEDY, 0), list(range(len(prompts))))
    for p, out in zip(prompts, outs):
        assert out.tokens.tolist() == engine.complete(alone[0], Request(p, 12, GREEDY, 0)).tokens.tolist()
    assert engine.batch_reason(alone[1]) is None
    from lssp.engines import VllmEngine

    assert VllmEngine.key(Mode("ssp", 2, engine="vllm", ngram=3)) == (2, 3)
    assert "no context lookup" in Engine.supports(VllmEngine.__new__(VllmEngine), Mode("ssp", 2, lookup=3,
                                                                                         engine="vllm"))


@pytest.mark.parametrize("k, rows, max_rows, drafts", [(3, 1, 0, 3), (3, 8, 0, 3), (3, 1, 4, 3), (3, 2, 4, 1),
                                                       (3, 3, 4, 0), (2, 2, 6, 2), (2, 3, 6, 1), (2, 7, 6, 0)])
def test_a_row_budget_lowers_k_as_the_batch_grows(k, rows, max_rows, drafts):
    assert batched.drafts_per_row(k, rows, max_rows) == drafts


def test_copy_first_rows_pass_a_skipped_step_to_the_drafter_inside():
    """A step no row drafted in reaches the head inside copy first with the target's features (it reads them at its
    next draft), as a copied iteration does."""
    from lssp.decoding.drafting import DraftRows, PolicyRows
    from lssp.drafters.lookup import CopyRows

    seen = []

    class Inner(DraftRows):
        def draft(self, seqs, pickers): return []
        def advance(self, row, proposal, accepted, features): pass
        def keep_rows(self, rows): pass
        def merge_rows(self, other): pass
        def skip(self, row, emitted, features): seen.append((row, list(emitted), features))

    rows = CopyRows(Inner(PolicyRows([], [[], []])), 2, 2)
    features = torch.ones(1, 4)
    rows.skip(1, [7], features)
    assert seen == [(1, [7], features)]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.7)], ids=["greedy", "T=0.7"])
@pytest.mark.parametrize("drafting", ["draft K=3", "feature head K=2", "copy first, feature head K=2"])
def test_under_a_row_budget_rows_stay_exact_and_draft_less_in_a_full_batch(compact_pair, head_pair, params, drafting):
    """Continuous batching at most 3 rows at once, 4 verified positions a step: each row drafts K alone, 1 or none
    beside others (a step no row drafts in skips the drafter, which reads what it missed once rows leave and it
    drafts again), so fewer drafts are made than without the budget, every row still to its budget. Greedy rows
    give what RSp gives (a sampled row's law is verify's to check: K chosen from the past keeps it exact)."""
    target, draft = head_pair if "head" in drafting else compact_pair
    k = 3 if drafting == "draft K=3" else 2
    prompts = [torch.tensor(p) for p in JOINING]
    make = (lambda: CopyFirst(FeatureHead(draft), 1)) if "copy" in drafting else (lambda: drafter_for(draft))

    def generators() -> list:
        return [None if params.greedy else torch.Generator().manual_seed(s) for s in range(len(JOINING))]
    free = speculative_decode_batch(target, make(), prompts, 12, k, params, generators(), concurrency=3)
    held = speculative_decode_batch(target, make(), prompts, 12, k, params, generators(), concurrency=3, max_rows=4)
    # the last rows run alone and draft again after steps that drafted nothing
    assert any(o.stats.drafted for o in held[-1:])
    assert sum(o.stats.drafted for o in held) < sum(o.stats.drafted for o in free)
    assert all(o.stats.new_tokens == 12 or o.stopped for o in held)
    if params.greedy:
        rsp = batched.generate_regular_rows(target, prompts, 12, params, [None] * len(JOINING), concurrency=3)
        assert [o.tokens.tolist() for o in held] == [o.tokens.tolist() for o in rsp]
