"""What a newcomer meets first: tables at 80 columns, results that are never lost or rewritten,
Ctrl-C, resume, progress in a log, a clean checkout, and options where a user puts them."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from lssp.cli import hoist_global_options
from lssp.report.results import append_csv, read_csv_parts

pytestmark = pytest.mark.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]


def assert_fits_80_columns(out: str) -> None:
    assert out.strip()
    assert "…" not in out, out  # rich marks a cut cell with an ellipsis
    assert max(len(line) for line in out.splitlines()) <= 80, out


@pytest.mark.parametrize("args", [
    ("models",),
    ("latency", "--k", "3", "--draft-confidence", "0,0.5", "--lookup", "0,2", "--nb-prompts", "1",
     "--max-new-tokens", "6"),
    ("bench", "--k", "2", "--nb-prompts", "1", "--max-new-tokens", "6", "--alpha", "0.6,0.8"),
    ("eval", "--both", "--nb-prompts", "3"),
    ("verify", "--nb-prompts", "1", "--samples", "60", "--depth", "1", "--effect", "1"),
    ("verify", "--temperature", "0", "--nb-prompts", "2", "--max-new-tokens", "8"),
    ("cost", "tiny-target", "tiny-draft", "--precisions", "float32,bfloat16", "--tokens", "1,2,3,5", "--repeats", "1"),
], ids=["models", "latency", "bench", "eval", "verify-sampled", "verify-greedy", "cost"])
def test_every_table_fits_80_columns_uncut(run, args):
    code, out, err = run(*args)
    assert code == 0, err
    table = out[:out.index("→")] if "→" in out else out  # the footer names long file paths and may wrap
    assert_fits_80_columns(table)


def test_latency_wide_shows_the_other_columns(run):
    code, out, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "6", "--k", "2")
    assert code == 0, err
    header = out.split("share of iterations")[0]
    assert "ms/token" in header and "TTFT" not in header and "median" not in header
    code, out, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "6", "--k", "2", "--wide")
    assert code == 0, err
    tables = out.split("share of iterations")[0]
    assert "TTFT" in tables and "median" in tables and "spread" in tables
    assert_fits_80_columns(tables)
    floor = re.search(r"floor of a tiny-target token \(float32, ([\d.e+-]+) MB.*?the median of 1 probe\): ([\d.e+-]+) "
                      r"ms; ms/token ÷ floor: RSp ([\d.e+-]+)×, K=2 ([\d.e+-]+)×", " ".join(out.split()))
    assert floor and float(floor.group(2)) > 0 and float(floor.group(3)) > 0  # each mode against the machine's floor


# --- nothing measured is lost ----------------------------------------------------------------
def test_append_csv_never_rewrites_earlier_lines(tmp_path):
    path = tmp_path / "latency.csv"
    earlier = "run_id,k,ms\nA,4,21\nB,2,20.5\n"
    path.write_text(earlier)
    assert append_csv(path, [{"run_id": "C", "k": 3, "ms": 19.25}]).path == path
    assert path.read_text() == earlier + "C,3,19.25\n"  # "4" stays "4", nothing is re-quoted or reordered
    # Rows with a column the header lacks go to a part beside it; the file stays as it was.
    appended = append_csv(path, [{"run_id": "D", "k": 1, "ms": 18.0, "noisy": True}])
    assert appended.path == tmp_path / "latency.1.csv" and "lacks columns noisy" in appended.note
    assert path.read_text() == earlier + "C,3,19.25\n"
    again = append_csv(path, [{"run_id": "E", "k": 2, "ms": 17.0, "noisy": False}])
    assert again.path == appended.path and again.note == ""  # said once, when the part was made
    frame = read_csv_parts(path)
    assert list(frame["run_id"]) == ["A", "B", "C", "D", "E"] and frame["noisy"].tolist()[-2:] == [True, False]


def test_csv_lines_end_in_lf_and_an_older_crlf_file_keeps_its_line_ends(tmp_path):
    new = tmp_path / "new.csv"
    append_csv(new, [{"run_id": "A", "k": 2}])
    assert new.read_bytes() == b"run_id,k\nA,2\n"
    old = tmp_path / "old.csv"
    old.write_bytes(b"run_id,k\r\nA,2\r\n")
    append_csv(old, [{"run_id": "B", "k": 3}])
    assert old.read_bytes() == b"run_id,k\r\nA,2\r\nB,3\r\n"


def test_malformed_csv_is_left_untouched_and_rows_go_beside(run, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    garbage = "run_id,mode,k\nx,rsp,0\nthis line, has, too, many, fields\n"
    (results / "latency.csv").write_text(garbage)
    code, out, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "4", results=results)
    assert code == 0, err
    assert (results / "latency.csv").read_text() == garbage
    assert "latency.csv is malformed (line 3 has 5 fields where its header has 3)" in err
    assert "latency.1.csv" in err
    rows = pd.read_csv(results / "latency.1.csv")
    assert list(rows["mode"]) == ["rsp", "ssp"] and "RSp" in out


def test_results_dir_is_checked_before_any_model_loads(run, tmp_path, monkeypatch):
    import lssp.models.loading

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the results directory was checked")

    monkeypatch.setattr(lssp.models.loading, "load_model", no_loading)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for command in (["latency"], ["eval", "--nb-prompts", "2"], ["bench"], ["verify"], ["cost"]):
        code, out, err = run(*command, results=blocker / "results")
        assert code == 2, (command, err)
        assert f"results directory {blocker / 'results'} is not writable" in err and "Traceback" not in err


def test_a_failed_write_names_the_file_and_keeps_the_rows_elsewhere(run, tmp_path):
    results = tmp_path / "results"
    (results / "latency.csv").mkdir(parents=True)  # a directory where the CSV should be: the write fails
    code, out, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "4", results=results)
    assert code == 1
    assert "RSp" in out and "SSp" in out  # the table came first
    line = next(x for x in err.splitlines() if "could not write" in x)
    assert str(results / "latency.csv") in line and "wrote " in line
    fallback = Path(line.split("wrote ")[1].split(" instead")[0])
    assert list(pd.read_csv(fallback)["mode"]) == ["rsp", "ssp"]
    assert (results / "latency_prompts.csv").exists()  # the other files were written where asked


# --- interruptions and resume ----------------------------------------------------------------
def _cli(tiny_dir: Path, results: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "LLAMASSP_LOG_EVERY": "0"}
    return subprocess.Popen([sys.executable, "-m", "lssp", "--config", str(tiny_dir / "models.yaml"), "--results-dir",
                             str(results), *args], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _interrupt_when(proc: subprocess.Popen, marker: str, timeout: float = 120) -> tuple[str, str]:
    """Wait for a stderr line matching the regex ``marker``, send SIGINT, return (stdout, stderr)."""
    seen, deadline = "", time.monotonic() + timeout
    while not re.search(marker, seen) and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.readline()
    assert re.search(marker, seen), seen
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return out, seen + err


def test_ctrl_c_in_latency_exits_130_and_keeps_the_completed_prompts(tiny_dir, tmp_path):
    results = tmp_path / "results"
    proc = _cli(tiny_dir, results, "latency", "--k", "2", "--max-new-tokens", "60", "--nb-prompts", "16",
                "--repeats", "4", "--ignore-eos")  # long enough that the signal always lands before the end
    out, err = _interrupt_when(proc, r"prompt 1/16 stories pass 1 ssp")  # one whole prompt done
    assert proc.returncode == 130, err
    assert "interrupted after" in err and "Traceback" not in err and "nothing was saved" not in err
    rows = pd.read_csv(results / "latency.csv")
    assert list(rows["mode"]) == ["rsp", "ssp"] and rows["interrupted"].all()
    prompts = pd.read_csv(results / "latency_prompts.csv")
    assert len(prompts) % 2 == 0 and len(prompts) >= 2  # whole prompts only, both modes on each


def test_sigterm_stops_latency_like_ctrl_c(tiny_dir, tmp_path):
    results = tmp_path / "results"
    proc = _cli(tiny_dir, results, "latency", "--no-baseline", "--k", "2", "--max-new-tokens", "60", "--nb-prompts", "16")
    seen, deadline = "", time.monotonic() + 120
    while "prompt 1/16" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.readline()
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted after" in err, seen + err
    assert pd.read_csv(results / "latency.csv")["interrupted"].all()


def test_ctrl_c_in_compare_exits_130(tiny_dir, tmp_path):
    proc = _cli(tiny_dir, tmp_path, "compare", "--max-new-tokens", "4")
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    seen, deadline = "", time.monotonic() + 120
    while "speedup" not in seen and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGINT)  # now waiting for the next prompt on stdin
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err


def test_ctrl_c_in_eval_exits_130_and_resume_finishes_it(tiny_dir, tmp_path, run):
    results = tmp_path / "results"
    proc = _cli(tiny_dir, results, "eval", "--both", "--nb-prompts", "60")
    _, err = _interrupt_when(proc, r"\[1/120\]")
    assert proc.returncode == 130 and "--resume continues it" in err, err
    assert not (results / "eval.csv").exists()
    code, out, err = run("eval", "--both", "--nb-prompts", "60", "--resume", results=results)
    assert code == 0, err
    assert "resumed:" in out
    rows = pd.read_csv(results / "eval.csv")
    assert list(rows["trials"]) == [60, 60]


def test_resume_with_nothing_to_resume_says_so(run, tmp_path, monkeypatch):
    import lssp.models.loading

    monkeypatch.setattr(lssp.models.loading, "load_model", lambda *a, **k: pytest.fail("loaded a model for nothing"))
    code, out, err = run("eval", "--nb-prompts", "3", "--resume")
    assert code == 2 and "nothing to resume: no eval run with these settings" in err
    assert not (tmp_path / "results" / "eval.csv").exists()


def test_resume_of_a_completed_run_adds_no_rows(run, tmp_path):
    assert run("eval", "--nb-prompts", "3")[0] == 0
    before = (tmp_path / "results" / "eval.csv").read_text()
    code, out, err = run("eval", "--nb-prompts", "3", "--resume")
    assert code == 2 and "nothing to resume" in err and "completed" in err
    assert (tmp_path / "results" / "eval.csv").read_text() == before


# --- noise, repeats, progress ----------------------------------------------------------------
def test_noise_is_measured_and_flagged(run, tmp_path, monkeypatch):
    import lssp.measure.latency

    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "2")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert (rows["forward_spread"] >= 1).all()
    monkeypatch.setattr(lssp.measure.latency, "NOISY_SPREAD", 1.0)  # any spread at all now counts as a busy machine
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "2")
    assert code == 0, err
    assert "busy machine" in out and "unreliable" in out
    rows = read_csv_parts(tmp_path / "results" / "latency.csv")
    assert rows["noisy"].iloc[-2:].all()


def test_spread_and_noisy_summary():
    from lssp.decoding.generation import GenerationStats
    from lssp.engines import Mode
    from lssp.measure.latency import PromptTiming, summarize

    def timing(index: int, target_s: float) -> PromptTiming:
        stats = GenerationStats("rsp", new_tokens=10, target_forwards=10, target_time_s=target_s, total_time_s=target_s)
        return PromptTiming(index, "rsp", 0, stats)

    quiet = summarize([timing(0, 0.20), timing(1, 0.21), timing(2, 0.22)], Mode("rsp"))
    busy = summarize([timing(0, 0.20), timing(1, 0.85), timing(2, 0.21)], Mode("rsp"))
    assert quiet.forward_spread == pytest.approx(0.22 / 0.21) and not quiet.noisy  # slowest ÷ median
    assert busy.forward_spread == pytest.approx(0.85 / 0.21) and busy.noisy


def test_repeats_give_the_speedup_a_spread(run, tmp_path):
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "2", "--repeats", "3",
                         "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    ssp = [r for r in json.loads((tmp_path / "l.json").read_text()) if r["mode"] == "ssp"][0]
    assert ssp["speedup_sd"] is not None and ssp["speedup_sd"] >= 0
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    assert sorted(set(prompts["repeat"])) == [0, 1, 2] and len(prompts) == 3 * 2 * 2
    assert "× 3 passes" in " ".join(out.split()) and "±sd" in out


def test_progress_lines_without_a_terminal(run):
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "4", "--k", "2")
    assert code == 0
    lines = [x for x in err.splitlines() if x.startswith("[")]
    assert lines[0].startswith("[1/6] latency: warm-up") and lines[-1].startswith("[6/6] latency:")
    assert "elapsed" in lines[-1] and "left" in lines[-1]


# --- options where a user puts them ----------------------------------------------------------
def test_global_options_after_the_subcommand(run, tmp_path):
    code, _, err = run("eval", "--nb-prompts", "2", "--seed", "7", "-v")
    assert code == 0, err
    assert pd.read_csv(tmp_path / "results" / "eval.csv")["seed"].tolist() == [7]
    assert hoist_global_options(["eval", "--seed=3", "--k", "2", "--device", "cpu", "--", "--seed"]) == [
        "--seed=3", "--device", "cpu", "eval", "--k", "2", "--", "--seed"]


@pytest.mark.parametrize("args, message", [
    (("latency", "--k", "1,,2"), "--k takes whole numbers separated by commas, got '1,,2'"),
    (("latency", "--nb-prompts", "100"), "--nb-prompts 100: the built-in list has only 16 prompts"),
    (("latency", "--draft-confidence", "0,"), "--draft-confidence takes numbers separated by commas"),
    (("latency", "--repeats", "0"), "--repeats must be at least 1"),
])
def test_more_bad_input(run, args, message):
    code, out, err = run(*args)
    assert code == 2 and message in err and "Traceback" not in err


def test_one_prompt_is_singular_and_wald_stays_in_range(run):
    code, out, err = run("latency", "--nb-prompts", "1", "--max-new-tokens", "4")
    assert code == 0 and "1 prompt " in out and "1 prompts" not in out
    from lssp.report.stats import wald

    low = wald(1, 30)
    assert low.low == 0.0 and low.high > low.estimate


def test_verify_says_where_it_wrote_and_both_modes_share_one_file(run, tmp_path):
    code, out, err = run("verify", "--temperature", "0", "--nb-prompts", "1", "--max-new-tokens", "6")
    assert code == 0, err
    assert "verify.csv" in out.replace("\n", "")
    code, out, err = run("verify", "--nb-prompts", "1", "--samples", "40", "--depth", "1", "--effect", "1")
    assert code == 0 and "new rows went to" not in err, err
    rows = pd.read_csv(tmp_path / "results" / "verify.csv")
    assert rows["identical"].notna().sum() == 2 and rows["chi2_p_value"].notna().sum() >= 1


@pytest.mark.slow
# --- the checkout stays clean ----------------------------------------------------------------
def test_a_run_leaves_the_git_checkout_clean(tiny_dir, tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    # The working tree as it is now (tracked files, and the ignore rules), committed in the clone.
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], cwd=clone, check=True)
    subprocess.run([*git, "commit", "-qm", "working tree", "--allow-empty"], cwd=clone, check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLAMASSP_CACHE": str(tmp_path / "cache")}
    for args in (["latency", "--nb-prompts", "1", "--max-new-tokens", "4", "--plot"], ["plot"]):
        done = subprocess.run([sys.executable, "llamassp.py", "--config", str(tiny_dir / "models.yaml"), *args],
                              cwd=clone, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert (clone / "results" / "latency.csv").exists() and (clone / "results" / "plots").is_dir()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", status


def test_one_converted_copy_per_gguf_content(tmp_path, monkeypatch):
    from lssp.models.sources import gguf_copy_dir

    monkeypatch.setenv("LLAMASSP_CACHE", str(tmp_path / "cache"))
    content = b"GGUF" + bytes(range(256)) * 10_000
    first, second = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(content)
    assert gguf_copy_dir(first, "bfloat16") == gguf_copy_dir(second, "bfloat16")  # two environments, one copy
    assert gguf_copy_dir(first, "bfloat16") != gguf_copy_dir(first, "float32")
    second.write_bytes(content[:-1] + b"x")
    assert gguf_copy_dir(first, "bfloat16") != gguf_copy_dir(second, "bfloat16")


def test_verify_exits_1_when_not_lossless(run, monkeypatch):
    import lssp.measure.verify

    monkeypatch.setattr(lssp.measure.verify.VerifyReport, "verdict", property(lambda self: "not lossless"))
    code, out, err = run("verify", "--temperature", "0", "--nb-prompts", "1", "--max-new-tokens", "4")
    assert code == 1 and "NOT LOSSLESS" in out


def test_ctrl_c_in_verify_keeps_the_prompts_done_and_says_so(run, tmp_path, monkeypatch):
    from lssp.engines import OursEngine

    runs, batched = [0], OursEngine.complete_many

    def interrupted_later(self, mode, ids, request, seeds):  # verify runs a prompt's samples in batches
        if mode.mode == "ssp":
            runs[0] += len(seeds)
        if runs[0] > 120:  # prompt 1's 100 runs are done, prompt 2's are not
            raise KeyboardInterrupt
        return batched(self, mode, ids, request, seeds)

    monkeypatch.setattr(OursEngine, "complete_many", interrupted_later)
    code, out, err = run("verify", "--nb-prompts", "2", "--samples", "100", "--depth", "1", "--k", "2", "--effect",
                         "1.5", "--json", str(tmp_path / "v.json"))
    assert code == 130 and "interrupted: 1 report(s) saved" in err and "(1 in the last)" in err, err
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["interrupted"] and report["prompts_done"] == 1 and {c["prompt_index"] for c in report["checks"]} == {0}
    assert "verdict (ours, K=2)" in out


def test_ctrl_c_while_loading_says_nothing_was_saved(run, monkeypatch):
    import importlib

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    for command in ("verify", "latency"):
        monkeypatch.setattr(importlib.import_module(f"lssp.cli.{command}"), "load_pair", interrupted)
    for args in (("verify", "--temperature", "0"), ("latency",)):
        code, _, err = run(*args)
        assert code == 130 and "interrupted: nothing was saved" in err, err


def test_latency_ends_with_a_verdict_that_matches_its_table(run, tmp_path, monkeypatch):
    import lssp.measure.latency

    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "1,2", "--json",
                         str(tmp_path / "l.json"))
    assert code == 0, err
    rows = [r for r in json.loads((tmp_path / "l.json").read_text()) if r["mode"] == "ssp"]
    chosen = next(r for r in rows if r["verdict"])
    verdict = " ".join(out.split("verdict: ")[1].split("Results")[0].split("results")[0].split())
    expected = {"gain": "use", "loss": "SSp does not pay here: the best,", "no clear gain": "no clear gain: the best,"}
    assert verdict.startswith(f"{expected[chosen['verdict']]} K={chosen['k']}"), out
    assert f"{chosen['verdict_speedup']:.2f}× [{chosen['verdict_low']:.2f}–{chosen['verdict_high']:.2f}]" in verdict
    assert "2 prompts" in verdict and "chosen and estimated on the same 2 prompts" in verdict
    best = min(rows, key=lambda r: r["ms_per_token"])
    stars = [line for line in out.splitlines() if "★" in line]
    assert len(stars) == (1 if best["speedup"] > 1 else 0)
    monkeypatch.setattr(lssp.measure.latency, "NOISY_SPREAD", 1.0)  # a busy machine: the verdict says what to do
    code, out, err = run("latency", "--nb-prompts", "2", "--max-new-tokens", "6", "--k", "2")
    assert "rerun with --repeats 3 on a quiet machine" in " ".join(out.split())
