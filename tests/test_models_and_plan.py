"""A newcomer's own models and node: any model by its hub id or path (offline: one line, no retries), the registry
found from any directory, `models` at 80 columns on the real registry, and `plan` finding a placement where one
exists (uneven budgets, the entry's max_memory, the draft's room kept first) or naming the nearest that does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli, save_tiny
from test_newcomer import assert_fits_80_columns

from lssp.errors import UserError
from lssp.models import hub
from lssp.models.registry import TOOL_DIR, load_registry, registry_path

pytestmark = pytest.mark.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "models.yaml"


@pytest.fixture()
def real(capsys, tmp_path):
    """The CLI on the repository's own models.yaml."""
    return cli(capsys, REGISTRY, tmp_path / "results")


# --- any model by its hub id or path -------------------------------------------------------------------------------

def _one_line(err: str) -> bool:
    return len([line for line in err.splitlines() if line.strip()]) <= 2  # rich may wrap the one message once


@pytest.mark.parametrize("args, message", [
    (("latency", "nobody/not-a-model"), "unknown model 'nobody/not-a-model' in"),
    (("plan", "meta-llama/Llama-3.1-8B", "--no-draft", "--gpus", "1", "--gpu-memory", "80GiB"),
     "did you mean 'llama-3.1-8b' (its entry has that path)?"),
    (("latency", "7B"), "huggyllama/llama-7b is not in the local Hugging Face cache and the hub is offline"),
    (("latency", "30B", "--device", "cpu"), "(once there, its weights need ~61 GiB in float16)"),
])
def test_a_hub_id_offline_and_not_cached_is_one_line_with_no_retries(real, args, message):
    """HF_HUB_OFFLINE=1 (as the tests run): a hub id, by name or in an entry, fails at once in one line."""
    start = time.monotonic()
    code, out, err = real(*args)
    assert code == 2 and message in err, err
    assert "Retrying" not in err + out and "Traceback" not in err + out and _one_line(err), err
    assert time.monotonic() - start < 20  # no retry storm (each storm is ~30 s); the plan builds a meta 8B model


def test_an_unknown_hub_id_says_what_an_unknown_name_says(real):
    _, _, by_name = real("latency", "llama-3.1-8")
    _, _, by_id = real("latency", "meta-llama/Llama-3.1-8")
    assert by_name.startswith("error: unknown model 'llama-3.1-8' in") and "did you mean 'llama-3.1-8b'" in by_name
    assert by_id.startswith("error: unknown model 'meta-llama/Llama-3.1-8' in")
    assert "not in the local Hugging Face cache (the hub is offline: HF_HUB_OFFLINE=1)" in by_id


@pytest.fixture()
def hub_unreachable(monkeypatch):
    """The hub configured online, but nothing answers at its address (a refused port answers at once)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test: going offline sets it
    hub._hub_answers.cache_clear()
    yield
    hub._hub_answers.cache_clear()


def test_a_hub_that_does_not_answer_switches_to_offline_in_one_line(hub_unreachable, tmp_path):
    from huggingface_hub import constants

    registry = load_registry(REGISTRY)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"unknown model 'nobody/nothing' in .*not in the local Hugging Face cache "
                                        r"\(the hub is unreachable: no answer from http://127.0.0.1:9\)"):
        registry.get("nobody/nothing")
    assert time.monotonic() - start < 10
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"  # transformers now reads the cache only


def test_a_local_folder_runs_by_its_path_with_its_configs_dtype(run, tiny_dir):
    code, out, err = run("latency", str(tiny_dir / "tiny-target"), "--draft", str(tiny_dir / "tiny-draft"), "--k", "2",
                         "--nb-prompts", "1", "--max-new-tokens", "4")
    assert code == 0, err
    said = [line for line in err.splitlines() if "is not in models.yaml" in line]
    assert len(said) == 2, err  # one line per model, said once
    assert "tiny-target is not in models.yaml: loading the folder with defaults, float32 (its config's)" in said[0]
    assert "RSp" in out


def test_a_missing_path_is_an_unknown_model(run, tmp_path):
    code, _, err = run("latency", str(tmp_path / "no-such-model"))
    assert code == 2 and "and no such file or folder" in err and _one_line(err)


def _fake_hub_cache(root: Path, repo_id: str, save) -> None:
    """``repo_id`` in the layout of the Hugging Face cache, as a download leaves it."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save(repo / "snapshots" / commit)


@pytest.mark.slow
def test_python_m_lssp_from_another_directory_loads_a_cached_hub_id(tmp_path):
    """From a directory without models.yaml: the registry beside the tool is read, and two hub ids found only in
    the cache load offline with their config's dtype, each said in one line."""
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "someone/tiny-target", lambda p: save_tiny(p, 0, scale=4.0))
    _fake_hub_cache(cache, "someone/tiny-draft", lambda p: save_tiny(p, 1, hidden=16, layers=1, scale=4.0))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO),
           "LLAMASSP_CACHE": str(tmp_path / "cache")}
    env.pop("LLAMASSP_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "lssp", "latency", "someone/tiny-target", "--draft",
                           "someone/tiny-draft", "--k", "2", "--nb-prompts", "1", "--max-new-tokens", "4"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "someone/tiny-target is not in models.yaml: loading the hub model with defaults, float32 (its config's)" \
        in " ".join(done.stderr.split())
    assert "Retrying" not in done.stderr and (work / "results" / "latency.csv").exists()


def test_the_registry_is_found_beside_the_tool_or_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMASSP_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert registry_path() == TOOL_DIR / "models.yaml" == REGISTRY
    assert registry_path("models.yaml") == REGISTRY  # --config models.yaml from elsewhere: the tool's
    mine = tmp_path / "mine.yaml"
    mine.write_text("models:\n  m: {path: someone/m}\n")
    monkeypatch.setenv("LLAMASSP_CONFIG", str(mine))
    assert registry_path() == mine and "m" in load_registry(registry_path()).models
    (tmp_path / "models.yaml").write_text("models:\n  here: {path: someone/here}\n")
    assert registry_path("models.yaml") == Path("models.yaml")  # the working directory's comes first
    with pytest.raises(UserError, match="looked in the working directory and in"):
        load_registry(registry_path("nowhere.yaml"))


def test_a_user_registry_from_the_environment_is_what_the_cli_reads(capsys, tmp_path, monkeypatch, tiny_dir):
    from lssp.cli import main

    monkeypatch.setenv("LLAMASSP_CONFIG", str(tiny_dir / "models.yaml"))
    monkeypatch.chdir(tmp_path)
    assert main(["models"]) == 0
    assert "tiny-target" in capsys.readouterr().out


# --- models at 80 columns --------------------------------------------------------------------------------------------

def test_models_fits_80_columns_with_the_real_registry(real):
    code, out, err = real("models")
    assert code == 0, err
    assert_fits_80_columns(out)
    registry = load_registry(REGISTRY)
    for name in registry.models:
        assert f"│ {name} " in out  # whole, on one line
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == len(registry.models) + 3  # one line per entry, and one for each default's tag (three)
    assert "│ llama-3.1-8b " in out and " 8.0B │ bf16 " in out and "│ hub · 4 GPUs " in out
    # the weight format an entry runs in, not the dtype of what is left unquantized
    assert "│ smollm2-135m-auto  " in out and " 135M │ auto " in out and " 135M │ q4_1 " in out and " 135M │ int4 " in out


def test_models_wide_and_json_give_every_field(real, tmp_path):
    code, out, err = real("models", "--wide")
    assert code == 0, err
    assert_fits_80_columns(out)
    assert "huggyllama/llama-65b (not on disk)" in out and "placement 4 GPUs" in out
    code, _, err = real("models", "--json", str(tmp_path / "models.json"))
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads((tmp_path / "models.json").read_text())}
    assert set(rows) == set(load_registry(REGISTRY).models)
    assert rows["llama-3.1-8b"]["path"] == "meta-llama/Llama-3.1-8B" and rows["llama-3.1-8b"]["source"] == "hub"
    assert 8.0e9 < rows["llama-3.1-8b"]["parameters"] < 8.1e9 and 72.6e9 < rows["qwen2.5-72b"]["parameters"] < 72.8e9
    assert rows["smollm2-135m-auto"]["role"] == "default target"
    assert (rows["smollm2-135m-eagle-chain6-min2"]["role"], rows["smollm2-135m-draft-auto"]["role"]) == ("default draft",
                                                                                         "default draft model")


@pytest.mark.parametrize("arch", ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-0.5b", "qwen2.5-14b"])
def test_the_parameter_count_from_a_shape_matches_the_model(arch):
    from lssp.models.catalog import parameter_count
    from lssp.models.placement import empty_model
    from lssp.models.registry import ModelSpec
    from lssp.models.sources import architectures, random_config

    model = empty_model(random_config(ModelSpec("m", init="random", config=arch)))
    assert parameter_count(architectures()[arch]) == sum(p.numel() for p in model.parameters())


def test_every_pretrained_hub_entry_has_a_shape_so_plan_never_asks_the_hub(monkeypatch):
    from lssp.models.placement import model_config

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(hub, "_hub_answers", no_hub)
    registry = load_registry(REGISTRY)
    for spec in registry.models.values():
        if spec.is_random or spec.local_path() is not None or spec.speculative_method in ("eagle", "eagle3"):
            continue
        assert isinstance(spec.config, str), f"{spec.name} has no config:"
        assert model_config(spec).num_hidden_layers > 0


# --- plan finds a placement where one exists -------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama-3.1-70b", "qwen2.5-0.5b"])
def test_the_balanced_budgets_are_those_transformers_gives_device_map_auto(arch):
    """plan's balanced placement caps each GPU but the last as loading (transformers' device_map="auto") does."""
    from transformers.integrations.accelerate import get_balanced_memory

    from lssp.models.placement import GiB, balanced_budgets, empty_model
    from lssp.models.registry import ModelSpec
    from lssp.models.sources import random_config

    model = empty_model(random_config(ModelSpec("m", init="random", config=arch)))
    budgets = {0: 78 * GiB, 1: 60 * GiB, 2: 50 * GiB}
    split = model._no_split_modules
    assert balanced_budgets(model, dict(budgets), split, None, {}) == get_balanced_memory(model, dict(budgets), split)


def _plan(real, *args: str, config: Path | None = None):
    return real("plan", *args, config=config)


@pytest.mark.slow
def test_70b_and_8b_fit_two_80gib_gpus_in_16_bit_with_the_draft_first(real, tmp_path):
    code, out, err = _plan(real, "llama-3.1-70b", "llama-3.1-8b", "--gpus", "2", "--gpu-memory", "80GiB",
                           "--json", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "At 16-bit, the widest that fits (131.4 + 15.0 GiB in 156.0 GiB usable)" in " ".join(out.split())
    assert "max_memory: {0: 63GiB, 1: 78GiB} (in place of gpus: 4)" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["fits_at"] == "16-bit" and data["draft_first_by_precision"]["16-bit"]
    per_gpu = data["target_by_precision"]["16-bit"]["bytes_per_device"]
    assert set(per_gpu) == {"0", "1"} and abs(per_gpu["0"] - per_gpu["1"]) > 5 * 2**30  # uneven
    draft_gpu = data["draft_by_precision"]["16-bit"]["blocks"][0][1]
    assert per_gpu[str(draft_gpu)] + data["draft_by_precision"]["16-bit"]["weight_bytes"] <= 78 * 2**30
    # the line to paste makes the ordinary placement (the target first, the draft beside) do the same
    registry = tmp_path / "pasted.yaml"
    registry.write_text("models:\n  t: {path: meta-llama/Llama-3.1-70B, config: llama-3.1-70b, dtype: bfloat16, "
                        "max_memory: {0: 63GiB, 1: 78GiB}}\n  d: {path: meta-llama/Llama-3.1-8B, config: llama-3.1-8b, "
                        "dtype: bfloat16}\n")
    code, out, err = _plan(real, "t", "d", "--gpus", "2", "--gpu-memory", "80GiB", config=registry)
    assert code == 0 and "16-bit (entry) │      131.4 │    70.5 │      15.0 │ GPU 0    │ yes " in out, out


@pytest.mark.slow
def test_an_entrys_max_memory_is_honoured(real, tmp_path):
    registry = tmp_path / "models.yaml"
    registry.write_text(
        "models:\n"
        "  capped: {path: x/70b, config: llama-3.1-70b, dtype: bfloat16, max_memory: {0: 40GiB, 1: 78GiB}}\n"
        "  auto: {path: x/70b, config: llama-3.1-70b, dtype: bfloat16, max_memory: {0: 78GiB, 1: 60GiB}}\n"
        "  seq: {path: x/70b, config: llama-3.1-70b, dtype: bfloat16, max_memory: {0: 78GiB, 1: 60GiB}, "
        "device_map: sequential}\n"
        "  draft: {path: x/8b, config: llama-3.1-8b, dtype: bfloat16}\n")
    code, out, err = _plan(real, "capped", "--no-draft", "--gpus", "2", "--gpu-memory", "80GiB", "--json",
                           str(tmp_path / "capped.json"), config=registry)
    assert code == 0, err
    data = json.loads((tmp_path / "capped.json").read_text())
    assert data["fits_at"] == "8-bit"  # 16-bit would fit on 2 x 78 GiB, not with 40 GiB on GPU 0
    assert all(p["bytes_per_device"].get("0", 0) <= 40 * 2**30 for p in data["target_by_precision"].values())
    assert "16-bit fits if capped's max_memory allows more:\n  max_memory: {0: 78GiB, 1: 78GiB}" in out
    code, out, err = _plan(real, "auto", "draft", "--gpus", "2", "--gpu-memory", "80GiB", config=registry)
    assert code == 0 and "16-bit fits within auto's max_memory as written if its entry also says device_map: " \
        "sequential" in " ".join(out.split()), out
    code, out, err = _plan(real, "seq", "draft", "--gpus", "2", "--gpu-memory", "80GiB", "--json",
                           str(tmp_path / "seq.json"), config=registry)
    assert code == 0, err
    data = json.loads((tmp_path / "seq.json").read_text())
    target = data["target_by_precision"]["16-bit"]["bytes_per_device"]
    assert data["fits_at"] == "16-bit" and target["1"] <= 60 * 2**30 and target["0"] > 70 * 2**30
    assert data["draft_by_precision"]["16-bit"]["blocks"] == [["", 1]]  # in the room the max_memory left


@pytest.mark.slow
def test_a_bare_gpu_memory_is_read_as_gib_and_said(real):
    code, out, err = _plan(real, "65B", "7B", "--gpus", "8", "--gpu-memory", "40")
    assert code == 0, err
    assert "--gpu-memory 40 has no unit: read as 40 GiB" in err and "on 8 × 40.0 GiB GPUs" in out


@pytest.mark.slow
def test_when_nothing_fits_the_nearest_option_is_named(real):
    code, out, err = _plan(real, "65B", "7B", "--gpus", "1", "--gpu-memory", "16GiB")
    assert code == 2 and "nearest that fits: 4-bit on 3 × 16.0 GiB GPUs" in err and "Traceback" not in err
    code, out, err = _plan(real, "llama-3.1-70b", "llama-3.1-8b", "--gpus", "2", "--gpu-memory", "40GiB")
    assert code == 0, err
    assert "At 4-bit" in out and "quantization: 4bit" in out and "gpus: 2 (it asks for 4)" in out
    assert "Nearest at more bits: 16-bit on 5 × 40.0 GiB GPUs; 8-bit on 3 × 40.0 GiB GPUs." in out
