"""Clocks wait for every GPU the models use; cache rollbacks never empty a cache (CPU-checkable parts of
the GPU path)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lssp.decoding.timing
from lssp.decoding.generation import generate_regular
from lssp.decoding.kv import drop, forward_logits, new_cache
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.timing import Clock, cuda_devices
from lssp.drafters import generate_speculative


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


def test_a_models_devices_are_walked_once_and_again_after_it_moves(monkeypatch):
    """A clock is made per request: walking every weight each time cost eval ~10 ms per problem."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    walks = []
    real = torch.nn.Module.buffers
    monkeypatch.setattr(torch.nn.Module, "buffers", lambda self, *a, **k: walks.append(1) or real(self, *a, **k))
    for _ in range(3):
        assert cuda_devices(model) == []
    assert len(walks) == 1
    model.to(torch.float64)  # same device: still known
    cuda_devices(model)
    assert len(walks) == 1
    moved = SimpleNamespace(device=torch.device("cuda:1"))  # as if moved to a GPU: the first weight's device changed
    monkeypatch.setattr(torch.nn.Module, "parameters", lambda self, *a, **k: iter([moved]))
    assert cuda_devices(model) == [torch.device("cuda:1")]
    assert len(walks) == 2


def test_generation_times_with_every_device_of_both_models(target, draft, synced, monkeypatch):
    """SSp's clock covers the target's and the draft's devices; RSp's the target's."""
    seen: list[tuple] = []

    def fake_devices(*models):
        seen.append(models)
        return [torch.device("cuda:0"), torch.device("cuda:1")]

    monkeypatch.setattr(lssp.decoding.timing, "cuda_devices", fake_devices)
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


@pytest.fixture()
def two_fake_gpus(monkeypatch):
    """Every clock believes the models sit on cuda:0 and cuda:1 (no GPU needed)."""
    monkeypatch.setattr(lssp.decoding.timing, "cuda_devices", lambda *models: [torch.device("cuda:0"), torch.device("cuda:1")])


@pytest.mark.parametrize("speculative", [False, True])
def test_untimed_forwards_sync_only_at_the_completions_boundaries(target, draft, synced, two_fake_gpus, speculative):
    """Without per-forward timing a completion syncs at start, end of prefill, first token and end, however
    long it is; with it, around every forward. The split is then recorded as not measured."""
    ids = torch.tensor([[0, 5, 6, 7]])

    def run(tokens: int, time_forwards: bool):
        synced.clear()
        if speculative:
            out = generate_speculative(target, draft, ids, tokens, 3, SamplingParams(0), time_forwards=time_forwards)
        else:
            out = generate_regular(target, ids, tokens, SamplingParams(0), time_forwards=time_forwards)
        return out.stats, len(synced) // 2  # two devices: readings = syncs / 2

    short, readings_short = run(4, time_forwards=False)
    long, readings_long = run(20, time_forwards=False)
    assert readings_short == readings_long == 4
    assert not long.forwards_timed and long.target_time_s == long.draft_time_s == 0.0
    timed, readings_timed = run(20, time_forwards=True)
    assert timed.forwards_timed
    assert readings_timed == 4 + 2 * (timed.target_forwards + timed.draft_forwards)


def test_a_separate_split_pass_gives_the_shares_and_the_timed_passes_give_ms_per_token(target, draft, synced,
                                                                                          two_fake_gpus):
    from lssp.measure.latency import SEPARATE_PASS, run_latency_ours
    from lssp.models.loading import LoadedModel
    from lssp.models.registry import ModelSpec

    t, d = LoadedModel(ModelSpec("t"), target, None), LoadedModel(ModelSpec("d"), draft, None)
    run = run_latency_ours(t, d, ["abc", "hello"], "warm", [2], SamplingParams(0), 6, 0, repeats=2)  # split="auto"
    assert run.setup.split_timing == SEPARATE_PASS
    headline = [p for p in run.timings if not p.split_pass]
    split = [p for p in run.timings if p.split_pass]
    assert len(headline) == 2 * 2 * 2 and len(split) == 2 * 2  # 2 passes + 1 split pass, 2 prompts, 2 modes
    assert not any(p.stats.forwards_timed for p in headline) and all(p.stats.forwards_timed for p in split)
    assert run.prompts_done == 4
    for m in run.summaries:
        mine = [p.stats for p in headline if p.mode == m.mode]
        assert m.ms_per_token == pytest.approx(1000 * sum(s.timed_s for s in mine) / sum(s.timed_tokens for s in mine))
        assert 0 < m.target_share <= 1
    assert all(row["split_timing"] == SEPARATE_PASS for row in run.rows())
    assert "separate pass synchronized around every forward" in run.markdown()
    assert run.cost_ratio == run.cost_ratio  # measured (not nan) from the split pass


def test_on_the_cpu_the_timed_passes_time_every_forward(target, draft):
    from lssp.measure.latency import SAME_PASS, run_latency_ours
    from lssp.models.loading import LoadedModel
    from lssp.models.registry import ModelSpec

    t, d = LoadedModel(ModelSpec("t"), target, None), LoadedModel(ModelSpec("d"), draft, None)
    run = run_latency_ours(t, d, ["abc"], "warm", [2], SamplingParams(0), 6, 0)
    assert run.setup.split_timing == SAME_PASS and not any(p.split_pass for p in run.timings)
    assert all(p.stats.forwards_timed for p in run.timings)


def test_bench_on_a_gpu_times_ours_end_to_end_and_takes_c_and_v_from_a_split_pass(target, draft, synced,
                                                                                   two_fake_gpus):
    from lssp.measure.bench import run_bench
    from lssp.measure.latency import SEPARATE_PASS
    from lssp.models.loading import LoadedModel
    from lssp.models.registry import ModelSpec

    t, d = LoadedModel(ModelSpec("t"), target, None), LoadedModel(ModelSpec("d"), draft, None)
    run = run_bench(t, d, ["abc", "hello"], "warm", 2, SamplingParams(0), 6, 0, engines=("ours-rsp", "ours-ssp"))
    timed = [r for r in run.runs if not r.split_pass]
    assert len(timed) == 4 and len([r for r in run.runs if r.split_pass]) == 4
    assert all(r.target_ms_per_forward != r.target_ms_per_forward for r in timed)  # nan: not measured there
    assert run.cost_ratio > 0 and run.verify_ratio > 0 and 0 <= run.ssp_overhead_share <= 1
    assert run.setup.prompts == 2 and run.setup.split_timing == SEPARATE_PASS
    assert all(row["split_timing"] == SEPARATE_PASS for row in run.rows())


def test_a_bad_split_choice_is_one_line_before_anything_loads(tiny_dir, tmp_path, capsys):
    from lssp.cli import main

    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path), "latency", "--split",
                 "sometimes"])
    err = capsys.readouterr().err
    assert code == 2 and "--split 'sometimes': expected one of auto, same, separate" in err and "Traceback" not in err
