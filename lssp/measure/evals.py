"""The reference's multiplication benchmark: "a * b = " after a three-line few-shot prefix."""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lssp.decoding.generation import GenerationOutput, Stopping
from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import SamplingParams
from lssp.engines import Engine, Mode, Request, engine_class, request_seed
from lssp.errors import UserError
from lssp.models.loading import LoadedModel
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share
from lssp.report.results import RunInfo, markdown_table
from lssp.report.stats import Z80, Z95, Interval, mcnemar, paired_difference, paired_score_difference, wald, wilson
from lssp.workloads.arithmetic import (
    HIGH,
    LOW,
    OPERATIONS,
    answer_for,
    few_shot,
    multiplication_problems,
    parse_answer,
    prompt_for,
)

CHUNK = 64  # problems per turn of each mode


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
    seconds: float | None = None  # the completion's wall time, prefill included


@dataclass
class EvalSummary:
    mode: str
    trials: int
    successes: int
    success_rate: float
    wald: Interval
    wilson: Interval
    seconds_per_problem: float = float("nan")  # mean over the problems timed in this run (not resumed ones)


@dataclass
class EvalComparison:
    """RSp − SSp on the same prompts."""

    difference: Interval  # Wald's paired interval (zero width with no discordant pair)
    mcnemar_p: float
    only_rsp: int
    only_ssp: int
    score_difference: Interval  # Tango's score interval: what the verdict reads (it keeps a width)
    pairs: int

    @property
    def detectable(self) -> float:
        """The difference McNemar's test at 5% would find with 80% power at the observed share of discordant pairs
        (nan with none): (z₀.₉₇₅ + z₀.₈)·sqrt(share / n)."""
        share = (self.only_rsp + self.only_ssp) / self.pairs if self.pairs else 0.0
        return (Z95 + Z80) * math.sqrt(share / self.pairs) if share else float("nan")


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
    op: str = "mul"
    max_operand: int = HIGH
    prefix_cache: bool = True
    rsp_batch: int = 1  # RSp problems of equal prompt length run in batches of up to this many
    engine: str = "ours"  # or vllm: every problem through vLLM, one request at a time
    ssp_batch: int = 1  # SSp problems run in batches of up to this many (batched SSp: any prompt lengths)


@dataclass
class EvalRun:
    run_id: str
    records_path: Path
    summaries: list[EvalSummary]
    comparison: EvalComparison | None
    resumed: int  # records found on disk and not redone
    setup: EvalSetup | None = None
    info: RunInfo = field(default_factory=RunInfo)
    others_cpu_share: float = float("nan")  # share of the CPUs' time other work took while this run scored

    def _drafted(self, mode: str) -> dict[str, int]:
        """The lookup and n-gram columns of ``mode``'s rows (``Engine.ssp_mode``: what the n-gram length meant)."""
        setup = self.setup
        ssp = engine_class(setup.engine).ssp_mode(setup.engine, setup.k, setup.lookup)
        return {"lookup": ssp.lookup, "ngram": ssp.ngram} if mode == "ssp" else {"lookup": 0, "ngram": 0}

    def rows(self) -> list[dict[str, Any]]:
        """One CSV row per mode."""
        setup, cmp, nan = self.setup, self.comparison, float("nan")
        return [{
            **self.info.head(), "run_id": self.run_id, "engine": setup.engine, "mode": m.mode, "target": setup.target,
            "draft": setup.draft if setup.draft and m.mode == "ssp" else "", "k": setup.k if m.mode == "ssp" else 0,
            **self._drafted(m.mode), **setup.params.as_dict(),
            "max_new_tokens": setup.max_new_tokens, "seed": setup.seed, "trials": m.trials, "successes": m.successes,
            "success_rate": m.success_rate, "wald_low": m.wald.low, "wald_high": m.wald.high,
            "wilson_low": m.wilson.low, "wilson_high": m.wilson.high,
            "diff_rsp_minus_ssp": cmp.difference.estimate if cmp else nan,
            "diff_low": cmp.difference.low if cmp else nan, "diff_high": cmp.difference.high if cmp else nan,
            "diff_score_low": cmp.score_difference.low if cmp else nan,
            "diff_score_high": cmp.score_difference.high if cmp else nan,
            "detectable_diff": cmp.detectable if cmp else nan,
            "mcnemar_p": cmp.mcnemar_p if cmp else nan, "op": setup.op, "max_operand": setup.max_operand,
            "s_per_problem": m.seconds_per_problem, "s_per_problem_basis": self.timing_basis(m.mode),
            "others_cpu_share": round(self.others_cpu_share, 3), "noisy": self.others_cpu_share > BUSY_SHARE,
            "prefix_cache": setup.prefix_cache, "records": str(self.records_path),
            "target_precision": setup.target_precision, "draft_precision": setup.draft_precision, **self.info.env,
        } for m in self.summaries]

    def timing_basis(self, mode: str) -> str:
        """How a mode's seconds per problem were measured: per problem, or a batch's time shared by its rows."""
        size = self.setup.rsp_batch if mode == "rsp" else self.setup.ssp_batch
        if size > 1:
            return f"amortised over batches of up to {size}"
        return "per problem"

    def summary_json(self) -> list[dict[str, Any]]:
        keys = ("engine", "mode", "target", "draft", "op", "max_operand", "trials", "successes", "success_rate", "wald_low",
                "wald_high", "wilson_low", "wilson_high", "diff_rsp_minus_ssp", "diff_low", "diff_high", "diff_score_low",
                "diff_score_high", "detectable_diff", "mcnemar_p", "s_per_problem", "s_per_problem_basis", "run_id")
        return [{key: row[key] for key in keys} for row in self.rows()]

    def markdown(self) -> str:
        setup = self.setup
        symbol = OPERATIONS[setup.op][0]
        return (f"# eval run {self.run_id}\n\ntarget `{setup.target}`, draft `{setup.draft or '-'}`, "
                f"{setup.nb_prompts} problems `a {symbol} b = ` with a, b in {LOW}..{setup.max_operand}, {setup.params}, "
                f"{self.info.describe()}\n\n" +
                markdown_table(self.rows(), ["mode", "trials", "successes", "success_rate", "wald_low", "wald_high",
                                             "wilson_low", "wilson_high", "diff_low", "diff_high", "diff_score_low",
                                             "diff_score_high", "mcnemar_p", "s_per_problem"]))


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during an eval: the records so far are on disk, and ``--resume`` continues them."""

    def __init__(self, records_path: Path, records: int) -> None:
        super().__init__(str(records_path))
        self.records_path = records_path
        self.records = records


def summarize(mode: str, records: Sequence[EvalRecord]) -> EvalSummary:
    n, s = len(records), sum(r.correct for r in records)
    timed = [r.seconds for r in records if r.seconds is not None]
    return EvalSummary(mode, n, s, s / n, wald(s, n), wilson(s, n), sum(timed) / len(timed) if timed else float("nan"))


def compare(rsp: Sequence[EvalRecord], ssp: Sequence[EvalRecord]) -> EvalComparison:
    by_index = {r.index: r for r in ssp}
    pairs = [(r, by_index[r.index]) for r in rsp if r.index in by_index]
    only_rsp = sum(a.correct and not b.correct for a, b in pairs)
    only_ssp = sum(b.correct and not a.correct for a, b in pairs)
    return EvalComparison(paired_difference(only_rsp, only_ssp, len(pairs)), mcnemar(only_rsp, only_ssp), only_rsp,
                          only_ssp, paired_score_difference(only_rsp, only_ssp, len(pairs)), len(pairs))


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def find_resumable(records_dir: Path, config: dict) -> Path | None:
    """The newest records file written with exactly this configuration."""
    key = config_key(config)
    candidates = sorted(records_dir.glob(f"eval-*-{key}.jsonl"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def eval_config(target: str, draft: str | None, modes: Sequence[str], nb_prompts: int, seed: int, k: int,
                max_new_tokens: int, params: SamplingParams, lookup: int = 0, op: str = "mul",
                max_operand: int = HIGH, engine: str = "ours") -> dict:
    """What a resumed run must match exactly (its hash names the records file). Settings at their defaults
    stay out, so that runs recorded before a setting existed still resume."""
    return {"target": target, "draft": draft, "modes": list(modes), "nb_prompts": nb_prompts, "seed": seed, "k": k,
            "max_new_tokens": max_new_tokens, **params.as_dict(), **({"lookup": lookup} if lookup else {}),
            **({"op": op} if op != "mul" else {}), **({"max_operand": max_operand} if max_operand != HIGH else {}),
            **({"engine": engine} if not engine_class(engine).reference else {})}


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


def _record(target: LoadedModel, mode: str, index: int, a: int, b: int, setup: EvalSetup,
            out: GenerationOutput) -> EvalRecord:
    completion = target.decode(out.tokens.tolist())
    expected = answer_for(a, b, setup.op)
    rate = out.stats.acceptance_rate if mode == "ssp" else None
    return EvalRecord(mode, index, a, b, prompt_for(a, b, setup.op), expected, completion,
                      parse_answer(completion) == expected, len(out.tokens), None if rate != rate else rate,
                      round(out.stats.total_time_s, 6))


def _request(target: LoadedModel, a: int, b: int, index: int, setup: EvalSetup, stopping: Stopping,
             prefix: PrefixCache | None) -> Request:
    """Problem ``index``'s request: the same seed in every mode, so the samples are paired."""
    return Request(target.encode(prompt_for(a, b, setup.op)), setup.max_new_tokens, setup.params,
                   request_seed(setup.seed, index), stopping, prefix=prefix)


def _score(target: LoadedModel, engine: Engine, mode: str, a: int, b: int, index: int, setup: EvalSetup,
           stopping: Stopping, prefix: PrefixCache | None) -> EvalRecord:
    """One problem in one mode."""
    return _record(target, mode, index, a, b, setup, engine.complete(_mode(engine, mode, setup),
                                                                     _request(target, a, b, index, setup, stopping,
                                                                              prefix)))


def _mode(engine: Engine, mode: str, setup: EvalSetup) -> Mode:
    return engine.ssp_mode(engine.name, setup.k, setup.lookup) if mode == "ssp" else Mode("rsp", engine=engine.name)


def _score_batches(target: LoadedModel, engine: Engine, mode: str, problems: Sequence[tuple[int, int, int]],
                   setup: EvalSetup, stopping: Stopping, prefix: PrefixCache | None) -> list[EvalRecord]:
    """(index, a, b) problems in batches (``Engine.complete_many``), the same tokens as one at a time in a fraction
    of the forwards: RSp those whose prompts have the same token count, up to ``setup.rsp_batch`` at a time, sharing
    positions; SSp any, up to ``setup.ssp_batch``."""
    groups: dict[int, list[tuple[int, int, int, Request]]] = {}
    for index, a, b in problems:
        request = _request(target, a, b, index, setup, stopping, prefix)
        groups.setdefault(request.ids.shape[1] if mode == "rsp" else 0, []).append((index, a, b, request))
    size = setup.rsp_batch if mode == "rsp" else setup.ssp_batch
    how = _mode(engine, mode, setup)
    records = []
    for group in groups.values():
        for start in range(0, len(group), size):
            batch = group[start:start + size]
            ids, seeds = [r.ids for *_, r in batch], [r.seed for *_, r in batch]
            outs = engine.complete_many(how, torch.cat(ids) if mode == "rsp" else ids, batch[0][3], seeds)
            records += [_record(target, mode, index, a, b, setup, out) for (index, a, b, _), out in zip(batch, outs)]
    return sorted(records, key=lambda r: r.index)


def answer_stopping(target: LoadedModel) -> Stopping:
    """An answer ends at its first newline, or at the end token."""
    tokenizer = target.tokenizer
    newline_ids = {i for t, i in tokenizer.get_vocab().items() if "\n" in tokenizer.convert_tokens_to_string([t])} \
        if tokenizer is not None else set()
    return Stopping(token_ids=newline_ids | target.eos_ids)


def run_eval(
    target: LoadedModel, draft: LoadedModel | None, engine: Engine, modes: Sequence[str], nb_prompts: int, seed: int,
    params: SamplingParams, max_new_tokens: int, k: int, records_dir: Path, resume: bool = False,
    on_record: Callable[[EvalRecord], None] | None = None, lookup: int = 0, op: str = "mul", max_operand: int = HIGH,
    prefix_cache: bool = True, rsp_batch: int = 1, ssp_batch: int = 1,
) -> EvalRun:
    """Score each mode on the same ``nb_prompts`` problems ``a OP b = `` (operands in LOW..``max_operand``),
    streaming records to JSONL as they come. With ``prefix_cache``, each model computes the few-shot prefix's
    keys and values once and every problem starts from them. ``rsp_batch`` > 1 runs RSp problems whose prompts
    have the same token count in batches (``generate_regular_batch``), ``ssp_batch`` > 1 SSp problems
    (``speculative_decode_batch``). Modes take turns every CHUNK problems. Every problem runs through ``engine``, one
    request at a time (ours: the prefix cache and the batches)."""
    if nb_prompts < 1:
        raise UserError("--nb-prompts must be at least 1")
    if max_operand < LOW:
        raise UserError(f"--max-operand must be at least {LOW}, got {max_operand}")
    if "ssp" in modes and draft is None and not engine.names_modes:  # servers already running draft as they do
        raise UserError("SSp evaluation needs a draft model")
    config = eval_config(target.name, draft.name if draft else None, modes, nb_prompts, seed, k, max_new_tokens,
                         params, lookup, op, max_operand, engine.name)
    info = RunInfo.for_models(target, draft)
    info.env = engine.environment(info.env)
    run_id = info.run_id
    records_dir.mkdir(parents=True, exist_ok=True)
    path, done = resume_point(records_dir, config) if resume else (None, [])
    if path is None:
        path = records_dir / f"eval-{run_id}-{config_key(config)}.jsonl"
        path.write_text(json.dumps({"config": config, "run_id": run_id}) + "\n")
    else:
        run_id = info.run_id = json.loads(path.open().readline()).get("run_id", run_id)
    finished = {(r.mode, r.index) for r in done}
    stopping = answer_stopping(target)
    prefix = PrefixCache(target.encode(few_shot(op))[0].tolist()) if prefix_cache and engine.caches_prefixes else None
    problems = multiplication_problems(nb_prompts, seed, max_operand)
    ssp = engine.ssp_mode(engine.name, k, lookup)
    batched = {m: m in modes and engine.batch_reason(ssp if m == "ssp" else Mode(m)) is None for m in ("rsp", "ssp")}
    records = list(done)
    setup = EvalSetup(target.name, draft.name if draft else None, target.precision, draft.precision if draft else "",
                      params, nb_prompts, seed, k, max_new_tokens, lookup, op, max_operand, prefix is not None,
                      rsp_batch if batched["rsp"] else 1, engine.name, ssp_batch if batched["ssp"] else 1)
    started = cpu_snapshot()
    with path.open("a") as sink:
        try:
            for chunk in range(0, nb_prompts, CHUNK):  # modes interleaved chunk by chunk
                for mode in modes:
                    todo = [(index, a, b) for index, (a, b) in enumerate(problems[chunk:chunk + CHUNK], chunk)
                            if (mode, index) not in finished]
                    if (setup.rsp_batch if mode == "rsp" else setup.ssp_batch) > 1:
                        scored = iter(_score_batches(target, engine, mode, todo, setup, stopping, prefix))
                    else:
                        scored = (_score(target, engine, mode, a, b, index, setup, stopping, prefix)
                                  for index, a, b in todo)
                    for record in scored:
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
    busy = others_share(started, cpu_snapshot()) if engine.checks_busy else float("nan")
    return EvalRun(run_id, path, summaries, comparison, len(done), setup, info, busy)
