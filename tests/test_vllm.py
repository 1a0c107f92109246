"""--engine vllm: a real vLLM engine on tiny fp32 models (where vLLM is installed), and what needs no vLLM at all."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from conftest import TINY_REGISTRY, char_tokenizer, cli, save_tiny
from transformers import LlamaForCausalLM

from lssp.decoding.generation import DECODE_TIMING, FIRST_TO_LAST, WHOLE_COMPLETION, generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.engines import vllm as vllm_engine
from lssp.engines.vllm import (
    Counters,
    EngineModel,
    VllmEngines,
    drafted_flags,
    read_counters,
    stats_from_request,
)
from lssp.errors import UserError
from lssp.models.draft_head import attach_subset_head
from lssp.models.export import export_draft, probe_texts
from lssp.models.loading import load_model
from lssp.models.registry import load_registry

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.vllm]
GREEDY = SamplingParams(0.0)
PROMPTS = ([5, 6, 7, 8], [20, 21, 3, 22, 23, 9], [10, 11, 12, 13, 14, 15, 16, 17], [30, 4, 30, 4, 30])


def vllm_or_skip() -> None:
    """Skip where vLLM is not installed, saying how to install it; CI sets LLAMASSP_REQUIRE_VLLM=1 to fail instead."""
    if vllm_engine.vllm_version() is None:
        if os.environ.get("LLAMASSP_REQUIRE_VLLM") == "1":
            pytest.fail("LLAMASSP_REQUIRE_VLLM=1 but vLLM is not installed (./setup.sh --vllm)")
        pytest.skip("vLLM is not installed (./setup.sh --vllm installs it)")


# vLLM's CPU attention takes head sizes of 32 and more: 256 wide over 4 heads.
VLLM_REGISTRY = """\
default_target: v-target
default_draft: v-draft
models:
  v-target: {path: ./v-target, dtype: float32}
  v-draft: {path: ./v-draft, dtype: float32}
  v-same: {path: ./v-target, dtype: float32}
  v-head-draft: {path: ./v-head-draft, dtype: float32}
  v-pipeline: {path: ./v-target, dtype: float32, pipeline_parallel_size: 2}
  v-too-long: {path: ./v-target, dtype: float32, max_model_len: 100000}
  v-random: {init: random, config: llama-2-1b, tokenizer: ./v-target}
  v-8bit: {path: ./v-target, quantization: 8bit}
  v-tp2: {path: ./v-target, dtype: float32, tensor_parallel_size: 2}
"""


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    save_tiny(root / "v-target", 0, hidden=256, scale=4.0)
    save_tiny(root / "v-draft", 1, hidden=256, layers=1, scale=4.0)
    head = LlamaForCausalLM.from_pretrained(root / "v-draft")
    attach_subset_head(head, list(range(0, 64, 2))).save_pretrained(root / "v-head-draft")
    char_tokenizer().save_pretrained(root / "v-head-draft")
    (root / "models.yaml").write_text(VLLM_REGISTRY)
    return root


@pytest.fixture(scope="module")
def engines(vllm_dir):
    """One set of engines for the module: RSp, n-gram lookup at K=2, SSp with the draft at K=2 (started last: its
    counters are the ones get_metrics() reads)."""
    vllm_or_skip()
    registry = load_registry(vllm_dir / "models.yaml")
    target, draft = EngineModel(registry.get("v-target")), EngineModel(registry.get("v-draft"))
    return VllmEngines(target, draft, [(0, 0), (2, 2), (2, 0)])


@pytest.fixture()
def run(vllm_dir, tmp_path, capsys):
    return cli(capsys, vllm_dir / "models.yaml", tmp_path / "results")


# --- a real engine ----------------------------------------------------------------------------------------

def test_greedy_ssp_equals_rsp_in_vllm_and_ours(engines, vllm_dir):
    ours = load_model(load_registry(vllm_dir / "models.yaml").get("v-target"))
    for ids in PROMPTS:
        rsp = engines.generate(0, 0, ids, 12, GREEDY, 0, ignore_eos=True).output.tokens.tolist()
        ssp = engines.generate(2, 0, ids, 12, GREEDY, 0, ignore_eos=True).output.tokens.tolist()
        ngram = engines.generate(2, 2, ids, 12, GREEDY, 0, ignore_eos=True).output.tokens.tolist()
        mine = generate_regular(ours.model, torch.tensor([ids]), 12, GREEDY).tokens.tolist()
        assert rsp == ssp == ngram == mine
        assert len(rsp) == 12


def test_counter_deltas_add_up_over_two_requests(engines):
    assert engines.counted == (2, 0)
    assert engines.generate(2, 2, PROMPTS[3], 6, GREEDY, 0).counters is None  # not the engine counted
    llm = engines.engines[(2, 0)]
    before = read_counters(llm)
    first = engines.generate(2, 0, PROMPTS[0], 10, GREEDY, 0, ignore_eos=True)
    second = engines.generate(2, 0, PROMPTS[1], 10, GREEDY, 0, ignore_eos=True)
    total = read_counters(llm) - before
    assert first.counters.draft_tokens > 0 and second.counters.draft_tokens > 0
    assert total.draft_tokens == first.counters.draft_tokens + second.counters.draft_tokens
    assert total.accepted == first.counters.accepted + second.counters.accepted
    assert total.drafts == first.counters.drafts + second.counters.drafts
    for done in (first, second):  # the per-request record agrees with the counters
        stats = done.output.stats
        assert stats.drafted == done.counters.draft_tokens
        assert stats.accepted == done.counters.accepted
        assert sum(stats.accepted_at) == stats.accepted
        assert stats.new_tokens == 10 and stats.target_forwards >= 1 + done.counters.drafts


def test_vllms_counters_map_onto_our_metrics_as_its_tokens_say(engines, vllm_dir):
    """vLLM's per-request record (accepted and drafted per step), mapped onto our counts, equals the replay of its
    emitted tokens with the draft's greedy proposals (its prefill emits the first token, and every step drafts K
    however few tokens are left; same weights, float32)."""
    from test_metrics import assert_same_counts, greedy_proposer

    from lssp.report.metrics import counts_of, replay_greedy

    draft = load_model(load_registry(vllm_dir / "models.yaml").get("v-draft")).model
    for ids in PROMPTS:
        out = engines.generate(2, 0, ids, 12, GREEDY, 0, ignore_eos=True).output
        replayed = replay_greedy(ids, out.tokens.tolist(), 2, greedy_proposer(draft), first_from_prefill=True,
                                 drafts_past_budget=True)
        assert_same_counts(counts_of(out.stats), replayed)


def test_end_token_stops_vllm_and_flags_mark_drafts(engines):
    rsp = engines.generate(0, 0, PROMPTS[0], 12, GREEDY, 0, ignore_eos=True).output.tokens.tolist()
    stop = rsp[4]
    cut = rsp.index(stop) + 1
    for key in ((0, 0), (2, 0)):
        done = engines.generate(*key, PROMPTS[0], 12, GREEDY, 0, stop_ids={stop})
        assert done.output.tokens.tolist() == rsp[:cut]
        assert done.output.stopped
        assert len(done.drafted) == cut
    assert not any(engines.generate(0, 0, PROMPTS[0], 12, GREEDY, 0).drafted)


def test_streamed_tokens_and_flags_match_the_request_record(engines):
    for key in ((0, 0), (2, 0), (2, 2)):
        pieces, flags = [], []
        done = engines.generate(*key, PROMPTS[3], 12, GREEDY, 0, ignore_eos=True,
                                on_tokens=lambda t, d: (pieces.extend(t), flags.extend(d)))
        assert pieces == done.output.tokens.tolist()
        if key[1]:  # n-gram: not flagged (its output steps and per-step record disagree)
            assert not any(flags)
        else:
            assert flags == done.drafted and sum(flags) == done.output.stats.accepted


def test_ctrl_c_in_a_mixed_ours_and_vllm_run_keeps_whole_prompts(engines, vllm_dir):
    """The split pass runs our modes only: an interruption there keeps every timed prompt and the split pass's whole
    prompts, counted by its own modes."""
    from lssp.engines import OursEngine, VllmEngine
    from lssp.measure.latency import latency_modes, run_latency
    from lssp.models.loading import check_compatible

    registry = load_registry(vllm_dir / "models.yaml")
    target, draft = load_model(registry.get("v-target")), load_model(registry.get("v-draft"), draft=True)
    runners = {"ours": OursEngine(target, [draft], [check_compatible(target, draft)]), "vllm": VllmEngine(engines)}
    modes = latency_modes(["ours", "vllm"], [draft.name], [2], lookups=[0, 2])
    assert len(modes) == 6 and {VllmEngine.key(m) for m in modes if m.engine == "vllm"} == set(engines.engines)

    def stop(message: str, done: int, total: int) -> None:
        if message.startswith("prompt 2/3") and "split pass" in message:
            raise KeyboardInterrupt

    run = run_latency(target, runners, modes, ["abc", "hello there", "xyz"], "w", GREEDY, 6, 0, [draft],
                      progress=stop, split="separate", ignore_eos=True)
    timed = [t for t in run.timings if not t.split_pass]
    split = [t for t in run.timings if t.split_pass]
    assert run.interrupted and len(timed) == 3 * 6 and {t.engine for t in timed} == {"ours", "vllm"}
    assert len(split) == 3 and {t.prompt_index for t in split} == {0} and {t.engine for t in split} == {"ours"}
    assert {row["engine"] for row in run.summary_json()} == {"ours", "vllm"}


def test_latency_engine_vllm_writes_rows(run, tmp_path):
    vllm_or_skip()
    code, out, err = run("latency", "--engine", "ours,vllm", "--k", "2", "--lookup", "0,2", "--nb-prompts", "2",
                         "--max-new-tokens", "8", "--ignore-eos", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "vLLM RSp" in out and "ours ÷ vLLM ms/token" in out and "2 ngram 2" in out
    verdicts = [line.split(":")[0] for line in out.splitlines() if line.startswith("verdict")]
    assert verdicts == ["verdict (ours)", "verdict (vLLM)"]  # one line per engine, each named
    assert all(len(line) <= 80 for line in out.splitlines())
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    vllm_rows = rows[rows.engine == "vllm"]
    assert set(vllm_rows.method) == {"none", "draft_model (greedy)", "ngram"}
    assert set(rows[rows.engine == "ours"].method) == {"none", "draft", "draft+lookup"}
    assert (vllm_rows.vllm.astype(str).str.len() > 0).all()
    assert vllm_rows[vllm_rows["mode"] == "ssp"].speedup.notna().all()
    assert (rows.decode_timing == DECODE_TIMING).all()  # one definition for every engine
    assert (vllm_rows.timing_basis == FIRST_TO_LAST).all()  # vLLM's request timestamps time its first token
    summary = json.loads((tmp_path / "l.json").read_text())
    assert len(summary) == 6


def test_eval_and_compare_through_vllm(run):
    vllm_or_skip()
    code, out, err = run("eval", "--engine", "vllm", "--both", "--nb-prompts", "3", "--k", "2")
    assert code == 0, err
    assert "in vLLM" in " ".join(out.split())
    code, out, err = run("compare", "--engine", "vllm", "--k", "2", "--prompt", "abc", "--max-new-tokens", "6")
    assert code == 0, err
    assert "in vLLM" in " ".join(out.split()) and "speedup" in out


def test_bench_with_vllm_as_rival(run, tmp_path):
    vllm_or_skip()
    code, out, err = run("bench", "--engine", "vllm", "--k", "2", "--nb-prompts", "2", "--max-new-tokens", "6")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "bench.csv").set_index("engine")
    assert list(rows.index) == ["ours-rsp", "vllm-rsp", "ours-ssp", "vllm-ssp"]
    assert rows.loc[["ours-rsp", "ours-ssp"], "ours_over_vllm_median"].notna().all()
    assert rows.loc["vllm-ssp", "vllm_ssp_equals_vllm_rsp"] == 1.0  # greedy, fp32: the same tokens
    assert "ours÷it" in out and all(len(line) <= 80 for line in out.splitlines())


def test_a_frequent_token_head_draft_runs_through_its_export(run, tmp_path, monkeypatch):
    vllm_or_skip()
    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "cache"))  # the export stays out of the user's cache
    code, out, err = run("latency", "v-target", "--draft", "v-head-draft", "--engine", "vllm", "--k", "2",
                         "--nb-prompts", "1", "--max-new-tokens", "6")
    assert code == 0, err


@pytest.mark.parametrize("needs_vllm, args, message", [
    (False, ("latency", "--engine", "vllm", "--draft-confidence", "0.5"), "--draft-confidence has no vLLM equivalent"),
    (True, ("latency", "v-pipeline", "--draft", "v-draft", "--engine", "vllm"), "pipeline parallelism"),
    (True, ("latency", "v-too-long", "--engine", "vllm", "--nb-prompts", "1"), "vLLM could not start v-too-long"),
    (True, ("latency", "v-random", "--engine", "vllm"), "not 'init: random'"),
    (True, ("latency", "v-8bit", "--engine", "vllm"), "no 8bit load-time quantization"),
    (False, ("latency", "--engine", "torch"), "--engine 'torch'"),
    (False, ("compare", "--engine", "ours,vllm", "--prompt", "a"), "one engine at a time"),
    (False, ("bench", "--engine", "ours"), "--engine 'ours'"),
])
def test_bad_vllm_input_is_one_line(run, needs_vllm, args, message):
    if needs_vllm:
        vllm_or_skip()
    code, out, err = run(*args)
    assert code != 0
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# --- no vLLM needed ---------------------------------------------------------------------------------------

def test_without_vllm_the_line_says_how_to_install(run, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: None)
    code, _, err = run("latency", "--engine", "vllm")
    assert code != 0
    assert "./setup.sh --vllm" in err and len(err.strip().splitlines()) == 1


def test_stats_from_a_request_follow_our_definitions():
    metrics = SimpleNamespace(first_token_ts=10.0, last_token_ts=10.9, first_token_latency=0.2)
    # prefill: 1 token; steps accept 2, 0, 1 of 2 drafts: 3 + 1 + 2 tokens; one step without drafts: 1 token
    stats = stats_from_request("ssp", 2, 8, 1.2, metrics, [2, 0, 1], [2, 2, 2])
    assert stats.drafted == 6 and stats.accepted == 3 and stats.rejections == 2
    assert stats.target_forwards == 1 + 3 + 1
    assert stats.drafted_at == [3, 3] and stats.accepted_at == [2, 1]
    assert stats.decode_time_s == pytest.approx(0.9 * 8 / 7)
    assert stats.ms_per_token == pytest.approx(1000 * 0.9 / 7)
    assert stats.ttft_s == 0.2
    rsp = stats_from_request("rsp", 0, 5, 1.0, metrics, [], [])
    assert rsp.target_forwards == 5 and rsp.drafted == 0
    assert stats.first_emission_tokens == 1 and stats.timing_basis == FIRST_TO_LAST  # its prefill emits one token


def test_stats_without_a_first_token_time_fall_back_to_the_whole_request_and_say_so():
    """Where vLLM gives no first-token time, ms/token is the whole request's (prefill included), marked as such,
    instead of the prefill silently counting as decode."""
    stats = stats_from_request("rsp", 0, 8, 1.2, SimpleNamespace(last_token_ts=10.9, first_token_latency=0.2), [], [])
    assert stats.timing_fallback and stats.timing_basis == WHOLE_COMPLETION
    assert stats.ms_per_token == pytest.approx(1000 * 1.2 / 8)
    one = stats_from_request("rsp", 0, 1, 0.3, SimpleNamespace(first_token_ts=10.0, last_token_ts=10.0), [], [])
    assert one.timing_fallback and one.ms_per_token == pytest.approx(300)  # one token: nothing after the first


def test_drafted_flags():
    assert drafted_flags(6, [2, 1]) == [False, True, True, False, True, False]
    assert drafted_flags(4, [2, 1]) == [False, True, True, False]  # the budget cut the last step
    assert drafted_flags(8, [2, 1]) is None  # steps without drafts: vLLM does not say where


def test_counters_subtract_per_position():
    assert (Counters(3, 9, 5, (3, 2)) - Counters(1, 3, 2, (1,))) == Counters(2, 6, 3, (2, 2))


def test_export_keeps_the_head_and_holds_the_rest_down(tmp_path):
    save_tiny(tmp_path / "d", 1, hidden=256, layers=1, scale=4.0)
    head_ids = list(range(3, 40))
    model = attach_subset_head(LlamaForCausalLM.from_pretrained(tmp_path / "d"), head_ids)
    model.save_pretrained(tmp_path / "h")
    char_tokenizer().save_pretrained(tmp_path / "h")
    report = export_draft(tmp_path / "h", tmp_path / "out")
    assert report.min_projection > 0 and report.excluded_mass < 1e-6
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert "head_token_ids" not in json.loads((tmp_path / "out" / "config.json").read_text())
    # Held down where the draft's states look like those of the probe texts (a random draft elsewhere need not be)
    ids = torch.tensor([char_tokenizer()(probe_texts()[0][:40].lower()).input_ids])
    with torch.no_grad():
        full = exported(ids).logits[0]
        subset = model(ids).logits[0]
    torch.testing.assert_close(full[:, head_ids], subset[:, head_ids])
    excluded = [i for i in range(64) if i not in head_ids]
    assert (full[:, excluded].max(-1).values < full[:, head_ids].max(-1).values - 10).all()
    assert full.softmax(-1)[:, excluded].sum(-1).max() < 1e-6


def test_registry_takes_vllm_keys_and_refuses_bad_values(tmp_path):
    good = TINY_REGISTRY + ("  tiny-tp:\n    path: ./tiny-target\n    gpus: 8\n    pipeline_parallel_size: 2\n"
                            "    distributed_executor_backend: ray\n    gpu_memory_utilization: 0.85\n"
                            "    max_model_len: 4096\n    enforce_eager: false\n    speculative_method: eagle\n")
    (tmp_path / "models.yaml").write_text(good)
    spec = load_registry(tmp_path / "models.yaml").get("tiny-tp")
    assert (spec.pipeline_parallel_size, spec.distributed_executor_backend, spec.speculative_method) == (2, "ray", "eagle")
    kwargs = vllm_engine.engine_kwargs(spec, "/x", 2)
    assert kwargs["tensor_parallel_size"] == 8 and kwargs["pipeline_parallel_size"] == 2
    assert kwargs["max_model_len"] == 4096 and kwargs["enforce_eager"] is False
    for key, value in (("gpu_memory_utilization", "1.5"), ("distributed_executor_backend", "slurm"),
                       ("speculative_method", "magic"), ("max_model_len", "0"), ("enforce_eager", "maybe")):
        (tmp_path / "models.yaml").write_text(TINY_REGISTRY + f"  bad:\n    path: ./tiny-target\n    {key}: {value}\n")
        with pytest.raises(UserError, match=rf"models.yaml:\d+: model 'bad': bad {key}"):
            load_registry(tmp_path / "models.yaml")


def test_tensor_parallel_on_a_cpu_binds_one_core_group_per_worker_and_refuses_more_workers_than_cores(
        tmp_path, monkeypatch):
    assert vllm_engine.cpu_core_groups([0, 1], 2) == "0|1"
    assert vllm_engine.cpu_core_groups(list(range(8)), 2) == "0-3|4-7"
    (tmp_path / "models.yaml").write_text(TINY_REGISTRY + "  tp:\n    path: ./tiny-target\n    tensor_parallel_size: 3\n")
    spec = load_registry(tmp_path / "models.yaml").get("tp")
    assert vllm_engine.engine_kwargs(spec, "/x", 1)["tensor_parallel_size"] == 3
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(UserError, match="tensor_parallel_size 3 on a CPU needs a core per worker; .* may use 2"):
        vllm_engine.bind_cpu_workers(spec)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    vllm_engine.bind_cpu_workers(replace(spec, tensor_parallel_size=2))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


@pytest.mark.slow
def test_latency_with_a_two_worker_tensor_parallel_target(run, tmp_path, monkeypatch):
    """Tensor parallelism for real: the target's layers split over two vLLM worker processes, one per core; its
    draft (the target itself, in one process) is kept as a greedy target keeps its own tokens."""
    vllm_or_skip()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    sizes = []
    kwargs_of = vllm_engine.engine_kwargs
    monkeypatch.setattr(vllm_engine, "engine_kwargs", lambda *a: sizes.append(kwargs_of(*a)["tensor_parallel_size"])
                        or kwargs_of(*a))
    code, out, err = run("latency", "v-tp2", "--draft", "v-same", "--engine", "vllm", "--k", "2", "--nb-prompts", "2",
                         "--max-new-tokens", "8", "--ignore-eos", "--temperature", "0", "--no-baseline")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert set(rows["mode"]) == {"ssp"} and (rows["engine"] == "vllm").all()  # SSp alone: one engine to start
    assert sizes == [2] and os.environ["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # two workers
    assert (rows[rows["mode"] == "ssp"]["acceptance_rate"] > 0.9).all()  # the target as its own draft: all kept


def test_pipeline_parallel_with_speculation_is_refused_before_loading(tmp_path):
    (tmp_path / "models.yaml").write_text(TINY_REGISTRY + "  pp:\n    path: ./tiny-target\n    pipeline_parallel_size: 2\n")
    spec = load_registry(tmp_path / "models.yaml").get("pp")
    with pytest.raises(UserError, match="pipeline parallelism"):
        vllm_engine.check_placement(spec, speculative=True)
    vllm_engine.check_placement(spec, speculative=False)


def _target_and_head(folder):
    """The target saved in ``folder``/t and the head in ``folder``/h, as vLLM's engine takes them."""
    (folder / "models.yaml").write_text("models:\n  t: {path: ./t, dtype: float32}\n  h: {path: ./h, dtype: float32}\n")
    registry = load_registry(folder / "models.yaml")
    target = EngineModel(registry.get("t"))
    return target, EngineModel(registry.get("h"), target)

def test_vllm_runs_our_feature_head_with_its_eagle_method(tmp_path):
    """Our heads are written in EAGLE's layout: vLLM's eagle method loads one as it is. On a planted head that
    is nearly always right (it reads the features a little), vLLM's greedy tokens equal our RSp's and it accepts
    about as much as ours."""
    vllm_or_skip()
    from conftest import char_tokenizer, tiny_llama

    from lssp.drafters import generate_speculative
    from lssp.models.eagle import FeatureDraft, FeatureHead, head_config, save_feature_head

    target = tiny_llama(12, hidden=256, scale=4.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target.save_pretrained(tmp_path / "t")
    char_tokenizer().save_pretrained(tmp_path / "t")
    torch.manual_seed(2)
    head = FeatureHead(head_config(target.config)).eval()
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :256] = torch.eye(256)
        head.fc.weight[:, 256:] = 2e-4 * torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    save_feature_head(head, tmp_path / "h", dtype=torch.float32)
    t, h = _target_and_head(tmp_path)
    assert h.draft_kind == "eagle" and vllm_engine.speculative_config(2, 0, h)["method"] == "eagle"
    engines = VllmEngines(t, h, [(3, 0)])
    ours = FeatureDraft(head, target)
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([prompt])
        done = engines.generate(3, 0, prompt, 16, GREEDY, 0, ignore_eos=True)
        want = generate_regular(target, ids, 16, GREEDY).tokens.tolist()
        assert done.output.tokens.tolist() == want
        mine = generate_speculative(target, ours, ids, 16, 3, GREEDY).stats
        theirs = done.output.stats
        assert theirs.acceptance_rate >= 0.75 and mine.acceptance_rate >= 0.75, (theirs.acceptance_rate, mine.acceptance_rate)



def test_vllm_runs_a_published_eagle3_head_with_its_eagle3_method(tmp_path):
    """An EAGLE-3 head in its published layout goes to vLLM as it is (method eagle3, its three target layers). On a
    target whose layers add nothing (its next token a function f of the current one) and a head planted to read
    f(f(token)) off ``fc``'s copy of the target's state (its layer adding nothing either), vLLM's greedy tokens are
    our RSp's and it accepts the drafts ours accepts (its first ones; the second reads the fed-back state)."""
    vllm_or_skip()
    from conftest import char_tokenizer, tiny_llama
    from test_eagle3 import publish

    from lssp.drafters import generate_speculative
    from lssp.models.compact import CompactLlama
    from lssp.models.eagle3 import Eagle3Draft, load_eagle3_head

    target = tiny_llama(14, hidden=256, layers=4, scale=4.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        unit = torch.nn.functional.normalize(target.model.embed_tokens.weight, dim=-1)
        f = target(torch.arange(64)[:, None]).logits[:, -1].argmax(-1)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer().save_pretrained(tmp_path / "t")
    draft_ids = list(range(8, 56))  # 48 of the 64 tokens
    rows = torch.stack([unit[f[f] == y].sum(0) for y in draft_ids]) * 50  # logit of y: 50 where f(f(x)) = y
    planted = {"fc.weight": torch.cat([torch.eye(256), torch.zeros(256, 512)], 1), "norm.weight": torch.ones(256),
               "midlayer.self_attn.o_proj.weight": torch.zeros(256, 256),
               "midlayer.mlp.down_proj.weight": torch.zeros(256, 512), "lm_head.weight": rows}
    publish(tmp_path / "h", target, draft_ids, seed=5, planted=planted)
    t, h = _target_and_head(tmp_path)
    assert h.draft_kind == "eagle" and vllm_engine.speculative_config(2, 0, h)["method"] == "eagle3"
    engines = VllmEngines(t, h, [(2, 0)])
    compact = CompactLlama(target)
    ours = Eagle3Draft(load_eagle3_head(tmp_path / "h", target), compact, torch.float32)
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([prompt])
        done = engines.generate(2, 0, prompt, 16, GREEDY, 0, ignore_eos=True)
        assert done.output.tokens.tolist() == generate_regular(compact, ids, 16, GREEDY).tokens.tolist()
        mine, theirs = generate_speculative(compact, ours, ids, 16, 2, GREEDY).stats, done.output.stats
        # the same drafts accepted, but for the last iteration at the token budget, which vLLM counts its own way
        assert abs(theirs.accepted - mine.accepted) <= 1 and mine.accepted >= 6, (theirs.accepted, mine.accepted)

def test_verify_audits_vllm_beside_ours(run, tmp_path):
    vllm_or_skip()
    code, out, err = run("verify", "--engine", "ours,vllm", "--samples", "200", "--nb-prompts", "1", "--depth", "1",
                         "--k", "2", "--effect", "1", "--temperature", "0.8", "--json", str(tmp_path / "v.json"))
    assert code in (0, 1), err
    reports = json.loads((tmp_path / "v.json").read_text())
    assert [r["engine"] for r in reports] == ["ours", "vllm"] and "verdict (vllm, K=2)" in out
    vllm_checks = reports[1]["checks"]
    assert vllm_checks and all(c["two_sample_p"] is not None and c["rsp_samples"] >= 20 for c in vllm_checks)
    assert reports[0]["lossless"] and code == (0 if reports[1]["lossless"] else 1)


def test_sampled_ssp_through_vllm_cpu_names_the_known_bug():
    from importlib.metadata import PackageNotFoundError, version

    from lssp.engines.vllm import CPU_SAMPLING_BUG, sampled_ssp_caveat

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("not vllm-cpu")
    assert sampled_ssp_caveat(SamplingParams(0.7)) == CPU_SAMPLING_BUG and "#55005" in CPU_SAMPLING_BUG
    assert sampled_ssp_caveat(GREEDY) == ""
