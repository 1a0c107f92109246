"""The embedded default pair (SmolLM2-135M-Instruct + the shipped draft) end to end, offline."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from lssp.cli import main
from lssp.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture()
def run(tmp_path, capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"

    def _run(*args: str) -> tuple[int, str]:
        code = main(["--config", str(ROOT / "models.yaml"), "--results-dir", str(tmp_path), *args])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return code, captured.out

    return _run


def test_default_pair_is_on_disk():
    reg = load_registry(ROOT / "models.yaml")
    for name in (reg.default_target, reg.default_draft):
        assert reg.get(name).available_locally(), name
    card = (ROOT / "drafts" / "smollm2-135m-draft" / "README.md").read_text()
    assert "Made with:" in card


def test_latency_on_the_default_pair(run, tmp_path):
    _, out = run("latency", "--nb-prompts", "2", "--max-new-tokens", "8", "--json", str(tmp_path / "l.json"))
    summary = json.loads((tmp_path / "l.json").read_text())
    assert [s["mode"] for s in summary] == ["rsp", "ssp"]
    assert summary[1]["target"] == "smollm2-135m-compact" and summary[1]["draft"] == "smollm2-135m-draft"
    assert all(s["ms_per_token"] > 0 for s in summary)
    prompts = pd.read_csv(tmp_path / "latency_prompts.csv")
    assert (prompts["new_tokens"] == 8).all()


def test_latency_on_chat_prompts(run, tmp_path):
    run("latency", "--nb-prompts", "1", "--max-new-tokens", "4", "--chat")
    rows = pd.read_csv(tmp_path / "latency.csv")
    assert (rows["prompt_format"] == "chat").all() and list(rows["mode"]) == ["rsp", "ssp"]
    assert "in the chat template" in next(tmp_path.glob("latency-*.md")).read_text()


def test_compare_on_the_default_pair(run):
    _, out = run("compare", "--prompt", "The capital of France is", "--max-new-tokens", "8")
    assert "Regular sampling with smollm2-135m" in out and "speedup" in out


def test_eval_on_the_default_pair(run, tmp_path):
    _, out = run("eval", "--nb-prompts", "5", "--json", str(tmp_path / "e.json"))
    (summary,) = json.loads((tmp_path / "e.json").read_text())
    assert summary["mode"] == "ssp" and summary["trials"] == 5


def test_a_gguf_target_is_converted_once_and_then_loads_from_its_copy(tmp_path, monkeypatch):
    import torch

    from lssp import loading

    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "cache"))
    spec = load_registry(ROOT / "models.yaml").get("smollm2-135m")
    first = loading.load_model(spec)  # from the GGUF file; writes the copy
    copy_dir = loading.gguf_copy_dir(spec.local_path(), spec.dtype)
    assert (copy_dir / "model.safetensors").exists() and (copy_dir / "tokenizer.json").exists()
    assert loading._source(spec) == (str(copy_dir), {})
    second = loading.load_model(spec)
    ids = torch.tensor([[1, 504, 3000, 22, 9000]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    text = "<|im_start|>user\n12 * 34 = ?<|im_end|> ünïcode"
    assert first.tokenizer(text).input_ids == second.tokenizer(text).input_ids
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
