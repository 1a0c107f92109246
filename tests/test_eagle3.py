"""EAGLE-3 heads in their published layout: loaded as published, drafting as vLLM's equations say, SSp exact."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from test_generation import two_token_counts

from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams, warp
from lssp.drafters import drafter_for, generate_speculative
from lssp.drafters.model import FeatureHead, draft_logits
from lssp.errors import UserError
from lssp.models.compact import CompactLlama
from lssp.models.eagle import read_weights
from lssp.models.eagle3 import Eagle3Draft, is_eagle3_head, load_eagle3_head, save_eagle3_head
from lssp.report.stats import chi_square_gof

GREEDY = SamplingParams(temperature=0)
AUX = [1, 2, 3]  # the hidden states entering layers 1, 2 and 3 of the 4-layer target


def publish(folder, target, draft_ids: list[int], seed: int, aux: list[int] | None = AUX, drop: str | None = None,
            planted: dict | None = None):
    """A random EAGLE-3 head for ``target`` (or with the ``planted`` weights) written by hand as SafeAILab's and
    SpecForge's scripts write them (names, shapes, d2t as offsets, t2d as a mask; none where the draft vocabulary is
    the target's), independently of lssp's own classes."""
    torch.manual_seed(seed)
    c = target.config
    d, hd, heads, kv_heads, inter = c.hidden_size, c.hidden_size // c.num_attention_heads, c.num_attention_heads, \
        c.num_key_value_heads, c.intermediate_size
    shapes = {"fc.weight": (d, len(aux or [2, 2, 2]) * d), "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * d),
              "midlayer.self_attn.k_proj.weight": (kv_heads * hd, 2 * d),
              "midlayer.self_attn.v_proj.weight": (kv_heads * hd, 2 * d), "midlayer.self_attn.o_proj.weight": (d, heads * hd),
              "midlayer.mlp.gate_proj.weight": (inter, d), "midlayer.mlp.up_proj.weight": (inter, d),
              "midlayer.mlp.down_proj.weight": (d, inter), "lm_head.weight": (len(draft_ids), d)}
    state = {k: torch.randn(*s) * 0.3 for k, s in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{norm}.weight"] = 1 + 0.1 * torch.randn(d)
    state["d2t"] = torch.tensor(draft_ids) - torch.arange(len(draft_ids))
    state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool)
    state["t2d"][draft_ids] = True
    state.update(planted or {})
    written = {k: v for k, v in state.items() if k != drop and (len(draft_ids) < c.vocab_size or k not in ("d2t", "t2d"))}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "vocab_size": c.vocab_size, "draft_vocab_size": len(draft_ids),
              "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": 256, "rope_theta": 10000.0,
              "hidden_act": "silu", "torch_dtype": "float32"}
    if aux is not None:  # where vLLM reads them, and where llama.cpp's converter does
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        config["eagle_aux_hidden_state_layer_ids"] = aux
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in written.items()}, folder / "model.safetensors")
    return state


def reference_logits(target, state: dict, ids: torch.Tensor, aux: list[int], fed: int = 0) -> torch.Tensor:
    """vLLM's Eagle3 equations over the whole sequence, no cache: the draft's logits (its vocabulary) for the token
    after ``ids`` (1, T), or, with ``fed`` > 0, after feeding its own argmax ``fed`` times (drafting steps)."""
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        fused = torch.cat([hidden[i] for i in aux], -1)[0, :-1] @ state["fc.weight"].T  # position t's, t < T-1
        tokens = ids[0, 1:].tolist()
        for step in range(fed + 1):
            prenorm = _layer(target, state, tokens, fused)
            logits = _rms(prenorm[-1], state["norm.weight"]) @ state["lm_head.weight"].T
            if step < fed:
                drafted = int(logits.argmax()) + int(state["d2t"][int(logits.argmax())])
                tokens, fused = tokens + [drafted], torch.cat([fused, prenorm[-1:]])
        return logits


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layer(target, state, tokens, fused):
    p = "midlayer."
    c = target.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // heads
    embeds = target.get_input_embeddings().weight[tokens]
    x = torch.cat([_rms(embeds, state[p + "input_layernorm.weight"]), _rms(fused, state[p + "hidden_norm.weight"])], -1)
    n = len(tokens)
    q, k, v = ((x @ state[f"{p}self_attn.{w}_proj.weight"].T).view(n, -1, hd).transpose(0, 1) for w in "qkv")
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(t):
        half = torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)
        return t * cos + half * sin
    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, -1)
    h = fused + out @ state[p + "self_attn.o_proj.weight"].T
    g = _rms(h, state[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(g @ state[p + "mlp.gate_proj.weight"].T) * (g @ state[p + "mlp.up_proj.weight"].T))
    return h + mlp @ state[p + "mlp.down_proj.weight"].T


@pytest.fixture(scope="module")
def target():
    return tiny_llama(40, layers=4, scale=4.0)


def test_a_published_eagle3_head_drafts_as_vllms_equations_say(target, tmp_path):
    draft_ids = list(range(2, 64, 2))  # half the vocabulary, d2t != 0
    state = publish(tmp_path / "head", target, draft_ids, seed=1)
    assert is_eagle3_head(tmp_path / "head")
    head = load_eagle3_head(tmp_path / "head", target)
    ids = torch.tensor([[0, 5, 9, 3, 17, 4, 40]])
    for model in (target, CompactLlama(target)):  # the features as either forward of the target gives them
        draft = Eagle3Draft(head, model, torch.float32)
        assert model.feature_layers == (0, 1, 2)  # the states entering layers 1, 2, 3
        got = draft_logits(model, draft, ids)[0]
        torch.testing.assert_close(got[draft_ids], reference_logits(target, state, ids, AUX), rtol=1e-4, atol=1e-4)
        assert torch.isinf(got[[i for i in range(64) if i not in draft_ids]]).all()
    # drafting steps feed the layer's own output back: three argmax drafts against the reference's
    drafter = drafter_for(draft)
    assert isinstance(drafter, FeatureHead) and drafter.rows_reason(CompactLlama(target)) is None  # batches too
    kv = draft.start(ids, _features(target, ids[:, :-1]))
    pending = ids[:, -1:]
    for step in range(3):
        logits, token_ids = draft.draft_logits(pending, kv)
        torch.testing.assert_close(logits, reference_logits(target, state, ids, AUX, fed=step), rtol=1e-4, atol=1e-4)
        pending = token_ids[logits.argmax()].view(1, 1)


def _features(target, ids):
    from lssp.decoding.kv import new_cache
    from lssp.models.eagle import forward_with_features

    return forward_with_features(target, ids, new_cache(target), 0)[1]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_ssp_with_an_eagle3_head_emits_rsps_tokens(target, tmp_path, k):
    publish(tmp_path / "head", target, list(range(64)), seed=2)
    compact = CompactLlama(target)
    draft = Eagle3Draft(load_eagle3_head(tmp_path / "head", target), compact, torch.float32)
    for prompt in ([0, 5, 9, 3], [0, 17], [7]):
        ids = torch.tensor([prompt])
        rsp = generate_regular(compact, ids, 24, GREEDY).tokens
        out = generate_speculative(compact, draft, ids, 24, k, GREEDY)
        assert torch.equal(out.tokens, rsp)
        assert out.stats.drafted > 0


VOCAB, SIGNIFICANCE = 8, 0.001  # two_token_counts (test_generation) draws its runs over these 8 tokens


@pytest.mark.slow
def test_ssp_with_an_eagle3_head_recovers_the_target_distribution(tmp_path):
    """A draft vocabulary of 6 of the 8 tokens (q is 0 on the others): the emitted pairs follow the target's law."""
    model = tiny_llama(41, vocab_size=VOCAB, layers=4, scale=3.0)
    publish(tmp_path / "head", model, [0, 1, 2, 4, 5, 7], seed=3)
    compact = CompactLlama(model)
    draft = Eagle3Draft(load_eagle3_head(tmp_path / "head", model), compact, torch.float32)
    prompt, params = torch.tensor([[1, 2, 3]]), SamplingParams(1.0)
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], params)
        rows = [warp(model(torch.cat([prompt, torch.tensor([[x]])], 1)).logits[0, -1], params) for x in range(VOCAB)]
    law = (p1[:, None] * torch.stack(rows)).flatten()
    result = chi_square_gof(two_token_counts(compact, draft, prompt, params, k=2, runs=1000), law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_eagle3_heads_save_load_and_say_what_is_wrong_in_one_line(target, tmp_path):
    publish(tmp_path / "head", target, list(range(10, 50)), seed=4)
    head = load_eagle3_head(tmp_path / "head", target)
    save_eagle3_head(head, tmp_path / "again", dtype=torch.float32)
    again = load_eagle3_head(tmp_path / "again", target)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    publish(tmp_path / "short", target, list(range(10, 50)), seed=4, drop="midlayer.hidden_norm.weight")
    with pytest.raises(UserError, match="missing midlayer.hidden_norm.weight"):
        load_eagle3_head(tmp_path / "short", target, "short")
    publish(tmp_path / "deep", target, list(range(10, 50)), seed=4, aux=[1, 2, 4])
    with pytest.raises(UserError, match=r"entering layers \[1, 2, 4\]; its target has layers 0..3"):
        load_eagle3_head(tmp_path / "deep", target, "deep")
    with pytest.raises(UserError, match="is for a target 32 wide .* its target 64"):
        load_eagle3_head(tmp_path / "again", tiny_llama(43, hidden=64, layers=4))
    publish(tmp_path / "default", target, list(range(10, 50)), seed=4, aux=None)  # vLLM's default: 2, L/2, L-3
    assert load_eagle3_head(tmp_path / "default", target).aux_ids == (2, 2, 1)
    config = json.loads((tmp_path / "default" / "config.json").read_text())  # as EAGLE's authors first published
    (tmp_path / "default" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    assert is_eagle3_head(tmp_path / "default") and not is_eagle3_head(tmp_path)


def test_an_eagle3_entry_runs_through_latency_verify_and_eval(tmp_path, capsys):
    """A registry entry pointing at a published EAGLE-3 folder drafts like any other: latency times it, verify finds
    greedy SSp equal to RSp, eval's batched SSp runs it in rows."""
    from conftest import char_tokenizer, cli

    target = tiny_llama(40, layers=4, scale=4.0)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer().save_pretrained(tmp_path / "t")
    publish(tmp_path / "h", target, list(range(2, 64, 2)), seed=6)
    (tmp_path / "models.yaml").write_text("default_target: t\ndefault_draft: h\nmodels:\n"
                                          "  t: {path: ./t, dtype: float32, forward: compact}\n"
                                          "  tq: {path: ./t, dtype: float32, forward: compact, quantization: q4_1}\n"
                                          "  h: {path: ./h, dtype: float32, quantization: auto}\n")
    run = cli(capsys, tmp_path / "models.yaml", tmp_path / "results")
    code, out, err = run("latency", "--k", "1,3", "--nb-prompts", "2", "--max-new-tokens", "8",
                         "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    rows = json.loads((tmp_path / "l.json").read_text())
    assert [(r["mode"], r["method"], r["k"]) for r in rows] == [("rsp", "none", 0), ("ssp", "eagle", 1), ("ssp", "eagle", 3)]
    code, out, err = run("verify", "--temperature", "0", "--nb-prompts", "2", "--k", "2", "--json", str(tmp_path / "v.json"))
    assert code == 0, err
    assert json.loads((tmp_path / "v.json").read_text())["lossless"]
    code, out, err = run("eval", "--both", "--nb-prompts", "6")
    assert code == 0, err
    code, out, err = run("export-draft", "h")
    assert code == 2 and "vLLM's eagle3 method loads" in " ".join(err.split())
    code, out, err = run("verify", "tq", "--temperature", "0", "--nb-prompts", "2", "--k", "2", "--json",
                         str(tmp_path / "vq.json"))  # over our kernel's one-call decoder, the head in float32
    assert code == 0 and json.loads((tmp_path / "vq.json").read_text())["lossless"], err


def test_the_training_time_test_unrolls_the_head_as_it_drafts(target, tmp_path):
    """``Eagle3Head.unrolled``: step 0 is the head over the real fused states; step 1 at position j is the draft fed
    its own output of position j-1, attending to the real pairs before it and to that output's own keys."""
    from lssp.decoding.kv import new_cache

    publish(tmp_path / "head", target, list(range(64)), seed=7)
    head = load_eagle3_head(tmp_path / "head", target)
    draft = Eagle3Draft(head, target, torch.float32)
    ids = torch.tensor([[0, 5, 9, 3, 17, 4, 40, 2]])
    features = _features(target, ids)
    fused = draft.fused(features[:, :-1])
    embeds = target.get_input_embeddings()(ids[:, 1:])
    with torch.no_grad():
        steps = head.unrolled(embeds, fused, 2)
        kv = new_cache(target) and draft.new_cache()
        torch.testing.assert_close(steps[0], head.step(embeds, fused, kv), rtol=1e-5, atol=1e-5)
        for j in (1, 4, 6):  # a draft begun at j-1: the real pairs up to j-1, then its output fed at j
            kv = draft.new_cache()
            first = head.step(embeds[:, :j], fused[:, :j], kv)
            second = head.step(embeds[:, j:j + 1], first[:, -1:], kv)
            torch.testing.assert_close(steps[1][:, j], second[:, 0], rtol=1e-5, atol=1e-5)


def test_distill_kind_eagle3_writes_a_published_head_that_drafts_and_resumes(tmp_path, capsys, monkeypatch):
    from conftest import char_tokenizer, cli

    import lssp.distill.eagle3_training as training

    target = tiny_llama(42, layers=4, scale=4.0)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer().save_pretrained(tmp_path / "t")
    (tmp_path / "models.yaml").write_text("default_target: t\nmodels:\n  t: {path: ./t, dtype: float32}\n"
                                          "  h: {path: ./h, dtype: float32}\n")
    run = cli(capsys, tmp_path / "models.yaml", tmp_path / "results")
    base = ["distill", "t", "--kind", "eagle3", "--out", str(tmp_path / "h"), "--batch-prompts", "4", "--new-tokens",
            "8", "--head-tokens", "16", "--data-tokens", "40"]
    code, out, err = run(*base, "--max-steps", "3")
    assert code == 0, err
    assert "EAGLE-3 head written to" in " ".join(out.split())
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 16
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # vLLM's default for 4 layers
    assert "EAGLE-3 head for t" in (tmp_path / "h" / "README.md").read_text()
    # More data, going on from the checkpoint, its most frequent tokens others: lm_head's rows keep their tokens,
    # and the loss reads the target's logits of those tokens.
    first, seen = read_weights(tmp_path / "h"), []
    loss = training.Eagle3Trainer.loss
    monkeypatch.setattr(training, "most_frequent", lambda counts, n: list(range(64 - n, 64)))
    monkeypatch.setattr(training.Eagle3Trainer, "loss", lambda self, batch: seen.append(
        torch.equal(self.rows, target.lm_head.weight[self.head.token_ids])) or loss(self, batch))
    code, out, err = run(*base[:-1], "80", "--max-steps", "5")
    assert code == 0, err
    assert torch.equal(read_weights(tmp_path / "h")["d2t"], first["d2t"]) and seen and all(seen)
    report = json.loads((tmp_path / "h" / "distill_report.json").read_text())
    assert [step for step, _, _ in report["loss_curve"]] == [3, 5] and report["data_tokens"] >= 80
    code, out, err = run("verify", "--draft", "h", "--temperature", "0", "--nb-prompts", "2", "--k", "2",
                         "--json", str(tmp_path / "v.json"))
    assert code == 0 and json.loads((tmp_path / "v.json").read_text())["lossless"], err
    code, out, err = run(*base[:2], "--kind", "eagle3", "--feature-layers", "0,1,4", "--out", str(tmp_path / "x"))
    assert code == 2 and "feature layers 4" in err
