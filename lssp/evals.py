"""The reference's multiplication benchmark: "a * b = " after a three-line few-shot prefix."""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lssp.errors import UserError
from lssp.generation import Stopping, generate_regular, generate_speculative
from lssp.loading import LoadedModel
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
class EvalRun:
    run_id: str
    records_path: Path
    summaries: list[EvalSummary]
    comparison: EvalComparison | None
    resumed: int  # records found on disk and not redone


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


def run_eval(
    target: LoadedModel, draft: LoadedModel | None, modes: Sequence[str], nb_prompts: int, seed: int,
    params: SamplingParams, max_new_tokens: int, k: int, records_dir: Path, run_id: str, config: dict,
    resume: bool = False, vocab_size: int | None = None, on_record: Callable[[EvalRecord], None] | None = None,
    lookup: int = 0,
) -> EvalRun:
    """Score each mode on the same ``nb_prompts`` problems, streaming records to JSONL as they come."""
    if nb_prompts < 1:
        raise UserError("--nb-prompts must be at least 1")
    if "ssp" in modes and draft is None:
        raise UserError("SSp evaluation needs a draft model")
    records_dir.mkdir(parents=True, exist_ok=True)
    path = find_resumable(records_dir, config) if resume else None
    done: list[EvalRecord] = read_records(path) if path else []
    if path is None:
        path = records_dir / f"eval-{run_id}-{config_key(config)}.jsonl"
        path.write_text(json.dumps({"config": config, "run_id": run_id}) + "\n")
    else:
        run_id = json.loads(path.open().readline()).get("run_id", run_id)
    finished = {(r.mode, r.index) for r in done}
    newline_ids = {i for t, i in target.tokenizer.get_vocab().items() if "\n" in target.tokenizer.convert_tokens_to_string([t])} \
        if target.tokenizer is not None else set()
    stopping = Stopping(token_ids=newline_ids)
    problems = multiplication_problems(nb_prompts, seed)
    records = list(done)
    with path.open("a") as sink:
        for index, (a, b) in enumerate(problems):
            for mode in modes:
                if (mode, index) in finished:
                    continue
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
                record = EvalRecord(mode, index, a, b, prompt, a * b, completion, parse_answer(completion) == a * b,
                                    len(out.tokens), None if rate != rate else rate)
                sink.write(json.dumps(asdict(record)) + "\n")
                sink.flush()
                records.append(record)
                if on_record:
                    on_record(record)
    by_mode = {m: sorted((r for r in records if r.mode == m), key=lambda r: r.index) for m in modes}
    summaries = [summarize(m, by_mode[m]) for m in modes]
    comparison = compare(by_mode["rsp"], by_mode["ssp"]) if {"rsp", "ssp"} <= set(modes) else None
    return EvalRun(run_id, path, summaries, comparison, len(done))
