"""The oracle draft (right with set probability) and `ceiling`, which times it against RSp and the real draft."""
from __future__ import annotations

import json
import re

import pytest
import torch

from lssp.decoding.generation import generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import DraftModel
from lssp.drafters.oracle import Oracle, wrong
from lssp.measure.ceiling import crossing

GREEDY = SamplingParams(0)


def oracle_run(target, draft, alpha: float, k: int, n: int = 24, seed: int = 0):
    ids = torch.tensor([[1, 5, 9, 3]])
    reference = generate_regular(target, ids, n, GREEDY).tokens.tolist()
    out = speculative_decode(target, Oracle(DraftModel(draft), reference, ids.shape[1], alpha, seed), ids, n, k, GREEDY)
    return reference, out


@pytest.mark.parametrize("k", [1, 3])
def test_an_oracle_always_right_has_every_draft_accepted(target, draft, k):
    reference, out = oracle_run(target, draft, 1.0, k)
    assert out.tokens.tolist() == reference
    s = out.stats
    assert s.accepted == s.drafted and s.rejections == 0
    assert s.target_forwards == -(-len(reference) // (k + 1))  # k + 1 tokens a forward, the last one fewer


def test_an_oracle_never_right_has_no_draft_accepted(target, draft):
    reference, out = oracle_run(target, draft, 0.0, 3)
    assert out.tokens.tolist() == reference
    assert out.stats.accepted == 0 and out.stats.target_forwards == len(reference)


def test_an_oracle_in_between_is_right_about_as_often_as_set(target, draft):
    """Greedy output stays the target's, and the acceptance of the i.i.d. model lands near the alpha set."""
    accepted = tried = 0
    for seed in range(6):
        reference, out = oracle_run(target, draft, 0.6, 2, n=40, seed=seed)
        assert out.tokens.tolist() == reference
        accepted, tried = accepted + out.stats.accepted, tried + out.stats.accepted + out.stats.rejections
    assert 0.45 < accepted / tried < 0.75


def test_the_oracle_refuses_sampling_and_an_alpha_outside_0_1(target, draft):
    ids = torch.tensor([[1, 5, 9, 3]])
    with pytest.raises(ValueError, match="greedy only"):
        speculative_decode(target, Oracle(DraftModel(draft), [4] * 8, 4, 0.5, 0), ids, 8, 2, SamplingParams(1.0),
                           torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="alpha"):
        Oracle(DraftModel(draft), [], 4, 1.5, 0)
    assert wrong(0) == 1 and wrong(7) == 6


def test_crossing_reads_the_alpha_where_a_bar_is_reached():
    points = [(0.6, 1.2), (0.8, 1.6), (1.0, 2.0)]
    assert crossing(points, 1.5) == 0.75
    assert crossing(points, 1.0) == 0.6  # already reached at the lowest alpha
    assert crossing(points, 2.5) is None
    assert crossing(list(reversed(points)), 1.6) == 0.8


def test_ceiling_times_the_draft_and_the_oracle_and_says_the_alpha_needed(run, tmp_path):
    code, out, err = run("ceiling", "tiny-target", "tiny-draft", "--nb-prompts", "2", "--repeats", "2", "--k", "1,2",
                         "--alpha", "0,1", "--bar", "1.1,50", "--max-new-tokens", "8", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    text = " ".join(out.split())
    assert "oracle α=1" in text and "tiny-draft" in text and "the draft's α (accepted ÷ tried)" in text
    assert "50× needs the oracle's α none measured at K=1" in text
    summary = json.loads((tmp_path / "c.json").read_text())
    rows = summary["rows"]
    assert {(r["task"], r["k"], r["alpha"]) for r in rows} == {
        (t, k, a) for t in ("stories", "all") for k in (1, 2) for a in (None, 0.0, 1.0)}
    perfect = next(r for r in rows if r["task"] == "all" and r["k"] == 2 and r["alpha"] == 1.0)
    assert perfect["tokens_per_forward"] > 2.5 and perfect["measured_alpha"] == 1.0
    assert all(r["not_equal_to_rsp"] == 0 and r["speedup_low"] <= r["speedup"] <= r["speedup_high"] for r in rows)
    assert "device" in rows[0] and summary["alpha_needed"]["50"] == {"K=1": None, "K=2": None}
    assert (tmp_path / "results" / "ceiling.csv").exists()


def test_ceiling_shows_intervals_and_says_where_there_is_none(run):
    code, out, err = run("ceiling", "tiny-target", "tiny-draft", "--nb-prompts", "2", "--repeats", "1", "--k", "1",
                         "--alpha", "1", "--max-new-tokens", "6")
    assert code == 0, err
    assert re.search(r"\[\d+\.\d\d-\d+\.\d\d\]", out)  # two completions a way: an interval, not eaten as markup
    code, out, err = run("ceiling", "tiny-target", "tiny-draft", "--nb-prompts", "1", "--repeats", "1", "--k", "1",
                         "--alpha", "1", "--max-new-tokens", "6")
    assert code == 0 and "no interval" in out, err


def test_ceiling_times_several_drafts_side_by_side(run, tmp_path):
    code, out, err = run("ceiling", "tiny-target", "--draft", "tiny-eagle,tiny-draft", "--nb-prompts", "2", "--repeats",
                         "1", "--k", "2", "--alpha", "1", "--max-new-tokens", "6", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    text = " ".join(out.split())
    assert "tiny-eagle's α (accepted ÷ tried)" in text and "tiny-draft's α (accepted ÷ tried)" in text
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert {(r["draft"], r["alpha"]) for r in rows if r["task"] == "all"} == {
        ("tiny-eagle", None), ("tiny-draft", None), ("tiny-eagle", 1.0)}  # the oracle drafts beside the first
    code, _, err = run("ceiling", "tiny-target", "--draft", "tiny-draft,tiny-draft")
    assert code == 2 and "names a draft twice" in err


def test_ctrl_c_in_ceiling_keeps_the_completions_every_way_finished(run, tmp_path, monkeypatch):
    import lssp.measure.ceiling as ceiling

    calls, real = [0], ceiling.speculative_decode

    def interrupted_later(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 7:  # the first prompt's 6 SSp ways are done, the second prompt's are not
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ceiling, "speculative_decode", interrupted_later)
    code, out, err = run("ceiling", "tiny-target", "tiny-draft", "--nb-prompts", "3", "--repeats", "1", "--k", "1,2",
                         "--alpha", "0.5,1", "--max-new-tokens", "6", "--json", str(tmp_path / "c.json"))
    assert code == 130 and "interrupted after 1 completion of each way" in " ".join(err.split()), err
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert rows and all(r["interrupted"] and r["completions"] == 1 for r in rows)


def test_ceiling_over_several_tasks_adds_a_line_per_task(run):
    code, out, err = run("ceiling", "tiny-target", "tiny-draft", "--task", "chat,stories", "--nb-prompts", "1",
                         "--repeats", "2", "--k", "2", "--alpha", "0,1", "--bar", "1.01", "--max-new-tokens", "6")
    assert code == 0, err
    text = " ".join(out.split())
    assert "By task" in text and re.search(r"│ chat +│ [\d.]+× \(K=2, α [\d.]+\)", out) and "│ stories" in out


def test_ceiling_says_a_wrong_alpha_in_one_line(run):
    code, _, err = run("ceiling", "tiny-target", "tiny-draft", "--alpha", "0.5,1.5")
    assert code == 2 and "--alpha values must be in [0, 1], got '0.5,1.5'" in " ".join(err.split())
    code, _, err = run("ceiling", "tiny-target", "tiny-draft", "--bar", "fast")
    assert code == 2 and "--bar takes numbers" in err
