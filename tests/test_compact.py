"""The compact forward and the frequent-token draft head: same logits, same tokens, same law."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import char_tokenizer, tiny_llama
from test_generation import SIGNIFICANCE, VOCAB, exact_two_token_law, two_token_counts

from lssp.decoding.generation import generate_regular
from lssp.decoding.kv import forward_logits, new_cache
from lssp.decoding.sampling import SamplingParams
from lssp.drafters import generate_speculative
from lssp.errors import UserError
from lssp.models.compact import CompactCache, CompactLlama, supports_compact
from lssp.models.draft_head import (
    attach_subset_head,
    has_subset_head,
    load_subset_head_model,
    most_frequent,
    subset_head,
)
from lssp.models.loading import cpu_quantize, load_model
from lssp.models.registry import ModelSpec, load_registry
from lssp.report.stats import chi_square_gof

GREEDY = SamplingParams(0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(30, scale=4.0)  # 4 query heads over 2 key/value heads: the grouped-query path


def test_compact_logits_equal_the_transformers_forward_through_prefill_decode_and_crop(model):
    compact = CompactLlama(model)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    hf_kv, kv = new_cache(model), new_cache(compact)
    steps = [(0, 12, 12), (12, 15, 3), (15, 16, 1)]  # prefill, a 3-token verification, one decode step
    for start, end, last in steps:
        expected = forward_logits(model, ids[:, start:end], hf_kv, last)
        got = forward_logits(compact, ids[:, start:end], kv, last)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    hf_kv.crop(-3)
    kv.crop(-3)
    assert kv.get_seq_length() == hf_kv.get_seq_length() == 13
    torch.testing.assert_close(forward_logits(compact, ids[:, 13:17], kv, 4),
                               forward_logits(model, ids[:, 13:17], hf_kv, 4), rtol=1e-5, atol=1e-5)


def test_compact_cache_crop_drops_only_what_it_is_told(model):
    """crop(0) keeps everything, as transformers' DynamicCache.crop(0) does: SSp calls it after a full acceptance."""
    kv = CompactCache(2, 2, 8, torch.float32, torch.device("cpu"))
    kv.length = 10
    kv.crop(0)
    assert kv.get_seq_length() == 10
    kv.crop(-3)
    assert kv.get_seq_length() == 7
    kv.crop(-20)
    assert kv.get_seq_length() == 0
    with pytest.raises(ValueError):
        kv.crop(5)


def test_ssp_never_refeeds_a_compact_draft_its_whole_sequence(model):
    """With draft == target every draft is accepted, so each draft forward takes at most 2 new tokens."""
    compact = CompactLlama(model)
    fed = []
    original = compact.forward
    compact.forward = lambda input_ids, **kw: fed.append(input_ids.shape[1]) or original(input_ids, **kw)
    out = generate_speculative(model, compact, torch.tensor([[0, 5, 9, 3]]), 24, 3, GREEDY)
    assert out.stats.accepted == out.stats.drafted
    assert fed[0] == 3 and max(fed[1:]) <= 2, fed


def test_compact_cache_grows_past_its_first_capacity(model):
    compact = CompactLlama(model)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    kv = CompactCache(2, 2, 8, torch.float32, torch.device("cpu"), capacity=8)
    hf_kv = new_cache(model)
    for start, end in [(0, 20), (20, 40)]:  # 8 -> 20 -> 40 positions
        torch.testing.assert_close(forward_logits(compact, ids[:, start:end], kv, end - start),
                                   forward_logits(model, ids[:, start:end], hf_kv, end - start), rtol=1e-5, atol=1e-5)
    assert kv.get_seq_length() == 40 and kv.capacity >= 40


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_ssp_with_a_compact_draft_equals_greedy_rsp(model, k):
    draft = CompactLlama(tiny_llama(31, hidden=16, layers=1, scale=4.0))
    for prompt in ([0, 5, 9, 3], [7]):
        ids = torch.tensor([prompt])
        expected = generate_regular(model, ids, 30, GREEDY).tokens.tolist()
        assert generate_speculative(model, draft, ids, 30, k, GREEDY).tokens.tolist() == expected
        assert generate_regular(CompactLlama(model), ids, 30, GREEDY).tokens.tolist() == expected


def test_compact_fused_layers_take_the_dynamic_quantization(model):
    spec = ModelSpec(name="m", quantization="dynamic-fp16")
    quantized = cpu_quantize(CompactLlama(copy.deepcopy(model)), spec)
    assert all(type(layer).__name__ == "Linear" and type(layer).__module__.startswith("torch.ao") for layer in quantized.qkv)
    ids = torch.tensor([[0, 5, 9, 3, 8]])
    torch.testing.assert_close(forward_logits(quantized, ids, quantized.new_cache(), 5),
                               forward_logits(model, ids, new_cache(model), 5), rtol=0, atol=5e-2)


def test_unsupported_models_are_refused_in_one_line(model, tiny_dir):
    other = copy.deepcopy(model)
    other.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert "rope type 'linear'" in supports_compact(other)
    with pytest.raises(ValueError):
        CompactLlama(other)
    registry = load_registry(tiny_dir / "models.yaml")
    packed = load_model(registry.get("tiny-target-8bit")).model
    assert "Linear8bitLt projections" in supports_compact(packed)
    loaded = load_model(registry.get("tiny-draft-compact"))
    assert loaded.precision == "float32, compact forward"
    assert loaded.hf_model is loaded.model.hf
    bad = tiny_dir / "bad-forward.yaml"
    bad.write_text("models:\n  m: {path: ./tiny-target, forward: fast}\n")
    with pytest.raises(UserError, match="bad forward 'fast'; expected one of transformers, compact"):
        load_registry(bad)


# --- the frequent-token head --------------------------------------------------------------

def test_subset_head_keeps_its_rows_and_masks_the_rest(model):
    headed = attach_subset_head(copy.deepcopy(model), [3, 5, 60])
    ids = torch.tensor([[0, 5, 9]])
    with torch.no_grad():
        full, part = model(ids).logits, headed(ids).logits
    assert part.shape == full.shape
    torch.testing.assert_close(part[..., [3, 5, 60]], full[..., [3, 5, 60]])
    assert torch.isinf(part[..., [0, 1, 2, 4, 63]]).all()
    assert subset_head(headed).position[5] == 1 and subset_head(headed).position[4] == -1
    assert most_frequent(torch.tensor([5, 0, 9, 1, 7]), 3) == [0, 2, 4]
    with pytest.raises(ValueError, match="increasing"):  # drafting samples them in the vocabulary's order
        attach_subset_head(copy.deepcopy(model), [5, 3, 60])


def test_subset_head_draft_saves_and_loads_through_the_registry(model, tmp_path, tiny_dir):
    headed = attach_subset_head(copy.deepcopy(model), list(range(0, 64, 2)))
    headed.save_pretrained(tmp_path / "headed")
    char_tokenizer().save_pretrained(tmp_path / "headed")
    assert has_subset_head(tmp_path / "headed") and not has_subset_head(tiny_dir / "tiny-target")
    reloaded = load_subset_head_model(tmp_path / "headed", torch.float32)
    ids = torch.tensor([[0, 5, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, headed(ids).logits)
    spec = ModelSpec(name="headed", path=str(tmp_path / "headed"), dtype="float32", forward="compact")
    loaded = load_model(spec)
    assert loaded.precision == "float32, compact forward"
    torch.testing.assert_close(forward_logits(loaded.model, ids, loaded.model.new_cache(), 4),
                               forward_logits(headed, ids, new_cache(headed), 4), rtol=1e-5, atol=1e-5)


def test_greedy_ssp_with_a_subset_head_draft_equals_greedy_rsp(model):
    draft = attach_subset_head(tiny_llama(32, hidden=16, layers=1, scale=4.0), list(range(0, 64, 3)))
    for prompt in ([0, 5, 9, 3], [7]):
        ids = torch.tensor([prompt])
        expected = generate_regular(model, ids, 30, GREEDY).tokens.tolist()
        out = generate_speculative(model, draft, ids, 30, 3, GREEDY)
        assert out.tokens.tolist() == expected
        assert out.stats.accepted < out.stats.drafted  # tokens outside the head get rejected, not emitted wrongly


@pytest.mark.slow
def test_ssp_with_a_subset_head_draft_recovers_the_target_distribution():
    params = SamplingParams(1.0)
    target = tiny_llama(20, vocab_size=VOCAB, scale=8.0)
    draft = attach_subset_head(tiny_llama(21, vocab_size=VOCAB, hidden=16, layers=1, scale=8.0), [0, 2, 3, 5])
    prompt = torch.tensor([[1, 2, 3]])
    law = exact_two_token_law(target, prompt, params)
    assert law.view(VOCAB, VOCAB)[[1, 4, 6, 7]].sum() > 0.05  # the target often picks tokens the draft never proposes
    # Both under the compact forward, as the shipped draft runs (and ~1.5x faster than transformers' forward).
    result = chi_square_gof(two_token_counts(CompactLlama(target), CompactLlama(draft), prompt, params,
                                                 batched=True), law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_the_compiled_step_gives_the_eager_logits_and_exact_greedy_ssp(model):
    """torch.compile on the CPU (inductor): the step over a fixed buffer with a position mask scores like the
    eager forward, through prefill, verification, decode and a rollback; SSp with a compiled target and draft
    emits greedy RSp's tokens. One compile per model keeps this test at tens of seconds."""
    from lssp.models.compact import compiled_graphs

    eager, compiled = CompactLlama(model), CompactLlama(copy.deepcopy(model))
    compiled.compile_decode("default")
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    eager_kv, kv = new_cache(eager), new_cache(compiled)
    assert all(torch.all(b == 0) for b in kv.keys_values)  # never NaN behind the mask
    for start, end, last, drop in [(0, 20, 1, 0), (19, 22, 3, 2), (20, 21, 1, 0), (21, 22, 1, 0)]:
        eager_kv.crop(-drop)
        kv.crop(-drop)
        torch.testing.assert_close(forward_logits(compiled, ids[:, start:end], kv, last),
                                   forward_logits(eager, ids[:, start:end], eager_kv, last), rtol=1e-4, atol=1e-4)
    draft = CompactLlama(tiny_llama(31, hidden=16, layers=1, scale=4.0))
    draft.compile_decode("default")
    prompt = torch.tensor([[0, 5, 6, 7, 8]])
    rsp = generate_regular(eager, prompt, 24, GREEDY).tokens
    for k in (1, 3):
        assert torch.equal(generate_speculative(compiled, draft, prompt, 24, k, GREEDY).tokens, rsp)
    graphs = compiled_graphs()
    generate_speculative(compiled, draft, prompt, 24, 3, GREEDY)  # warm: the same shapes again
    assert compiled_graphs() == graphs  # nothing recompiles once warm
    assert len(compiled._free_buffers) >= 1  # dropped caches hand their buffers to the next one
    # A second compiled model of the same shapes, other weights: the guards skip the models' own attributes, so it
    # must get graphs of its own, never the first model's.
    other = tiny_llama(77, scale=4.0)
    twin, twin_eager = CompactLlama(copy.deepcopy(other)), CompactLlama(other)
    twin.compile_decode("default")
    kv, eager_kv, graphs = new_cache(twin), new_cache(twin_eager), compiled_graphs()
    for start, end, last in ((0, 20, 1), (20, 22, 2), (22, 23, 1)):
        torch.testing.assert_close(forward_logits(twin, ids[:, start:end], kv, last),
                                   forward_logits(twin_eager, ids[:, start:end], eager_kv, last), rtol=1e-4, atol=1e-4)
    assert compiled_graphs() > graphs  # its own graphs


def test_compile_refuses_what_it_cannot_compile_in_one_line_or_falls_back_when_asked(model, caplog):
    from lssp.models.loading import compile_decode

    spec = ModelSpec("q", compile=True)
    quantized = cpu_quantize(CompactLlama(copy.deepcopy(model)), ModelSpec("q", quantization="dynamic-fp16"))
    with pytest.raises(UserError, match="dynamically quantized layers .* opaque to torch.compile.*--compile-fallback"):
        compile_decode(quantized, spec)
    with pytest.raises(UserError, match="runs the compact forward only"):
        compile_decode(model, spec)
    compile_decode(quantized, spec, fallback=True)
    assert quantized.compile_mode is None and "runs uncompiled" in caplog.text


def test_the_registry_takes_compile_true_or_a_mode(tmp_path):
    registry = tmp_path / "models.yaml"
    registry.write_text("models:\n  a: {init: random, config: smollm2-135m, forward: compact, compile: true}\n"
                        "  b: {init: random, config: smollm2-135m, compile: reduce-overhead}\n")
    models = load_registry(registry).models
    assert models["a"].compile is True and models["b"].compile == "reduce-overhead"
    registry.write_text("models:\n  a: {init: random, config: smollm2-135m, compile: fast}\n")
    with pytest.raises(UserError, match=r"models.yaml:2: model 'a': bad compile 'fast'; expected true, false or a"):
        load_registry(registry)


def test_compact_cache_select_keeps_the_rows_asked_for_and_refuses_another_order():
    cache = CompactCache(2, 1, 4, torch.float32, torch.device("cpu"), capacity=8, batch=4)
    for buffer in cache.keys_values:
        buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32).reshape(buffer.shape))
    cache.length = 5
    before = [buffer.clone() for buffer in cache.keys_values]
    cache.select(torch.tensor([0, 2, 3]))
    for old, new in zip(before, cache.keys_values, strict=True):
        assert new.shape[0] == 3 and torch.equal(new[:, :, :5], old[[0, 2, 3], :, :5])
    cache.select(torch.tensor([1]))
    assert torch.equal(cache.keys_values[0][:, :, :5], before[0][[2], :, :5])
    cache.select(torch.tensor([], dtype=torch.long))
    assert cache.keys_values[0].shape[0] == 0
    with pytest.raises(ValueError, match="increasing"):
        CompactCache(1, 1, 4, torch.float32, torch.device("cpu"), batch=3).select(torch.tensor([2, 0]))
