"""Our CPU kernel (``lssp.kernels``, ``BlockLinear``): it holds a GGUF's own Q4_1 and Q8_0 blocks, multiplies by them as
llama.cpp does (int8 activations in groups of 32), gives each row the numbers it gets alone, and a target loaded in
``q4_1`` decodes exactly (greedy SSp = RSp, eager and compiled)."""
from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_tiny

from lssp.decoding.batched import speculative_decode_batch
from lssp.decoding.generation import generate_regular
from lssp.decoding.kv import forward_logits, new_cache
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.speculative import speculative_decode
from lssp.drafters.lookup import CopyFirst
from lssp.drafters.model import FeatureHead
from lssp.engines import Mode, OursEngine, Request
from lssp.kernels import missing_flags
from lssp.models.loading import check_compatible, load_model
from lssp.models.registry import load_registry
from lssp.models.weight_only import INT4_GROUP, BlockLinear, q4_1_blocks, q8_0_blocks, weight_only_quantize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(bool(missing_flags()), reason=f"the CPU lacks {' '.join(missing_flags())}")


def reference(x: torch.Tensor, layer: BlockLinear) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: activations in int8 groups of 32, exact integer dot products per group."""
    q, d, m = layer.blocks()
    xs = x.reshape(x.shape[0], -1, INT4_GROUP)
    s = xs.abs().amax(-1) / 127
    xq = torch.round(xs / torch.where(s > 0, s, torch.ones_like(s))[..., None])
    dots = torch.einsum("rgk,ngk->rng", xq.double(), q.double().reshape(q.shape[0], -1, INT4_GROUP))
    sums = (s * xq.sum(-1)).double()
    return ((dots * (d * s[:, None, :]).double() + m.double()[None] * sums[:, None, :]).sum(-1)).float()


@pytest.mark.parametrize("bits,rows", [(4, 7), (8, 7), (4, 20), (8, 20)])
def test_the_kernel_multiplies_as_llama_cpp_does_and_each_row_alone(bits, rows):
    """Rows go 8 at a time over the weights (20: tiles of 8, 8 and 4; on AVX2 the 4-bit tile takes them 4 at most per
    pass over a block: 7 as 4 and 3), their int8 quantization split between threads from 16 rows."""
    torch.manual_seed(0)
    layer = BlockLinear(torch.randn(48, 96) * 0.05, bits=bits)
    x = torch.randn(rows, 96)
    got = layer(x)
    torch.testing.assert_close(got, reference(x, layer), rtol=1e-4, atol=1e-5)
    for r in range(rows):  # the same numbers alone as beside other rows
        assert torch.equal(layer(x[r:r + 1])[0], got[r])
    assert layer(x[None, :3]).shape == (1, 3, 48)
    held = layer.dequantized()  # within a quantization step of the weight
    torch.testing.assert_close(x @ held.t(), got, rtol=0.05, atol=0.02)


def _gguf_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, d, m of a Q4_1 or Q8_0 tensor as stored in the file (Q8_0 in BlockLinear's form: q + 128, m = -128 d)."""
    rows = tensor.data.shape[0]
    if tensor.tensor_type.name == "Q4_1":  # per 32 weights: d, m (fp16), 16 bytes of nibbles (j low, j + 16 high)
        blocks = tensor.data.reshape(rows, -1, 20)
        d, m = blocks[..., 0:2].copy().view(np.float16)[..., 0], blocks[..., 2:4].copy().view(np.float16)[..., 0]
        q = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1)
        return q.reshape(rows, -1), d.astype(np.float32), m.astype(np.float32)
    blocks = tensor.data.reshape(rows, -1, 34)  # Q8_0: d (fp16), 32 int8
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
    return q.reshape(rows, -1).astype(np.uint8), d, -128 * d


def test_the_default_targets_gguf_blocks_come_back_exactly_from_its_float32_weights():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(load_registry(ROOT / "models.yaml").get("smollm2-135m").local_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, blocks in (("blk.0.ffn_down.weight", q4_1_blocks), ("token_embd.weight", q8_0_blocks)):
        tensor = tensors[name]
        weight = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        if name == "token_embd.weight":
            weight = weight[:4096]  # enough rows, a fraction of the time
        q, d, m = (t.numpy() for t in blocks(weight))
        want_q, want_d, want_m = (a[:weight.shape[0]] for a in _gguf_blocks(tensor))
        assert (q == want_q).all() and (d == want_d).all() and (m == want_m).all(), name


def test_q4_1_keeps_the_output_layer_in_8_bits():
    model = torch.nn.Module()
    model.proj, model.lm_head = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 48, bias=False)
    quantized, kept = weight_only_quantize(model, "q4_1")
    assert (quantized.proj.bits, quantized.lm_head.bits, kept) == (4, 8, 0)


@pytest.mark.parametrize("name", ["tiny-target-q4", "tiny-target-q4-compiled"])
def test_a_target_loaded_in_q4_1_decodes_exactly(tiny_dir, name):
    registry = load_registry(tiny_dir / "models.yaml")
    plain = load_model(registry.get("tiny-target"))
    draft = load_model(registry.get("tiny-draft"), draft=True)
    target = load_model(registry.get(name))
    assert target.precision.startswith("q4_1")
    ids = torch.tensor([[1, 5, 9, 3, 8, 2]])
    want = forward_logits(plain.model, ids, new_cache(plain.model), 6)
    got = forward_logits(target.model, ids, new_cache(target.model), 6)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8  # close to the float model's
    engine = OursEngine(target, [draft], [check_compatible(target, draft)])
    for temperature in (0.0, 0.8):
        request = Request(ids, 24, SamplingParams(temperature), 0)
        rsp = engine.complete(Mode("rsp"), request).tokens.tolist()
        ssp = engine.complete(Mode("ssp", 3), request).tokens.tolist()
        if temperature == 0:
            assert ssp == rsp
        else:
            assert len(ssp) == len(rsp) == 24


def test_quantization_auto_measures_once_says_its_choice_and_the_head_follows_the_target(tiny_dir, tmp_path,
                                                                                         monkeypatch, caplog):
    import json

    from lssp.models import calibration
    from lssp.report import contention

    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path))
    monkeypatch.setattr(contention, "others_share", lambda start, end: 0.0)  # quiet, whatever runs beside the test
    registry = load_registry(tiny_dir / "models.yaml")
    with caplog.at_level("INFO"):
        target = load_model(registry.get("tiny-target-auto"))
    chosen = target.spec.quantization
    assert chosen in {q for q, _ in calibration.CANDIDATES} and target.precision.startswith(chosen)
    assert "quantization auto -> " + chosen in caplog.text and "measured now" in caplog.text
    stored = json.loads(calibration.cache_file().read_text())
    (entry,) = stored.values()
    assert entry["quantization"] == chosen and set(entry["ms"]) >= {"int4", "dynamic-fp16"}
    caplog.clear()
    with caplog.at_level("INFO"):
        again = load_model(registry.get("tiny-target-auto"))
    assert again.spec.quantization == chosen and "cached" in caplog.text
    head = load_model(registry.get("tiny-eagle-auto"), draft=True, target=target)
    assert head.spec.quantization == chosen
    ids = torch.tensor([[1, 5, 9, 3, 8, 2]])
    engine = OursEngine(target, [head], [check_compatible(target, head)])
    request = Request(ids, 16, SamplingParams(0.0), 0)
    assert engine.complete(Mode("ssp", 2), request).tokens.tolist() == engine.complete(Mode("rsp"), request).tokens.tolist()


def test_a_calibration_timed_on_a_busy_machine_is_used_but_not_cached(tiny_dir, tmp_path, monkeypatch, caplog):
    from lssp.models import calibration
    from lssp.report import contention

    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path))
    monkeypatch.setattr(contention, "others_share", lambda start, end: 0.6)
    registry = load_registry(tiny_dir / "models.yaml")
    with caplog.at_level("INFO"):
        target = load_model(registry.get("tiny-target-auto"))
    assert target.spec.quantization in {q for q, _ in calibration.CANDIDATES}
    assert "busy machine (other work 60% of the CPUs): not cached" in caplog.text
    assert not calibration.cache_file().exists()


@pytest.mark.parametrize("name", ["tiny-target-q4", "tiny-target-q4-compiled", "tiny-wide-q4", "tiny-wide-q4-f16"])
def test_a_verification_forward_gives_each_position_the_one_token_forwards_numbers(tiny_dir, name):
    """int8 activations turn a batched attention's rounding into other tokens: under q4_1 each query attends by
    itself (row_attention), so 5 tokens in one forward get the very logits of 5 one-token forwards; after a long
    context too, where the rows' slots run over blocks of 128 (the last rows into a second one, or a third)."""
    model = load_model(load_registry(tiny_dir / "models.yaml").get(name)).model
    ids = torch.randint(0, 64, (1, 310), generator=torch.Generator().manual_seed(3))
    for start in (25, 125, 300):
        with torch.inference_mode():
            kv = model.new_cache()
            model(ids[:, :start], past_key_values=kv)
            one = torch.stack([model(ids[:, start + i:start + i + 1], past_key_values=kv).logits[0, -1] for i in range(5)])
            kv.crop(-5)
            assert torch.equal(model(ids[:, start:start + 5], past_key_values=kv).logits[0], one)


@pytest.mark.parametrize("heads", [6, 8])
def test_query_heads_sharing_a_key_value_head_attend_together_as_each_alone(tmp_path, heads):
    """Heads of 64 sharing a key/value head (3 or 4 to one) attend together in the one-call decoder, each key and
    value row widened from float16 once for the group: each query still gets the numbers the layer-by-layer forward
    gives it (row_attention, one query at a time; logits ~2-4 apart where a head is mixed up) up to int8 activations
    rounding the other way, and a verification forward the one-token forwards' numbers, within one block of slots and
    past it."""
    save_tiny(tmp_path / "grouped", 6, hidden=64 * heads, heads=heads, kv_heads=2, scale=4.0)
    (tmp_path / "models.yaml").write_text("models:\n  grouped:\n    path: ./grouped\n    dtype: float32\n"
                                          "    quantization: q4_1\n    forward: compact\n    kv_cache: float16\n")
    model = load_model(load_registry(tmp_path / "models.yaml").get("grouped")).model
    assert model._block_stack() is not None
    ids = torch.randint(0, 64, (1, 310), generator=torch.Generator().manual_seed(4))

    def forwards(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            kv = model.new_cache()
            model(ids[:, :start], past_key_values=kv)
            one = torch.stack([model(ids[:, start + i:start + i + 1], past_key_values=kv).logits[0, -1] for i in range(3)])
            kv.crop(-3)
            return one, model(ids[:, start:start + 3], past_key_values=kv).logits[0]

    for start in (40, 300):
        one, verification = forwards(start)
        assert torch.equal(verification, one)
        model.__dict__["_stack"] = None  # the layer-by-layer forward: each query by itself
        alone, _ = forwards(start)
        del model.__dict__["_stack"]
        torch.testing.assert_close(one, alone, rtol=0, atol=0.1)  # int8 activations rounding the other way: ~0.03


@pytest.mark.parametrize("name, long", [("tiny-target-q4", False), ("tiny-wide-q4-f16", False),
                                        ("tiny-wide-q4", True), ("tiny-wide-q4-f16", True)])
def test_batched_rows_give_each_row_the_tokens_it_gets_alone(tiny_dir, name, long):
    """Rows of different lengths in one batch (holes in the cache, rows accepting different numbers of drafts): under
    q4_1 each row's sampled tokens are those it draws alone with its seed, exactly (a float16 cache too); past 128
    slots too, where a block of slots serves the queries of every row reaching it."""
    registry = load_registry(tiny_dir / "models.yaml")
    target = load_model(registry.get(name))
    draft = load_model(registry.get("tiny-draft"), draft=True)
    engine = OursEngine(target, [draft], [check_compatible(target, draft)])
    rows = [torch.tensor([1, 5, 9, 3]), torch.tensor([2, 7]), torch.tensor([4, 4, 6, 8, 1, 3])]
    if long:
        rows = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (140, 118, 260)]
    request = Request(rows[0][None], 20, SamplingParams(0.8), 0)
    for mode in (Mode("rsp"), Mode("ssp", 3)):
        assert engine.batch_reason(mode) is None
        together = engine.complete_many(mode, rows, request, [11, 12, 13])
        for row, seed, out in zip(rows, (11, 12, 13), together):
            alone = engine.complete(mode, Request(row[None], 20, SamplingParams(0.8), seed))
            assert out.tokens.tolist() == alone.tokens.tolist()


def test_the_one_call_decoder_skips_a_batchs_holes_and_computes_the_rest_as_before(tiny_dir):
    """Padding (``used`` False) is not computed: the other positions get the numbers of the padded forward, a hole's
    logits and hidden states are zeros and its cache slot keeps what it held."""
    model = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    used = torch.ones(2, 4, dtype=torch.bool)
    used[0, :2] = used[1, 3] = False  # row 0 left-padded, row 1 right-padded
    valid = torch.cat([torch.ones(2, 5, dtype=torch.bool), used], dim=1)  # as lssp.decoding.batched masks rows
    slot, query = torch.arange(9)[None, None], 5 + torch.arange(4)[None, :, None]
    allowed = (valid[:, None] & (slot <= query)) | (slot == query)  # a hole sees only itself, no one sees a hole
    mask = torch.zeros(2, 1, 4, 9).masked_fill_(~allowed[:, None], float("-inf"))
    positions = torch.tensor([[5, 5, 5, 6], [5, 6, 7, 7]])
    outs, caches = [], []
    with torch.inference_mode():
        for holes in (None, used):
            kv = model.new_cache(2)
            model(ids[:, :5], past_key_values=kv)
            kv.reserve(9)
            for buffer in kv.keys_values:
                buffer[1, :, 8] = 7.0  # row 1's hole
            caches.append(kv)
            outs.append(model(ids[:, 5:], past_key_values=kv, attention_mask=mask, position_ids=positions,
                              features=True, used=holes))
    (full, skipped), (kv_full, kv_skipped) = outs, caches
    assert torch.equal(skipped.logits[used], full.logits[used])
    assert torch.equal(skipped.features[used], full.features[used])
    assert not skipped.logits[~used].any() and not skipped.features[~used].any()
    for a, b in zip(kv_full.keys_values, kv_skipped.keys_values):
        assert torch.equal(a[0, :, 7:9], b[0, :, 7:9]) and torch.equal(a[1, :, 5:8], b[1, :, 5:8])
        assert (b[1, :, 8] == 7.0).all() and not (a[1, :, 8] == 7.0).all()  # the hole's slot: written only unskipped


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "T=1"])
def test_rows_copying_chains_over_a_q4_target_are_batched_and_each_gets_its_tokens_alone(tiny_dir, params):
    """Over a target whose forward skips the padding, copied chains past K no longer keep a batch from forming: rows
    verifying chains of up to 5 beside rows verifying K=2 drafts each get the tokens and counts they get alone."""
    registry = load_registry(tiny_dir / "models.yaml")
    loaded = load_model(registry.get("tiny-target-q4"))
    target, head = loaded.model, load_model(registry.get("tiny-eagle-q4"), draft=True, target=loaded).model
    make = lambda: CopyFirst(FeatureHead(head), 1, chain=5)  # noqa: E731
    assert target.skips_holes and make().rows_reason(target) is None
    prompts = [[3, 9, 4, 3, 9, 4, 3, 9], [7, 7, 7, 7, 7], [5, 1, 2, 6, 5, 1], [8, 2]]
    generators = lambda s: None if params.greedy else torch.Generator().manual_seed(s)  # noqa: E731
    outs = speculative_decode_batch(target, make(), [torch.tensor(p) for p in prompts], 16, 2, params,
                                    [generators(s) for s in range(len(prompts))])
    for seed, (prompt, out) in enumerate(zip(prompts, outs)):
        alone = speculative_decode(target, make(), torch.tensor([prompt]), 16, 2, params, generators(seed))
        assert out.tokens.tolist() == alone.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted, out.stats.drafted_at) == \
            (alone.stats.drafted, alone.stats.accepted, alone.stats.drafted_at), prompt
    assert any(out.stats.drafted_at[2:] != [0, 0, 0] for out in outs)  # chains past K were verified


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "T=1"])
def test_a_subset_head_drafts_from_its_own_tokens_logits_as_its_forward_gives_them(tiny_dir, params):
    """Over a q4_1 target a head over frequent tokens drafts from its tokens' logits unwidened (``draft_logits``):
    its forward's numbers at those tokens; and SSp drafting so proposes the tokens, with the laws, that drafting
    from the widened logits does (greedy: RSp's tokens)."""
    from lssp.models.eagle import FeatureDraft
    from lssp.models.loading import cpu_quantize
    from lssp.models.registry import ModelSpec
    from tests.conftest import random_head

    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    ids = list(range(1, 64, 2))
    head = cpu_quantize(FeatureDraft(random_head(target, 3, token_ids=ids), target), ModelSpec("h", quantization="q4_1"))
    assert head._fused_output(1) is not None  # the head's output rows run in the one call
    prompt = torch.tensor([[3, 9, 4, 7, 1, 8]])
    with torch.inference_mode():
        kv_target = new_cache(target)
        features = target(prompt[:, :-1], past_key_values=kv_target, features=True).features
        kv_a, kv_b = head.start(prompt, features), head.start(prompt, features)
        for token in (8, 5):  # the first draft after the prompt, then one fed the head's own guess
            full = head(torch.tensor([[token]]), kv_a, logits_to_keep=1).logits[0, -1]
            narrow, columns = head.draft_logits(torch.tensor([[token]]), kv_b)
            assert columns.tolist() == ids and torch.equal(narrow, full[columns])
            assert torch.isinf(full[::2]).all() and torch.equal(kv_a.guess, kv_b.guess)
    generator = lambda: None if params.greedy else torch.Generator().manual_seed(4)  # noqa: E731
    out = speculative_decode(target, FeatureHead(head), prompt, 20, 3, params, generator())
    widened = FeatureHead(head)
    widened.chains = False  # step by step, through _logits
    widened._logits = lambda pending: (head(pending, widened.kv, logits_to_keep=1).logits[0, -1], None)
    again = speculative_decode(target, widened, prompt, 20, 3, params, generator())
    assert out.tokens.tolist() == again.tokens.tolist() and out.stats.accepted == again.stats.accepted
    if params.greedy:
        assert out.tokens.tolist() == generate_regular(target, prompt, 20, params).tokens.tolist()


def _q4_head(kind: str, target, ids: list[int], folder: Path):
    """A random head of ``kind`` (EAGLE-1 or EAGLE-3) drafting ``ids`` for ``target``, its Linear layers in q4_1."""
    from lssp.models.eagle import FeatureDraft
    from lssp.models.eagle3 import Eagle3Draft, load_eagle3_head
    from lssp.models.loading import cpu_quantize
    from lssp.models.registry import ModelSpec
    from tests.conftest import random_head
    from tests.test_eagle3 import publish

    if kind == "eagle":
        return cpu_quantize(FeatureDraft(random_head(target, 3, token_ids=ids), target), ModelSpec("h", quantization="q4_1"))
    publish(folder, target, ids, seed=3, aux=[1] * 3)  # the 2-layer target's one middle state, three times
    head = Eagle3Draft(load_eagle3_head(folder, target), target, torch.float32)
    return weight_only_quantize(head, "q4_1")[0]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "T=0.7"])
def test_a_heads_chain_in_one_call_is_its_steps_one_by_one(tiny_dir, tmp_path, temperature, kind):
    """``draft_chain`` (k drafts in one kernel call) gives the argmaxes of k ``draft_logits`` steps, each fed the last
    draft, or at a temperature their draws (``inverse_cdf`` of the warped logits by the same uniforms) and laws; and
    leaves the head's cache, guess and length as those steps do, after a first step of one token or several. SSp
    gives the same tokens and counts with it and without it (sampling: the same seed). EAGLE-1 and EAGLE-3 heads."""
    from lssp.decoding.sampling import inverse_cdf, warp

    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    ids = list(range(1, 64, 2))
    head = _q4_head(kind, target, ids, tmp_path / "head")
    assert head.can_chain
    params = SamplingParams(temperature)
    prompt = torch.tensor([[3, 9, 4, 7, 1, 8, 2, 6]])
    with torch.inference_mode():
        features = target(prompt[:, :-1], past_key_values=new_cache(target), features=True).features
        for fed, k in ((1, 3), (3, 2), (2, 1)):  # the first step feeds the prompt's last `fed` tokens
            read = prompt.shape[1] - fed  # the tokens the head has read before
            kv_chain, kv_steps = (head.start(prompt[:, :read + 1], features[:, :read]) for _ in range(2))
            for kv in (kv_chain, kv_steps):
                if fed > 1:
                    kv.queue(features[:, read:])
            pending = prompt[:, read:]
            uniforms = torch.rand(k, dtype=torch.float64, generator=torch.Generator().manual_seed(fed))
            chain, laws = head.draft_chain(pending, kv_chain, k, temperature, uniforms if temperature else None)
            steps = []
            for j in range(k):
                logits, columns = head.draft_logits(pending, kv_steps)
                if temperature:
                    q = warp(logits.unsqueeze(0), params)[0]
                    torch.testing.assert_close(laws[j], q, rtol=1e-5, atol=1e-7)
                    assert int(inverse_cdf(laws[j], uniforms[j:j + 1])) == int(inverse_cdf(q, uniforms[j:j + 1]))
                column = int(inverse_cdf(laws[j], uniforms[j:j + 1])) if temperature else int(logits.argmax())
                steps.append(int(columns[column]))
                pending = torch.tensor([[steps[-1]]])
            assert chain == steps and kv_chain.length == kv_steps.length
            assert (laws is None) == (temperature == 0)
            assert torch.equal(kv_chain.guess, kv_steps.guess)
            for a, b in zip(kv_chain.keys_values, kv_steps.keys_values):
                assert torch.equal(a[:, :, :kv_chain.length], b[:, :, :kv_chain.length])
    chained, stepwise = FeatureHead(head), FeatureHead(head)
    stepwise.chains = False
    generator = lambda: torch.Generator().manual_seed(5) if temperature else None  # noqa: E731
    runs = [speculative_decode(target, drafter, prompt, 24, 3, params, generator()) for drafter in (chained, stepwise)]
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
    assert (runs[0].stats.accepted, runs[0].stats.drafted) == (runs[1].stats.accepted, runs[1].stats.drafted)


def test_an_eagle3_layer_in_one_kernel_call_drafts_as_its_torch_layer(tiny_dir, tmp_path):
    """An EAGLE-3 head in q4_1 runs its layer (the two normed halves into queries, keys and values, its own final
    norm, the pre-norm state fed back) in our kernel: over a prompt and four drafting steps its logits are those of
    the same blocks run layer by layer in torch, to float32 rounding."""
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    head = _q4_head("eagle3", target, list(range(1, 64, 2)), tmp_path / "head")
    prompt = torch.tensor([[3, 9, 4, 7, 1, 8, 2, 6]])
    runs = []
    with torch.inference_mode():
        features = target(prompt[:, :-1], past_key_values=new_cache(target), features=True).features
        for kernel in (True, False):
            if not kernel:
                head.__dict__["_chain_parts_"] = None  # as a head outside our blocks runs
            kv, pending, steps = head.start(prompt, features), prompt[:, -1:], []
            for _ in range(4):
                logits, columns = head.draft_logits(pending, kv)
                steps.append(logits)
                pending = torch.tensor([[int(columns[int(logits.argmax())])]])
            runs.append(torch.stack(steps))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "T=1"])
def test_batched_rows_with_an_eagle3_head_give_what_each_gives_alone(tiny_dir, tmp_path, params, kernel):
    """An EAGLE-3 head drafts for rows at positions of their own (its layer in our kernel, padding skipped, or in
    torch under the rows' mask): each row gets the tokens and counts it gets alone."""
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    head = _q4_head("eagle3", target, list(range(64)), tmp_path / "head")
    if not kernel:
        head.__dict__["_chain_parts_"] = None  # as a head outside our blocks runs
    assert FeatureHead(head).rows_reason(target) is None
    prompts = [[3, 9, 4, 3, 9, 4, 3, 9], [7, 7, 7, 7, 7], [5, 1, 2, 6, 5, 1], [8, 2]]
    generators = lambda s: None if params.greedy else torch.Generator().manual_seed(s)  # noqa: E731
    outs = speculative_decode_batch(target, FeatureHead(head), [torch.tensor(p) for p in prompts], 16, 2, params,
                                    [generators(s) for s in range(len(prompts))])
    for seed, (prompt, out) in enumerate(zip(prompts, outs)):
        alone = speculative_decode(target, FeatureHead(head), torch.tensor([prompt]), 16, 2, params, generators(seed))
        assert out.tokens.tolist() == alone.tokens.tolist(), prompt
        assert (out.stats.drafted, out.stats.accepted) == (alone.stats.drafted, alone.stats.accepted), prompt
    assert sum(out.stats.accepted for out in outs) > 0


def test_a_float16_kv_cache_holds_the_float32_keys_and_values_rounded_where_the_one_call_decoder_runs(tiny_dir):
    """``kv_cache: float16`` on a q4_1 entry: the cache is float16, its first layer's keys and values (read from the
    embeddings alone) the float32 cache's rounded to nearest, the precision says so, and the logits stay close; over
    heads the kernel does not take in float16 (8 wide) the cache stays float32."""
    registry = load_registry(tiny_dir / "models.yaml")
    half, full = (load_model(registry.get(name)) for name in ("tiny-wide-q4-f16", "tiny-wide-q4"))
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        caches = [loaded.model.new_cache() for loaded in (half, full)]
        logits = [loaded.model(ids, past_key_values=kv).logits for loaded, kv in zip((half, full), caches)]
    assert caches[0].keys_values[0].dtype == torch.float16 and caches[1].keys_values[0].dtype == torch.float32
    for i in (0, 1):  # layer 0's keys and values
        assert torch.equal(caches[0].keys_values[i][:, :, :40], caches[1].keys_values[i][:, :, :40].half())
    gap = (logits[0] - logits[1]).abs()
    assert gap.mean() < 0.05 and gap.max() < 0.25, (gap.mean(), gap.max())  # int8 activations round a few other ways
    assert half.precision.endswith("float16 KV cache") and "KV cache" not in full.precision
    narrow = load_model(registry.get("tiny-target-q4-f16"))
    assert narrow.model.new_cache().keys_values[0].dtype == torch.float32 and "KV cache" not in narrow.precision


def test_the_kernels_fake_tensors_match_what_they_return_for_any_layout():
    """torch.compile builds graphs from the ops' fake kernels: their shapes, dtypes and strides must be the real ones,
    also for a query laid out as attention hands it over (heads and positions transposed), or a compiled step fails
    at run time (`assert_size_stride`)."""
    layer = BlockLinear(torch.randn(16, 64) * 0.05, bits=4)  # loads the ops
    torch.library.opcheck(torch.ops.lssp.block_mm.default, (torch.randn(3, 64), layer.packed, layer.scales, layer.mins),
                          test_utils=("test_schema", "test_faketensor"))
    q = torch.randn(1, 5, 4, 64).transpose(1, 2)  # (B, H, R, D) with R and H strides swapped
    keys, values = torch.randn(1, 4, 9, 64), torch.randn(1, 4, 9, 64)
    allowed = torch.ones(1, 5, 9, dtype=torch.bool)
    for mask in (allowed, None):
        torch.library.opcheck(torch.ops.lssp.row_attention.default, (q, keys, values, mask, 0.125),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("head_dim, half", [(8, False), (64, False), (64, True), (128, True)])
def test_row_attention_is_each_querys_softmax_attention_over_its_allowed_slots(head_dim, half):
    """Against attention in float64, each query over the slots its mask allows (some rows seeing more than 128 slots,
    in blocks, some fewer, one none): float32 sums' rounding apart, the same; float16 keys and values read widened."""
    BlockLinear(torch.randn(16, 64) * 0.05, bits=4)  # loads the ops
    gen = torch.Generator().manual_seed(head_dim)
    B, H, R, S = 2, 3, 4, 300
    q = torch.randn(B, H, R, head_dim, generator=gen)
    keys, values = torch.randn(B, H, S, head_dim, generator=gen), torch.randn(B, H, S, head_dim, generator=gen)
    if half:
        keys, values = keys.half(), values.half()
    allowed = torch.rand(B, R, S, generator=gen) < 0.7
    allowed[0, 0, 100:] = False  # within one block
    allowed[1, 1] = False  # no slot at all: zeros
    out = torch.ops.lssp.row_attention(q, keys, values, allowed, head_dim ** -0.5)
    scores = (q.double() @ keys.double().transpose(2, 3)) * head_dim ** -0.5
    weights = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(out, (weights @ values.double()).float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(out[1, :, 1], torch.zeros(H, head_dim))


@pytest.mark.parametrize("name, start", [("tiny-target-q4", 9), ("tiny-eagle-q4", 9), ("tiny-wide-q4-f16", 9),
                                         ("tiny-wide-q4-f16", 300)])
def test_the_one_call_decoder_computes_what_the_layer_by_layer_forward_does(tiny_dir, name, start):
    """A q4_1 model's decoder layers, final norm and output layer run in one call of ``torch.ops.lssp.decoder``; the
    layer-by-layer forward (block_mm and row_attention from Python) is the reference: the same arithmetic, up to where
    float32 sums round an int8 activation the other way; after 300 tokens too (attention over blocks of slots)."""
    registry = load_registry(tiny_dir / "models.yaml")
    target = load_model(registry.get("tiny-target-q4"))
    model = target.model if name == "tiny-target-q4" else load_model(registry.get(name), draft=True, target=target).model
    if name == "tiny-wide-q4-f16":
        target = load_model(registry.get(name))
        model, name = target.model, "tiny-target-q4"  # a target, as above
    assert model._block_stack() is not None
    assert model._fused_output(1) is not None  # the final norm and output layer in the same call
    ids = torch.randint(0, 64, (1, start + 3), generator=torch.Generator().manual_seed(5))

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            kv = model.new_cache()
            if name != "tiny-target-q4":
                model.start(ids[:, :start], torch.randn(1, start - 1, model.config.hidden_size,
                                                        generator=torch.Generator().manual_seed(1)), kv)
            first = model(ids[:, :start], past_key_values=kv) if name == "tiny-target-q4" else None
            steps = [model(ids[:, start + i:start + i + 1], past_key_values=kv).logits[0, -1] for i in range(3)]
            every = start >= 100  # a long prompt: each of its positions
            return torch.cat(([first.logits[0, -start if every else -1:]] if first is not None else []) +
                             [torch.stack(steps)])

    fused = logits()
    model.__dict__["_stack"] = None  # the layer-by-layer forward
    layered = logits()
    if start < 100:
        torch.testing.assert_close(fused, layered, rtol=1e-3, atol=1e-3)
    else:  # over hundreds of positions some int8 activations round the other way: most positions still agree
        assert (fused - layered).abs().amax(-1).median() < 1e-4


def test_the_one_call_decoder_gives_the_hidden_states_of_tapped_layers(tiny_dir):
    """A fused feature head reads the target's hidden states after some layers: the one-call decoder then runs in a
    call per run of layers, with the same logits and final features, and the tapped states those of the
    layer-by-layer forward."""
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(6))

    def features(taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        target.feature_layers = taps
        with torch.inference_mode():
            kv = target.new_cache()
            out = [target(ids[:, :7], past_key_values=kv, features=True)]
            out += [target(ids[:, 7 + i:8 + i], past_key_values=kv, features=True) for i in range(3)]
        return torch.cat([o.logits[0, -1:] for o in out]), torch.cat([o.features[0] for o in out])

    plain_logits, plain = features(())
    tapped_logits, tapped = features((0,))
    assert tapped.shape[-1] == 2 * plain.shape[-1]
    torch.testing.assert_close(tapped_logits, plain_logits, rtol=0, atol=0)
    torch.testing.assert_close(tapped[:, -plain.shape[-1]:], plain, rtol=0, atol=0)
    target.__dict__["_stack"] = None  # the layer-by-layer forward
    layered_logits, layered = features((0,))
    torch.testing.assert_close(tapped, layered, rtol=1e-3, atol=1e-3)


def kept_against_passed(model: torch.nn.Module) -> int:
    """The one-call decoder's logits from ``model``'s kept stack equal those from its tensors passed; its handle."""
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        kv = model.new_cache()
        model(ids[:, :5], past_key_values=kv)
        hidden = model.hf.model.embed_tokens(ids[:, 5:])
        cos, sin = model._rotary(5, 6, hidden)
        output, handle = model._fused_output(1), model._kept_stack()
        logits = [torch.ops.lssp.decoder(hidden, cos, sin, None, weights, kv.keys_values, 5, model.heads,
                                         model.kv_heads, model.eps, model.scale, output.norm, output.weights, 1, None,
                                         stack=stack)[1] for weights, stack in (([], handle), (model._block_stack(), -1))]
        assert torch.equal(*logits)
        assert len(torch.ops.lssp.kept(handle)) == len(model._block_stack())
    return handle


def test_a_kept_stack_gives_its_tensors_numbers_and_goes_with_its_model(tiny_dir):
    """The one-call decoder reads a model's weights from a stack kept in the kernel by handle (passing 14 tensors a
    layer to every call cost ~0.1 ms a forward): the same logits as the tensors passed; the stack is let go when its
    model is, and its handle then refused in one line."""
    model = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target-q4")).model
    handle = kept_against_passed(model)
    del model
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no stack kept as {handle}"):
        torch.ops.lssp.kept(handle)


def test_the_forward_gives_the_same_logits_on_one_thread_as_on_two(tiny_dir):
    """Each output of the one-call decoder is computed by one thread in the same order however the work is shared,
    so one thread and two give the same logits, decoding and verifying."""
    model = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-wide-q4-f16")).model
    ids = torch.randint(0, 64, (1, 140), generator=torch.Generator().manual_seed(8))

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            kv = model.new_cache()
            prompt = model(ids[:, :136], past_key_values=kv).logits[0]
            return torch.cat([prompt, model(ids[:, 136:137], past_key_values=kv).logits[0],
                              model(ids[:, 137:140], past_key_values=kv).logits[0]])

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = logits()
        torch.set_num_threads(1)
        one = logits()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_kernel_runs_on_avx512_vnni_or_avx2_and_says_which(monkeypatch):
    """Either vector set builds the kernel (AVX-512 first); a CPU with neither is told what it lacks."""
    import lssp.kernels as kernels
    from lssp.report import results

    monkeypatch.setattr(kernels, "FORCE_AVX2", False)
    cases = [({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}, "avx512-vnni"),
             ({"avx512f", "avx2", "fma", "f16c"}, "avx2"), ({"avx2", "fma", "f16c"}, "avx2"), ({"avx", "f16c"}, "")]
    for flags, isa in cases:
        monkeypatch.setattr(results, "cpu_flags", lambda flags=flags: flags)
        assert kernels.kernel_isa() == isa
        assert kernels.missing_flags() == ([] if isa else ["avx2", "fma"])


# The kernel tests that compare its numbers with a reference: run again over the AVX2 build where the CPU has AVX-512.
AVX2_RERUN = ("multiplies or decodes_exactly or verification_forward or attend_together or layer_by_layer or "
              "row_attention or float16_kv or chain_in_one_call")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_kernels_other_vector_path_builds_and_computes_what_the_references_do(tmp_path):
    """The suite runs the path this CPU builds by default; the other one must not break unseen. On a CPU with
    AVX-512, the AVX2 path (pairs of 256-bit registers, F16C; what an AVX2-only EPYC runs) is built
    ($LLAMASSP_KERNEL_AVX2=1) and the kernel's tests against references run over it in a child pytest; on an
    AVX2-only CPU, the AVX-512 source is compiled (it cannot run there)."""
    from lssp.kernels import kernel_isa

    if kernel_isa() == "avx512-vnni":
        env = {**os.environ, "LLAMASSP_KERNEL_AVX2": "1"}
        child = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs",
                                str(Path(__file__)), "-k", AVX2_RERUN, "--basetemp", str(tmp_path)],
                               capture_output=True, text=True, env=env, cwd=ROOT)
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
        passed = re.search(r"(\d+) passed", child.stdout)
        assert passed and int(passed.group(1)) >= 20 and "skipped" not in child.stdout, child.stdout[-1500:]
        return
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from lssp.kernels import SOURCE

    includes = [arg for path in [*include_paths(), sysconfig.get_paths()["include"]] for arg in ("-isystem", path)]
    result = subprocess.run(["c++", "-fsyntax-only", "-std=c++20", "-O3", "-march=icelake-server", "-fopenmp",
                             "-DTORCH_EXTENSION_NAME=lssp_avx512_check", *includes, str(SOURCE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_row_says_whether_the_kernels_weights_got_huge_pages(tiny_dir):
    """A forward streaming its weights from 4 KiB pages took up to 20% longer by chance per process: the run's
    environment (every row) names the share of each model's weights arena in huge pages, where it has one."""
    from lssp.kernels import huge_page_share
    from lssp.report.results import RunInfo

    registry = load_registry(tiny_dir / "models.yaml")
    q4, plain = load_model(registry.get("tiny-target-q4")), load_model(registry.get("tiny-draft"))
    arena = torch.ops.lssp.arena(4 << 20)
    share = huge_page_share([(arena.data_ptr(), arena.numel())])
    assert share is not None and 0.0 <= share <= 1.0
    assert plain.huge_pages is None and q4.huge_pages is not None
    env = RunInfo.for_models(q4, plain).env
    assert env["huge_pages"] == f"tiny-target-q4: {q4.huge_pages:.0%}"
