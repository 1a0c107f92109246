"""`distill` on a tiny random target: a loadable, compatible draft, and a resumable run."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import tiny_llama

from lssp.cli import main
from lssp.distill import REPEAT_CUE, REPEAT_WINDOW, DistillConfig, chosen_shard, held_out_acceptance, repeat_prompts
from lssp.distill.collection import _batches, generate_rows
from lssp.distill.data import training_prompts
from lssp.errors import IncompatibleModelsError
from lssp.models.loading import check_compatible, load_model
from lssp.models.registry import load_registry
from lssp.workloads.prompts import HELD_OUT

ACCEPTANCE = "latency prompts 1-4, greedy, K=4, 32 tokens"


def test_training_prompts_are_varied_and_held_out():
    prompts = training_prompts(2000, seed=0)
    texts = [p for p, _ in prompts]
    assert not set(texts) & HELD_OUT
    assert not any(t.startswith("8 * 12 = 96") for t in texts)
    assert len(set(texts)) > 1000
    assert 0.3 < sum(chat for _, chat in prompts) / len(prompts) < 0.5
    assert any("def " in t for t in texts) and any("?" in t for t in texts)


def test_greedy_batches_do_not_repeat_a_prompt_until_all_have_run():
    prompts = [[i % 30, 7] for i in range(90)]  # 30 distinct prompts, each three times
    cfg = DistillConfig(batch_prompts=4, temperatures=(0.0, 1.0))
    batches = [b for b, _ in zip(_batches(prompts, cfg), range(20))]
    greedy = [p for batch, temperature in batches if temperature == 0 for p in batch]
    assert all(len(batch) == 4 for batch, _ in batches) and len(greedy) == 40
    assert len({tuple(p) for p in greedy[:30]}) == 30  # every distinct prompt once before any repeat
    again = [b for b, _ in zip(_batches(prompts, cfg), range(20))]
    assert again == batches  # deterministic: a resumed run continues the same sequence


def test_distill_makes_a_loadable_draft_and_resumes(tiny_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    base = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
            "--out", str(out), "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32",
            "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40"]
    assert main(base + ["--max-steps", "3"]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    card = (out / "README.md").read_text()
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 3 and report["data_tokens"] >= 40
    assert list(report["acceptance"]) == [ACCEPTANCE] and 0 <= report["acceptance"][ACCEPTANCE] <= 1
    assert "Made with: `" in card and f"| {ACCEPTANCE} | {report['acceptance'][ACCEPTANCE]:.3f} |" in card
    shards = {path: path.stat().st_mtime_ns for path in (out / "work" / "data").glob("shard_*.pt")}
    assert shards
    # Resume: more data and more steps continue from what is on disk.
    assert main(base[:-1] + ["80", "--max-steps", "5"]) == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["steps"] == 5 and report["data_tokens"] >= 80
    assert [step for step, _, _ in report["loss_curve"]] == [3, 5]  # the first run's 3 steps, then 2 more
    after = {path: path.stat().st_mtime_ns for path in (out / "work" / "data").glob("shard_*.pt")}
    assert len(after) > len(shards) and all(after[path] == mtime for path, mtime in shards.items())  # kept, not rewritten
    reg = load_registry(tiny_dir / "models.yaml")
    target = load_model(reg.get("tiny-target"))
    from lssp.models.registry import ModelSpec

    draft = load_model(ModelSpec(name="d", path=str(out), dtype="float32"))
    assert check_compatible(target, draft) == 64
    assert draft.model.config.num_hidden_layers == 1 and draft.model.dtype == torch.float32


def test_distill_a_target_under_the_compact_forward(tiny_dir, tmp_path, capsys):
    """Collection runs batches, so it uses the transformers model a compact forward wraps."""
    out = tmp_path / "draft"
    argv = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill",
            "tiny-target-compact", "--out", str(out), "--hidden-size", "16", "--layers", "1", "--heads", "2",
            "--intermediate-size", "32", "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40", "--max-steps", "2"]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads((out / "distill_report.json").read_text())["target"] == "tiny-target-compact"


def test_distill_rejects_bad_sizes(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--out", str(tmp_path / "d"),
                 "--hidden-size", "30", "--heads", "4"])
    assert code == 2 and "multiple of --heads" in capsys.readouterr().err


def test_distill_goes_on_from_an_earlier_draft(tiny_dir, tmp_path, capsys, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
              "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40", "--max-steps", "2"]
    first_args = common + ["--out", str(first), "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32"]
    monkeypatch.setattr(sys, "argv", ["llamassp.py"] + first_args)  # the command the card records
    assert main(first_args) == 0, capsys.readouterr().err
    monkeypatch.undo()
    # The earlier draft's shape wins over the (default) size options.
    assert main(common + ["--out", str(second), "--init-draft", str(first), "--data-dir", str(tmp_path / "w2")]) == 0
    report = json.loads((second / "distill_report.json").read_text())
    assert report["started_from"]["path"] == str(first) and report["started_from"]["steps"] == 2
    assert report["started_from"]["command"] == "python llamassp.py " + " ".join(first_args)
    assert f"started from the weights of `{first}`" in (second / "README.md").read_text()
    config = json.loads((second / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (16, 1)
    code = main(common + ["--out", str(tmp_path / "third"), "--init-draft", str(tmp_path / "missing")])
    assert code == 2 and "cannot load --init-draft" in capsys.readouterr().err


def test_distill_with_a_frequent_token_head(tiny_dir, tmp_path, capsys):
    first, second = tmp_path / "headed", tmp_path / "again"
    common = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
              "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40", "--max-steps", "2"]
    assert main(common + ["--out", str(first), "--hidden-size", "16", "--layers", "1", "--heads", "2",
                          "--intermediate-size", "32", "--head-tokens", "12"]) == 0, capsys.readouterr().err
    config = json.loads((first / "config.json").read_text())
    ids = config["head_token_ids"]
    assert len(ids) == 12 and ids == sorted(set(ids)) and not config["tie_word_embeddings"]
    # The head holds the tokens the target emitted most often in the collected data.
    counts = torch.zeros(64, dtype=torch.long)
    for shard in (first / "work" / "data").glob("shard_*.pt"):
        rec = torch.load(shard)
        for row, n in zip(rec["tokens"], rec["lengths"].tolist()):
            counts += torch.bincount(row[:n].long(), minlength=64)
    assert counts[ids].min() >= counts[[i for i in range(64) if i not in ids]].max()
    report = json.loads((first / "distill_report.json").read_text())
    assert report["head_coverage"] == pytest.approx(float(counts[ids].sum() / counts.sum()))
    assert f"12 most frequent tokens, {report['head_coverage']:.1%} of the target tokens it was trained on" in (first / "README.md").read_text()
    losses = [loss for _, _, loss in report["loss_curve"]]
    assert losses and all(loss == loss and loss < 1e6 for loss in losses)  # finite: no -inf logits in the loss
    # Going on from it keeps its head; the registry loader gives a compatible draft.
    assert main(common + ["--out", str(second), "--init-draft", str(first), "--data-dir", str(tmp_path / "w2")]) == 0
    assert json.loads((second / "config.json").read_text())["head_token_ids"] == ids
    from lssp.models.registry import ModelSpec

    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target"))
    draft = load_model(ModelSpec(name="d", path=str(second), dtype="float32", forward="compact"))
    assert check_compatible(target, draft) == 64
    code = main(common + ["--out", str(tmp_path / "x"), "--head-tokens", "-1"])
    assert code == 2 and "--head-tokens" in capsys.readouterr().err


def test_distill_trains_on_other_collections_too(tiny_dir, tmp_path, capsys):
    from lssp.distill.training import _examples, held_out_split, training_examples

    first, second = tmp_path / "w1", tmp_path / "w2"
    common = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
              "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32",
              "--batch-prompts", "4", "--new-tokens", "8", "--max-steps", "2"]
    assert main(common + ["--data-dir", str(first), "--data-tokens", "400", "--collect-only"]) == 0, capsys.readouterr().err
    out = tmp_path / "draft"
    assert main(common + ["--data-dir", str(second), "--data-tokens", "40", "--also-data", str(first),
                          "--out", str(out)]) == 0, capsys.readouterr().err
    meta = json.loads((first / "data" / "meta.json").read_text())
    report = json.loads((out / "distill_report.json").read_text())
    assert [(c["path"], c["source"], c["tokens"]) for c in report["also_data"]] == [(str(first), "built-in", meta["tokens"])]
    assert report["config"]["also_data"] == [str(first)]
    assert 0 <= report["acceptance"][f"held-out top-1 agreement on {first}"] <= 1
    assert f"also trained on the {meta['tokens']} tokens of the collection in `{first}`" in (out / "README.md").read_text()
    # Trained on both collections' sequences but their held-out ones; the curve is the --data-dir's.
    cfg = DistillConfig(also_data=(str(first),))
    examples, held, others = training_examples(_examples, second, cfg)
    own, theirs = held_out_split(_examples(second, cfg), second), held_out_split(_examples(first, cfg), first)
    assert len(examples) == len(own[0]) + len(theirs[0]) and theirs[1]
    assert list(others) == [str(first)] and len(others[str(first)]) == len(theirs[1])
    assert len(held) == len(own[1])
    # What a user can get wrong: one line each.
    for folder, message in [(tmp_path / "nothing", "no collection in"), (second, "is the --data-dir itself")]:
        code = main(common + ["--data-dir", str(second), "--data-tokens", "40", "--also-data", str(folder), "--out", str(out)])
        assert code == 2 and message in capsys.readouterr().err
    code = main(common + ["--data-dir", str(first), "--source", "sharegpt", "--data-tokens", "40", "--out", str(out)])
    assert code == 2 and "holds a collection of --source built-in prompts" in capsys.readouterr().err


def test_training_precision_is_bf16_where_the_cpu_computes_it_natively(tiny_dir, tmp_path, capsys, monkeypatch):
    from lssp.distill import training
    from lssp.report import results

    model = torch.nn.Linear(2, 2)
    for flags, want in [([], "fp32"), (["avx512_bf16"], "bf16")]:
        monkeypatch.setattr(results, "native_bf16", lambda flags=flags: flags)
        assert training.training_precision(model, "auto") == want
        assert training.training_precision(model, "fp32") == "fp32"
    monkeypatch.undo()
    out = tmp_path / "draft"
    argv = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
            "--out", str(out), "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32",
            "--batch-prompts", "4", "--new-tokens", "8", "--data-tokens", "40", "--max-steps", "2"]
    losses = {}
    for precision in ("fp32", "bf16"):
        assert main(argv + ["--precision", precision, "--data-dir", str(tmp_path / "w")]) == 0, capsys.readouterr().err
        report = json.loads((out / "distill_report.json").read_text())
        assert report["precision"] == precision and f"min in {precision}" in (out / "README.md").read_text()
        losses[precision] = report["loss_curve"][0][2]
        (tmp_path / "w" / "checkpoint-draft.pt").unlink()  # the same two steps again, in the other precision
    assert losses["bf16"] != losses["fp32"] and losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)
    code = main(argv + ["--precision", "fp16"])
    assert code == 2 and "--precision 'fp16'" in capsys.readouterr().err


def test_chosen_shards_are_spread_evenly():
    assert [chosen_shard(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert sum(chosen_shard(i, 0.25) for i in range(100)) == 25
    assert all(chosen_shard(i, 1.0) for i in range(10)) and not any(chosen_shard(i, 0.0) for i in range(10))


def test_distill_on_policy_data_from_the_starting_draft(tiny_dir, tmp_path, capsys):
    first, second, work = tmp_path / "first", tmp_path / "second", tmp_path / "w"
    common = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
              "--batch-prompts", "4", "--new-tokens", "8", "--max-steps", "2", "--data-dir", str(work)]
    assert main(common + ["--out", str(first), "--hidden-size", "16", "--layers", "1", "--heads", "2",
                          "--intermediate-size", "32", "--data-tokens", "30"]) == 0, capsys.readouterr().err
    before = len(list((work / "data").glob("shard_*.pt")))
    (work / "checkpoint-draft.pt").unlink()  # a new training run over the grown data
    assert main(common + ["--out", str(second), "--init-draft", str(first), "--data-tokens", "90", "--on-policy", "1"]) == 0
    shards = sorted((work / "data").glob("shard_*.pt"))
    sources = [torch.load(path).get("source", "target") for path in shards]
    assert sources[:before] == ["target"] * before and len(shards) > before and set(sources[before:]) == {"draft"}
    report = json.loads((second / "distill_report.json").read_text())
    written = sum(int(torch.load(path)["lengths"].sum()) for path in shards[before:])
    assert report["draft_written_tokens"] == written > 0 and report["data_tokens"] >= 90
    assert f"{written} by the starting draft (on-policy" in (second / "README.md").read_text()
    code = main(common + ["--out", str(tmp_path / "x"), "--data-tokens", "30", "--on-policy", "0.5"])
    assert code == 2 and "--on-policy needs --init-draft" in capsys.readouterr().err


def test_repeat_contexts_end_with_a_cue_copied_from_their_window():
    prompts = [torch.arange(100, 130, dtype=torch.int32), torch.tensor([7, 8], dtype=torch.int32)]
    tokens = torch.arange(200, 296, dtype=torch.int32).view(1, -1).repeat(2, 1)
    tokens[1, 5] = 2  # the second row stops at a special token, which the window leaves out
    source = {"prompts": prompts, "tokens": tokens, "lengths": torch.tensor([96, 6])}
    contexts = repeat_prompts(source, {2}, torch.Generator().manual_seed(0))
    first, second = contexts
    window = first[:-REPEAT_CUE]
    assert len(window) == REPEAT_WINDOW and window == list(range(122, 130)) + list(range(200, 240))  # prompt end + start
    cue = first[-REPEAT_CUE:]
    assert any(window[i: i + REPEAT_CUE] == cue for i in range(len(window)))
    assert second[:-REPEAT_CUE] == [7, 8, 200, 201, 202, 203, 204] and 2 not in second
    assert second[-REPEAT_CUE:] == second[:REPEAT_CUE]  # a window too short to choose: the cue repeats its start
    assert repeat_prompts(source, {2}, torch.Generator().manual_seed(0)) == contexts  # resumable: seeded per shard


def test_distill_repeat_data_continues_earlier_text(tiny_dir, tmp_path, capsys):
    work, out = tmp_path / "w", tmp_path / "d"
    common = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "distill", "tiny-target",
              "--batch-prompts", "4", "--new-tokens", "8", "--max-steps", "2", "--data-dir", str(work), "--out", str(out),
              "--hidden-size", "16", "--layers", "1", "--heads", "2", "--intermediate-size", "32"]
    assert main(common + ["--data-tokens", "100", "--repeat-share", "0.5"]) == 0, capsys.readouterr().err
    records = [torch.load(path) for path in sorted((work / "data").glob("shard_*.pt"))]
    sources = [r.get("source", "target") for r in records]
    assert sources[0] == "target" and sources[1] == "repeat" and "target" in sources[2:] and "repeat" in sources[2:]
    for record in (r for r in records if r.get("source") == "repeat"):
        for prompt in record["prompts"]:
            prompt = prompt.tolist()
            cue = prompt[-REPEAT_CUE:]
            assert any(prompt[i: i + REPEAT_CUE] == cue for i in range(len(prompt) - REPEAT_CUE))
    report = json.loads((out / "distill_report.json").read_text())
    repeated = sum(int(r["lengths"].sum()) for r in records if r.get("source") == "repeat")
    assert report["repeat_tokens"] == repeated > 0
    assert f"{repeated} of them the target's continuations of contexts that end by repeating" in (out / "README.md").read_text()
    assert main(common + ["--repeat-share", "1.5"]) == 2 and "--repeat-share must be in [0, 1]" in capsys.readouterr().err


def test_a_frequent_token_head_draft_writes_only_its_own_tokens():
    """On-policy data from a subset-head draft: batched rows draw only the head's tokens, greedy rows as alone."""
    from lssp.decoding.generation import generate_regular
    from lssp.decoding.sampling import SamplingParams
    from lssp.models.draft_head import attach_subset_head

    draft = attach_subset_head(tiny_llama(4), list(range(0, 64, 2))).eval()
    prompts = [[5, 9, 2, 7], [3]]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature)
        got = generate_rows(draft, prompts, 6, params, [torch.Generator().manual_seed(r) for r in range(2)], 3, set())
        assert set(got["tokens"].flatten().tolist()) <= set(range(0, 64, 2))
        assert set(got["top_ids"].flatten().tolist()) <= set(range(0, 64, 2))
        for r, prompt in enumerate(prompts):
            alone = generate_regular(draft, torch.tensor([prompt]), 6, params, torch.Generator().manual_seed(r))
            assert got["tokens"][r].tolist() == alone.tokens.tolist()


def test_held_out_acceptance_of_a_written_draft(tiny_dir):
    """The target as its own draft is always accepted; an unrelated draft is not; another tokenizer is refused."""
    target = load_model(load_registry(tiny_dir / "models.yaml").get("tiny-target"))
    itself = held_out_acceptance(target, tiny_dir / "tiny-target", seed=0, device=None)
    assert list(itself) == [ACCEPTANCE] and itself[ACCEPTANCE] > 0.9  # bfloat16 draft, float32 target: near-ties may differ
    other = held_out_acceptance(target, tiny_dir / "tiny-draft", seed=0)
    assert list(other) == [ACCEPTANCE] and 0 <= other[ACCEPTANCE] < 0.5
    with pytest.raises(IncompatibleModelsError, match="does not share target"):
        held_out_acceptance(target, tiny_dir / "tiny-other", seed=0)
