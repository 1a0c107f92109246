"""One metric schema: each engine's counters, mapped onto α, τ and per-position acceptance, equal what the emitted
tokens say (greedy, replayed with the draft's own proposals). vLLM's and llama.cpp's own runs: in test_vllm.py and
test_llamacpp.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_llama

from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.drafters import generate_speculative
from lssp.report.metrics import SpecCounts, counts_of, replay_greedy

GREEDY = SamplingParams(0)


def greedy_proposer(draft):
    def propose(text: list[int], n: int) -> list[int]:
        return generate_regular(draft, torch.tensor([text]), n, GREEDY).tokens.tolist()
    return propose


def assert_same_counts(engine: SpecCounts, replayed: SpecCounts) -> None:
    assert engine == replayed
    for name in ("acceptance_rate", "alpha", "tokens_per_target_forward"):
        a, b = getattr(engine, name), getattr(replayed, name)
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b), name


def test_the_derived_metrics_follow_their_definitions():
    counts = SpecCounts(3, new_tokens=10)
    for drafted, accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        counts.step(drafted, accepted)
    assert (counts.target_forwards, counts.drafted, counts.accepted, counts.rejections) == (4, 11, 6, 2)
    assert counts.acceptance_rate == pytest.approx(6 / 11) and counts.alpha == pytest.approx(6 / 8)
    assert counts.tokens_per_target_forward == pytest.approx(10 / 4)
    assert counts.drafted_at == [4, 4, 3] and counts.accepted_at == [3, 2, 1]
    assert counts.acceptance_by_position == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert counts.acceptance_given_previous == pytest.approx([3 / 4, 2 / 3, 1 / 2])


@pytest.mark.parametrize("k", [1, 3])
def test_our_counters_equal_the_replay_of_our_tokens(k):
    target = tiny_llama(0, scale=4.0)
    draft = copy.deepcopy(target)  # the target with a perturbed output layer: it agrees often, not always
    with torch.no_grad():
        weight = draft.lm_head.weight
        weight.add_(0.7 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    for prompt in ([0, 5, 6, 7], [3, 9, 12, 30, 2], [7]):
        out = generate_speculative(target, draft, torch.tensor([prompt]), 24, k, GREEDY)
        assert out.stats.accepted and out.stats.rejections  # both accepting and rejecting happen here
        assert_same_counts(counts_of(out.stats), replay_greedy(prompt, out.tokens.tolist(), k, greedy_proposer(draft)))
