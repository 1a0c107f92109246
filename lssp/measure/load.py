"""Speculative decoding under load: RSp and SSp serving the same requests at rising concurrency, and the
concurrency from which SSp no longer pays (per-user latency and throughput, separately).

At each concurrency level every mode serves the same request set, at most ``concurrency`` requests in flight,
through one engine behind ``LoadBackend`` (``lssp.measure.load_backends``: vLLM servers loaded by vLLM's own
client; our engine, continuous batching; ``lssp.measure.load_llamacpp``: llama-servers with parallel slots, loaded by
a streaming client of ours). Per request: TTFT (from the request's arrival: its scheduled time under
Poisson arrivals, so the wait for a free slot and for the iteration in flight counts; its send in a closed loop) and
TPOT, the per-user decode time per token, (last token time − first token time) ÷ (tokens − 1); per level and mode
their median, 90th and 99th percentiles, the output throughput (tokens ÷ the level's wall time), and for SSp the acceptance rate (accepted
÷ drafted) and mean acceptance length (1 + accepted ÷ verification steps), from counter deltas over the level.
"""
from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Engine, Mode, request_seed
from lssp.engines.vllm import Counters
from lssp.errors import UserError
from lssp.measure.latency import uses_chat_template
from lssp.measure.runloop import rotated
from lssp.models.loading import ModelHandle, conversation
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share
from lssp.report.results import RunInfo, markdown_table, plural
from lssp.report.stats import Interval, ratio_interval, ratio_of_medians_interval
from lssp.workloads.tasks import TaskPrompt

TPOT = ("per request: (last token time - first token time) / (tokens - 1); median, p90 and p99 over the level's "
        "requests")
TTFT = "per request: from its arrival (Poisson: its scheduled time; closed loop: its send) to its first token"
TTFT_VLLM_CLIENT = "per request: from its send by vLLM's serving client (after its max-concurrency wait) to its first token"
INTERVALS = ("latency_ratio_low-high: its 95% interval, a bootstrap over the level's requests (each request's TPOT "
             "under RSp and SSp in the same pass resampled together; the spread over requests and passes); "
             "throughput_ratio: the geometric mean of the passes' ratios, each pass's from its wall times, with a t "
             "interval over the passes (throughput_ratio_low-high; none with one pass, --repeats 1).")
NAN = float("nan")


# --- statistics (pure) -----------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of the finite values, interpolated linearly between order statistics (numpy's
    and vLLM's client's default); nan for none."""
    finite = sorted(v for v in values if v == v and not math.isinf(v))
    if not finite:
        return NAN
    position = (len(finite) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(finite) - 1)
    return finite[low] + (finite[high] - finite[low]) * (position - low)


def ratio(numerator: float, denominator: float) -> float:
    """numerator ÷ denominator, nan where either is missing or the denominator is not positive."""
    if numerator != numerator or denominator != denominator or denominator <= 0:
        return NAN
    return numerator / denominator


@dataclass(frozen=True)
class BreakEven:
    """Where SSp stops paying on one figure: ``level`` is the lowest concurrency from which on every measured ratio
    is ≤ 1 (None: SSp still pays at the highest level measured)."""

    level: int | None
    levels: tuple[int, ...]
    ratios: tuple[float, ...]
    lows: tuple[float, ...] = ()  # each ratio's 95% interval, where it has one (per-user latency)
    highs: tuple[float, ...] = ()

    @property
    def pays_everywhere(self) -> bool:
        known = [r for r in self.ratios if r == r]
        return bool(known) and all(r > 1 for r in known)

    def describe(self) -> str:
        if not any(r == r for r in self.ratios):
            return "not measured (no ratio)"
        if self.pays_everywhere:
            text = "SSp pays at every level measured"
        elif self.level is None:
            text = "none: SSp pays again at the highest level measured"
        elif self.level == self.levels[0]:
            text = f"SSp pays at no level measured (from {self.level})"
        else:
            text = f"SSp no longer pays from concurrency {self.level}"
        return text + self.clarity()

    def clarity(self) -> str:
        """Where the 95% intervals put each ratio: above 1, below 1, or spanning it ("" without intervals)."""
        sides: dict[str, list[int]] = {"above 1": [], "spanning 1": [], "below 1": []}
        for c, low, high in zip(self.levels, self.lows, self.highs):
            if low == low and high == high:
                sides["above 1" if low > 1 else "below 1" if high < 1 else "spanning 1"].append(c)
        parts = [f"{side} at c={', '.join(map(str, levels))}" for side, levels in sides.items() if levels]
        return f" (95% interval {'; '.join(parts)})" if parts else ""


def break_even(levels: Sequence[int], ratios: Sequence[float], lows: Sequence[float] = (),
               highs: Sequence[float] = ()) -> BreakEven:
    """The break-even rule: the lowest level c such that SSp's ratio to RSp (> 1: SSp pays) is ≤ 1 at c and at
    every level measured above it; levels without a ratio (nan) are skipped. ``lows``, ``highs``: the ratios' 95%
    intervals, said beside the verdict."""
    pairs = sorted((c, r) for c, r in zip(levels, ratios) if r == r)
    level = None
    for c, r in reversed(pairs):
        if r > 1:
            break
        level = c
    return BreakEven(level, tuple(levels), tuple(ratios), tuple(lows), tuple(highs))


# --- what a backend measures --------------------------------------------------------------------------------------

def poisson_arrivals(count: int, rate: float | None, seed: int) -> list[float]:
    """Seconds from the level's start at which each request may be sent: all at once (``rate`` None), or Poisson
    arrivals at ``rate`` per second (exponential gaps, seeded)."""
    if not rate:
        return [0.0] * count
    draw, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        at += draw.expovariate(rate)
        times.append(at)
    return times


@dataclass
class LoadRequest:
    """One request of the set every mode serves: prompt ids, its seed, where it came from."""

    index: int
    ids: list[int]
    seed: int
    task: str = ""
    prompt_id: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # the conversation the ids encode (a chat API is sent it)


@dataclass
class RequestTiming:
    """One served request (seconds): from its start to its first token, and from its first token to its last."""

    index: int
    tokens: int
    ttft_s: float
    first_to_last_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float:
        return self.first_to_last_s / (self.tokens - 1) if self.ok and self.tokens > 1 else NAN


@dataclass
class ModeLevel:
    """One mode at one concurrency level: its requests' timings, the level's wall time, counter deltas."""

    mode: Mode
    concurrency: int
    wall_s: float
    requests: list[RequestTiming]
    counters: Counters | None = None  # speculative-decoding counter deltas over the level (None: RSp)
    batched: bool = True  # False: an engine that served this mode one request at a time (said in the output)
    scheduling: str = "continuous"  # how requests entered the engine's batch: continuous, or static batches
    prompt_tokens_cut: int = 0  # prompt tokens an engine dropped to batch (none now: ours runs each row whole; rows written before did)
    client: dict[str, Any] = field(default_factory=dict)  # the load client's own summary, where it gives one
    repeat: int = 0  # which pass over the level (``--repeats``)


class LoadFailure(Exception):
    """A backend failed mid-run (a server died): the levels completed are kept, then this message is raised."""


class LoadBackend(ABC):
    """One engine under load: serves a request set in one mode at one concurrency. Started before anything is
    timed (servers up, models loaded), closed after."""

    name: ClassVar[str]
    times_from_send: ClassVar[bool] = False  # its client times a Poisson request from its send, not its arrival
    # Whether other processes' CPU time here is other work (the busy check): not where the servers timed are others'.
    checks_busy: ClassVar[bool] = True

    @property
    def version(self) -> str:
        return ""

    def ttft_definition(self, request_rate: float | None) -> str:
        """Where this engine's TTFT starts."""
        return TTFT_VLLM_CLIENT if self.times_from_send and request_rate else TTFT

    def notes(self) -> list[str]:
        """Lines the output prints about how this engine was loaded (asked after the warm-up and each level)."""
        return []

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The environment every row carries (``RunInfo.env``): this machine's, unless the engine runs elsewhere."""
        return env

    def check(self, mode: Mode, setup: LoadSetup) -> None:  # noqa: B027 - most engines take every mode
        """Refuse, with one line, what this engine cannot run (before anything is timed)."""

    def warm_up(self, modes: Sequence[Mode], request: LoadRequest) -> None:  # noqa: B027
        """One untimed request per mode (first-request costs stay out of the figures)."""

    @abstractmethod
    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        """Every request once in ``mode``, at most ``concurrency`` at a time; raises LoadFailure if the engine
        broke down (UserError for anything else users can fix)."""

    def close(self) -> None:  # noqa: B027
        """Stop what the backend started."""

    key = staticmethod(Engine.key)  # the server of ``mode`` where an engine runs one per mode


# --- a run ------------------------------------------------------------------------------------------------------

@dataclass
class LoadSetup:
    """What a load run was asked to do."""

    engine: str
    target: str
    draft: str | None
    modes: list[Mode]
    levels: list[int]
    params: SamplingParams
    max_new_tokens: int
    requests: int
    workload: str  # task names or the prompts file
    prompts: int  # distinct prompts behind the requests
    chat: bool = False
    ignore_eos: bool = False
    request_rate: float | None = None  # Poisson arrivals per second (None: closed loop, all sent at once)
    seed: int = 0
    batching: str = "continuous"  # ours: continuous where it can (the compact forward), or static batches
    engine_version: str = ""
    draft_method: str = ""  # vLLM's speculative method for the draft
    row_budget: str = ""  # how an automatic row budget was chosen (``lssp.measure.cost.RowBudget.describe``)
    repeats: int = 1  # passes over each level, every mode once per pass (the throughput ratio's interval)


@dataclass
class LevelSummary:
    """One mode at one concurrency level, in the figures the output shows."""

    concurrency: int
    mode: str
    k: int
    lookup: int
    label: str
    requests: int
    completed: int
    failed: int
    output_tokens: int
    wall_s: float
    tpot_median_ms: float
    tpot_p90_ms: float
    ttft_median_ms: float
    ttft_p90_ms: float
    throughput_tok_s: float
    acceptance_rate: float = NAN
    mean_acceptance_length: float = NAN
    drafts: int = 0  # verification steps that drafted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    latency_ratio: float = NAN  # RSp's median TPOT ÷ this one's (> 1: SSp faster per user)
    latency_ratio_low: float = NAN  # its 95% interval (``latency_interval``: a bootstrap over the requests)
    latency_ratio_high: float = NAN
    throughput_ratio: float = NAN  # this throughput ÷ RSp's (> 1: SSp serves more tokens per second)
    batched: bool = True
    scheduling: str = "continuous"
    prompt_tokens_cut: int = 0
    ngram: int = 0  # SSp: n-gram length of the engine's n-gram drafter, drafting alone (0: a draft model)
    tpot_p99_ms: float = NAN
    ttft_p99_ms: float = NAN
    same_as_rsp: float = NAN  # greedy: the share of requests whose output equals RSp's at the same level
    throughput_ratio_low: float = NAN  # its 95% interval over the passes (``throughput_interval``)
    throughput_ratio_high: float = NAN
    passes: int = 1


def mode_label(mode: Mode) -> str:
    """RSp, SSp k=4, ngram 3 k=4 (an engine's n-gram drafter alone), SSp k=4 +lookup 3 (the draft with the context
    lookup), SSp k=4 rows≤8 (under a row budget)."""
    if mode.mode == "rsp":
        return "RSp"
    if mode.ngram:
        return f"ngram {mode.ngram} k={mode.k}"
    if mode.draft and not mode.k:  # a server's SSp configuration by its name (``load --endpoint``)
        return f"SSp {mode.draft}"
    return f"SSp k={mode.k}" + (f" +lookup {mode.lookup}" if mode.lookup else "") + \
        (f" rows≤{mode.max_rows}" if mode.max_rows else "")


def pooled(passes: Sequence[ModeLevel], size: int) -> ModeLevel:
    """One mode at one level over its passes as one: the requests (indices offset by ``size`` a pass, so that each
    pairs with RSp's in the same pass), wall times, counters and the clients' outputs together."""
    if len(passes) == 1:
        return passes[0]
    first = passes[0]
    client = {key: {p.repeat * size + i: out for p in passes for i, out in p.client[key].items()}
              for key in ("tokens", "texts") if all(key in p.client for p in passes)}
    counters = None if any(p.counters is None for p in passes) else sum((p.counters for p in passes[1:]),
                                                                        first.counters)
    return ModeLevel(first.mode, first.concurrency, sum(p.wall_s for p in passes),
                     [replace(r, index=p.repeat * size + r.index) for p in passes for r in p.requests], counters,
                     first.batched, first.scheduling, sum(p.prompt_tokens_cut for p in passes), client)


def summarize_level(level: ModeLevel) -> LevelSummary:
    """The figures of one mode at one level (ratios filled in by ``with_ratios``)."""
    done = [r for r in level.requests if r.ok]
    tokens = sum(r.tokens for r in done)
    tpots = [1000 * r.tpot_s for r in done]
    ttfts = [1000 * r.ttft_s for r in done]
    c = level.counters
    summary = LevelSummary(
        level.concurrency, level.mode.mode, level.mode.k, level.mode.lookup, mode_label(level.mode),
        len(level.requests), len(done), len(level.requests) - len(done), tokens, level.wall_s,
        percentile(tpots, 50), percentile(tpots, 90), percentile(ttfts, 50), percentile(ttfts, 90),
        tokens / level.wall_s if level.wall_s > 0 else NAN, batched=level.batched, scheduling=level.scheduling,
        prompt_tokens_cut=level.prompt_tokens_cut, ngram=level.mode.ngram, tpot_p99_ms=percentile(tpots, 99),
        ttft_p99_ms=percentile(ttfts, 99))
    if c is not None and level.mode.mode == "ssp":
        summary.drafts, summary.draft_tokens, summary.accepted_tokens = c.drafts, c.draft_tokens, c.accepted
        summary.acceptance_rate = ratio(c.accepted, c.draft_tokens)
        summary.mean_acceptance_length = 1 + c.accepted / c.drafts if c.drafts else NAN
    return summary


def with_ratios(summaries: list[LevelSummary]) -> list[LevelSummary]:
    """SSp's ratios to the RSp of the same level: per-user latency (RSp median TPOT ÷ SSp's) and throughput. An
    SSp served one request at a time (not batched) gets no latency ratio: its TPOT is that of a request running
    alone, not under load (the wait is in its TTFT)."""
    rsp = {s.concurrency: s for s in summaries if s.mode == "rsp"}
    for s in summaries:
        base = rsp.get(s.concurrency)
        if s.mode == "ssp" and base is not None:
            if s.batched:
                s.latency_ratio = ratio(base.tpot_median_ms, s.tpot_median_ms)
            s.throughput_ratio = ratio(s.throughput_tok_s, base.throughput_tok_s)
    return summaries


def throughput_interval(rsp: Sequence[ModeLevel], ssp: Sequence[ModeLevel]) -> Interval:
    """SSp's throughput ratio at one level over its passes: the geometric mean of each pass's (SSp tokens/s ÷ RSp's
    in the same pass) with a t interval over the passes; no bounds with one pass."""
    def throughput(m: ModeLevel) -> float:
        return sum(r.tokens for r in m.requests if r.ok) / m.wall_s if m.wall_s > 0 else NAN

    theirs = {m.repeat: throughput(m) for m in rsp}
    return ratio_interval([(throughput(m), theirs[m.repeat]) for m in ssp if m.repeat in theirs])


def latency_interval(rsp: ModeLevel, ssp: ModeLevel, seed: int = 0) -> Interval:
    """SSp's per-user latency ratio at one level (RSp's median TPOT ÷ SSp's) with a 95% percentile bootstrap
    interval: the requests both modes served resampled, each request's two TPOTs together. It measures the spread
    over the requests of this run (prompts, answer lengths, their place in the batch), not from run to run."""
    theirs = {r.index: r.tpot_s for r in rsp.requests if r.ok}
    return ratio_of_medians_interval([(theirs[r.index], r.tpot_s) for r in ssp.requests
                                      if r.ok and r.index in theirs], seed=seed)


def same_outputs(rsp: ModeLevel, ssp: ModeLevel) -> float:
    """The share of the requests both served whose SSp output (tokens, or text where the client sees text) equals
    RSp's; nan where the backend kept neither."""
    for key in ("tokens", "texts"):
        theirs, mine = rsp.client.get(key), ssp.client.get(key)
        if theirs and mine:
            both = [i for i in mine if i in theirs]
            return sum(mine[i] == theirs[i] for i in both) / len(both) if both else NAN
    return NAN


def with_intervals(summaries: list[LevelSummary], levels: Sequence[ModeLevel], seed: int,
                   greedy: bool = False) -> list[LevelSummary]:
    """Each batched SSp summary's latency interval (``latency_interval``) and, ``greedy``, the share of its outputs
    equal to RSp's (``same_outputs``); ``levels`` the ModeLevels the summaries were made from, in order."""
    rsp = {m.concurrency: m for m in levels if m.mode.mode == "rsp"}
    for s, m in zip(summaries, levels, strict=True):
        if s.mode == "ssp" and m.concurrency in rsp:
            if s.batched:
                interval = latency_interval(rsp[m.concurrency], m, seed + m.concurrency)
                s.latency_ratio_low, s.latency_ratio_high = interval.low, interval.high
            if greedy:
                s.same_as_rsp = same_outputs(rsp[m.concurrency], m)
    return summaries


@dataclass
class LoadRun:
    """A load run: its setup, the levels completed, whether Ctrl-C cut it or a backend failed."""

    setup: LoadSetup
    info: RunInfo
    levels: list[list[ModeLevel]] = field(default_factory=list)  # per level done, one ModeLevel per mode
    interrupted: bool = False
    failure: str = ""
    notes: list[str] = field(default_factory=list)
    others_cpu_share: dict[int, float] = field(default_factory=dict)  # per concurrency: the CPUs' time other work took
    ttft_definition: str = TTFT  # where each request's TTFT starts (``LoadBackend.ttft_definition``)

    @property
    def busy_levels(self) -> dict[int, float]:
        """The levels during which other work took more than ``BUSY_SHARE`` of the CPUs' time."""
        return {c: share for c, share in self.others_cpu_share.items() if share > BUSY_SHARE}

    @property
    def summaries(self) -> list[LevelSummary]:
        """One per level and mode, its passes together (``pooled``)."""
        groups = [[m for m in level if m.mode == mode] for level in self.levels for mode in self.setup.modes]
        flat = [pooled(passes, self.setup.requests) for passes in groups]
        summaries = with_intervals(with_ratios([summarize_level(m) for m in flat]), flat, self.setup.seed,
                                   self.setup.params.greedy)
        rsp = {passes[0].concurrency: passes for passes in groups if passes[0].mode.mode == "rsp"}
        for s, passes in zip(summaries, groups, strict=True):
            s.passes = len(passes)
            if s.mode == "ssp" and s.concurrency in rsp and len(passes) > 1:
                interval = throughput_interval(rsp[s.concurrency], passes)
                s.throughput_ratio, s.throughput_ratio_low, s.throughput_ratio_high = \
                    interval.estimate, interval.low, interval.high
        return summaries

    @property
    def levels_done(self) -> list[int]:
        return [level[0].concurrency for level in self.levels if level]

    def break_evens(self) -> list[tuple[str, BreakEven, BreakEven]]:
        """(SSp mode label, per-user latency break-even, throughput break-even) for each SSp mode."""
        out = []
        summaries = self.summaries
        for label in dict.fromkeys(s.label for s in summaries if s.mode == "ssp"):
            rows = [s for s in summaries if s.label == label]
            levels = [s.concurrency for s in rows]
            out.append((label, break_even(levels, [s.latency_ratio for s in rows], [s.latency_ratio_low for s in rows],
                                          [s.latency_ratio_high for s in rows]),
                        break_even(levels, [s.throughput_ratio for s in rows], [s.throughput_ratio_low for s in rows],
                                   [s.throughput_ratio_high for s in rows])))
        return out

    def rows(self, summaries: list[LevelSummary] | None = None) -> list[dict[str, Any]]:
        """One CSV row per level and mode (``summaries``: some of them; default all)."""
        setup, info = self.setup, self.info
        return [{
            **info.head(), "engine": setup.engine, "concurrency": s.concurrency, "mode": s.mode,
            "method": "none" if s.mode == "rsp" else "ngram" if s.ngram else setup.draft_method or "draft",
            "target": setup.target, "draft": (setup.draft or "") if s.mode == "ssp" and not s.ngram else "", "k": s.k,
            "lookup": s.lookup, "ngram": s.ngram, **setup.params.as_dict(), "max_new_tokens": setup.max_new_tokens,
            "ignore_eos": setup.ignore_eos, "task": setup.workload, "chat": setup.chat,
            "request_rate": setup.request_rate if setup.request_rate else "inf", "seed": setup.seed,
            **{key: value for key, value in asdict(s).items() if key not in ("concurrency", "mode", "k", "lookup", "ngram")},
            "interrupted": self.interrupted, "engine_version": setup.engine_version, "tpot_definition": TPOT,
            "ttft_definition": self.ttft_definition, "row_budget": setup.row_budget,
            "others_cpu_share": round(self.others_cpu_share.get(s.concurrency, float("nan")), 3),
            "noisy": s.concurrency in self.busy_levels,
            **info.env,
        } for s in (summaries if summaries is not None else self.summaries)]

    def level_rows(self, index: int) -> list[dict[str, Any]]:
        """The rows of the ``index``-th level done (what is appended after each level)."""
        concurrency = self.levels_done[index]
        return self.rows([s for s in self.summaries if s.concurrency == concurrency])

    def summary_json(self) -> dict[str, Any]:
        return {"run_id": self.info.run_id, "engine": self.setup.engine, "target": self.setup.target,
                "draft": self.setup.draft, "levels": self.levels_done, "interrupted": self.interrupted,
                "failure": self.failure or None, "notes": self.notes,
                "break_even": [{"mode": label, "latency": lat.level, "latency_text": lat.describe(),
                                "throughput": thr.level, "throughput_text": thr.describe()}
                               for label, lat, thr in self.break_evens()],
                "rows": self.rows()}

    def markdown(self) -> str:
        setup = self.setup
        columns = ["concurrency", "label", "completed", "tpot_median_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_median_ms",
                   "ttft_p90_ms", "ttft_p99_ms", "throughput_tok_s", "acceptance_rate", "mean_acceptance_length", "latency_ratio",
                   "latency_ratio_low", "latency_ratio_high", "throughput_ratio", "throughput_ratio_low",
                   "throughput_ratio_high", "same_as_rsp", "batched"]
        lines = [f"- {label}: per-user latency break-even: {lat.describe()}; throughput break-even: {thr.describe()}"
                 for label, lat, thr in self.break_evens()]
        return (f"# load run {self.info.run_id}\n\n{setup.engine} {setup.engine_version}: target `{setup.target}`, "
                f"draft `{setup.draft or '-'}`, {plural(setup.requests, 'request')} ({setup.workload}) per level "
                f"and mode{f' × {setup.repeats} passes' if setup.repeats > 1 else ''}, ≤{setup.max_new_tokens} new tokens, {setup.params}, "
                f"{'Poisson arrivals at ' + format(setup.request_rate, 'g') + '/s' if setup.request_rate else 'closed loop'}"
                f"\n\n{self.info.describe()}\n\n{markdown_table(self.rows(), columns)}\n" + "\n".join(lines)
                + "\n\n" + " ".join(self.notes + ([f"SSp under a {setup.row_budget}."] if setup.row_budget else []))
                + "".join(f"\n\nBusy at concurrency {c}: other work took {share:.0%} of "
                                                      "the CPUs' time; its figures are unreliable."
                                                      for c, share in self.busy_levels.items())
                + ("\n\nInterrupted: the levels shown completed." if self.interrupted
                                                  else "") + (f"\n\nFailed: {self.failure}" if self.failure else "")
                + f"\n\nTPOT: {TPOT}. TTFT: {self.ttft_definition}. Ratios: latency = RSp median TPOT ÷ SSp's; throughput = SSp tokens/s ÷ RSp's; "
                f"> 1: SSp pays. {INTERVALS} Break-even: the lowest concurrency from which on every ratio measured is ≤ 1.\n")


# --- building the request set and running the levels ----------------------------------------------------------

def build_requests(target: ModelHandle, prompts: Sequence[TaskPrompt], count: int, seed: int,
                   chat: bool = False) -> list[LoadRequest]:
    """``count`` requests: the prompts' first turns in turn (cycling where there are fewer prompts), in the target's
    chat template where ``chat`` or the prompt asks for it, each with its seed (``request_seed``)."""
    if not prompts:
        raise UserError("no prompts to build requests from")
    encoded = [target.encode_turns(p.turns[:1], (), uses_chat_template(target, p, chat))[0].tolist() for p in prompts]
    return [LoadRequest(i, encoded[i % len(prompts)], request_seed(seed, i), prompts[i % len(prompts)].task,
                        prompts[i % len(prompts)].id, conversation(prompts[i % len(prompts)].turns[:1]))
            for i in range(count)]


LevelDone = Callable[["LoadRun"], None]
Progress = Callable[[str, int, int], None]


def run_load(backend: LoadBackend, setup: LoadSetup, info: RunInfo, requests: Sequence[LoadRequest],
             on_level: LevelDone | None = None, progress: Progress | None = None) -> LoadRun:
    """Every mode at every level on the same requests, ``setup.repeats`` passes a level, the modes' order rotating
    from one pass to the next; ``on_level`` after each level (saving it). Ctrl-C after a level keeps the levels
    done (``interrupted``); a backend failure ends the run with the levels done and ``failure`` set."""
    for mode in setup.modes:
        backend.check(mode, setup)
    run = LoadRun(setup, info, ttft_definition=backend.ttft_definition(setup.request_rate))
    passes = range(setup.repeats)
    total, done = len(setup.levels) * len(setup.modes) * setup.repeats + 1, 0
    if progress:
        progress("warm-up", done, total)
    backend.warm_up(setup.modes, requests[0])
    run.notes = backend.notes()
    done += 1
    try:
        for index, concurrency in enumerate(setup.levels):
            served: dict[tuple[int, Mode], ModeLevel] = {}
            before = cpu_snapshot()
            for repeat in passes:
                for mode in rotated(setup.modes, index * setup.repeats + repeat):
                    start = time.perf_counter()
                    served[repeat, mode] = replace(backend.serve(mode, requests, concurrency), repeat=repeat)
                    done += 1
                    if progress:
                        progress(f"concurrency {concurrency}" + (f" pass {repeat + 1}" if setup.repeats > 1 else "")
                                 + f" {mode_label(mode)} ({time.perf_counter() - start:.0f} s)", done, total)
            run.levels.append([served[r, m] for r in passes for m in setup.modes])
            run.notes = backend.notes()  # with what the level taught (a server that gave no token counts)
            if backend.checks_busy:
                run.others_cpu_share[concurrency] = others_share(before, cpu_snapshot())
            if on_level:
                on_level(run)
    except KeyboardInterrupt:
        if not run.levels:
            raise
        run.interrupted = True
    except LoadFailure as exc:
        run.failure = str(exc)
    return run
