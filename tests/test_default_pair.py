"""The embedded default pair (SmolLM2-135M-Instruct + the shipped draft) end to end, offline."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from statistics import median

import pandas as pd
import pytest
from conftest import cli

from lssp.models.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.slow]  # the real SmolLM2 pair


@pytest.fixture()
def run(tmp_path, capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"

    call = cli(capsys, ROOT / "models.yaml", tmp_path)

    def _run(*args: str) -> tuple[int, str]:
        code, out, err = call(*args)
        assert code == 0, err
        return code, out

    return _run


def test_default_pair_is_on_disk():
    reg = load_registry(ROOT / "models.yaml")
    for name in (reg.default_target, reg.default_draft, reg.default_draft_model):
        assert reg.get(name).available_locally(), name
    for draft in ("smollm2-135m-draft", "smollm2-135m-eagle"):
        assert "Made with:" in (ROOT / "drafts" / draft / "README.md").read_text()


def test_latency_on_the_default_pair(run, tmp_path):
    _, out = run("latency", "--nb-prompts", "2", "--max-new-tokens", "8", "--json", str(tmp_path / "l.json"))
    rsp, ssp = json.loads((tmp_path / "l.json").read_text())
    draft = load_registry(ROOT / "models.yaml").models["smollm2-135m-eagle-chain6-min2"]
    k, chain = draft.k, draft.prompt_lookup_chain  # the head's own K (no --k given); copied chains run further
    assert (rsp["mode"], ssp["mode"]) == ("rsp", "ssp") and k == 2 and chain == 6
    assert ssp["target"] == "smollm2-135m-auto" and ssp["draft"] == "smollm2-135m-eagle-chain6-min2" and ssp["k"] == k
    assert ssp["method"] == "eagle"
    assert ssp["speedup"] == pytest.approx(rsp["ms_per_token"] / ssp["ms_per_token"])
    # Greedy on two fixed prompts: deterministic. The shipped draft predicts the target (about 0.6 here; a
    # draft that shares nothing with it, or a broken tokenizer match, is near 0).
    assert 0.3 < ssp["alpha"] <= 1 and 1 < ssp["mean_accepted"] <= chain + 1
    assert k <= len(ssp["acceptance_by_position"]) <= chain
    assert all(0 <= x <= 1 for x in ssp["acceptance_by_position"])
    # accepted = tokens - target forwards; acceptance = accepted / drafted with at most 6 drafts per forward.
    tokens = 2 * 8
    forwards = tokens / ssp["mean_accepted"]
    assert forwards == round(forwards)
    assert ssp["acceptance_rate"] >= (tokens - forwards) / (chain * forwards) - 1e-9
    prompts = pd.read_csv(tmp_path / "latency_prompts.csv")
    assert sorted(prompts["mode"]) == ["rsp", "rsp", "ssp", "ssp"] and (prompts["new_tokens"] == 8).all()
    for summary in (rsp, ssp):  # the summary's median is over the per-prompt rows
        per_prompt = prompts.loc[prompts["mode"] == summary["mode"], "ms_per_token"]
        assert summary["ms_per_token_median"] == pytest.approx(median(per_prompt))
        assert per_prompt.min() <= summary["ms_per_token"] <= per_prompt.max()


def test_an_engine_that_cannot_run_the_head_drafts_with_the_default_draft_model(tmp_path, capsys):
    call = cli(capsys, ROOT / "models.yaml", tmp_path)
    code, _, err = call("latency", "--engine", "ours,hf", "--nb-prompts", "1", "--max-new-tokens", "4",
                        "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "drafting with smollm2-135m-draft-auto, the default_draft_model" in " ".join(err.split())
    ssp = [row for row in json.loads((tmp_path / "l.json").read_text()) if row["mode"] == "ssp"]
    assert {(row["engine"], row["draft"]) for row in ssp} == {("ours", "smollm2-135m-draft-auto"),
                                                                ("hf", "smollm2-135m-draft-auto")}


def test_latency_on_chat_prompts(run, tmp_path):
    run("latency", "--nb-prompts", "1", "--max-new-tokens", "4", "--chat")
    rows = pd.read_csv(tmp_path / "latency.csv")
    assert (rows["prompt_format"] == "chat").all() and list(rows["mode"]) == ["rsp", "ssp"]
    assert "in the chat template" in next(tmp_path.glob("latency-*.md")).read_text()


def test_compare_on_the_default_pair_streams_the_same_greedy_text_twice(run):
    prompt = "The capital of France is"
    _, out = run("compare", "--prompt", prompt, "--max-new-tokens", "8")
    # Each completion is streamed after its header and followed by "   <seconds>s, ..." (headers may wrap).
    rsp = re.search(r"=> Regular sampling with smollm2-135m-auto\n(.*?)\n   [\d.]+s, ", out, re.S)
    ssp = re.search(r"made\s+by\s+the\s+target\n(.*?)\n   [\d.]+s, ", out, re.S)
    assert rsp and ssp, out
    assert rsp.group(1).startswith(prompt) and len(rsp.group(1)) > len(prompt) + 3
    assert ssp.group(1) == rsp.group(1)  # greedy SSp is lossless: the same text
    assert re.search(r"speedup [\d.]+×", out)


def test_eval_on_the_default_pair_gives_rsp_and_ssp_the_same_greedy_answers(run, tmp_path):
    from lssp.measure.evals import multiplication_problems, parse_answer, read_records

    _, out = run("eval", "--both", "--temperature", "0", "--nb-prompts", "5", "--json", str(tmp_path / "e.json"))
    rsp, ssp = json.loads((tmp_path / "e.json").read_text())
    assert (rsp["mode"], ssp["mode"], rsp["trials"], ssp["trials"]) == ("rsp", "ssp", 5, 5)
    (path,) = (tmp_path / "eval_records").glob("eval-*.jsonl")
    records = read_records(path)
    by_mode = {m: sorted((r for r in records if r.mode == m), key=lambda r: r.index) for m in ("rsp", "ssp")}
    assert [(r.a, r.b) for r in by_mode["rsp"]] == [(r.a, r.b) for r in by_mode["ssp"]] == multiplication_problems(5, 0)
    for a, b in zip(by_mode["rsp"], by_mode["ssp"]):
        assert a.completion == b.completion and a.new_tokens == b.new_tokens  # greedy SSp is lossless
        assert a.expected == a.a * a.b and a.correct == (parse_answer(a.completion) == a.expected)
    assert rsp["successes"] == ssp["successes"] == sum(r.correct for r in by_mode["rsp"])
    assert (rsp["diff_rsp_minus_ssp"], rsp["mcnemar_p"]) == (0.0, 1.0)
    assert rsp["diff_score_low"] < 0 < rsp["diff_score_high"]  # no discordant pair, yet an interval with a width
    assert "Tango's score" in out and "Wald" in out and "Wilson" in out and "no discordant pair" in out
    for m in (rsp, ssp):
        assert m["success_rate"] == m["successes"] / 5
        assert m["wilson_low"] <= m["success_rate"] <= m["wilson_high"] and m["wald_low"] <= m["success_rate"] <= m["wald_high"]


def test_a_gguf_target_is_converted_once_and_then_loads_from_its_copy(tmp_path, monkeypatch, capfd):
    """Converted quietly (transformers' own conversion bar off unless -v), once."""
    import torch

    from lssp.models import loading, sources

    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "cache"))
    spec = load_registry(ROOT / "models.yaml").get("smollm2-135m")
    first = loading.load_model(spec)  # from the GGUF file; writes the copy
    assert "Converting and de-quantizing" not in capfd.readouterr().err
    copy_dir = sources.gguf_copy_dir(spec.local_path(), spec.dtype)
    assert (copy_dir / "model.safetensors").exists() and (copy_dir / "tokenizer.json").exists()
    assert sources.model_source(spec) == (str(copy_dir), {})
    second = loading.load_model(spec)
    ids = torch.tensor([[1, 504, 3000, 22, 9000]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    text = "<|im_start|>user\n12 * 34 = ?<|im_end|> ünïcode"
    assert first.tokenizer(text).input_ids == second.tokenizer(text).input_ids
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
