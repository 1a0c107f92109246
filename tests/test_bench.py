"""bench: the four engines agree token for token when greedy; the summary is consistent."""
from __future__ import annotations

import copy

import pandas as pd
import pytest

from conftest import char_tokenizer, tiny_llama
from lssp.bench import ENGINES, copy_bandwidth, run_bench
from lssp.cli import main
from lssp.loading import LoadedModel, load_model
from lssp.registry import ModelSpec, load_registry
from lssp.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair():
    # No EOS in the config: hf generate then needs no EOS suppression and samples what ours samples.
    tok = char_tokenizer()
    return (LoadedModel(ModelSpec("t"), tiny_llama(40, scale=6.0, eos=None), tok),
            LoadedModel(ModelSpec("d"), tiny_llama(41, hidden=16, layers=1, scale=6.0, eos=None), tok))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_four_engines_agree_token_for_token_when_greedy(pair, k):
    target, draft = pair
    run = run_bench(target, draft, ["hello there", "12 * 4 = ", "abc"], "warm", k, SamplingParams(0), 24, seed=0)
    by_prompt = {}
    for r in run.runs:
        assert len(r.tokens) == 24
        by_prompt.setdefault(r.prompt_index, {})[r.engine] = r.tokens
    for tokens in by_prompt.values():
        assert set(tokens) == set(ENGINES)
        assert all(t == tokens["ours-rsp"] for t in tokens.values())
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}
    ours_rsp, hf_gen = (next(s for s in run.summaries if s.engine == e) for e in ("ours-rsp", "hf-generate"))
    assert ours_rsp.ratio_min <= ours_rsp.ratio_median <= ours_rsp.ratio_max
    assert 0 <= run.ssp_overhead_share < 1 and run.cost_ratio > 0 and run.verify_ratio > 0
    assert hf_gen.ms_per_token > 0


def test_hf_assisted_schedule_state_does_not_leak_between_calls(pair):
    target, draft = pair
    before = draft.model.generation_config.to_dict()
    run_bench(target, draft, ["hello"], "warm", 3, SamplingParams(0), 10, seed=0, engines=("hf-assisted",))
    assert draft.model.generation_config.to_dict() == before


def test_copy_bandwidth_is_positive():
    assert copy_bandwidth("cpu", megabytes=16, repeats=2) > 1e8


def test_bench_cli_writes_table_and_predictions(tiny_dir, tmp_path, capsys):
    code = main(["--config", str(tiny_dir / "models.yaml"), "--results-dir", str(tmp_path), "bench", "--nb-prompts", "2",
                 "--max-new-tokens", "8", "--k", "2", "--alpha", "0.6,0.8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Predicted SSp speedup" in out and "floor" in out
    rows = pd.read_csv(tmp_path / "bench.csv")
    assert list(rows["engine"]) == list(ENGINES)
    assert (rows["ms_per_token"] > 0).all() and (rows["bandwidth_floor_ms"] > 0).all()
    assert rows.loc[rows["engine"] == "ours-rsp", "ours_over_hf_median"].notna().all()
    from lssp.stats import predicted_speedup

    row = rows.iloc[0]
    assert row["ssp_speedup_predicted_v"] == pytest.approx(
        predicted_speedup(row["alpha"], 2, row["cost_ratio"], row["verify_ratio"]))
    assert "measured cost of a (K+1)-token verification" in out


def test_bench_with_a_compact_draft_gives_transformers_the_wrapped_model(tiny_dir):
    registry = load_registry(tiny_dir / "models.yaml")
    target, draft = load_model(registry.get("tiny-target")), load_model(registry.get("tiny-draft-compact"))
    run = run_bench(target, draft, ["hello there", "abc"], "warm", 3, SamplingParams(0), 16, seed=0)
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}


def test_random_init_pair_warns_that_acceptance_means_nothing(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "m.yaml"
    cfg.write_text((tiny_dir / "models.yaml").read_text().replace("./tiny-", str(tiny_dir) + "/tiny-"))
    code = main(["--config", str(cfg), "--results-dir", str(tmp_path), "bench", "tiny-random", "tiny-draft",
                 "--nb-prompts", "1", "--max-new-tokens", "6", "--alpha", "0.7"])
    assert code == 0
    assert "acceptance and measured speedup mean nothing" in capsys.readouterr().out


def test_four_engines_agree_on_dynamically_quantized_models(pair):
    from dataclasses import replace

    from lssp.loading import dynamic_quantize

    quantized = [LoadedModel(replace(m.spec, quantization=q), dynamic_quantize(copy.deepcopy(m.model), replace(m.spec, quantization=q)),
                             m.tokenizer) for m, q in zip(pair, ("dynamic-fp16", "dynamic-int8"))]
    run = run_bench(*quantized, ["hello there", "abc"], "warm", 3, SamplingParams(0), 16, seed=0)
    assert run.greedy_agreement == {e: 1.0 for e in ENGINES}
    assert quantized[0].weight_bytes < pair[0].weight_bytes
