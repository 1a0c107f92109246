"""models.yaml validation and model loading."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.drafters import generate_speculative
from lssp.errors import IncompatibleModelsError, UserError
from lssp.models.loading import check_compatible, load_model
from lssp.models.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_shipped_registry_is_valid_and_has_the_families():
    reg = load_registry(ROOT / "models.yaml")
    for name in ["7B", "13B", "30B", "65B", "7B_8bit", "65B_8bit", "llama-2-7b", "llama-2-70b", "llama-3.2-1b",
                 "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-0.5b", "qwen2.5-72b"]:
        assert name in reg.models
    assert reg.models["65B_8bit"].quantization == "8bit"
    assert reg.default_target == "smollm2-135m-auto" and reg.default_draft == "smollm2-135m-eagle-chain6-min2"
    assert reg.default_draft_model == "smollm2-135m-draft-auto"
    assert reg.models["llama-2-7b-random"].is_random


def test_unknown_key_names_key_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, "models:\n  a:\n    path: x/y\n    dtpye: float16\n")
    with pytest.raises(UserError, match=r"models.yaml:4: model 'a': unknown key 'dtpye'; did you mean 'dtype'"):
        load_registry(path)


def test_bad_dtype_is_rejected_with_the_choices(tmp_path):
    path = write(tmp_path, "models:\n  a:\n    path: x/y\n    dtype: float8\n")
    with pytest.raises(UserError, match=r"models.yaml:4: model 'a': bad dtype 'float8'; expected one of auto, float32"):
        load_registry(path)


def test_bad_quantization_and_gpus(tmp_path):
    with pytest.raises(UserError, match="bad quantization '3bit'"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, quantization: 3bit}\n"))
    with pytest.raises(UserError, match="bad gpus -1"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, gpus: -1}\n"))


def test_a_kv_cache_is_float16_or_float32(tmp_path):
    with pytest.raises(UserError, match="bad kv_cache 'int8'; expected one of float32, float16"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, quantization: q4_1, kv_cache: int8}\n"))
    assert load_registry(write(tmp_path, "models:\n  a: {path: x, kv_cache: float16}\n")).get("a").kv_cache == "float16"


def test_a_copied_chain_length_needs_the_lookup_it_lengthens(tmp_path):
    with pytest.raises(UserError, match="'prompt_lookup_chain' needs 'prompt_lookup'"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, prompt_lookup_chain: 6}\n"))
    spec = load_registry(write(tmp_path, "models:\n  a: {path: x, prompt_lookup: 4, prompt_lookup_chain: 6}\n")).get("a")
    assert (spec.prompt_lookup, spec.prompt_lookup_chain) == (4, 6)
    with pytest.raises(UserError, match="'prompt_lookup_min' needs 'prompt_lookup'"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, prompt_lookup_min: 2}\n"))
    with pytest.raises(UserError, match=r"'prompt_lookup_min' \(5\) is above 'prompt_lookup' \(4\)"):
        load_registry(write(tmp_path, "models:\n  a: {path: x, prompt_lookup: 4, prompt_lookup_min: 5}\n"))
    spec = load_registry(write(tmp_path, "models:\n  a: {path: x, prompt_lookup: 4, prompt_lookup_min: 3}\n")).get("a")
    assert (spec.prompt_lookup, spec.prompt_lookup_min) == (4, 3)


def test_a_draft_entry_carries_its_confidence_stop(tmp_path):
    assert load_registry(write(tmp_path, "models:\n  a: {path: x, confidence: 0.5}\n")).get("a").confidence == 0.5
    for bad in ("0", "1", "1.5", "yes"):
        with pytest.raises(UserError, match="bad confidence .*expected a probability in \\(0, 1\\)"):
            load_registry(write(tmp_path, f"models:\n  a: {{path: x, confidence: {bad}}}\n"))


def test_unknown_model_name_suggests_close_names():
    reg = load_registry(ROOT / "models.yaml")
    with pytest.raises(UserError, match=r"unknown model '7b'.*did you mean '7B'"):
        reg.get("7b")


def test_malformed_yaml_and_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"models.yaml:\d+: malformed YAML"):
        load_registry(write(tmp_path, "models:\n  a: [unclosed\n"))
    with pytest.raises(UserError, match="cannot read model registry"):
        load_registry(tmp_path / "nope.yaml")


def test_default_must_name_a_model(tmp_path):
    with pytest.raises(UserError, match=r"models.yaml:1: default_target names unknown model 'b'"):
        load_registry(write(tmp_path, "default_target: b\nmodels:\n  a: {path: x}\n"))


def test_default_draft_model_stands_in_where_a_feature_head_cannot_run(tmp_path):
    said = []
    text = ("default_draft: head\ndefault_draft_model: plain\nmodels:\n  head: {path: ./h, k: 2}\n"
            "  plain: {path: ./p, k: 3}\n")
    reg = replace(load_registry(write(tmp_path, text)), notify=said.append)
    assert (reg.draft_name(None), reg.draft_k(None)) == ("head", 2) and not said
    assert (reg.draft_name(None, heads=False), reg.draft_k(None, heads=False)) == ("plain", 3)
    assert len(said) == 1 and "drafting with plain, the default_draft_model" in said[0]  # said once
    assert reg.draft_name("head", heads=False) == "head"  # a draft named is used as given
    without = load_registry(write(tmp_path, "default_draft: head\nmodels:\n  head: {path: ./h}\n"))
    assert without.draft_name(None, heads=False) == "head"  # no stand-in: the engine says why it cannot run it
    with pytest.raises(UserError, match=r"models.yaml:1: default_draft_model names unknown model 'plian'"):
        load_registry(write(tmp_path, "default_draft_model: plian\nmodels:\n  plain: {path: ./p}\n"))


def test_entry_needs_a_path(tmp_path):
    with pytest.raises(UserError, match="'path' is required"):
        load_registry(write(tmp_path, "models:\n  a: {dtype: float16}\n"))


def test_package_path_resolves_without_importing(tmp_path):
    reg = load_registry(write(tmp_path, "models:\n  a: {path: 'pkg:pytest/__init__.py'}\n  b: {path: 'pkg:no_such_pkg/x.gguf'}\n"))
    assert reg.get("a").local_path().name == "__init__.py"
    assert reg.get("a").available_locally()
    with pytest.raises(UserError, match="package 'no_such_pkg' is not installed"):
        reg.get("b").local_path()


def test_loads_tiny_models_and_refuses_a_different_vocabulary(tiny_dir):
    reg = load_registry(tiny_dir / "models.yaml")
    target = load_model(reg.get("tiny-target"))
    draft = load_model(reg.get("tiny-draft"))
    assert check_compatible(target, draft) == 64
    other = load_model(reg.get("tiny-other-vocab"))
    with pytest.raises(IncompatibleModelsError, match=r"does not share target 'tiny-target''s tokenizer.*id 3: '0' \(target\) vs \"'\" \(draft\)"):
        check_compatible(target, other)


def test_padded_embeddings_use_the_common_prefix(tiny_dir):
    reg = load_registry(tiny_dir / "models.yaml")
    target = load_model(reg.get("tiny-target"))
    draft = load_model(reg.get("tiny-draft"))
    draft.model.resize_token_embeddings(80)  # same tokenizer, padded matrix
    assert check_compatible(target, draft) == 64
    ids = target.encode("12 * 4 = ")
    out = generate_speculative(target.model, draft.model, ids, 12, 3, SamplingParams(0), vocab_size=64)
    assert out.tokens.tolist() == generate_regular(target.model, ids, 12, SamplingParams(0)).tokens.tolist()


def test_8bit_bitsandbytes_model_keeps_the_float_logits_and_ssp_stays_exact(tiny_dir):
    reg = load_registry(tiny_dir / "models.yaml")
    loaded = load_model(reg.get("tiny-target-8bit"))
    plain = load_model(reg.get("tiny-target"))
    draft = load_model(reg.get("tiny-draft"))
    assert loaded.precision == "8bit (bnb)"
    # The layers' projections are int8, one byte a weight; embeddings, norms and the output layer stay float32.
    int8 = sum(p.numel() for p in loaded.model.parameters() if p.dtype == torch.int8)
    linears = [m for m in plain.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert int8 == sum(m.weight.numel() for m in linears)
    saved = plain.weight_bytes - loaded.weight_bytes  # 3 of 4 bytes a weight, less at most a float32 scale per row
    assert 3 * int8 - 4 * sum(m.out_features for m in linears) <= saved <= 3 * int8
    assert check_compatible(loaded, draft) == 64
    ids = loaded.encode("12 * 4 = ")
    with torch.inference_mode():
        quantized, exact = loaded.model(ids).logits, plain.model(ids).logits
    # int8 weights move the logits by ~1% of their range (0.012 of 1.2 here); a wrong scale or a skipped layer moves them by far more.
    assert (quantized - exact).abs().max() < 0.05 * exact.abs().max()
    rsp = generate_regular(loaded.model, ids, 12, SamplingParams(0)).tokens.tolist()
    assert len(rsp) == 12
    for k in (1, 3):  # SSp is exact for any target: verifying with the 8-bit model gives its own greedy text
        assert generate_speculative(loaded.model, draft.model, ids, 12, k, SamplingParams(0)).tokens.tolist() == rsp


def test_dynamic_quantization_prepacks_linears_and_keeps_ssp_exact(tiny_dir):
    reg = load_registry(tiny_dir / "models.yaml")
    plain = load_model(reg.get("tiny-target"))
    target = load_model(reg.get("tiny-target-fp16dyn"))
    draft = load_model(reg.get("tiny-draft-int8dyn"))
    assert target.precision == "dynamic-fp16 (torch)" and draft.precision == "dynamic-int8 (torch)"
    linear = target.model.model.layers[0].mlp.up_proj
    assert isinstance(linear, torch.ao.nn.quantized.dynamic.Linear) and linear._packed_params.dtype == torch.float16
    assert target.dtype == "float32"  # embeddings and norms run in float32
    assert check_compatible(target, draft) == 64  # the logit width is read from the quantized output layer
    # Packed weights count: fp16 halves the float32 Linear bytes.
    linear_params = sum(m.weight.numel() for m in plain.model.modules() if isinstance(m, torch.nn.Linear))
    assert target.weight_bytes == plain.weight_bytes - 2 * linear_params
    ids = target.encode("12 * 4 = ")
    rsp = generate_regular(target.model, ids, 12, SamplingParams(0)).tokens.tolist()
    assert rsp == generate_regular(plain.model, ids, 12, SamplingParams(0)).tokens.tolist()  # fp16 weights: same argmaxes
    for k in (1, 3):
        assert generate_speculative(target.model, draft.model, ids, 12, k, SamplingParams(0)).tokens.tolist() == rsp


def test_random_init_builds_the_declared_shapes(tiny_dir):
    reg = load_registry(tiny_dir / "models.yaml")
    loaded = load_model(reg.get("tiny-random"))
    cfg = loaded.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (32, 2, 64)
    assert loaded.model.model.layers[0].mlp.up_proj.weight.shape == (64, 32)


def test_gpu_only_entry_without_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    reg = load_registry(write(tmp_path, "models:\n  big: {path: x/y, gpus: 2}\n"))
    with pytest.raises(UserError, match=r"needs 2 GPU\(s\) and none is visible; use --device cpu"):
        load_model(reg.get("big"))
