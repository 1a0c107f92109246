"""The reference's multiplication benchmark: "a * b = " after a three-line few-shot prefix."""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lssp.errors import UserError
from lssp.generation import Stopping, generate_regular, generate_speculative
from lssp.loading import LoadedModel
from lssp.report import RunInfo, markdown_table
from lssp.sampling import SamplingParams
from lssp.stats import Interval, difference, mcnemar, wald, wilson

FEW_SHOT = "8 * 12 = 96\n25 * 4 = 100\n37 * 85 = 3145\n"
LOW, HIGH = 1, 99  # both inclusive (the reference drew 1..98 while its README said 1..99)


def multiplication_problems(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)) for _ in range(n)]


def prompt_for(a: int, b: int) -> str:
    return f"{FEW_SHOT}{a} * {b} = "


def parse_answer(completion: str) -> int | None:
    """The first line of the completion as an integer, or None."""
    first = completion.split("\n", 1)[0].strip().replace(",", "")
    try:
        return int(first)
    except ValueError:
        return None


@dataclass
class EvalRecord:
    mode: str
    index: int
    a: int
    b: int
    prompt: str
    expected: int
    completion: str
    correct: bool
    new_tokens: int
    acceptance_rate: float | None = None


@dataclass
class EvalSummary:
    mode: str
    trials: int
    successes: int
    success_rate: float
    wald: Interval
    wilson: Interval


@dataclass
class EvalComparison:
    """RSp − SSp on the same prompts."""

    difference: Interval
    mcnemar_p: float
    only_rsp: int
    only_ssp: int


@dataclass
class EvalSetup:
    """What an eval run was asked to do (recorded in every row)."""

    target: str
    draft: str | None
    target_precision: str
    draft_precision: str
    params: SamplingParams
    nb_prompts: int
    seed: int
    k: int
    max_new_tokens: int
    lookup: int = 0


@dataclass
class EvalRun:
    run_id: str
    records_path: Path
    summaries: list[EvalSummary]
    comparison: EvalComparison | None
    resumed: int  # records found on disk and not redone
    setup: EvalSetup | None = None
    info: RunInfo = field(default_factory=RunInfo)

    def rows(self) -> list[dict[str, Any]]:
        """One CSV row per mode."""
        setup, cmp, nan = self.setup, self.comparison, float("nan")
        return [{
            **self.info.head(), "run_id": self.run_id, "mode": m.mode, "target": setup.target,
            "draft": setup.draft if setup.draft and m.mode == "ssp" else "", "k": setup.k if m.mode == "ssp" else 0,
            "lookup": setup.lookup if m.mode == "ssp" else 0, **setup.params.as_dict(),
            "max_new_tokens": setup.max_new_tokens, "seed": setup.seed, "trials": m.trials, "successes": m.successes,
            "success_rate": m.success_rate, "wald_low": m.wald.low, "wald_high": m.wald.high,
            "wilson_low": m.wilson.low, "wilson_high": m.wilson.high,
            "diff_rsp_minus_ssp": cmp.difference.estimate if cmp else nan,
            "diff_low": cmp.difference.low if cmp else nan, "diff_high": cmp.difference.high if cmp else nan,
            "mcnemar_p": cmp.mcnemar_p if cmp else nan, "records": str(self.records_path),
            "target_precision": setup.target_precision, "draft_precision": setup.draft_precision, **self.info.env,
        } for m in self.summaries]

    def summary_json(self) -> list[dict[str, Any]]:
        keys = ("mode", "target", "draft", "trials", "successes", "success_rate", "wald_low", "wald_high", "wilson_low",
                "wilson_high", "diff_rsp_minus_ssp", "diff_low", "diff_high", "mcnemar_p", "run_id")
        return [{key: row[key] for key in keys} for row in self.rows()]

    def markdown(self) -> str:
        setup = self.setup
        return (f"# eval run {self.run_id}\n\ntarget `{setup.target}`, draft `{setup.draft or '-'}`, "
                f"{setup.nb_prompts} problems, {setup.params}, {self.info.describe()}\n\n" +
                markdown_table(self.rows(), ["mode", "trials", "successes", "success_rate", "wald_low", "wald_high",
                                             "wilson_low", "wilson_high", "diff_low", "diff_high", "mcnemar_p"]))


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during an eval: the records so far are on disk, and ``--resume`` continues them."""

    def __init__(self, records_path: Path, records: int) -> None:
        super().__init__(str(records_path))
        self.records_path = records_path
        self.records = records


def summarize(mode: str, records: Sequence[EvalRecord]) -> EvalSummary:
    n, s = len(records), sum(r.correct for r in records)
    return EvalSummary(mode, n, s, s / n, wald(s, n), wilson(s, n))


def compare(rsp: Sequence[EvalRecord], ssp: Sequence[EvalRecord]) -> EvalComparison:
    by_index = {r.index: r for r in ssp}
    pairs = [(r, by_index[r.index]) for r in rsp if r.index in by_index]
    only_rsp = sum(a.correct and not b.correct for a, b in pairs)
    only_ssp = sum(b.correct and not a.correct for a, b in pairs)
    s1, s2 = sum(r.correct for r in rsp), sum(r.correct for r in ssp)
    return EvalComparison(difference(s1, len(rsp), s2, len(ssp)), mcnemar(only_rsp, only_ssp), only_rsp, only_ssp)


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def find_resumable(records_dir: Path, config: dict) -> Path | None:
    """The newest records file written with exactly this configuration."""
    key = config_key(config)
    candidates = sorted(records_dir.glob(f"eval-*-{key}.jsonl"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def eval_config(target: str, draft: str | None, modes: Sequence[str], nb_prompts: int, seed: int, k: int,
                max_new_tokens: int, params: SamplingParams, lookup: int = 0) -> dict:
    """What a resumed run must match exactly (its hash names the records file)."""
    return {"target": target, "draft": draft, "modes": list(modes), "nb_prompts": nb_prompts, "seed": seed, "k": k,
            "max_new_tokens": max_new_tokens, **params.as_dict(), **({"lookup": lookup} if lookup else {})}


def resume_point(records_dir: Path, config: dict) -> tuple[Path, list[EvalRecord]]:
    """The interrupted run to continue and its records; a UserError when there is none (no run with these
    settings, or the newest one completed), so that a completed run is never counted twice."""
    path = find_resumable(records_dir, config) if records_dir.is_dir() else None
    if path is None:
        raise UserError(f"nothing to resume: no eval run with these settings in {records_dir}")
    done = read_records(path)
    if len({(r.mode, r.index) for r in done}) >= config["nb_prompts"] * len(config["modes"]):
        raise UserError(f"nothing to resume: the newest eval run with these settings ({path.name}) completed")
    return path, done


def read_records(path: Path) -> list[EvalRecord]:
    records = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
            if "config" not in row:
                records.append(EvalRecord(**row))
    return records


def _score(target: LoadedModel, draft: LoadedModel | None, mode: str, a: int, b: int, index: int, seed: int,
           params: SamplingParams, max_new_tokens: int, k: int, stopping: Stopping, vocab_size: int | None,
           lookup: int) -> EvalRecord:
    """One problem in one mode."""
    prompt = prompt_for(a, b)
    ids = target.encode(prompt)
    # Same seed per problem for every mode: the samples are paired.
    generator = torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + index)
    if mode == "rsp":
        out = generate_regular(target.model, ids, max_new_tokens, params, generator, stopping)
    else:
        out = generate_speculative(target.model, draft.model, ids, max_new_tokens, k, params, generator,
                                   stopping, vocab_size=vocab_size, lookup=lookup)
    completion = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
    rate = out.stats.acceptance_rate if mode == "ssp" else None
    return EvalRecord(mode, index, a, b, prompt, a * b, completion, parse_answer(completion) == a * b,
                      len(out.tokens), None if rate != rate else rate)


def run_eval(
    target: LoadedModel, draft: LoadedModel | None, modes: Sequence[str], nb_prompts: int, seed: int,
    params: SamplingParams, max_new_tokens: int, k: int, records_dir: Path, resume: bool = False, vocab_size: int | None = None, on_record: Callable[[EvalRecord], None] | None = None,
    lookup: int = 0,
) -> EvalRun:
    """Score each mode on the same ``nb_prompts`` problems, streaming records to JSONL as they come."""
    if nb_prompts < 1:
        raise UserError("--nb-prompts must be at least 1")
    if "ssp" in modes and draft is None:
        raise UserError("SSp evaluation needs a draft model")
    config = eval_config(target.name, draft.name if draft else None, modes, nb_prompts, seed, k, max_new_tokens,
                         params, lookup)
    info = RunInfo.for_models(target, draft)
    run_id = info.run_id
    records_dir.mkdir(parents=True, exist_ok=True)
    path, done = resume_point(records_dir, config) if resume else (None, [])
    if path is None:
        path = records_dir / f"eval-{run_id}-{config_key(config)}.jsonl"
        path.write_text(json.dumps({"config": config, "run_id": run_id}) + "\n")
    else:
        run_id = info.run_id = json.loads(path.open().readline()).get("run_id", run_id)
    finished = {(r.mode, r.index) for r in done}
    newline_ids = {i for t, i in target.tokenizer.get_vocab().items() if "\n" in target.tokenizer.convert_tokens_to_string([t])} \
        if target.tokenizer is not None else set()
    stopping = Stopping(token_ids=newline_ids)
    problems = multiplication_problems(nb_prompts, seed)
    records = list(done)
    setup = EvalSetup(target.name, draft.name if draft else None, target.precision, draft.precision if draft else "",
                      params, nb_prompts, seed, k, max_new_tokens, lookup)
    with path.open("a") as sink:
        try:
            for index, (a, b) in enumerate(problems):
                for mode in modes:
                    if (mode, index) in finished:
                        continue
                    record = _score(target, draft, mode, a, b, index, seed, params, max_new_tokens, k, stopping,
                                    vocab_size, lookup)
                    sink.write(json.dumps(asdict(record)) + "\n")
                    sink.flush()
                    records.append(record)
                    if on_record:
                        on_record(record)
        except KeyboardInterrupt:
            raise EvalInterrupted(path, len(records)) from None
    by_mode = {m: sorted((r for r in records if r.mode == m), key=lambda r: r.index) for m in modes}
    summaries = [summarize(m, by_mode[m]) for m in modes]
    comparison = compare(by_mode["rsp"], by_mode["ssp"]) if {"rsp", "ssp"} <= set(modes) else None
    return EvalRun(run_id, path, summaries, comparison, len(done), setup, info)
