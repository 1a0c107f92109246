"""Feature-level drafts (EAGLE): exactness, the features the head reads, its cache, the published format."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import random_head, tiny_llama
from test_generation import two_token_counts

import lssp.decoding.verification as verification
import lssp.models.eagle as eagle
from lssp.decoding.generation import generate_regular
from lssp.decoding.kv import new_cache
from lssp.decoding.sampling import SamplingParams, warp
from lssp.drafters import generate_speculative
from lssp.errors import UserError
from lssp.models.compact import CompactLlama
from lssp.models.eagle import FeatureDraft, FeatureHead, load_feature_head, save_feature_head
from lssp.report.stats import chi_square_gof

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[0, 5, 9, 3], [0, 17], [0, 40, 41, 42, 43, 44, 45, 46], [7]]


@pytest.fixture(scope="module")
def target(soft_target):
    return soft_target


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, 1)


def planted_right(noise: float = 0.0) -> tuple[torch.nn.Module, FeatureHead]:
    """A target whose layers add nothing (its feature at t is the norm of token t's embedding) and a head
    that returns the next token's embedding: the same argmax, so every greedy draft must pass. ``noise``
    mixes some of the feature in, so the head reads it and is sometimes wrong."""
    model = tiny_llama(12, scale=4.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    head = random_head(model, 2)
    width = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :width] = torch.eye(width)
        head.fc.weight[:, width:] = noise * torch.randn(width, width, generator=torch.Generator().manual_seed(0))
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return model, head


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_ssp_with_a_feature_head_equals_greedy_rsp(target, head, k, compact):
    model = CompactLlama(target).eval() if compact else target
    draft = FeatureDraft(head, model)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want = generate_regular(model, ids, 20, GREEDY).tokens
        got = generate_speculative(model, draft, ids, 20, k, GREEDY)
        assert torch.equal(got.tokens, want), (prompt, k)
        assert got.stats.drafted > 0 or len(prompt) == 1


def test_a_head_planted_to_be_right_has_every_greedy_draft_accepted():
    model, head = planted_right()
    draft = FeatureDraft(head, model)
    for k in (1, 3):
        out = generate_speculative(model, draft, torch.tensor([[0, 5, 9, 3]]), 24, k, GREEDY)
        assert out.stats.accepted == out.stats.drafted > 0
        assert torch.equal(out.tokens, generate_regular(model, torch.tensor([[0, 5, 9, 3]]), 24, GREEDY).tokens)


def _recorded_pairs(monkeypatch) -> list[tuple[list[int], torch.Tensor]]:
    """(tokens, features) of every head forward that read real features."""
    pairs = []
    forward = FeatureDraft.forward

    def spy(self, input_ids, past_key_values, *args, **kwargs):
        if past_key_values.queued is not None:
            pairs.append((input_ids[0].tolist(), past_key_values.queued[0].clone()))
        return forward(self, input_ids, past_key_values, *args, **kwargs)

    monkeypatch.setattr(FeatureDraft, "forward", spy)
    return pairs


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0)], ids=["greedy", "t1.0"])
def test_the_head_reads_the_feature_of_the_token_before_each_token(params, monkeypatch):
    """Each token x_{j+1} the head reads with real features comes with the target's final hidden state at j,
    also after partial acceptances (the head's guesses are dropped, the real features queued)."""
    target, head = planted_right(noise=0.002)
    pairs = _recorded_pairs(monkeypatch)
    prompt = torch.tensor([[0, 5, 9, 3]])
    out = generate_speculative(target, FeatureDraft(head, target), prompt, 24, 3, params, torch.Generator().manual_seed(3))
    assert 0 < out.stats.accepted < out.stats.drafted  # partial acceptances happened
    seq = torch.cat([prompt[0], out.tokens])
    with torch.no_grad():
        real = target.model(input_ids=seq[None]).last_hidden_state[0]
    at = 1  # the head's first pair is (f_0, x_1)
    for tokens, features in pairs:
        assert tokens == seq[at: at + len(tokens)].tolist()
        torch.testing.assert_close(features, real[at - 1: at - 1 + len(tokens)], atol=1e-4, rtol=1e-4)
        at += len(tokens)
    assert at >= len(seq) - 4  # every position but the last iteration's was read with real features


def test_a_feature_fed_one_position_off_is_caught(monkeypatch):
    target, head = planted_right(noise=0.002)
    pairs = _recorded_pairs(monkeypatch)
    queue = eagle.FeatureCache.queue
    monkeypatch.setattr(eagle.FeatureCache, "queue", lambda self, f: queue(self, torch.roll(f, 1, dims=1)))
    prompt = torch.tensor([[0, 5, 9, 3]])
    out = generate_speculative(target, FeatureDraft(head, target), prompt, 12, 3, GREEDY)
    seq = torch.cat([prompt[0], out.tokens])
    with torch.no_grad():
        real = target.model(input_ids=seq[None]).last_hidden_state[0]
    tokens, features = pairs[0]
    assert not torch.allclose(features, real[: len(tokens)], atol=1e-4)
    assert out.stats.accepted < out.stats.drafted  # and the head, reading the wrong features, drafts worse


def test_the_runtime_head_gives_the_training_forward_logits(target, head):
    """FeatureDraft over its cache, fed in pieces, equals FeatureHead's causal forward over the whole text."""
    ids = torch.tensor([[0, 5, 9, 3, 7, 8, 11, 2]])
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state
        predicted = head(target.model.embed_tokens(ids[:, 1:]), features[:, :-1])
        want = target.lm_head(predicted)[0]
    draft = FeatureDraft(head, target)
    with torch.inference_mode():
        kv = draft.new_cache()
        got = []
        for a, b in [(1, 4), (4, 5), (5, 8)]:
            kv.queue(features[:, a - 1: b - 1])
            got.append(draft(ids[:, a:b], kv).logits[0])
        torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
        kv.crop(-3)
        kv.queue(features[:, 4:7])
        torch.testing.assert_close(draft(ids[:, 5:8], kv).logits[0], want[4:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers", [1, 2])
def test_the_training_time_test_is_drafting_from_every_position(target, layers):
    """Step s of FeatureHead.unrolled at position j is what drafting gives at its (s+1)-th draft begun at j-s: the
    causal forward over the real features up to j-s followed by the head's own guesses (step 0: the forward)."""
    head = random_head(target, layers).eval()
    ids = torch.tensor([[0, 5, 9, 3, 7, 8, 11, 2, 4]])
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state[:, :-1]
        embeds = target.model.embed_tokens(ids[:, 1:])
        steps = head.unrolled(embeds, features, 4)
        torch.testing.assert_close(steps[0], head(embeds, features), atol=1e-5, rtol=1e-5)
        for step in range(1, 4):
            for j in range(step, features.shape[1]):
                fed = features[:, : j - step + 1]
                for _ in range(step + 1):  # the draft feeds its last guess back
                    guess = head(embeds[:, : fed.shape[1]], fed)[:, -1:]
                    fed = torch.cat([fed, guess], dim=1)
                torch.testing.assert_close(steps[step][:, j], guess[:, 0], atol=1e-5, rtol=1e-5)


def test_a_head_over_frequent_tokens_proposes_only_those(target):
    ids = list(range(0, 64, 2))
    draft = FeatureDraft(random_head(target, 3, token_ids=ids), target)
    out = generate_speculative(target, draft, torch.tensor([[0, 5, 9]]), 30, 3, GREEDY)
    assert torch.equal(out.tokens, generate_regular(target, torch.tensor([[0, 5, 9]]), 30, GREEDY).tokens)
    with torch.inference_mode():
        kv = draft.start(torch.tensor([[0, 5, 9]]), target.model(input_ids=torch.tensor([[0, 5]])).last_hidden_state)
        logits = draft(torch.tensor([[9]]), kv).logits[0, -1]
    assert torch.isinf(logits[1::2]).all() and torch.isfinite(logits[::2]).all()


# --- The law of the first two tokens (8-token vocabulary, as in test_generation) -------------------
# SSp is exact for any draft distribution q, so a head fed the wrong features only drafts worse (the
# alignment tests above catch that); what the law test catches is a q in the ratio that is not the one
# the head sampled from.
VOCAB, SIGNIFICANCE = 8, 0.001  # two_token_counts (test_generation) draws its 2,000 runs over these 8 tokens


@pytest.fixture(scope="module")
def small_pair():
    model = tiny_llama(30, vocab_size=VOCAB, hidden=16, layers=1, scale=3.0)
    return model, FeatureDraft(random_head(model, 31, scale=2.0), model)


def _exact_law(model, prompt, params) -> torch.Tensor:
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], params)
        rows = [warp(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1], params) for x in range(VOCAB)]
    return (p1[:, None] * torch.stack(rows)).flatten()


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4)], ids=["t1.0", "t0.7-topk4"])
def test_ssp_with_a_feature_head_recovers_the_target_distribution(small_pair, params):
    model, draft = small_pair
    prompt = torch.tensor([[1, 2, 3]])
    law = _exact_law(model, prompt, params)
    result = chi_square_gof(two_token_counts(CompactLlama(model), draft, prompt, params, k=2, batched=True),
                            law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_the_law_test_catches_a_ratio_without_the_heads_q(small_pair, monkeypatch):
    model, draft = small_pair
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    accepted_prefix = verification.accepted_prefix
    monkeypatch.setattr(verification, "on_kernel", lambda t: False)  # the rule in Python, where the bug is
    monkeypatch.setattr(verification, "accepted_prefix",
                        lambda p, q, drafts, g: accepted_prefix(p, torch.full_like(q, 1 / VOCAB), drafts, g))
    # the batched loop verifies through the function patched here
    result = chi_square_gof(two_token_counts(CompactLlama(model), draft, prompt, params, k=2, batched=True),
                            _exact_law(model, prompt, params).tolist())
    assert result.p_value < SIGNIFICANCE, result


# --- The published format --------------------------------------------------------------------------

def _published(folder, target, head: FeatureHead, extra: dict | None = None, drop: str | None = None) -> None:
    """``head`` as EAGLE's authors publish heads: pytorch_model.bin with fc (and its bias), layers.0 without
    input_layernorm, a copy of the target's embeddings; a plain Llama config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    state.update(extra or {})
    if drop:
        del state[drop]
    torch.save(state, folder / "pytorch_model.bin")
    config = head.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))


def test_a_published_head_loads_key_by_key_and_runs(tmp_path, target):
    head = random_head(target, 4, bias=True)
    _published(tmp_path / "eagle", target, head)
    assert eagle.is_feature_head(tmp_path / "eagle")
    loaded = load_feature_head(tmp_path / "eagle")
    assert loaded.fc.bias is not None
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.tensor([[0, 5, 9, 3]])
    out = generate_speculative(target, FeatureDraft(loaded, target), ids, 20, 3, GREEDY)
    assert torch.equal(out.tokens, generate_regular(target, ids, 20, GREEDY).tokens)


def test_our_heads_save_and_load_in_that_format(tmp_path, target, head):
    save_feature_head(head, tmp_path / "ours", dtype=torch.float32)
    assert eagle.is_feature_head(tmp_path / "ours")
    loaded = load_feature_head(tmp_path / "ours")
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("change, message", [
    ({"drop": "layers.0.mlp.down_proj.weight"}, "missing layers.0.mlp.down_proj.weight"),
    ({"extra": {"layers.1.mlp.down_proj.weight": torch.zeros(2, 2)}}, "unexpected layers.1.mlp.down_proj.weight"),
    ({"extra": {"d2t": torch.zeros(3)}}, "EAGLE-3"),
    ({"extra": {"fc.weight": torch.zeros(32, 96)}}, "fc takes 96 inputs"),
])
def test_a_head_whose_weights_do_not_match_is_refused_naming_the_key(tmp_path, target, change, message):
    _published(tmp_path / "bad", target, random_head(target, 5), **change)
    with pytest.raises(UserError, match=message):
        load_feature_head(tmp_path / "bad")


# --- Through the CLI (tiny-eagle in conftest's registry: a random head for tiny-target) -------------



def test_latency_times_a_head_beside_a_draft_in_one_run(run, tmp_path):
    import pandas as pd

    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft,tiny-eagle", "--k", "1,2", "--nb-prompts", "2",
                         "--max-new-tokens", "10")
    assert code == 0, err
    assert "SSp eagle" in out and "SSp draft" in out and "tiny-eagle" in out
    assert max(map(len, out.splitlines())) <= 80
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["method"]) == ["none", "draft", "draft", "eagle", "eagle"]
    assert list(rows["draft"].fillna("")) == ["", "tiny-draft", "tiny-draft", "tiny-eagle", "tiny-eagle"]
    assert (rows["speedup"].dropna() > 0).all() and rows["best"].sum() == 1
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    assert len(prompts) == 2 * 5 and set(prompts["draft"].fillna("")) == {"", "tiny-draft", "tiny-eagle"}


def test_verify_and_eval_run_a_head(run, tmp_path):
    code, out, err = run("verify", "tiny-target", "tiny-eagle", "--nb-prompts", "1", "--samples", "600", "--depth", "2",
                         "--effect", "1")
    assert code == 0 and "LOSSLESS" in out, out + err
    code, out, err = run("verify", "tiny-target", "tiny-eagle", "--nb-prompts", "2", "--temperature", "0")
    assert code == 0 and "identical" in out.lower(), out + err
    code, out, err = run("eval", "tiny-target", "--draft", "tiny-eagle", "--nb-prompts", "3", "--max-new-tokens", "4")
    assert code == 0, err


@pytest.mark.parametrize("args, message", [
    (("latency", "tiny-eagle"), "is a feature head (EAGLE): it drafts for a target"),
    (("bench", "tiny-target", "tiny-eagle", "--nb-prompts", "1"), "assisted generation cannot run the feature head"),
    (("latency", "tiny-target", "--draft", "tiny-eagle,tiny-eagle"), "names a draft twice"),
])
def test_what_a_head_cannot_do_is_one_line(run, args, message):
    code, out, err = run(*args)
    assert code != 0 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_head_of_another_width_is_refused(target):
    other = tiny_llama(40, hidden=16)
    with pytest.raises(UserError, match="is 16 wide, its target 32"):
        eagle.check_head_fits(random_head(other, 1), target, "narrow")


def test_distill_kind_eagle_makes_a_loadable_head_and_resumes(tiny_dir, tmp_path, capsys):
    from lssp.cli import main
    from lssp.distill import HELD_OUT_ACCEPTANCE
    from lssp.models.loading import check_compatible, load_model
    from lssp.models.registry import ModelSpec, load_registry

    out = tmp_path / "head"
    base = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
            "--kind", "eagle", "--out", str(out), "--batch-prompts", "4", "--new-tokens", "8", "--head-tokens", "40",
            "--data-tokens", "40"]
    assert main(base + ["--max-steps", "3"]) == 0, capsys.readouterr().err
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 3 and report["data_tokens"] >= 40 and 0 < report["head_coverage"] <= 1
    assert 0 <= report["acceptance"][HELD_OUT_ACCEPTANCE] <= 1
    card = (out / "README.md").read_text()
    assert "Feature head (EAGLE)" in card and "Made with: `" in card and "| step | target tokens seen | loss |" in card
    config = json.loads((out / "config.json").read_text())
    assert config[eagle.HEAD_MARK] and config["num_hidden_layers"] == 1 and len(config["head_token_ids"]) == 40
    assert not (out / "tokenizer.json").exists()  # the target's is used
    # Resume: more data and more steps go on from the checkpoint.
    assert main(base[:-1] + ["80", "--max-steps", "5"]) == 0, capsys.readouterr().err
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 5 and report["data_tokens"] >= 80
    assert [step for step, _, _ in report["loss_curve"]] == [3, 5]
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target"))
    head = load_model(ModelSpec(name="h", path=str(out), dtype="float32"), draft=True, target=target)
    assert head.draft_kind == "eagle" and check_compatible(target, head) == 64
    ids = torch.tensor([[0, 5, 9, 3]])
    want = generate_regular(target.model, ids, 12, GREEDY).tokens
    assert torch.equal(generate_speculative(target.model, head.model, ids, 12, 3, GREEDY).tokens, want)
    # A plain draft trained on the same collection keeps a checkpoint of its own, and the head's resumes after it.
    draft_out = tmp_path / "draft"
    assert main(base[:6] + ["--out", str(draft_out), "--data-dir", str(out / "work"), "--data-tokens", "80",
                            "--max-steps", "2", "--hidden-size", "16", "--layers", "1", "--heads", "2",
                            "--intermediate-size", "32", "--batch-prompts", "4", "--new-tokens", "8"]) == 0, capsys.readouterr().err
    assert json.loads((draft_out / "distill_report.json").read_text())["steps"] == 2
    assert {p.name for p in (out / "work").glob("checkpoint-*.pt")} == {"checkpoint-eagle.pt", "checkpoint-draft.pt"}
    assert main(base[:-1] + ["80", "--max-steps", "6"]) == 0, capsys.readouterr().err
    assert [step for step, _, _ in json.loads((out / "distill_report.json").read_text())["loss_curve"]] == [3, 5, 6]
    # Going on from the head on a new collection (another seed), unrolled over 3 steps: its tokens and weights are
    # the start, and the card continues the learning curve.
    more = tmp_path / "more"
    again = ["--config", str(tiny_dir / "models.yaml"), "--seed", "1", *base[4:6], "--kind", "eagle", "--out", str(more),
             "--init-draft", str(out), "--batch-prompts", "16", "--new-tokens", "8", "--data-tokens", "420",
             "--max-steps", "2", "--unroll", "3"]
    assert main(again) == 0, capsys.readouterr().err
    report = json.loads((more / "distill_report.json").read_text())
    assert report["config"]["unroll"] == 3 and report["started_from"]["path"] == str(out)
    assert report["started_from"]["steps"] == 6 and report["started_from"]["distinct_tokens"] >= 80
    ids = [json.loads((folder / "config.json").read_text())["head_token_ids"] for folder in (out, more)]
    assert ids[0] == ids[1]
    card = (more / "README.md").read_text()
    assert "## Learning curve across trainings" in card and f"started from the weights of `{out}`" in card
    assert "draft token 3 (on its own guesses)" in json.dumps(report["acceptance"])
    # The first collection, written again from the token ids it kept (--tokens-from), has its shards and tokens.
    kept = out / "work" / "data"
    tokens = json.loads((kept / "meta.json").read_text())["tokens"]
    again_dir = tmp_path / "again"
    assert main(base[:-1] + [str(tokens), "--data-dir", str(again_dir), "--tokens-from", str(kept / "tokens.npz"),
                             "--collect-only"]) == 0, capsys.readouterr().err
    rebuilt = json.loads((again_dir / "data" / "meta.json").read_text())
    assert rebuilt["tokens"] == tokens and rebuilt["shards"] == json.loads((kept / "meta.json").read_text())["shards"]
    assert all(f["rebuilt"] for f in rebuilt["files"]) and rebuilt["source"] == "built-in"
    # Asked for fewer tokens than the file holds, the rebuild stops there; stopped early, it says its prompts.
    from lssp.distill.collection import collection_model
    from lssp.distill.tokens import rebuild_shards

    first = json.loads((kept / "meta.json").read_text())["files"]
    part = tmp_path / "part" / "data"
    wanted = first[0]["tokens"] + 1  # into the second shard
    assert len(first) > 2 and rebuild_shards(collection_model(target.model), kept / "tokens.npz", part, tokens=wanted, source="built-in") == 2
    assert json.loads((part / "meta.json").read_text())["tokens"] == first[0]["tokens"] + first[1]["tokens"]
    assert json.loads((part / "meta.json").read_text())["source"] == "built-in"
    # Training on it again counts none of its text as new in the learning curve.
    from lssp.distill.card import distinct_tokens
    from lssp.distill.collection import collection_summary

    assert collection_summary(again_dir)["rebuilt_tokens"] == tokens
    assert distinct_tokens({"data_tokens": tokens, "rebuilt_tokens": tokens,
                            "also_data": [collection_summary(again_dir), {"tokens": 7}]}) == 7


def test_distill_kind_eagle_refuses_what_only_drafts_take(tiny_dir, tmp_path, capsys):
    from lssp.cli import main

    code = main(["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--kind", "eagle",
                 "--init-draft", str(tmp_path), "--on-policy", "0.5", "--out", str(tmp_path / "h")])
    assert code == 2 and "--on-policy is for --kind draft" in capsys.readouterr().err
    code = main(["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--kind", "eagle",
                 "--unroll", "0", "--out", str(tmp_path / "h")])
    assert code == 2 and "--unroll" in capsys.readouterr().err
    code = main(["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--kind", "medusa"])
    assert code == 2 and "expected draft, eagle or eagle3" in capsys.readouterr().err


@pytest.mark.parametrize("options", [{"lookup": 2}, {"confidence": 0.3}], ids=["lookup", "confidence"])
def test_a_head_with_the_lookup_or_early_stopping_stays_exact(target, head, options):
    draft = FeatureDraft(head, target)
    for prompt in ([0, 5, 9, 3, 5, 9], [0, 40, 41, 42, 40, 41]):
        ids = torch.tensor([prompt])
        want = generate_regular(target, ids, 24, GREEDY).tokens
        assert torch.equal(generate_speculative(target, draft, ids, 24, 3, GREEDY, **options).tokens, want)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.8)], ids=["greedy", "t0.8"])
def test_a_shared_prompt_prefix_gives_a_head_the_same_tokens(target, head, params):
    """eval's prefix cache: the target's features of the few-shot prefix and the head's pairs over it are
    computed once; every problem rolls both back and feeds the rest, and gets what a full prefill gives."""
    from lssp.decoding.kv import PrefixCache

    draft = FeatureDraft(head, target)
    shared = [0, 7, 8, 9, 10, 11, 12]
    prefix = PrefixCache(shared)
    for tail in ([3, 4], [5], [6, 2, 9, 1]):
        ids = torch.tensor([shared + tail])
        plain = generate_speculative(target, draft, ids, 16, 3, params, torch.Generator().manual_seed(1))
        cached = generate_speculative(target, draft, ids, 16, 3, params, torch.Generator().manual_seed(1), prefix=prefix)
        assert torch.equal(plain.tokens, cached.tokens), tail
        assert cached.stats.drafted == plain.stats.drafted
    rsp = generate_regular(target, torch.tensor([shared + [3]]), 8, GREEDY, prefix=prefix)  # RSp shares the prefix
    assert torch.equal(rsp.tokens, generate_regular(target, torch.tensor([shared + [3]]), 8, GREEDY).tokens)


# Fused features (EAGLE-3): a head that also reads the target's hidden states after some of its layers.

def _fused_pair(compact: bool, layers: tuple[int, ...] = (0, 1), seed: int = 4):
    """A 3-layer target (its own: binding a head sets its feature layers) and a random head reading ``layers``."""
    model = tiny_llama(21, layers=3, scale=4.0).eval()
    target = CompactLlama(model).eval() if compact else model
    head = eagle.with_feature_layers(random_head(model, seed), layers)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(seed))
    return target, head


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
def test_features_lead_with_the_hidden_states_of_the_layers_heads_read(compact):
    target, head = _fused_pair(compact)
    FeatureDraft(head, target)
    assert target.feature_layers == (0, 1)
    ids = torch.tensor([[0, 5, 9, 3, 7, 8]])
    with torch.no_grad():
        out = (target.hf if compact else target).model(input_ids=ids, output_hidden_states=True)
        _, features = eagle.forward_with_features(target, ids, new_cache(target), 0)
    want = torch.cat([out.hidden_states[1], out.hidden_states[2], out.last_hidden_state], dim=-1)
    torch.testing.assert_close(features, want, atol=1e-4, rtol=1e-4)
    assert eagle.feature_width(target) == 3 * target.config.hidden_size


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_ssp_with_a_fused_head_equals_greedy_rsp(compact, k):
    target, head = _fused_pair(compact)
    draft = FeatureDraft(head, target)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        got = generate_speculative(target, draft, ids, 20, k, GREEDY)
        assert torch.equal(got.tokens, generate_regular(target, ids, 20, GREEDY).tokens), (prompt, k)


def test_a_head_given_more_layers_drafts_as_it_did_until_trained():
    """``with_feature_layers`` starts ``fuse`` as the identity on the final feature: the same drafts, token by token,
    also beside a plain head bound to the same target (each reads its own share of the features)."""
    model = tiny_llama(21, layers=3, scale=4.0).eval()
    plain = random_head(model, 5)
    target = CompactLlama(model).eval()
    before = FeatureDraft(plain, target)
    wider = FeatureDraft(eagle.with_feature_layers(plain, [1]), target)
    assert target.feature_layers == (1,) and wider.head.feature_layers == (1,)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    outs = [generate_speculative(target, d, ids, 16, 3, GREEDY) for d in (before, wider)]
    assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
    assert (outs[0].stats.drafted, outs[0].stats.accepted) == (outs[1].stats.drafted, outs[1].stats.accepted)


def test_a_head_grown_by_a_layer_drafts_as_it_did_until_trained():
    """``with_more_layers``: the new layer starts as the identity (zero output projections), so the deeper head
    proposes the same drafts, token by token; it keeps the first layer's weights and differs only once trained."""
    model = tiny_llama(21, layers=3, scale=4.0).eval()
    plain = random_head(model, 5)
    target = CompactLlama(model).eval()
    deeper = eagle.with_more_layers(plain, 2)
    assert len(deeper.layers) == 2 and deeper.config.num_hidden_layers == 2 and len(plain.layers) == 1
    assert torch.equal(deeper.layers[0].mlp.up_proj.weight, plain.layers[0].mlp.up_proj.weight)
    assert deeper.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # the new layer's other weights are live
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    outs = [generate_speculative(target, FeatureDraft(h, target), ids, 16, 3, GREEDY) for h in (plain, deeper)]
    assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
    assert (outs[0].stats.drafted, outs[0].stats.accepted) == (outs[1].stats.drafted, outs[1].stats.accepted)


def test_distill_deepens_a_head_it_goes_on_from(tiny_dir, tmp_path, capsys):
    """``--init-draft HEAD --layers 2``: the head goes on with a second layer (from the identity), saves it, and
    loads and drafts exactly; resuming its checkpoint as another shape is one line; a --layers below the head's
    keeps its shape."""
    from lssp.cli import main
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec, load_registry

    base = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill",
            "tiny-target", "--kind", "eagle", "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40",
            "--max-steps", "2", "--data-dir", str(tmp_path / "work"), "--init-draft", str(tiny_dir / "tiny-eagle")]
    assert main(base + ["--out", str(tmp_path / "deep"), "--layers", "2"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "deep" / "config.json").read_text())["num_hidden_layers"] == 2
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target"))
    head = load_model(ModelSpec(name="h", path=str(tmp_path / "deep"), dtype="float32"), draft=True, target=target)
    assert len(head.model.head.layers) == 2
    ids = torch.tensor([[0, 5, 9, 3]])
    want = generate_regular(target.model, ids, 12, GREEDY).tokens
    assert torch.equal(generate_speculative(target.model, head.model, ids, 12, 3, GREEDY).tokens, want)
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "same")]) == 2  # its checkpoint holds the deeper head: one line
    assert "of another shape" in capsys.readouterr().err
    again = base + ["--out", str(tmp_path / "same"), "--layers", "1", "--data-dir", str(tmp_path / "work2")]
    assert main(again) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "same" / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_fused_head_saves_and_loads_with_its_layers(tmp_path):
    target, head = _fused_pair(False)
    save_feature_head(head, tmp_path / "h", dtype=torch.float32)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["feature_layers"] == [0, 1]
    assert eagle.head_feature_layers(tmp_path / "h") == (0, 1)
    loaded = load_feature_head(tmp_path / "h")
    assert loaded.feature_layers == (0, 1)
    torch.testing.assert_close(loaded.fuse.weight, head.fuse.weight)
    with pytest.raises(UserError, match="choose from 0..1"):
        eagle.check_feature_layers(target, [0, 2])


@pytest.mark.slow
def test_ssp_with_a_fused_head_recovers_the_target_distribution():
    model = tiny_llama(30, vocab_size=VOCAB, hidden=16, layers=2, scale=3.0)
    head = eagle.with_feature_layers(random_head(model, 31, scale=2.0), [0])
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    compact = CompactLlama(model)  # bound to the head: it returns the fused layers' features
    draft = FeatureDraft(head, compact)
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    result = chi_square_gof(two_token_counts(compact, draft, prompt, params, k=2, batched=True),
                            _exact_law(model, prompt, params).tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_distill_a_head_reading_more_layers_from_a_plain_one(tiny_dir, tmp_path, capsys):
    """``--feature-layers``: the collection keeps those layers' hidden states, the head goes on from a plain one
    (drafting as it did at first) and loads and drafts exactly; what does not fit is one line."""
    from lssp.cli import main
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec, load_registry

    out, work = tmp_path / "fused", tmp_path / "work"
    base = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill",
            "tiny-target", "--kind", "eagle", "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40",
            "--max-steps", "2", "--data-dir", str(work)]
    assert main(base + ["--out", str(out), "--init-draft", str(tiny_dir / "tiny-eagle"), "--feature-layers", "0"]) == 0, \
        capsys.readouterr().err
    assert json.loads((work / "data" / "meta.json").read_text())["feature_layers"] == [0]
    assert torch.load(work / "data" / "shard_00000.pt")["features"][0].shape[-1] == 64  # layer 0's and the final
    assert json.loads((out / "config.json").read_text())["feature_layers"] == [0]
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target"))
    head = load_model(ModelSpec(name="h", path=str(out), dtype="float32"), draft=True, target=target)
    ids = torch.tensor([[0, 5, 9, 3]])
    want = generate_regular(target.model, ids, 12, GREEDY).tokens
    assert torch.equal(generate_speculative(target.model, head.model, ids, 12, 3, GREEDY).tokens, want)
    # Going on from the fused head reads its layers without being told.
    assert main(base + ["--out", str(tmp_path / "again"), "--init-draft", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "again" / "config.json").read_text())["feature_layers"] == [0]
    capsys.readouterr()
    for extra, message in [(["--feature-layers", "1"], "choose from 0..0"),
                           (["--feature-layers", "a"], "expected layer numbers"),
                           (["--data-dir", str(tmp_path / "plain")], None)]:
        args = base + ["--out", str(tmp_path / "no")] + extra
        if message is None:  # a collection of the final features only, then one with layer 0's
            assert main(base[:-1] + [str(tmp_path / "plain"), "--out", str(tmp_path / "p"), "--collect-only"]) == 0
            args, message = args + ["--feature-layers", "0"], "features of layers none"
        assert main(args) == 2
        assert message in capsys.readouterr().err
    code = main(base[:6] + ["--kind", "draft", "--feature-layers", "0", "--out", str(tmp_path / "d")])
    assert code == 2 and "--feature-layers is for --kind eagle" in capsys.readouterr().err


def test_vllm_is_not_given_a_head_reading_more_layers(tmp_path):
    from lssp.engines.vllm import model_path
    from lssp.models.registry import ModelSpec

    _, head = _fused_pair(False)
    save_feature_head(head, tmp_path / "fused")
    with pytest.raises(UserError, match="several layers"):
        model_path(ModelSpec(name="fused", path=str(tmp_path / "fused")))
