"""`distill` on a tiny random target: a loadable, compatible draft, and a resumable run."""
from __future__ import annotations

import json

import torch

from lssp.cli import main
from lssp.distill_data import training_prompts
from lssp.loading import check_compatible, load_model
from lssp.prompts import HELD_OUT
from lssp.registry import load_registry


def test_training_prompts_are_varied_and_held_out():
    prompts = training_prompts(2000, seed=0)
    texts = [p for p, _ in prompts]
    assert not set(texts) & HELD_OUT
    assert not any(t.startswith("8 * 12 = 96") for t in texts)
    assert len(set(texts)) > 1000
    assert 0.3 < sum(chat for _, chat in prompts) / len(prompts) < 0.5
    assert any("def " in t for t in texts) and any("?" in t for t in texts)


def test_distill_makes_a_loadable_draft_and_resumes(tiny_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    base = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
            "--out", str(out), "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32",
            "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40"]
    assert main(base + ["--max-steps", "3"]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    card = (out / "README.md").read_text()
    assert "Made with:" in card and "acceptance" in card
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 3 and report["data_tokens"] >= 40
    assert 0 <= report["acceptance"]["latency prompts 1-4, greedy, K=4, 32 tokens"] <= 1
    shards = sorted((out / "work" / "data").glob("shard_*.pt"))
    # Resume: more data and more steps continue from what is on disk.
    assert main(base[:-1] + ["80", "--max-steps", "5"]) == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 5 and report["data_tokens"] >= 80
    assert sorted((out / "work" / "data").glob("shard_*.pt"))[: len(shards)] == shards
    reg = load_registry(tiny_dir / "models.yaml")
    target = load_model(reg.get("tiny-target"))
    from lssp.registry import ModelSpec

    draft = load_model(ModelSpec(name="d", path=str(out), dtype="float32"))
    assert check_compatible(target, draft) == 64
    assert draft.model.config.num_hidden_layers == 1 and draft.model.dtype == torch.float32


def test_distill_rejects_bad_sizes(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--out", str(tmp_path / "d"),
                 "--hidden-size", "30", "--heads", "4"])
    assert code == 2 and "multiple of --heads" in capsys.readouterr().err
