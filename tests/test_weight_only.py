"""Weight-only int4 and int8 layers (``lssp.models.weight_only``): they multiply by the weights they hold, int4 keeps
a GGUF Q4_1 grid exactly, and a target loaded with them decodes as exactly as any other (greedy SSp = RSp)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lssp.decoding.kv import forward_logits, new_cache
from lssp.decoding.sampling import SamplingParams
from lssp.engines import Mode, OursEngine, Request
from lssp.models.loading import check_compatible, load_model
from lssp.models.registry import load_registry
from lssp.models.weight_only import INT4_GROUP, Int4Linear, Int8Linear, weight_only_quantize


def test_the_layers_multiply_by_the_weights_they_hold_within_a_quantization_step():
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * 0.05
    x = torch.randn(3, 96)
    grouped = weight.reshape(48, -1, INT4_GROUP)
    int4_step = ((grouped.amax(-1) - grouped.amin(-1)) / 15).repeat_interleave(INT4_GROUP, 1)
    int8_step = (weight.abs().amax(1, keepdim=True) / 127).expand_as(weight)
    for layer, step in ((Int4Linear(weight), int4_step), (Int8Linear(weight), int8_step)):
        held = layer.dequantized()
        assert ((held - weight).abs() <= 0.51 * step + 1e-3).all()  # round to nearest (+ the bf16 of the scales)
        torch.testing.assert_close(layer(x), x.bfloat16().float() @ held.t(), rtol=2e-2, atol=2e-3)
        assert layer(x[None]).shape == (1, 3, 48)  # any leading dimensions


def test_int4_keeps_a_q4_1_grid_exactly():
    """Q4_1 stores w = q * d + m per 32 weights: where a block uses its whole range (q 0 and 15), int4's groups
    hold the very same values (scale d, zero m + 8d)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (16, 2, INT4_GROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.tensor([0.5, 0.25, 0.125, 1.0])[torch.randint(0, 4, (16, 2, 1), generator=generator)]
    m = torch.tensor([-1.0, -2.0, 0.5])[torch.randint(0, 3, (16, 2, 1), generator=generator)]
    weight = (q * d + m).reshape(16, 2 * INT4_GROUP)
    assert torch.equal(Int4Linear(weight).dequantized(), weight)


def test_shapes_the_kernel_refuses_stay_float():
    model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.Linear(16, 10, bias=False), nn.Linear(10, 4))
    quantized, kept = weight_only_quantize(model, "int4")
    assert type(quantized[0]) is Int4Linear and type(quantized[1]) is nn.Linear and kept == 2


def test_a_target_loaded_in_int4_or_int8_decodes_exactly(tiny_dir):
    registry = load_registry(tiny_dir / "models.yaml")
    plain = load_model(registry.get("tiny-target"))
    draft = load_model(registry.get("tiny-draft"), draft=True)
    ids = torch.tensor([[1, 5, 9, 3, 8, 2]])
    want = forward_logits(plain.model, ids, new_cache(plain.model), 6)
    for name, precision in (("tiny-target-int4", "int4 (torch), compact forward"), ("tiny-target-int8", "int8 (torch)")):
        target = load_model(registry.get(name))
        assert target.precision == precision
        got = forward_logits(target.model, ids, new_cache(target.model), 6)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8  # close to the float model's
        engine = OursEngine(target, [draft], [check_compatible(target, draft)])
        request = Request(ids, 24, SamplingParams(0.0), 0)
        assert engine.complete(Mode("ssp", 3), request).tokens.tolist() == \
            engine.complete(Mode("rsp"), request).tokens.tolist()


def test_cost_times_the_weight_only_formats_against_the_machines_floor(run, tmp_path):
    """Each format's forward beside its floor: the Linear weights (as stored: int4 about a quarter of fp16's bytes)
    read at the copy bandwidth, or their arithmetic at the format's own matmul speed."""
    import json

    code, out, err = run("cost", "tiny-target", "--precisions", "int4,int8,dynamic-fp16,float32", "--tokens", "1,3",
                         "--repeats", "2", "--context", "40", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    assert "int4" in out and "int8" in out and "floor" in out
    rows = {(r["precision"], r["tokens"]): r for r in json.loads((tmp_path / "c.json").read_text())}
    assert all(r["floor_ms"] > 0 and r["over_floor"] > 0 and r["bound"] in ("memory", "compute") for r in rows.values())
    assert rows[("int4", 1)]["weight_bytes"] < 0.6 * rows[("dynamic-fp16", 1)]["weight_bytes"]
    assert rows[("dynamic-fp16", 1)]["weight_bytes"] == rows[("float32", 1)]["weight_bytes"] // 2
    assert rows[("float32", 3)]["floor_ms"] >= rows[("float32", 1)]["floor_ms"]
    # the 40 cached tokens' keys and values are read too: float32 ones in every format here (the weights' format
    # leaves the cache alone)
    assert len({r["cache_bytes"] for r in rows.values()}) == 1 and rows[("int4", 1)]["cache_bytes"] > 0
    for r in rows.values():
        if r["bound"] == "memory":
            read = r["weight_bytes"] + r["cache_bytes"]
            assert r["floor_ms"] == pytest.approx(1000 * read / (r["bandwidth_gbs"] * 1e9), rel=1e-6)


def test_the_floor_counts_the_cached_keys_and_values_in_the_caches_dtype(target):
    """A float16 cache (the compact forward's ``cache_dtype``) holds half a float32 one's bytes per token, and each
    cached token adds them to a forward's reads."""
    from lssp.measure.cost import Floor, cache_bytes_per_token

    config = target.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    assert cache_bytes_per_token(target) == 4 * per_token
    target.cache_dtype = torch.float16
    try:
        assert cache_bytes_per_token(target) == 2 * per_token
        floor = Floor.of(target, bandwidth=1e9, throughput=1e18)
        assert floor.ms(1, 100) == (pytest.approx(1000 * (floor.weight_bytes + 100 * 2 * per_token) / 1e9), "memory")
        assert floor.ms(1) == (pytest.approx(1000 * floor.weight_bytes / 1e9), "memory")
    finally:
        del target.cache_dtype
    assert cache_bytes_per_token(torch.nn.Linear(2, 2)) == 0  # no shapes said: no cache counted


def test_the_layers_take_inputs_that_are_not_contiguous():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    x = torch.randn(64, 3).t()  # a transposed view, as a batched step may hand over
    for layer in (Int4Linear(weight), Int8Linear(weight)):
        torch.testing.assert_close(layer(x), layer(x.contiguous()))
