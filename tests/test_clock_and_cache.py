"""Clocks wait for every GPU the models use; cache rollbacks never empty a cache (CPU-checkable parts of
the GPU path)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lssp.timing
from lssp.generation import drop, forward_logits, generate_regular, generate_speculative, new_cache
from lssp.sampling import SamplingParams
from lssp.timing import Clock, cuda_devices


@pytest.fixture()
def synced(monkeypatch) -> list[torch.device]:
    """The devices torch.cuda.synchronize is called with (no GPU needed)."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_a_clock_syncs_each_cuda_device_once_and_no_other(synced):
    Clock(["cuda:1", "cpu", "cuda:0", torch.device("cuda:1")]).now()
    assert synced == [torch.device("cuda:0"), torch.device("cuda:1")]
    synced.clear()
    Clock("cpu").now()
    Clock().now()
    assert synced == []


def test_cuda_devices_lists_every_device_a_split_model_spans():
    class Split:  # stands in for a model accelerate spread over GPUs and the CPU
        def parameters(self):
            return [SimpleNamespace(device=torch.device(d)) for d in ("cuda:2", "cuda:0", "cpu")]

        def buffers(self):
            return [SimpleNamespace(device=torch.device("cuda:3"))]

    assert cuda_devices(Split()) == [torch.device(f"cuda:{i}") for i in (0, 2, 3)]
    assert cuda_devices(torch.nn.Linear(2, 2)) == []


def test_generation_times_with_every_device_of_both_models(target, draft, synced, monkeypatch):
    """SSp's clock covers the target's and the draft's devices; RSp's the target's."""
    seen: list[tuple] = []

    def fake_devices(*models):
        seen.append(models)
        return [torch.device("cuda:0"), torch.device("cuda:1")]

    monkeypatch.setattr(lssp.timing, "cuda_devices", fake_devices)
    ids = torch.tensor([[0, 5, 6, 7]])
    generate_speculative(target, draft, ids, 6, 3, SamplingParams(0))
    assert seen == [(target, draft)]
    assert synced and set(synced) == {torch.device("cuda:0"), torch.device("cuda:1")}
    assert synced.count(torch.device("cuda:0")) == synced.count(torch.device("cuda:1"))  # every reading waits on both
    seen.clear()
    generate_regular(target, ids, 4, SamplingParams(0))
    assert seen == [(target,)]


def test_drop_zero_keeps_the_cache(target):
    kv = new_cache(target)
    forward_logits(target, torch.tensor([[0, 5, 6, 7, 8]]), kv, 1)
    drop(kv, 0)
    drop(kv, -1)
    assert kv.get_seq_length() == 5
    drop(kv, 2)
    assert kv.get_seq_length() == 3


def test_full_acceptance_never_refeeds_the_sequence(target, monkeypatch):
    """Draft = target: every draft is accepted, the case where crop(0) empties the cache in transformers
    before 5.17 (emulated here). After the prefills, no forward may be fed more than K drafts and one token."""
    from transformers import DynamicCache

    crop = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: crop(self, -self.get_seq_length() if n == 0 else n))
    fed: list[int] = []
    hook = target.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)
    try:
        k, prompt = 4, torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11]])
        out = generate_speculative(target, target, prompt, 30, k, SamplingParams(0))
    finally:
        hook.remove()
    assert out.stats.accepted == out.stats.drafted > 0  # every draft accepted
    assert max(fed[2:]) <= k + 1, fed  # fed[0], fed[1]: the two prefills (target, then draft)
