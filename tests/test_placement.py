"""Placement on a node of GPUs, worked out on the meta device: `plan`, and the rules loading shares with it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lssp.cli import main
from lssp.models.placement import GiB, Placement, empty_model, model_config, parse_bytes, plan_node
from lssp.models.registry import load_registry

REGISTRY = Path(__file__).resolve().parents[1] / "models.yaml"


@pytest.fixture(scope="module")
def llama_65b_and_7b():
    registry = load_registry(REGISTRY)
    return tuple(empty_model(model_config(registry.get(name))) for name in ("65B", "7B"))


def test_the_registrys_65b_fits_8_gpus_of_40gib_in_16_bit_with_the_draft_whole_on_one(llama_65b_and_7b):
    target, draft = llama_65b_and_7b
    node = plan_node(target, "65B", draft, "7B", 8, 40 * GiB, 2 * GiB)
    assert node.fitting() == "16-bit"
    t = node.target["16-bit"]
    assert t.gpus == list(range(8)) and t.fits
    assert 120 * GiB < t.weight_bytes < 123 * GiB  # 65.3e9 weights x 2 bytes
    assert all(b <= 38 * GiB for b in t.bytes_per_device.values())
    d = node.draft["16-bit"]
    assert list(d.device_map) == [""] and len(d.gpus) == 1  # whole, on one GPU
    free = {i: 38 * GiB - t.bytes_per_device.get(i, 0) for i in range(8)}
    assert free[d.gpus[0]] == max(free.values())  # the emptiest one after the target


def test_on_2_gpus_of_40gib_65b_does_not_fit_in_16_bit_but_does_in_4_bit(llama_65b_and_7b):
    target, draft = llama_65b_and_7b
    node = plan_node(target, "65B", None, None, 2, 40 * GiB, 2 * GiB)
    assert not node.target["16-bit"].fits and node.target["16-bit"].missing_bytes > 40 * GiB
    assert node.target["4-bit"].fits and node.target["4-bit"].gpus == [0, 1]
    assert node.target["4-bit"].weight_bytes < 0.3 * node.target["16-bit"].weight_bytes


def test_blocks_merge_runs_of_layers_on_one_device():
    p = Placement("m", "16-bit", 0, {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
                                     "model.layers.2": 1, "model.layers.3": 1, "model.layers.4": 0, "lm_head": 1})
    assert p.blocks() == [("model.embed_tokens", 0), ("model.layers.0-1", 0), ("model.layers.2-3", 1),
                          ("model.layers.4", 0), ("lm_head", 1)]


@pytest.mark.parametrize("text, expected", [("40GiB", 40 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 2**29),
                                            ("1.5GiB", 3 * 2**29), ("1000", 1000)])
def test_sizes_parse(text, expected):
    assert parse_bytes(text, "--gpu-memory") == expected


def _plan(capsys, *args):
    code = main(["--config", str(REGISTRY), "plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_where_each_block_goes_and_the_floor(capsys, tmp_path):
    code, out, err = _plan(capsys, "65B", "7B", "--gpus", "8", "--gpu-memory", "40GiB", "--bandwidth", "1555",
                           "--json", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "16-bit (entry)" in out and "the widest that fits" in out
    assert "model.layers.0-9 → GPU 0" in out and "lm_head → GPU 7" in out
    assert "target 84.0 ms" in out  # 130.6 GB / 1555 GB/s
    assert max(len(line) for line in out.splitlines()) <= 80
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["fits_at"] == "16-bit" and data["draft_by_precision"]["16-bit"]["blocks"] == [["", 7]]


def test_plan_for_a_model_that_fits_nowhere_says_how_much_is_missing(capsys):
    code, out, err = _plan(capsys, "65B", "7B", "--gpus", "1", "--gpu-memory", "16GiB")
    assert code != 0
    assert "does not fit on 1 × 16.0 GiB at any precision" in err and "GiB find no room" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine's own GPUs are the default there")
def test_plan_without_a_gpu_asks_for_the_node(capsys):
    code, _, err = _plan(capsys, "65B", "--no-draft")
    assert code == 2 and "--gpus N --gpu-memory SIZE" in err


def test_plan_of_a_hub_model_never_downloaded_without_a_shape_says_what_to_add(capsys, tmp_path):
    registry = tmp_path / "models.yaml"
    registry.write_text("models:\n  big: {path: nobody/not-downloaded}\n")
    code = main(["--config", str(registry), "plan", "big", "--no-draft", "--gpus", "8", "--gpu-memory", "40GiB"])
    err = capsys.readouterr().err
    assert code == 2 and "add 'config: <architecture>'" in err


TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


@pytest.fixture()
def two_gpus_with_free_memory(monkeypatch):
    """torch believes there are two GPUs with 10 and 30 GiB free (no GPU needed to choose between them)."""
    free = {0: 10 * GiB, 1: 30 * GiB}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free[i], 40 * GiB))
    return free


def test_a_draft_whose_entry_says_nothing_goes_whole_onto_the_emptiest_gpu(two_gpus_with_free_memory):
    from lssp.models.loading import _placement
    from lssp.models.registry import ModelSpec

    spec = ModelSpec("d", init="random", config=TINY)
    assert _placement(spec, None, draft=True) == {"device_map": "cuda:1"}
    assert _placement(spec, None)["device_map"] == "auto"  # a target is spread as before
    asked = ModelSpec("d", init="random", config=TINY, device_map="auto")
    assert _placement(asked, None, draft=True)["device_map"] == "auto"  # split only where its entry asks


def test_a_draft_too_big_for_any_single_gpu_is_refused_in_one_line(two_gpus_with_free_memory):
    from lssp.errors import UserError
    from lssp.models.loading import _placement
    from lssp.models.registry import ModelSpec

    spec = ModelSpec("big", init="random", config="llama-2-13b", dtype="bfloat16")  # 24.2 GiB: fits in 30 GiB free
    assert _placement(spec, None, draft=True) == {"device_map": "cuda:1"}
    two_gpus_with_free_memory[1] = 20 * GiB
    with pytest.raises(UserError, match=r"does not fit whole on one GPU \(cuda:1 has the most free, 20.0 GiB\); "
                                        r"give its entry 'device_map: auto'"):
        _placement(spec, None, draft=True)


def test_a_weight_only_entry_loads_through_bitsandbytes_where_it_lands_on_a_gpu(two_gpus_with_free_memory):
    """int8/int4/q4_1 run CPU kernels: on a GPU they become bitsandbytes' 8-bit or 4-bit weights under
    transformers' forward, and `plan` sizes them so."""
    from lssp.models.loading import _lands_on_gpu, on_gpu_weight_only
    from lssp.models.placement import precision_of
    from lssp.models.registry import ModelSpec

    assert _lands_on_gpu({"device_map": "cuda:1"}) and _lands_on_gpu({"device_map": "auto"})
    assert _lands_on_gpu({"device_map": {"model.layers.0": 0, "lm_head": "cpu"}})
    assert not _lands_on_gpu({"device_map": "cpu"}) and not _lands_on_gpu({"device_map": {"": "cpu"}})
    for quantization, expected in (("q4_1", "4bit"), ("int4", "4bit"), ("int8", "8bit")):
        spec = ModelSpec("t", path="x.gguf", quantization=quantization, forward="compact", compile=True)
        on_gpu = on_gpu_weight_only(spec)
        assert (on_gpu.quantization, on_gpu.forward, on_gpu.compile) == (expected, "transformers", False)
        assert precision_of(spec) == precision_of(on_gpu) == expected.replace("bit", "-bit")
    assert precision_of(ModelSpec("t", path="x", quantization="dynamic-fp16")) == "16-bit"


def test_random_weights_asked_in_bitsandbytes_are_refused_in_one_line():
    from lssp.errors import UserError
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec

    with pytest.raises(UserError, match=r"random weights are built without bitsandbytes \(quantization: 4bit\)"):
        load_model(ModelSpec("r", init="random", config=TINY, quantization="4bit"), "cpu")


def test_random_weights_follow_the_entrys_max_memory_through_the_balanced_placement():
    """The path `gpus`/`max_memory` take for random init: built on the meta device, placed, then filled where
    each block goes. Here the only device allowed is the CPU, so it can run without a GPU."""
    from lssp.decoding.kv import forward_logits, new_cache
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec

    loaded = load_model(ModelSpec("r", init="random", config=TINY, dtype="float32", max_memory={"cpu": "1GiB"}))
    model = loaded.model
    assert not any(p.is_meta for p in model.parameters()) and loaded.placement == "cpu"
    assert torch.all(model.model.norm.weight == 1)
    assert 0.01 < model.model.layers[0].mlp.down_proj.weight.std() < 0.03  # initializer_range 0.02
    logits = forward_logits(model, torch.tensor([[1, 2, 3]]), new_cache(model), 1)
    assert torch.isfinite(logits).all()


def test_random_weights_that_do_not_fit_their_max_memory_are_refused():
    from lssp.errors import UserError
    from lssp.models.loading import load_model
    from lssp.models.registry import ModelSpec

    with pytest.raises(UserError, match="does not fit on the memory its entry allows"):
        load_model(ModelSpec("r", init="random", config=TINY, max_memory={"cpu": "1KiB"}))


def test_device_names_are_compact():
    from types import SimpleNamespace

    from lssp.models.placement import device_names

    def on(*devices):
        return SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device(d)) for d in devices])

    assert device_names(torch.nn.Linear(2, 2)) == "cpu"
    assert device_names(on("cuda:3", "cuda:3")) == "cuda:3"
    assert device_names(on("cuda:2", "cuda:0", "cuda:1", "cuda:3")) == "cuda:0-3"
    assert device_names(on("cuda:2", "cuda:0", "cpu")) == "cuda:0,2+cpu"


def test_budgets_written_as_sizes_place_like_budgets_in_bytes():
    """Loading passes ``max_memory`` as sizes ("139000MiB", as from_pretrained takes them); the balanced placement
    of random-init models read them as numbers (found on the first GPU run)."""
    from transformers import LlamaConfig

    from lssp.models.placement import place_target

    model = empty_model(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}), torch.float32)
    as_sizes = place_target(model, "r", "16-bit", {0: "60KiB", 1: "60KiB", "cpu": "1GiB"})
    in_bytes = place_target(model, "r", "16-bit", {0: 60 * 2**10, 1: 60 * 2**10, "cpu": 2**30})
    assert as_sizes.device_map == in_bytes.device_map
    assert {0, 1} <= set(as_sizes.device_map.values())
