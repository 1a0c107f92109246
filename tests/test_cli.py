"""The command line, end to end on tiny models saved to a temporary folder."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from conftest import cli

from lssp.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")




def test_models_lists_the_registry(run):
    code, out, _ = run("models")
    assert code == 0
    for name in ("tiny-target", "tiny-draft", "tiny-target-8bit", "tiny-random"):
        assert name in out
    assert "(default target)" in out


def test_latency_writes_csv_markdown_and_json(run, tmp_path):
    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft", "--k", "1,3", "--nb-prompts", "2",
                         "--max-new-tokens", "12", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "speedup" in out and "share of iterations accepting draft i (K=3)" in out
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["mode"]) == ["rsp", "ssp", "ssp"] and list(rows["k"]) == [0, 1, 3]
    for col in ("timestamp", "run_id", "target", "draft", "temperature", "top_k", "top_p", "max_new_tokens", "prompts",
                "ms_per_token", "ttft_ms", "acceptance_rate", "mean_accepted", "speedup", "device", "torch",
                "transformers", "git_commit", "target_precision"):
        assert col in rows.columns, col
    assert (rows["ms_per_token"] > 0).all() and (rows["prompts"] == 2).all()
    ssp = rows[rows["mode"] == "ssp"]
    assert ssp["acceptance_rate"].between(0, 1).all() and (ssp["mean_accepted"] >= 1).all()
    assert (ssp["speedup"] > 0).all() and ssp["best"].sum() == 1
    assert (ssp["same_as_rsp"] == 1.0).all() and "greedy SSp's text equal to RSp's: K=1 100%, K=3 100%" in out
    summary = json.loads((tmp_path / "l.json").read_text())
    assert [s["mode"] for s in summary] == ["rsp", "ssp", "ssp"]
    for key in ("mode", "target", "draft", "k", "ms_per_token", "ttft_ms", "acceptance_rate", "mean_accepted", "speedup"):
        assert key in summary[1]
    assert len(list((tmp_path / "results").glob("latency-*.md"))) == 1
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    assert len(prompts) == 6 and (prompts["new_tokens"] == 12).all()  # EOS never ends a timed completion


def test_latency_appends_rows_never_overwrites(run, tmp_path):
    for _ in range(2):
        assert run("latency", "tiny-target", "--nb-prompts", "1", "--max-new-tokens", "4")[0] == 0
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert len(rows) == 2 and rows["run_id"].nunique() == 2 and (rows["mode"] == "rsp").all()


def test_latency_with_default_pair_and_no_baseline(run, tmp_path):
    code, _, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "6", "--no-baseline")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["mode"]) == ["ssp"] and rows["draft"][0] == "tiny-draft"


def test_a_drafts_own_k_is_the_default_and_a_bad_one_is_one_line(run, tiny_dir, tmp_path):
    registry = tmp_path / "k.yaml"
    entries = f"  t: {{path: {tiny_dir}/tiny-target, dtype: float32}}\n  d: {{path: {tiny_dir}/tiny-draft, dtype: float32, k: 3}}\n"
    registry.write_text("default_target: t\ndefault_draft: d\nmodels:\n" + entries)
    code, _, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "6", config=registry)
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["k"]) == [0, 3]  # RSp, then SSp at the draft's own K
    code, out, err = run("compare", "--max-new-tokens", "6", "--prompt", "ab", config=registry)
    assert code == 0 and "K=3" in out, err
    assert run("latency", "--nb-prompts", "1", "--max-new-tokens", "6", "--k", "2", config=registry)[0] == 0
    assert list(pd.read_csv(tmp_path / "results" / "latency.csv")["k"])[-1] == 2  # --k wins
    registry.write_text(registry.read_text().replace("k: 3", "k: 0"))
    code, out, err = run("latency", "--nb-prompts", "1", config=registry)
    assert code == 2 and "bad k 0; expected a whole number >= 1" in err and "Traceback" not in err + out


def test_eval_both_reports_intervals_and_resumes(run, tmp_path):
    code, out, err = run("eval", "tiny-target", "--draft", "tiny-draft", "--both", "--nb-prompts", "6",
                         "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    assert "RSp − SSp" in out
    summary = json.loads((tmp_path / "e.json").read_text())
    assert [s["mode"] for s in summary] == ["rsp", "ssp"]
    for s in summary:
        assert s["trials"] == 6 and 0 <= s["successes"] <= 6
        assert s["wald_low"] <= s["success_rate"] <= s["wald_high"]
        assert s["wilson_low"] <= s["wilson_high"]
    records = tmp_path / "results" / "eval_records"
    (path,) = records.glob("eval-*.jsonl")
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["config"]["nb_prompts"] == 6
    assert len(lines) == 1 + 12
    row = json.loads(lines[1])
    assert {"prompt", "expected", "completion", "correct"} <= set(row)
    assert row["prompt"].startswith("8 * 12 = 96\n25 * 4 = 100\n37 * 85 = 3145\n")
    # Interrupt: keep the header and the first 5 records, as if the run died there.
    path.write_text("\n".join(lines[:6]) + "\n")
    code, out, err = run("eval", "tiny-target", "--draft", "tiny-draft", "--both", "--nb-prompts", "6", "--resume")
    assert code == 0, err
    assert "resumed: 5 records reused" in out
    assert "[6/12]" in err and "[1/12]" not in err  # progress counts on from the 5 records reused
    resumed = path.read_text().splitlines()
    assert len(resumed) == 1 + 12
    assert sorted((json.loads(x)["mode"], json.loads(x)["index"]) for x in resumed[1:]) == sorted(
        (m, i) for m in ("rsp", "ssp") for i in range(6))
    assert resumed[:6] == lines[:6]  # earlier records untouched
    rows = pd.read_csv(tmp_path / "results" / "eval.csv")
    assert len(rows) == 4 and rows["run_id"].nunique() == 1  # resumed run keeps its id


def test_eval_rsp_only(run, tmp_path):
    code, _, err = run("eval", "tiny-target", "--nb-prompts", "3", "--temperature", "0")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "eval.csv")
    assert list(rows["mode"]) == ["rsp"] and rows["trials"][0] == 3


def test_compare_streams_both_completions(run):
    code, out, err = run("compare", "tiny-target", "tiny-draft", "--prompt", "hello", "--max-new-tokens", "10", "--k", "3")
    assert code == 0, err
    assert "Regular sampling with tiny-target" in out and "Speculative sampling" in out
    assert "speedup" in out and "ms/token" in out


def test_compare_says_a_busy_machine_under_the_prompt_it_timed(run, monkeypatch):
    import lssp.cli.compare as compare

    monkeypatch.setattr(compare, "others_share", lambda start, end: 0.6)
    code, out, err = run("compare", "tiny-target", "tiny-draft", "--prompt", "ab", "--max-new-tokens", "4")
    assert code == 0, err
    said = " ".join(out.split())
    assert "this prompt: busy machine: other work took 60% of the CPUs' time" in said
    assert said.index("speedup") < said.index("this prompt: busy machine")


def test_compare_reads_prompts_from_stdin_until_eof(run, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    code, out, _ = run("compare", "--max-new-tokens", "4")
    assert code == 0
    assert out.count("Regular sampling") == 2
    summary = out[out.index("compare: wall time per token"):]
    assert "one" in summary and "two" in summary and "all 2" in summary  # per prompt, then overall
    said = re.search(r"per prompt: ([\d.]+)× \[([\d.]+)–([\d.]+)\] \(geometric mean, 95% t interval\)",
                     " ".join(summary.split()))
    assert said and float(said.group(2)) <= float(said.group(1)) <= float(said.group(3)), summary


def test_compare_nb_prompts_alone_takes_the_default_prompts_not_stdin(run, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("never read\n"))
    code, out, err = run("compare", "--nb-prompts", "2", "--max-new-tokens", "4")
    assert code == 0, err
    assert out.count("Regular sampling") == 2 and "never read" not in out and "all 2" in out


def test_json_into_a_missing_folder_and_a_file_as_results_dir_are_one_line_each(run, tmp_path):
    code, _, err = run("verify", "--temperature", "0", "--json", str(tmp_path / "nowhere" / "v.json"))
    assert code == 2 and "does not exist" in err and not (tmp_path / "nowhere").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run("--results-dir", str(afile), "latency")
    assert code == 2 and "is a file, not a folder" in err


@pytest.mark.parametrize("args, message", [
    (("latency", "nope"), "unknown model 'nope'"),
    (("latency", "tiny-targte"), "did you mean 'tiny-target'"),
    (("latency", "tiny-target", "--draft", "tiny-draft", "--k", "0"), "--k values must be at least 1"),
    (("eval", "tiny-target", "--nb-prompts", "0"), "--nb-prompts must be at least 1"),
    (("latency", "tiny-target", "--prompts", "/no/such/file"), "cannot read prompts file /no/such/file"),
    (("latency", "tiny-target", "--draft", "tiny-other-vocab"), "does not share target 'tiny-target''s tokenizer"),
    (("latency", "tiny-target", "--temperature", "-1"), "--temperature must be a number >= 0"),
    (("latency", "tiny-target", "--temperature", "nan"), "--temperature must be a number >= 0, got nan"),
    (("latency", "tiny-target", "--chat"), "its tokenizer has no chat template"),
    (("--device", "tpu", "latency"), "--device takes cpu, cuda, cuda:N or auto, got 'tpu'"),
    (("verify", "tiny-target", "tiny-draft", "--k", "1000"), "--k 1000 is more than --max-new-tokens 64"),
    (("plan", "tiny-target", "--gpus", "0"), "--gpus must be at least 1, got 0"),
])
def test_bad_input_gives_one_line_and_nonzero_exit(run, args, message):
    code, out, err = run(*args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out
    assert len([line for line in err.splitlines() if line.strip()]) <= 2  # one message (rich may wrap it once)


def test_unknown_option_is_a_usage_error_not_a_traceback(run):
    code, out, err = run("latency", "--bogus")
    assert code == 2 and "No such option: --bogus" in err and "Traceback" not in err + out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: No such option: --bogus (see `")  # one line, where to look
    assert lines[0].endswith(" latency --help`)")


def test_malformed_registry_is_one_line(run, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a:\n    path: x\n    colour: red\n")
    code, out, err = run("models", config=bad)
    assert code == 2 and "bad.yaml:4: model 'a': unknown key 'colour'" in err and "Traceback" not in err


def test_gpu_only_entry_without_gpu(run, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text("models:\n  big: {path: x/y, gpus: 8}\n")
    code, _, err = run("latency", "big", config=cfg)
    assert code == 2 and "needs 8 GPU(s) and none is visible" in err


def test_stats_against_hand_computed_values():
    from lssp.report.stats import (
        difference,
        expected_tokens_per_iteration,
        mcnemar,
        paired_difference,
        predicted_speedup,
        wald,
        wilson,
    )

    w = wald(284, 1000)  # the reference's 7B figure: 28.4% on 1000 prompts
    assert w.estimate == 0.284 and w.high - w.estimate == pytest.approx(1.959964 * (0.284 * 0.716 / 1000) ** 0.5)
    assert w.low == pytest.approx(0.256051, abs=1e-6) and w.high == pytest.approx(0.311949, abs=1e-6)
    wi = wilson(0, 20)
    assert wi.low == pytest.approx(0.0, abs=1e-12) and wi.high == pytest.approx(0.161125, abs=1e-6)
    wi = wilson(7, 10)
    assert (wi.low, wi.high) == (pytest.approx(0.39678, abs=1e-5), pytest.approx(0.89221, abs=1e-5))
    d = difference(284, 1000, 281, 1000)
    assert d.estimate == pytest.approx(0.003)
    assert d.high - d.estimate == pytest.approx(1.959964 * (0.284 * 0.716 / 1000 + 0.281 * 0.719 / 1000) ** 0.5)
    assert d.contains(0)
    # Paired: 1500 problems, 232 right only with RSp and 232 only with SSp (the README's eval run).
    paired = paired_difference(232, 232, 1500)
    assert paired.estimate == 0 and paired.high == pytest.approx(1.959964 * 464 ** 0.5 / 1500)  # ±2.81 points
    assert difference(500, 1500, 500, 1500).high > paired.high  # the independent interval ignores the pairing
    assert paired_difference(30, 10, 100).estimate == pytest.approx(0.2)
    assert paired_difference(30, 10, 100).high == pytest.approx(0.2 + 1.959964 * (40 - 400 / 100) ** 0.5 / 100)
    assert mcnemar(0, 0) == 1.0 and mcnemar(10, 0) == pytest.approx(2 * 0.5 ** 10)
    assert expected_tokens_per_iteration(0.5, 3) == pytest.approx(1.875)
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    assert predicted_speedup(1.0, 4, 0.0) == 5.0
    from lssp.report.stats import alpha_estimate, alpha_from_tokens_per_iteration

    # 3 iterations of K=4: accepted 4 (no rejection), 1 then rejected, 0 then rejected: 5 / (5 + 2)
    assert alpha_estimate(5, 2) == pytest.approx(5 / 7)
    assert alpha_from_tokens_per_iteration(1.875, 3) == pytest.approx(0.5)
    assert alpha_from_tokens_per_iteration(1.0, 4) == pytest.approx(0.0, abs=1e-9)


def test_cost_times_each_precision_and_token_count(tiny_dir, tmp_path, capsys):
    results = tmp_path / "results"
    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(results), "cost", "tiny-target", "tiny-draft",
                 "--precisions", "float32,dynamic-int8", "--tokens", "1,3", "--repeats", "2", "--json", str(tmp_path / "c.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "c.json").read_text())
    assert {(r["model"], r["precision"], r["tokens"]) for r in rows} == {
        (m, p, n) for m in ("tiny-target", "tiny-draft") for p in ("float32", "dynamic-int8") for n in (1, 3)}
    assert all(r["ms"] > 0 and (r["tokens"] > 1 or r["relative"] == 1.0) for r in rows)
    assert "no native bf16" in rows[0]["device"] or "bf16:" in rows[0]["device"]
    assert (results / "cost.csv").exists() and "c = tiny-draft ÷ tiny-target" in capsys.readouterr().out
    code = main(["--config", str(tiny_dir / "models.yaml"), "cost", "--precisions", "int3"])
    assert code == 2 and "--precisions takes some of" in capsys.readouterr().err


def test_cost_compares_the_two_forwards(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path / "results"), "cost", "tiny-target",
                 "tiny-draft", "--precisions", "float32", "--tokens", "1,2", "--repeats", "2", "--forwards",
                 "transformers,compact", "--json", str(tmp_path / "c.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "c.json").read_text())
    assert {(r["model"], r["forward"]) for r in rows} == {
        (m, f) for m in ("tiny-target", "tiny-draft") for f in ("transformers", "compact")}
    out = capsys.readouterr().out
    assert "float32 (compact):" in out and "float32 (transformers):" in out
    code = main(["--config", str(tiny_dir / "models.yaml"), "cost", "--forwards", "fast"])
    assert code == 2 and "--forwards takes some of" in capsys.readouterr().err


def test_latency_sweeps_draft_confidence(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path), "latency", "--default-pair",
                 "--k", "3", "--draft-confidence", "0,0.5", "--nb-prompts", "2", "--max-new-tokens", "8",
                 "--json", str(tmp_path / "l.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "l.json").read_text())
    assert [(r["mode"], r["k"], r["confidence"]) for r in rows] == [("rsp", 0, 0.0), ("ssp", 3, 0.0), ("ssp", 3, 0.5)]
    assert "≤3 p≥0.5" in capsys.readouterr().out
    code = main(["--config", str(tiny_dir / "models.yaml"), "latency", "--draft-confidence", "1.5"])
    assert code == 2 and "--draft-confidence" in capsys.readouterr().err


def test_latency_sweeps_the_context_lookup_and_other_commands_take_it(tiny_dir, tmp_path, capsys):
    config = ["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path)]
    code = main([*config, "latency", "--default-pair", "--k", "2", "--lookup", "0,1", "--nb-prompts", "2",
                 "--max-new-tokens", "8", "--json", str(tmp_path / "l.json")])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "l.json").read_text())
    assert [(r["mode"], r["k"], r["lookup"]) for r in rows] == [("rsp", 0, 0), ("ssp", 2, 0), ("ssp", 2, 1)]
    assert "2 +lookup 1" in capsys.readouterr().out
    assert set(pd.read_csv(tmp_path / "latency.csv")["lookup"]) == {0, 1}
    code = main([*config, "verify", "--temperature", "0", "--nb-prompts", "1", "--max-new-tokens", "8", "--lookup", "1", "--k", "2",
                 "--json", str(tmp_path / "v.json")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "v.json").read_text())["lookup"] == 1
    code = main([*config, "eval", "--both", "--nb-prompts", "2", "--lookup", "1"])
    assert code == 0, capsys.readouterr().err
    assert list(pd.read_csv(tmp_path / "eval.csv")["lookup"]) == [0, 1]
    for command in (["latency", "--lookup", "-1"], ["compare", "--prompt", "x", "--lookup", "-1"]):
        assert main([*config, *command]) == 2
        assert "--lookup" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ("latency", "--nb-prompts", "1", "--max-new-tokens", "4"),
    ("bench", "--nb-prompts", "1", "--max-new-tokens", "4"),
    ("eval", "--both", "--nb-prompts", "2"),
    ("verify", "--nb-prompts", "1", "--samples", "20", "--depth", "1", "--k", "2", "--effect", "2"),
    ("cost", "--tokens", "1,2", "--repeats", "1", "--precisions", "float32"),
], ids=lambda args: args[0])
def test_every_commands_json_rows_name_their_engine(run, tmp_path, args):
    out = tmp_path / "rows.json"
    code, _, err = run(*args, "--json", str(out))
    assert code == 0, err
    rows = json.loads(out.read_text())
    rows = [rows] if isinstance(rows, dict) else rows  # verify writes one report
    assert rows and all(row["engine"] in ("ours", "hf", "vllm", "ours-rsp", "ours-ssp", "hf-generate", "hf-assisted")
                        for row in rows)


@pytest.mark.parametrize("command, engine, takes", [("cost", "vllm", "cost takes ours"),
                                                   ("verify", "tgi", "verify takes ours, hf, vllm, llamacpp")])
def test_an_engine_a_command_cannot_use_is_one_line_naming_those_it_takes(run, command, engine, takes):
    code, _, err = run(command, "--engine", engine)
    assert code == 2 and takes in err and "Traceback" not in err


def test_latency_and_eval_run_transformers_as_an_engine(run, tmp_path):
    code, out, err = run("latency", "--engine", "ours,hf", "--k", "2", "--lookup", "0,2", "--nb-prompts", "2",
                         "--max-new-tokens", "6", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "hf RSp" in out and "hf SSp" in out
    rows = json.loads((tmp_path / "l.json").read_text())
    hf = [r for r in rows if r["engine"] == "hf"]
    assert {(r["mode"], r["lookup"]) for r in hf} == {("rsp", 0), ("ssp", 0)}  # no lookup in assisted generation
    assert all(r["method"] == "assisted" for r in hf if r["mode"] == "ssp") and hf[1]["speedup"] > 0
    code, _, err = run("eval", "--engine", "hf", "--both", "--nb-prompts", "3", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    assert {r["engine"] for r in json.loads((tmp_path / "e.json").read_text())} == {"hf"}


def test_a_draft_that_copies_first_runs_on_ours_and_another_engine_refuses_it(run, tmp_path):
    code, out, err = run("latency", "tiny-target", "tiny-draft-copy", "--k", "2", "--nb-prompts", "2",
                         "--max-new-tokens", "8", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert {r["draft"] for r in json.loads((tmp_path / "l.json").read_text()) if r["mode"] == "ssp"} == {"tiny-draft-copy"}
    code, _, err = run("latency", "tiny-target", "tiny-draft-copy", "--engine", "ours,hf", "--nb-prompts", "1")
    assert code == 2 and "prompt_lookup (copy first, then the draft) runs on our engine alone" in err
    assert "Traceback" not in err


def test_a_draft_entrys_confidence_stop_is_the_options(run, tmp_path):
    """An entry with ``confidence: 0.5`` drafts as its draft does under --draft-confidence 0.5 (the same tokens and
    drafts, greedy); other engines refuse it in one line."""
    stats = {}
    for name, more in [("tiny-draft-sure", []), ("tiny-draft", ["--draft-confidence", "0.5"]), ("tiny-draft", [])]:
        json_path = tmp_path / f"{name}{len(more)}.json"
        code, _, err = run("latency", "tiny-target", name, "--k", "3", "--nb-prompts", "2", "--max-new-tokens", "12",
                           "--repeats", "1", *more, "--json", str(json_path))
        assert code == 0, err
        stats[name + str(len(more))] = [(r["confidence"], r["alpha"], r["mean_accepted"], r["acceptance_by_position"])
                                        for r in json.loads(json_path.read_text()) if r["mode"] == "ssp"]
    assert stats["tiny-draft-sure0"] == stats["tiny-draft2"] != stats["tiny-draft0"]
    assert stats["tiny-draft-sure0"][0][0] == 0.5  # the row says the stop it drafted with
    code, _, err = run("latency", "tiny-target", "tiny-draft-sure", "--engine", "ours,hf", "--nb-prompts", "1")
    assert code == 2 and "confidence (the confidence stop) runs on our engine alone" in err


def test_verify_keeps_the_other_engines_reports_when_one_breaks_down(run, tmp_path, monkeypatch):
    from lssp.engines import TransformersEngine

    def broken(self, mode, request):
        raise RuntimeError("max(): Expected reduction dim to be specified")

    monkeypatch.setattr(TransformersEngine, "complete", broken)
    code, out, err = run("verify", "--engine", "ours,hf", "--nb-prompts", "1", "--samples", "20", "--depth", "1",
                         "--k", "2", "--effect", "2", "--json", str(tmp_path / "v.json"))
    assert code == 2 and "verify --engine hf K=2 failed while running (RuntimeError: max()" in err and "Traceback" not in err
    assert json.loads((tmp_path / "v.json").read_text())["engine"] == "ours" and "verdict (ours, K=2)" in out


@pytest.mark.parametrize("args", [("compare", "--prompt", "x", "--k", "100", "--max-new-tokens", "16"),
                                  ("eval", "--k", "9", "--nb-prompts", "2"),
                                  ("latency", "--k", "2,100", "--max-new-tokens", "16"),
                                  ("bench", "--k", "100", "--max-new-tokens", "16")])
def test_a_k_above_the_token_budget_is_one_line(run, args):
    code, _, err = run(*args)
    assert code == 2 and "is more than --max-new-tokens" in err and "Traceback" not in err


def test_a_bug_is_not_called_a_users_mistake(capsys, monkeypatch):
    """An internal error says it is a bug and exits 3 (a user's mistake exits 2), its traceback shown with -v; an
    error of the machine's (a full disk, a read-only folder) stays one line with exit 2."""
    import lssp.cli
    from lssp.cli import BUG_EXIT, _run

    def raising(exc: Exception):
        def command(*args, **kwargs):
            raise exc
        return command

    monkeypatch.setattr(lssp.cli, "app", raising(RuntimeError("planted bug")))
    assert _run(["models"]) == BUG_EXIT == 3
    err = capsys.readouterr().err
    assert "internal error" in err and "bug in llamassp" in err and "RuntimeError: planted bug" in err and "-v" in err
    with pytest.raises(RuntimeError):
        _run(["models", "-v"])
    monkeypatch.setattr(lssp.cli, "app", raising(OSError(28, "No space left on device")))
    assert _run(["models"]) == 2 and "No space left on device" in capsys.readouterr().err


def test_every_command_takes_its_draft_as_a_second_name_or_as_draft(run):
    """One way to name a draft is as good as the other: `latency T D` = `latency T --draft D`, `compare T --draft D` =
    `compare T D`; naming two different drafts is one line and exit 2."""
    short = ("--max-new-tokens", "4")
    assert run("latency", "tiny-target", "tiny-draft", "--k", "2", "--nb-prompts", "1", *short)[0] == 0
    code, out, err = run("compare", "tiny-target", "--draft", "tiny-draft", "--prompt", "ab", *short)
    assert code == 0, err
    assert "tiny-draft" in out
    code, _, err = run("compare", "tiny-target", "tiny-draft", "--draft", "tiny-other-vocab", "--prompt", "ab", *short)
    assert code == 2 and err.strip().splitlines() == [
        "error: the draft is named twice ('tiny-draft' and --draft 'tiny-other-vocab'): give it once"]


def test_two_drafts_of_one_kind_are_told_apart_by_name(run):
    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft,tiny-draft-compact", "--k", "2",
                         "--nb-prompts", "1", "--max-new-tokens", "4")
    assert code == 0, err
    # less the words their names share (the title names them whole): one line each at 80 columns
    assert "SSp draft " in out and "SSp draft-compact " in out and "tiny-draft, tiny-draft-compact" in out


def test_an_unknown_name_far_from_every_model_points_at_models_not_at_all_of_them(tmp_path, capsys):
    import yaml

    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": {f"model-{i}": {"path": f"org/m{i}"} for i in range(20)}}))
    code, _, err = cli(capsys, registry, tmp_path)("latency", "zzzzzz")
    assert code == 2 and "none of the 20 known is close (`llamassp.py models` lists them)" in err
    assert "model-7" not in err


def test_json_into_the_results_folder_the_run_makes_is_allowed(run, tmp_path):
    fresh = tmp_path / "fresh"
    code, _, err = run("--results-dir", str(fresh), "cost", "tiny-draft", "--precisions", "float32", "--tokens", "1",
                       "--repeats", "1", "--json", str(fresh / "c.json"))
    assert code == 0, err
    assert (fresh / "c.json").exists()
    code, _, err = run("cost", "tiny-draft", "--json", str(tmp_path / "no" / "such" / "c.json"))
    assert code == 2 and "does not exist" in err


def test_a_busy_machine_is_said_with_one_prompt_and_marks_the_rows(run, tmp_path, monkeypatch):
    """Other work's share of the CPUs while timing (``lssp.report.contention``), here said to be 60%: the verdict says
    the machine was busy, the rows carry the share and are marked noisy (charts draw them hollow)."""
    import lssp.measure.latency as latency

    monkeypatch.setattr(latency, "others_share", lambda start, end: 0.6)
    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft", "--k", "2", "--nb-prompts", "1",
                         "--max-new-tokens", "4", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "busy machine: other work took 60% of the CPUs' time while timing" in " ".join(out.split())
    rows = json.loads((tmp_path / "l.json").read_text())
    assert rows and all(r["others_cpu_share"] == 0.6 and r["noisy"] for r in rows)


def test_other_works_share_of_the_cpus_is_measured_and_ours_is_not_counted():
    """A child of this process spinning a whole core adds nothing to others' share. Windows with and without it
    alternate and their differences' median is read, so that another test process (pytest-xdist's other worker)
    starting or stopping between two windows does not decide it (a counted child adds ~1/cores to every pair)."""
    import statistics
    import subprocess
    import time

    from lssp.report.contention import cpu_snapshot, others_share

    if cpu_snapshot() is None:
        pytest.skip("no /proc here")

    def window() -> float:
        start = cpu_snapshot()
        time.sleep(0.6)
        share = others_share(start, cpu_snapshot())
        assert 0 <= share <= 1
        return share

    differences = []
    for _ in range(5):
        child = subprocess.Popen(["python3", "-c", "while True: pass"])  # ours: a child of this process
        try:
            time.sleep(0.2)
            with_child = window()
        finally:
            child.kill()
            child.wait()
        differences.append(with_child - window())
    assert statistics.median(differences) < 0.25, differences


def test_bench_says_a_busy_machine_too(run, tmp_path, monkeypatch):
    import lssp.measure.bench as bench

    monkeypatch.setattr(bench, "others_share", lambda start, end: 0.5)
    code, out, err = run("bench", "tiny-target", "tiny-draft", "--k", "2", "--nb-prompts", "1", "--max-new-tokens", "4",
                         "--json", str(tmp_path / "b.json"))
    assert code == 0, err
    assert "busy machine: other work took 50% of the CPUs' time" in " ".join(out.split())
    rows = json.loads((tmp_path / "b.json").read_text())
    assert rows and all(r["others_cpu_share"] == 0.5 and r["noisy"] for r in rows)


def test_cost_times_a_compiled_entry_in_every_precision_uncompiled(run, tmp_path):
    """An entry with ``compile: true`` (as the default target is) timed in precisions it was not compiled for: each
    precision's eager forward, said in one line, never a crash."""
    code, out, err = run("cost", "tiny-target-q4-compiled", "--precisions", "bfloat16,float32,q4_1", "--tokens", "1,3",
                         "--repeats", "2", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    assert "timed uncompiled: tiny-target-q4-compiled asks torch.compile" in " ".join(out.split())
    rows = json.loads((tmp_path / "c.json").read_text())
    assert {(r["precision"], r["tokens"]) for r in rows} == {(p, n) for p in ("bfloat16", "float32", "q4_1") for n in (1, 3)}
