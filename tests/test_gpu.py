"""The GPU path: run by `benchmarks/gpu.sh` (or `pytest -m gpu`) on a machine with a CUDA GPU; skipped elsewhere.

Two devices in one loop (target on the GPU, draft on the CPU) take the same code path as two GPUs:
ids, logits and draws cross devices exactly where they would between cuda:0 and cuda:1.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_llama
from test_generation import N_RUNS, SIGNIFICANCE, VOCAB, PrefixTableLM, exact_two_token_law

from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.timing import Clock
from lssp.drafters import generate_speculative
from lssp.models.compact import CompactLlama
from lssp.report.stats import chi_square_gof

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")]
GREEDY = SamplingParams(0)
PROMPT = torch.tensor([[0, 5, 6, 7, 8, 9]])


def test_greedy_ssp_equals_rsp_with_the_target_on_the_gpu_and_the_draft_on_the_cpu():
    target = tiny_llama(0, scale=30.0).to("cuda")
    draft = tiny_llama(1, hidden=16, layers=1, scale=30.0)
    rsp = generate_regular(target, PROMPT, 40, GREEDY)
    assert rsp.tokens.device.type == "cpu"
    for k in (1, 2, 4):
        ssp = generate_speculative(target, draft, PROMPT, 40, k, GREEDY)
        assert torch.equal(ssp.tokens, rsp.tokens), k
        assert ssp.stats.drafted > 0 and ssp.stats.forwards_timed


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4)], ids=["t1.0", "t0.7-topk4"])
def test_ssp_keeps_the_targets_law_across_devices(params):
    """The chi-square test of test_generation with the target on the GPU (where verification and every draw
    happen, on a CUDA generator) and the draft on the CPU."""
    target = PrefixTableLM(20)
    draft = PrefixTableLM(21, like=target, mix=0.6)
    law = exact_two_token_law(target, torch.tensor([[1, 2, 3]]), params)
    target = target.to("cuda")
    counts = [0] * VOCAB * VOCAB
    generator = torch.Generator(device="cuda")
    for seed in range(N_RUNS):
        generator.manual_seed(seed)
        first, second = generate_speculative(target, draft, torch.tensor([[1, 2, 3]]), 4, 3, params,
                                             generator).tokens[:2].tolist()
        counts[first * VOCAB + second] += 1
    result = chi_square_gof(counts, law.tolist())
    assert result.p_value > SIGNIFICANCE, result


def test_a_target_split_between_the_gpu_and_the_cpu_decodes_like_one_on_the_cpu():
    from accelerate import dispatch_model

    reference = tiny_llama(0, scale=30.0)
    split = dispatch_model(copy.deepcopy(reference), {"model.embed_tokens": 0, "model.layers.0": 0,
                                                      "model.layers.1": "cpu", "model.norm": "cpu",
                                                      "model.rotary_emb": "cpu", "lm_head": "cpu"})
    draft = tiny_llama(1, hidden=16, layers=1, scale=30.0)
    assert Clock.for_models(split).cuda == [torch.device("cuda:0")]
    expected = generate_regular(reference, PROMPT, 30, GREEDY).tokens
    assert torch.equal(generate_regular(split, PROMPT, 30, GREEDY).tokens, expected)
    assert torch.equal(generate_speculative(split, draft, PROMPT, 30, 3, GREEDY).tokens, expected)


@pytest.mark.parametrize("quantization", ["8bit", "4bit", "int8", "q4_1"])
def test_bitsandbytes_on_cuda_decodes_and_ssp_matches_its_rsp(tiny_dir, quantization):
    """bitsandbytes' entries, and the weight-only ones (CPU kernels) that load through it on a GPU."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (carry its wheel to the GPU machine)")
    from lssp.models.loading import load_model
    from lssp.models.registry import load_registry

    registry = load_registry(tiny_dir / "models.yaml")
    weight_only = quantization in ("int8", "q4_1")  # their entries ask for the compact forward, which bnb skips
    spec = dataclasses.replace(registry.get("tiny-target"), quantization=quantization, dtype="float16",
                               **({"forward": "compact", "compile": True} if weight_only else {}))
    target = load_model(spec, "cuda")
    draft = load_model(registry.get("tiny-draft"), "cuda")
    assert "(bnb)" in target.precision and target.device.type == "cuda"
    rsp = generate_regular(target.model, PROMPT, 24, GREEDY).tokens
    assert torch.equal(generate_speculative(target.model, draft.model, PROMPT, 24, 3, GREEDY).tokens, rsp)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_compiled_compact_forward_on_cuda_is_exact_within_itself_and_close_to_eager(mode):
    """Compiled (CUDA graphs with reduce-overhead) target and draft: greedy SSp emits the compiled target's
    greedy RSp tokens; its logits stay close to the eager compact forward's."""
    from lssp.decoding.kv import forward_logits, new_cache

    eager = CompactLlama(tiny_llama(0, scale=4.0).to("cuda"))
    compiled = CompactLlama(tiny_llama(0, scale=4.0).to("cuda"))
    compiled.compile_decode(mode)
    draft = CompactLlama(tiny_llama(1, hidden=16, layers=1, scale=4.0).to("cuda"))
    draft.compile_decode(mode)
    ids = torch.arange(1, 11, device="cuda")[None]
    kv_e, kv_c = new_cache(eager), new_cache(compiled)
    for start, end in [(0, 6), (6, 9), (9, 10)]:  # prefill, a verification, a decode step
        torch.testing.assert_close(forward_logits(compiled, ids[:, start:end], kv_c, end - start),
                                   forward_logits(eager, ids[:, start:end], kv_e, end - start), rtol=1e-3, atol=1e-3)
    rsp = generate_regular(compiled, PROMPT, 32, GREEDY).tokens
    for k in (2, 4):
        assert torch.equal(generate_speculative(compiled, draft, PROMPT, 32, k, GREEDY).tokens, rsp)


def test_untimed_forwards_on_cuda_give_the_same_tokens_and_no_split():
    target = tiny_llama(0, scale=30.0).to("cuda")
    draft = tiny_llama(1, hidden=16, layers=1, scale=30.0).to("cuda")
    timed = generate_speculative(target, draft, PROMPT, 30, 3, GREEDY)
    untimed = generate_speculative(target, draft, PROMPT, 30, 3, GREEDY, time_forwards=False)
    assert torch.equal(timed.tokens, untimed.tokens)
    assert not untimed.stats.forwards_timed and untimed.stats.target_time_s == 0 < untimed.stats.decode_time_s
    assert timed.stats.target_time_s > 0


def test_random_init_with_gpus_and_a_draft_land_where_the_rules_say():
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    target = load_model(ModelSpec("t", init="random", config=config, gpus=1, dtype="bfloat16"))
    draft = load_model(ModelSpec("d", init="random", config=config, dtype="bfloat16"), draft=True)
    assert target.placement == "cuda:0" and draft.placement.startswith("cuda:")
    assert torch.equal(generate_speculative(target.model, draft.model, PROMPT, 12, 2, GREEDY).tokens,
                       generate_regular(target.model, PROMPT, 12, GREEDY).tokens)


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
def test_greedy_ssp_with_a_feature_head_on_the_gpu_equals_rsp(compact):
    """The head shares the target's device: features, its cache and the verification stay on the GPU."""
    from lssp.models.eagle import FeatureDraft, FeatureHead, head_config

    target = tiny_llama(10, scale=4.0).to("cuda")
    model = CompactLlama(target).eval() if compact else target
    torch.manual_seed(1)
    head = FeatureHead(head_config(target.config)).eval()
    draft = FeatureDraft(head, model)
    assert draft.get_input_embeddings().weight.device.type == "cuda"
    rsp = generate_regular(model, PROMPT, 30, GREEDY)
    for k in (1, 3):
        ssp = generate_speculative(model, draft, PROMPT, 30, k, GREEDY)
        assert torch.equal(ssp.tokens, rsp.tokens), k
