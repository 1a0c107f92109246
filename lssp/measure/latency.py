"""Latency of RSp and SSp on a prompt list, measured side by side in one run."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from statistics import median, stdev
from typing import Any

import numpy as np
import torch

from lssp.decoding.generation import FIRST_TO_LAST, GenerationOutput, GenerationStats, Stopping, combined, timing_basis
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.timing import Clock
from lssp.engines import ENGINES, Engine, EngineInfo, Mode, OursEngine, Request, engine_class, request_seed
from lssp.errors import UserError
from lssp.measure.cost import Floor, bandwidth_probe, model_floor
from lssp.measure.runloop import Progress, run_interleaved
from lssp.models.compact import compiled_graphs
from lssp.models.loading import LoadedModel, conversation
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share
from lssp.report.metrics import SpecCounts
from lssp.report.results import RunInfo, markdown_table, plural
from lssp.report.stats import Interval, alpha_estimate, ratio_interval
from lssp.workloads.tasks import TaskPrompt


@dataclass
class PromptTiming:
    """One timed completion of one prompt in one mode."""

    prompt_index: int
    mode: str
    k: int
    stats: GenerationStats
    confidence: float = 0.0  # SSp: the draft stops early below this own-probability (0: always k)
    lookup: int = 0  # SSp: n-gram length of the context lookup (0: off)
    repeat: int = 0  # which pass over the prompts (--repeats)
    split_pass: bool = False  # a pass synchronized around every forward, for the draft/target split only
    task: str = "prompts"
    turns: int = 1  # completions made: one per user turn
    at_budget: int = 0  # of those, how many ran to max_new_tokens (no end token before)
    engine: str = "ours"
    draft: str = ""  # SSp in a run of several drafts: which one
    ngram: int = 0  # SSp: n-gram length of the engine's n-gram drafter, drafting alone (0: a draft model)
    floor_ms: float = float("nan")  # the target's one-token floor at the bandwidth probed in this prompt's round,
    # after the tokens its completion had cached on average (``mean_context``)
    answers: tuple[str, ...] = ()  # the text of each turn's completion

    @property
    def how(self) -> Mode:
        return Mode(self.mode, self.k, self.confidence, self.lookup, self.engine, self.draft, self.ngram)

    @property
    def ms_per_target_forward(self) -> float:
        s = self.stats
        return 1000 * s.target_time_s / s.target_forwards if s.target_forwards else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens ÷ the whole completion's wall time, prefill included (Spec-Bench's per-question figure)."""
        s = self.stats
        return s.new_tokens / s.total_time_s if s.total_time_s > 0 else float("nan")


RSP = Mode("rsp")
ALL_TASKS = "all"  # the summary over every prompt of a run, whatever its task


@dataclass
class ModeSummary:
    """Figures for one mode (rsp, or ssp at one k) over all prompts of a run."""

    mode: str
    k: int
    prompts: int
    new_tokens: int
    ms_per_token: float  # decode ms/token (DECODE_TIMING), over all its completions
    ms_per_token_median: float
    ms_per_token_min: float
    ms_per_token_max: float
    ttft_ms: float  # mean time to first token, prefill included
    acceptance_rate: float = float("nan")  # accepted / drafted
    alpha: float = float("nan")  # per-token acceptance of the i.i.d. model (accepted / (accepted + rejections))
    mean_accepted: float = float("nan")  # tokens per target forward (the bonus counted)
    acceptance_by_position: list[float] = field(default_factory=list)  # of the steps drafting position i, kept
    acceptance_given_previous: list[float] = field(default_factory=list)  # of the steps keeping draft i−1, kept i
    draft_share: float = float("nan")  # of decode time (from the pass that timed forwards)
    target_share: float = float("nan")
    other_share: float = float("nan")
    target_ms_per_forward: float = float("nan")
    draft_ms_per_forward: float = float("nan")
    speedup: float = float("nan")  # RSp ms/token / this ms/token, same run
    best: bool = False
    confidence: float = 0.0  # SSp: k is a maximum, drafting stops below this draft probability
    draft_forwards_per_iteration: float = float("nan")
    lookup: int = 0  # SSp: n-gram length of the context lookup (0: off)
    lookup_share: float = float("nan")  # of drafts, those the lookup proposed
    lookup_acceptance: float = float("nan")  # of those, the share accepted
    forward_spread: float = float("nan")  # the slowest prompt's mean ms per target forward ÷ the median prompt's
    noise_spread: float = float("nan")  # the worst completion's time per iteration, relative (see noise_spreads)
    speedup_sd: float = float("nan")  # sd of the speedup over --repeats passes (nan for one pass)
    speedup_low: float = float("nan")  # 95% interval of the geometric-mean per-prompt speedup (paired_speedup)
    speedup_high: float = float("nan")
    repeats: int = 1
    task: str = ALL_TASKS  # the task category these prompts are from
    at_budget_share: float = float("nan")  # of the completions (turns), those that ran to max_new_tokens
    tokens_per_s: float = float("nan")  # mean over prompts of tokens ÷ whole completion time (Spec-Bench's)
    specbench_speedup: float = float("nan")  # this mode's tokens_per_s ÷ RSp's (Spec-Bench's overall speedup)
    engine: str = "ours"  # the speedup is over the same engine's RSp
    draft: str = ""  # in a run of several drafts: which one drafted (else the run's draft)
    timing_fallbacks: int = 0  # completions whose ms/token is the whole completion's (no timed first emission)
    timing_basis: str = FIRST_TO_LAST  # how ms/token was measured (lssp.decoding.generation.timing_basis)
    ngram: int = 0  # SSp: n-gram length of the engine's n-gram drafter, drafting alone (0: a draft model)
    floor_ms: float = float("nan")  # median of its completions' one-token floors (``over_floor``)
    over_floor: float = float("nan")  # geometric mean of its completions' ms/token ÷ the floor beside each
    over_floor_low: float = float("nan")  # its 95% t interval
    over_floor_high: float = float("nan")
    same_as_rsp: float = float("nan")  # greedy SSp: the share of its completions whose text is the same engine's RSp
    #   completion of the same prompt and pass (an exact SSp: 1; an engine whose verification rounds otherwise: less)
    k_seen: int = 0  # SSp: the K its completions said they drafted with, the most common (a server's own, from its
    #   counters, where the mode is the server's name); 0 where none said

    @property
    def how(self) -> Mode:
        return Mode(self.mode, self.k, self.confidence, self.lookup, self.engine, self.draft, self.ngram)

    @property
    def noisy(self) -> bool:
        return (self.noise_spread if self.noise_spread == self.noise_spread else self.forward_spread) > NOISY_SPREAD


# On a quiet machine the slowest prompt's forwards take at most ~1.35x the median prompt's (measured
# 1.35 for RSp, 1.23-1.35 for SSp over 3 x 16 prompts on 2 EPYC cores, run 20261123-080537-a8f4a4);
# other processes on the CPU stretch whole prompts far beyond that (the case that prompted this check: 40x).
NOISY_SPREAD = 1.5


def spread(values: Sequence[float]) -> float:
    """max / median of the finite values (nan when there are none): how far the slowest stands out."""
    finite = [v for v in values if v == v and v > 0]
    return max(finite) / median(finite) if finite else float("nan")


def summarize(timings: Sequence[PromptTiming], how: Mode = RSP,
              split: Sequence[PromptTiming] | None = None, task: str = ALL_TASKS) -> ModeSummary:
    """Figures of one mode; the shares of decode time, ms per forward and the spread come from
    ``split`` where given (a separate pass timed around every forward), else from ``timings``."""
    mode, k = how.mode, how.k
    stats = [t.stats for t in timings]
    per_prompt = [s.ms_per_token for s in stats]
    tokens = sum(s.new_tokens for s in stats)
    fallbacks = sum(s.timing_fallback for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    looked_up = sum(s.looked_up for s in stats)
    target_fw, draft_fw = sum(s.target_forwards for s in stats), sum(s.draft_forwards for s in stats)
    split = timings if split is None else split
    timed = [t.stats for t in split if t.stats.forwards_timed]
    split_decode = sum(s.decode_time_s for s in timed)
    split_target_fw, split_draft_fw = sum(s.target_forwards for s in timed), sum(s.draft_forwards for s in timed)
    target_t, draft_t = sum(s.target_time_s for s in timed), sum(s.draft_time_s for s in timed)
    pooled = SpecCounts(k if mode == "ssp" else 0)
    if mode == "ssp":  # K positions, and those beyond that a copied chain reached
        reached = [i + 1 for s in stats for i, n in enumerate(s.drafted_at) if n]
        width = max([k, *reached])
        pooled.drafted_at = [sum(s.drafted_at[i] for s in stats if i < len(s.drafted_at)) for i in range(width)]
        pooled.accepted_at = [sum(s.accepted_at[i] for s in stats if i < len(s.accepted_at)) for i in range(width)]
    seen = Counter(s.k for s in stats if s.k)  # the K each completion said it drafted with
    nan = float("nan")
    return ModeSummary(
        mode=mode, k=k, prompts=len(stats), new_tokens=tokens,
        ms_per_token=_ms_per_token(timings),
        ms_per_token_median=median(per_prompt), ms_per_token_min=min(per_prompt), ms_per_token_max=max(per_prompt),
        ttft_ms=1000 * sum(s.ttft_s for s in stats) / len(stats),
        acceptance_rate=accepted / drafted if drafted else nan,
        alpha=alpha_estimate(*rejections_known(stats)),
        mean_accepted=tokens / target_fw if mode == "ssp" and target_fw else nan,
        acceptance_by_position=pooled.acceptance_by_position,
        acceptance_given_previous=pooled.acceptance_given_previous,
        draft_share=draft_t / split_decode if split_decode else nan,
        target_share=target_t / split_decode if split_decode else nan,
        other_share=(split_decode - draft_t - target_t) / split_decode if split_decode else nan,
        target_ms_per_forward=1000 * target_t / split_target_fw if split_target_fw else nan,
        draft_ms_per_forward=1000 * draft_t / split_draft_fw if split_draft_fw else nan,
        confidence=how.confidence,
        draft_forwards_per_iteration=draft_fw / target_fw if mode == "ssp" and target_fw else nan,
        lookup=how.lookup,
        lookup_share=looked_up / drafted if how.lookup and drafted else nan,
        lookup_acceptance=sum(s.looked_up_accepted for s in stats) / looked_up if looked_up else nan,
        forward_spread=spread([t.ms_per_target_forward for t in split if t.stats.forwards_timed]),
        repeats=len({t.repeat for t in timings}),
        task=task,
        at_budget_share=sum(t.at_budget for t in timings) / max(1, sum(t.turns for t in timings)),
        tokens_per_s=sum(t.tokens_per_s for t in timings) / len(timings),
        engine=how.engine,
        draft=how.draft,
        ngram=how.ngram,
        timing_fallbacks=fallbacks,
        timing_basis=timing_basis(fallbacks, len(stats)),
        k_seen=seen.most_common(1)[0][0] if mode == "ssp" and seen else 0,
        **over_floor(timings),
    )


def rejections_known(stats: Sequence[GenerationStats]) -> tuple[int, int]:
    """(accepted, rejections) over the completions that counted their rejections: one that kept fewer drafts than it
    made rejected one at least, so where it says none it did not count them (a server's usage says drafted and
    accepted only)."""
    known = [s for s in stats if s.rejections or s.accepted == s.drafted]
    return sum(s.accepted for s in known), sum(s.rejections for s in known)


def over_floor(timings: Sequence[PromptTiming]) -> dict[str, float]:
    """ModeSummary's floor fields: each completion's ms/token ÷ the floor probed in its round, their geometric mean
    with a 95% interval (nan where no probe was taken: a GPU, another engine's weights)."""
    pairs = [(t.stats.ms_per_token, t.floor_ms) for t in timings if t.floor_ms == t.floor_ms]
    if not pairs:
        return {}
    interval = ratio_interval(pairs)
    return {"floor_ms": median(f for _, f in pairs), "over_floor": interval.estimate,
            "over_floor_low": interval.low, "over_floor_high": interval.high}


SAME_PASS = "same pass"  # no GPU to synchronize: the timed passes time every forward too
SEPARATE_PASS = "separate pass"  # ms/token from passes synced only at start and end; the split from one more pass
SPLIT_CHOICES = ("auto", "same", "separate")


def separate_split_pass(split: str, *models: torch.nn.Module) -> bool:
    """Whether the split needs a pass of its own: asked for, or (auto) a model runs on a GPU."""
    if split not in SPLIT_CHOICES:
        raise ValueError(f"split must be one of {SPLIT_CHOICES}, got {split!r}")
    return split == "separate" or (split == "auto" and bool(Clock.for_models(*models).cuda))


@dataclass
class LatencySetup:
    """What a latency run was asked to do (recorded in every row)."""

    target: str
    draft: str | None
    target_precision: str
    draft_precision: str
    params: SamplingParams
    max_new_tokens: int
    prompts: int
    chat: bool = False  # the chat template for every prompt (--chat)
    repeats: int = 1
    ignore_eos: bool = False  # completions ran to max_new_tokens past the end token
    tasks: list[str] = field(default_factory=list)  # in the order the prompts came
    prompt_formats: dict[str, str] = field(default_factory=dict)  # task: chat, raw or mixed
    split_timing: str = SAME_PASS  # where the draft/target/other split was measured
    recompiles: int = 0  # graphs torch.compile built during the timed passes (after the warm-ups)
    others_cpu_share: float = float("nan")  # share of the CPUs' time other work took during the timed passes
    engines: dict[str, EngineInfo] = field(default_factory=dict)  # what each engine of the run says of itself
    draft_kinds: dict[str, str] = field(default_factory=dict)  # each draft's kind: draft (a model) or eagle (a head)
    draft_precisions: dict[str, str] = field(default_factory=dict)  # in a run of several drafts
    left_out: list[str] = field(default_factory=list)  # modes asked for that an engine would not run as asked, why
    floor_precision: str = ""  # the target's weights as the floor counts them (``model_floor``); "": no floor
    floor_bound: str = ""  # memory or compute: what bounds the one-token floor at the median bandwidth
    floor_weight_mb: float = float("nan")  # the target's Linear weights a forward reads
    floor_cache_kb: float = float("nan")  # the keys and values a forward reads per cached token
    bandwidth_gbs: float = float("nan")  # the median of the copy-bandwidth probes taken, one per prompt and pass
    bandwidth_probes: int = 0
    environments: dict[str, dict[str, str]] = field(default_factory=dict)  # an engine that ran elsewhere: its rows'

    def method(self, m: ModeSummary) -> str:
        """How a mode drafted: none (RSp); ngram (an engine's n-gram drafter alone); the engine's own method with a
        draft (hf: assisted; vLLM: its speculative method; llama.cpp: draft-simple); else the draft's kind (draft or
        eagle), +lookup."""
        if m.mode == "rsp":
            return "none"
        if m.ngram:
            return "ngram"
        own = self.engines[m.engine].draft_method if m.engine in self.engines else ""
        if own:
            return own
        kind = self.draft_kinds.get(self.draft_of(m), "draft")
        return f"{kind}+lookup" if m.lookup else kind

    def draft_of(self, m: ModeSummary) -> str:
        return m.draft or self.draft or ""

    def draft_label(self, m: ModeSummary) -> str:
        """What tells ``m``'s drafter apart from the others timed: its method (draft, eagle, ngram), or where two
        drafts timed are of one kind, the draft's name less the words all of that kind's names start with
        (smollm2-135m-eagle-chain6, smollm2-135m-eagle-chain6-min2: chain6, chain6-min2)."""
        method = self.method(m).split("+")[0]
        kind = self.draft_kinds.get(self.draft_of(m))
        alike = [name for name, k in self.draft_kinds.items() if k == kind]
        if method != kind or len(alike) < 2:
            return method
        common = 0  # whole words ("-"-separated) every name of the kind shares, one always left
        words = [name.split("-") for name in alike]
        while all(len(w) > common + 1 and w[common] == words[0][common] for w in words):
            common += 1
        return "-".join(self.draft_of(m).split("-")[common:])

    def own(self, engine: str) -> EngineInfo:
        """What ``engine`` said of itself (nothing, where it was not described)."""
        return self.engines.get(engine) or EngineInfo(engine, engine)


VERSION_COLUMNS = tuple(dict.fromkeys(e.version_column for e in ENGINES.values() if e.version_column))


def version_columns(engine: type[Engine], version: str) -> dict[str, str]:
    """The rows' version columns (one per engine that has a version of its own): ``engine``'s filled, the others
    empty."""
    return {column: version if column == engine.version_column else "" for column in VERSION_COLUMNS}


@dataclass
class LatencyRun:
    summaries: list[ModeSummary]
    timings: list[PromptTiming]
    setup: LatencySetup | None = None
    info: RunInfo = field(default_factory=RunInfo)
    interrupted: bool = False  # Ctrl-C: the summaries cover the prompts completed in every mode
    failure: str = ""  # a server that failed mid-run (``ServerFailure``): interrupted there, its line

    @property
    def overall(self) -> list[ModeSummary]:
        """The summaries over every prompt (one per mode)."""
        return [s for s in self.summaries if s.task == ALL_TASKS] or list(self.summaries)

    @property
    def by_task(self) -> list[ModeSummary]:
        """The summaries of each task (none when the run had one task: its summaries are the overall ones)."""
        overall = self.overall
        return [s for s in self.summaries if s not in overall]

    @property
    def recommended(self) -> list[ModeSummary]:
        """Per engine, its fastest SSp mode over every prompt (the one to use, if it beats RSp at all)."""
        return [s for s in self.overall if s.best]

    @cached_property
    def verdicts(self) -> list[Verdict]:
        """Per engine with both RSp and SSp over every prompt: the mode to use and its speedup's interval."""
        headline = [t for t in self.timings if not t.split_pass]
        verdicts = []
        for engine in self.engines:
            rsp = next((s for s in self.overall if s.mode == "rsp" and s.engine == engine), None)
            ssp = [s for s in self.overall if s.mode == "ssp" and s.engine == engine]
            if rsp is not None and ssp:
                verdicts.append(choose_and_estimate(headline, rsp.how, ssp))
        return verdicts

    @property
    def baseline(self) -> ModeSummary | None:
        return next((s for s in self.overall if s.mode == "rsp" and engine_class(s.engine).reference), None)

    @property
    def engines(self) -> list[str]:
        return list(dict.fromkeys(s.engine for s in self.overall))

    @property
    def cost_ratio(self) -> float:
        """c: draft ms per forward / target ms per 1-token forward (from our RSp); the first draft's in a run of
        several (``cost_ratios`` has each)."""
        return next(iter(self.cost_ratios.values()), float("nan"))

    @property
    def cost_ratios(self) -> dict[str, float]:
        """Each draft's c (the median over its modes)."""
        base = self.baseline
        ratios: dict[str, list[float]] = {}
        for s in self.overall:
            if s.mode == "ssp" and engine_class(s.engine).splits_time:
                ratios.setdefault(self.setup.draft_of(s), []).append(s.draft_ms_per_forward)
        if base is None:
            return {}
        return {name: median(values) / base.target_ms_per_forward for name, values in ratios.items()}

    @property
    def noisy(self) -> bool:
        """The target's forward time varied across prompts beyond what a quiet machine shows, or other work took
        more than ``BUSY_SHARE`` of the CPUs while timing."""
        return any(s.noisy for s in self.overall) or self.busy

    @property
    def busy(self) -> bool:
        """Other work took more than ``BUSY_SHARE`` of the CPUs' time during the timed passes."""
        return self.setup is not None and self.setup.others_cpu_share > BUSY_SHARE

    @property
    def timing_fallbacks(self) -> int:
        """Timed completions whose ms/token fell back to the whole completion (all prompts, every mode)."""
        return sum(s.timing_fallbacks for s in self.overall)

    @property
    def fallback_note(self) -> str:
        """Which modes' ms/token fell back to the whole completion, and why, in one sentence."""
        modes = ", ".join(f"{s.engine} {s.mode}" + (f" k={s.k}" if s.k else "") + f" ({s.timing_fallbacks})"
                          for s in self.overall if s.timing_fallbacks)
        return (f"{plural(self.timing_fallbacks, 'completion')} had no timed first emission or nothing after it "
                f"(one emission, or an engine that gave no time): their ms/token is the whole completion ÷ tokens, "
                f"prefill included (timing_basis): {modes}")

    @property
    def split_note(self) -> str:
        """Where the draft/target split was measured, in words."""
        if self.setup.split_timing == SEPARATE_PASS:
            return ("a separate pass synchronized around every forward; ms/token from passes synchronized only at "
                    "each completion's start, end of prefill, first token and end")
        return "the timed passes themselves (no GPU to synchronize, so timing each forward costs nothing)"

    @property
    def prompts_done(self) -> int:
        return len({(t.repeat, t.prompt_index) for t in self.timings if not t.split_pass})

    def rows(self) -> list[dict[str, Any]]:
        """One CSV row per mode."""
        setup, info = self.setup, self.info
        verdicts = {id(v.mode): v for v in self.verdicts}
        return [{
            **info.head(), "engine": m.engine, "method": setup.method(m), "mode": m.mode, "target": setup.target,
            "draft": setup.draft_of(m) if setup.method(m) not in ("none", "ngram") else "",
            "k": m.k, **setup.params.as_dict(), "max_new_tokens": setup.max_new_tokens,
            "prompt_format": self.prompt_format(m.task), "ignore_eos": setup.ignore_eos,
            **{key: value for key, value in asdict(m).items() if key not in ("mode", "k", "draft")},
            "acceptance_by_position": ";".join(f"{x:.4f}" for x in m.acceptance_by_position),
            "acceptance_given_previous": ";".join(f"{x:.4f}" for x in m.acceptance_given_previous),
            "noisy": m.noisy or self.busy, "interrupted": self.interrupted, "split_timing": setup.split_timing,
            "recompiles": setup.recompiles, "others_cpu_share": round(setup.others_cpu_share, 3),
            "bandwidth_gbs": setup.bandwidth_gbs, "floor_precision": setup.floor_precision,
            "floor_cache_kb": setup.floor_cache_kb, "target_precision": setup.own(m.engine).target_precision or setup.target_precision,
            "draft_precision": setup.draft_precisions.get(m.draft, setup.draft_precision) or "",
            **version_columns(engine_class(m.engine), setup.own(m.engine).version),
            "decode_timing": engine_class(m.engine).decode_timing, **verdict_columns(verdicts.get(id(m))),
            **setup.environments.get(m.engine, info.env),
        } for m in self.summaries]

    def prompt_format(self, task: str) -> str:
        """chat or raw: how the prompts of ``task`` (or of the whole run) were fed."""
        formats = set(self.setup.prompt_formats.values()) if task == ALL_TASKS else {self.setup.prompt_formats.get(task)}
        formats.discard(None)
        return formats.pop() if len(formats) == 1 else "mixed" if formats else ("chat" if self.setup.chat else "raw")

    def prompt_rows(self) -> list[dict[str, Any]]:
        """One CSV row per timed completion."""
        setup = self.setup
        return [{"run_id": self.info.run_id, "mode": p.mode, "k": p.k, "engine": p.engine, "confidence": p.confidence, "lookup": p.lookup,
                 "ngram": p.ngram,
                 "repeat": p.repeat, "split_pass": p.split_pass, "prompt_index": p.prompt_index, "task": p.task,
                 "turns": p.turns, "at_budget": p.at_budget, "new_tokens": p.stats.new_tokens,
                 "ms_per_token": p.stats.ms_per_token, "timing_basis": p.stats.timing_basis,
                 "ms_per_target_forward": p.ms_per_target_forward,
                 "ttft_ms": 1000 * p.stats.ttft_s, "acceptance_rate": p.stats.acceptance_rate,
                 "target": setup.target, "draft": (p.draft or setup.draft or "") if p.mode == "ssp" else ""}
                for p in self.timings]

    def summary_json(self) -> list[dict[str, Any]]:
        """The run for scripts (``--json``)."""
        keys = ("task", "engine", "method", "mode", "target", "draft", "k", "confidence", "lookup", "lookup_acceptance", "ngram", "ms_per_token",
                "ttft_ms", "acceptance_rate", "alpha", "mean_accepted", "speedup", "speedup_sd", "speedup_low",
                "speedup_high", "specbench_speedup", "same_as_rsp", *verdict_columns(None), "at_budget_share",
                "ms_per_token_median",
                "forward_spread", "noise_spread", "noisy", "others_cpu_share", "floor_ms", "over_floor",
                "over_floor_low", "over_floor_high", "floor_precision", "bandwidth_gbs", "timing_basis", "interrupted",
                "run_id", "device")
        return [{**{key: row[key] for key in keys}, "draft": row["draft"] or None,
                 "acceptance_by_position": [round(x, 4) for x in m.acceptance_by_position],
                 "acceptance_given_previous": [round(x, 4) for x in m.acceptance_given_previous]}
                for m, row in zip(self.summaries, self.rows())]

    def markdown(self) -> str:
        setup, rows = self.setup, self.rows()
        columns = ["mode", *(["method", "draft"] if len(setup.draft_kinds) > 1 else []), "k", *(["confidence"] if any(m.confidence for m in self.summaries) else []),
                   *(["lookup"] if any(m.lookup for m in self.summaries) else []),
                   *(["ngram"] if any(m.ngram for m in self.summaries) else []), "ms_per_token", "ms_per_token_median",
                   "ms_per_token_min", "ms_per_token_max", "ttft_ms", "acceptance_rate", "alpha", "mean_accepted",
                   "speedup", *(["speedup_sd"] if setup.repeats > 1 else []), "speedup_low", "speedup_high",
                   "specbench_speedup", *(["same_as_rsp"] if setup.params.greedy else []), "at_budget_share",
                   "forward_spread", "noise_spread",
                   *(["over_floor", "over_floor_low", "over_floor_high"] if setup.floor_precision else [])]
        notes = [f"The draft/target shares, ms per forward and the spread come from {self.split_note}.",
                 "ms/token: time from a completion's first emission to its last token ÷ the tokens emitted after the "
                 "first emission, for every engine; speedup: RSp's ms/token ÷ this one's; speedup_low–high: the "
                 "95% interval of the geometric mean of the per-prompt speedups (paired, t); specbench_speedup: "
                 "mean per-prompt tokens/s (whole completion) ÷ RSp's, as Spec-Bench computes it; at_budget_share: "
                 "completions that ran to the token budget" + (" (--ignore-eos: all of them)." if setup.ignore_eos
                                                              else " instead of ending at the end token.")]
        if setup.params.greedy:
            notes.append("same_as_rsp: of an SSp mode's completions, the share whose text is its engine's RSp "
                         "completion of the same prompt and pass (an exact SSp: 1).")
        notes += [f"Left out: {line}." for line in setup.left_out]
        if setup.floor_precision:
            notes.append(floor_note(setup))
        if setup.recompiles:
            notes.append(f"torch.compile built {plural(setup.recompiles, 'graph')} during the timed passes: their "
                         "compile time is in the figures.")
        if self.interrupted:
            notes.append("Interrupted" + (f" ({self.failure})" if self.failure else "")
                         + ": only the prompts completed in every mode are counted.")
        if self.timing_fallbacks:
            notes.append(self.fallback_note + ".")
        if self.busy:
            notes.append(f"Busy: other work took {self.setup.others_cpu_share:.0%} of the CPUs' time while timing "
                         f"(others_cpu_share; a quiet machine: under {BUSY_SHARE:.0%}); the speedup is unreliable.")
        if any(s.noisy for s in self.overall):
            notes.append(f"Noisy: a completion's time per iteration stood more than {NOISY_SPREAD}x above its mode's "
                          "(at its drafts per iteration) and its prompt's typical one (noise_spread), or the slowest "
                          "prompt's target forwards took "
                          f"more than {NOISY_SPREAD}x the median "
                         "prompt's; the speedup is unreliable.")
        notes += [f"Verdict{f' ({v.engine})' if len(self.verdicts) > 1 else ''}: {v.outcome}, {v.mode.how.name} at "
                  f"{v.speedup.estimate:.2f}x [{v.speedup.low:.2f}, {v.speedup.high:.2f}] over {plural(v.pairs, 'prompt')} "
                  f"({v.basis})." for v in self.verdicts]
        n = len(self.overall)
        tables = markdown_table(rows[:n], ["task", "prompt_format", *columns] if not self.by_task else columns)
        if self.by_task:
            tables = (f"## All prompts\n\n{tables}\n## By task\n\n"
                      + markdown_table(rows[n:], ["task", "prompt_format", *columns]))
        tasks = f" from {', '.join(setup.tasks)}" if setup.tasks else ""
        return (f"# latency run {self.info.run_id}\n\ntarget `{setup.target}` ({setup.target_precision}), draft "
                f"`{setup.draft or '-'}`, {plural(self.prompts_done // setup.repeats, 'prompt')}{tasks}"
                f"{' in the chat template' if setup.chat else ''}, up to {setup.max_new_tokens} new tokens"
                f"{' (end token ignored)' if setup.ignore_eos else ' (or the end token)'}"
                f"{f' x {setup.repeats} passes' if setup.repeats > 1 else ''}, {setup.params}\n\n{self.info.describe()}"
                f"\n\n{tables}\n{' '.join(notes)}\n")


def floor_note(setup: LatencySetup) -> str:
    """What over_floor divides by, in a sentence."""
    return (f"over_floor: a completion's ms/token ÷ the floor of one {setup.target} token ({setup.floor_precision}, "
            f"{setup.floor_weight_mb:.3g} MB of weights and {setup.floor_cache_kb:.3g} kB of keys and values per "
            f"token cached before it (the completion's mean) read once, {setup.floor_bound}-bound) at the copy bandwidth "
            f"probed right after its prompt's first mode (median {setup.bandwidth_gbs:.1f} GB/s over "
            f"{plural(setup.bandwidth_probes, 'probe')}); the geometric mean with its 95% interval.")


def verdict_columns(verdict: Verdict | None) -> dict[str, Any]:
    """The verdict's columns, filled on the row of the mode it chose (blank on the others)."""
    if verdict is None:
        return dict.fromkeys(("verdict", "verdict_speedup", "verdict_low", "verdict_high", "verdict_pairs",
                              "verdict_basis"), "")
    return {"verdict": verdict.outcome, "verdict_speedup": verdict.speedup.estimate, "verdict_low": verdict.speedup.low,
            "verdict_high": verdict.speedup.high, "verdict_pairs": verdict.pairs, "verdict_basis": verdict.basis}


def iteration_ms(timing: PromptTiming) -> float:
    """Decode ms per iteration (one target forward with its drafts); an engine that counts no forwards gives RSp's
    ms per token, and nothing for SSp."""
    s = timing.stats
    if s.target_forwards:
        return 1000 * s.decode_time_s / s.target_forwards
    return s.ms_per_token if timing.mode == "rsp" else float("nan")


def drafts_per_iteration(timing: PromptTiming) -> float:
    s = timing.stats
    return s.drafted / s.target_forwards if s.target_forwards else 0.0


MIN_DRAFT_GAP = 0.25  # drafts per iteration: closer pairs of completions say nothing of what a draft costs
SLOPE_SAMPLE = 600  # completions whose pairs give the slope (180k pairs; a long run's every completion: millions)


def expected_iteration_ms(values: Sequence[float], drafts: Sequence[float]) -> list[float]:
    """What each completion's ms per iteration should be for its drafts per iteration ``drafts``: a line through
    them where they vary (an n-gram drafter drafts only where its lookup matches, a copied chain runs past K, and an
    iteration verifying 5 tokens costs more than one verifying 1), else the median. The line is Theil-Sen's (the
    median of the pairwise slopes), which a slowed completion does not pull."""
    v, d = np.asarray(values, dtype=float), np.asarray(drafts, dtype=float)
    step = -(-len(v) // SLOPE_SAMPLE)  # the pairs of at most SLOPE_SAMPLE completions, evenly spaced
    i, j = np.triu_indices(len(v[::step]), 1)
    sv, sd = v[::step], d[::step]
    gap = sd[j] - sd[i]
    apart = np.abs(gap) >= MIN_DRAFT_GAP
    median_ms = float(np.median(v))
    if apart.sum() < 3:
        return [median_ms] * len(v)
    slope = max(0.0, float(np.median((sv[j] - sv[i])[apart] / gap[apart])))
    expected = float(np.median(v - slope * d)) + slope * d
    return list(expected) if (expected > 0).all() else [median_ms] * len(v)


def noise_spreads(timings: Sequence[PromptTiming]) -> dict[Mode, float]:
    """Per mode, the worst of its completions' time per iteration, divided by what the mode costs at its drafts per
    iteration (``expected_iteration_ms``) and then by the median over modes of the same prompt and pass (what the
    prompt costs: its length, its task). On a quiet machine every value is near 1; a completion slowed by other
    work stands out, in any engine and in the passes that give the figures."""
    by_mode: dict[Mode, list[PromptTiming]] = {}
    for t in timings:
        value = iteration_ms(t)
        if value == value and value > 0:
            by_mode.setdefault(t.how, []).append(t)
    cell: dict[tuple[int, int], dict[Mode, float]] = {}
    for how, done in by_mode.items():
        expected = expected_iteration_ms([iteration_ms(t) for t in done], [drafts_per_iteration(t) for t in done])
        for t, typical in zip(done, expected):
            cell.setdefault((t.repeat, t.prompt_index), {})[how] = iteration_ms(t) / typical
    worst: dict[Mode, float] = {}
    for relative in cell.values():
        centre = median(relative.values())
        for how, r in relative.items():
            worst[how] = max(worst.get(how, 0.0), r / centre)
    return worst


def _summaries(timings: Sequence[PromptTiming], modes: Sequence[Mode], task: str = ALL_TASKS,
               greedy: bool = False) -> list[ModeSummary]:
    headline = [t for t in timings if not t.split_pass]
    split = [t for t in timings if t.split_pass]
    summaries = [summarize([t for t in headline if t.how == how], how,
                           [t for t in split if t.how == how] if split else None, task) for how in modes]
    noise = noise_spreads(headline)
    for how, s in zip(modes, summaries):
        s.noise_spread = noise.get(how, float("nan"))
    repeats = sorted({t.repeat for t in headline})
    for engine in dict.fromkeys(s.engine for s in summaries):
        rsp = next((s for s in summaries if s.mode == "rsp" and s.engine == engine), None)
        ssp = [s for s in summaries if s.mode == "ssp" and s.engine == engine]
        for s in ssp:
            if rsp is None:
                continue
            s.speedup = rsp.ms_per_token / s.ms_per_token
            s.specbench_speedup = s.tokens_per_s / rsp.tokens_per_s
            interval, _ = paired_speedup(headline, rsp.how, s.how)
            s.speedup_low, s.speedup_high = interval.low, interval.high
            if greedy:
                s.same_as_rsp = same_answers(headline, rsp.how, s.how)
            if len(repeats) > 1:
                per_pass = [_ms_per_token([t for t in headline if t.repeat == r and t.how == rsp.how])
                            / _ms_per_token([t for t in headline if t.repeat == r and t.how == s.how]) for r in repeats]
                s.speedup_sd = stdev(per_pass)
        if ssp:
            min(ssp, key=lambda s: s.ms_per_token).best = True
    return summaries


PromptKey = tuple[int, int, str]  # (pass, prompt index, task): one prompt's completion in each mode of a pass


def same_answers(timings: Sequence[PromptTiming], rsp: Mode, ssp: Mode) -> float:
    """Of ``ssp``'s completions, the share whose answers are ``rsp``'s for the same prompt and pass (nan: none
    paired)."""
    base = {(t.repeat, t.prompt_index, t.task): t.answers for t in timings if t.how == rsp}
    pairs = [base[key] == t.answers for t in timings if t.how == ssp and (key := (t.repeat, t.prompt_index, t.task))
             in base]
    return sum(pairs) / len(pairs) if pairs else float("nan")


def per_prompt_ms(timings: Sequence[PromptTiming], how: Mode) -> dict[PromptKey, float]:
    return {(t.repeat, t.prompt_index, t.task): t.stats.ms_per_token for t in timings if t.how == how}


def paired_speedup(timings: Sequence[PromptTiming], rsp: Mode, ssp: Mode,
                   keep: Callable[[PromptKey], bool] = lambda key: True) -> tuple[Interval, int]:
    """SSp's speedup over RSp from the per-prompt ratios of the completions both made of the same prompt in the same
    pass (the interleaved design pairs them): their geometric mean with a 95% t interval, and how many pairs."""
    base, fast = per_prompt_ms(timings, rsp), per_prompt_ms(timings, ssp)
    pairs = [(base[key], fast[key]) for key in base if key in fast and keep(key)]
    return ratio_interval(pairs), len(pairs)


GAIN, NO_CLEAR_GAIN, LOSS = "gain", "no clear gain", "loss"


@dataclass
class Verdict:
    """Per engine: the SSp mode to use and its speedup over RSp with a 95% interval, estimated where possible on
    prompts (or passes) that its choice did not see, so that picking the best of several modes does not inflate it."""

    engine: str
    mode: ModeSummary
    speedup: Interval
    pairs: int  # prompt completions (pairs of RSp and SSp) the estimate comes from
    basis: str  # how the mode was chosen and where its speedup was estimated

    @property
    def outcome(self) -> str:
        """gain (the interval above 1), loss (below 1), or no clear gain (it holds 1, or there is no interval)."""
        low, high = self.speedup.low, self.speedup.high
        return GAIN if low > 1 else LOSS if high < 1 else NO_CLEAR_GAIN


def choose_and_estimate(timings: Sequence[PromptTiming], rsp: Mode, candidates: Sequence[ModeSummary]) -> Verdict:
    """The verdict of one engine: with several SSp modes, the fastest on the first half of the passes (or on every
    other prompt, with one pass) is chosen, and its speedup estimated on the rest."""
    keys = sorted(per_prompt_ms(timings, rsp))
    passes = sorted({key[0] for key in keys})
    if len(candidates) == 1:
        choose = estimate = None
        basis = "one SSp mode, nothing chosen"
    elif len(passes) > 1:
        first = set(passes[:len(passes) // 2])
        choose, estimate = (lambda key: key[0] in first), (lambda key: key[0] not in first)
        basis = f"chosen on {_passes(1, len(first))}, estimated on {_passes(len(first) + 1, len(passes))}"
    elif len(keys) >= 4:
        odd = set(keys[::2])
        choose, estimate = (lambda key: key in odd), (lambda key: key not in odd)
        basis = "chosen on the 1st, 3rd, 5th… prompts, estimated on the others"
    else:
        choose = estimate = None
        basis = f"chosen and estimated on the same {plural(len(keys), 'prompt')} (too few to split: it favours the choice)"

    def score(m: ModeSummary) -> float:
        value = paired_speedup(timings, rsp, m.how, choose or (lambda key: True))[0].estimate
        return value if value == value else float("-inf")

    chosen = max(candidates, key=score)
    interval, pairs = paired_speedup(timings, rsp, chosen.how, estimate or (lambda key: True))
    return Verdict(rsp.engine, chosen, interval, pairs, basis)


def _passes(first: int, last: int) -> str:
    """"pass 2" or "passes 2–3"."""
    return f"pass {first}" if first == last else f"passes {first}–{last}"


def rsp_mode(engine: str = "ours") -> Mode:
    return Mode("rsp", engine=engine)


def summaries_by_task(timings: Sequence[PromptTiming], modes: Sequence[Mode], greedy: bool = False) -> list[ModeSummary]:
    """Each mode over all prompts (task "all"), then over each task's; a run of one task has only the latter.
    ``greedy``: SSp's answers are set beside RSp's (``same_as_rsp``)."""
    tasks = list(dict.fromkeys(t.task for t in timings))
    if len(tasks) == 1:
        return _summaries(timings, modes, tasks[0], greedy)
    return _summaries(timings, modes, greedy=greedy) + [
        s for task in tasks for s in _summaries([t for t in timings if t.task == task], modes, task, greedy)]


def _ms_per_token(timings: Sequence[PromptTiming]) -> float:
    """Decode ms/token of several completions: their timed spans ÷ their timed tokens (``GenerationStats``)."""
    tokens = sum(t.stats.timed_tokens for t in timings)
    return 1000 * sum(t.stats.timed_s for t in timings) / tokens if tokens else float("nan")


def as_task_prompts(prompts: Sequence[str | TaskPrompt], chat: bool = False) -> list[TaskPrompt]:
    """Plain strings become one-turn prompts of the task "prompts"."""
    return [p if isinstance(p, TaskPrompt) else TaskPrompt("prompts", (p,), chat, f"prompts-{i + 1}")
            for i, p in enumerate(prompts)]


def uses_chat_template(target: LoadedModel, prompt: TaskPrompt, forced: bool) -> bool:
    """Whether ``prompt`` goes in the target's chat template: always when ``forced`` (``--chat``), else where the
    prompt asks for it and the target has one."""
    return forced or (prompt.chat and target.has_chat_template)


def complete_turns(target: LoadedModel, prompt: TaskPrompt, chat: bool,
                   generate: Callable[[torch.Tensor, tuple[tuple[str, str], ...]], GenerationOutput]
                   ) -> tuple[GenerationStats, int, list[str]]:
    """Every turn of ``prompt``, each conditioned on the earlier answers (``generate`` gets the ids and the
    conversation they encode): the stats of all of them together, how many ran to the budget (did not stop), and
    the answers."""
    answers: list[str] = []
    outputs = []
    for turn in range(len(prompt.turns)):
        out = generate(target.encode_turns(prompt.turns[:turn + 1], answers, chat),
                       conversation(prompt.turns[:turn + 1], answers))
        outputs.append(out)
        answers.append(target.decode(out.tokens.tolist()))
    return combined([o.stats for o in outputs]), sum(not o.stopped for o in outputs), answers


def latency_modes(engines: Sequence[str], drafts: Sequence[str], ks: Sequence[int], confidences: Sequence[float] = (0.0,),
                  lookups: Sequence[int] = (0,), baseline: bool = True) -> list[Mode]:
    """The modes a latency run times on each engine: RSp (unless no ``baseline`` and there is a draft), then SSp at
    each k, confidence and n-gram length of ``lookups`` with each of ``drafts`` (ours; the others run the first): a
    length n > 0 is the context lookup over the draft's picks where the engine takes it (``Mode.lookup``), else the
    engine's n-gram drafter alone (``Mode.ngram``: vLLM's, llama.cpp's; with no draft, ours' too)."""
    modes: list[Mode] = []
    names = list(drafts) if len(drafts) > 1 else [""]
    for engine in engines:
        modes += [Mode("rsp", engine=engine)] if baseline or not drafts else []
        kind = engine_class(engine)
        for name in names:
            for n in lookups:
                ssp = [kind.ssp_mode(engine, k, n, c, name, bool(drafts)) for c in confidences for k in ks]
                modes += [m for m in ssp if (m.ngram or drafts) and not kind.refuses(m)]
    return list(dict.fromkeys(modes))


def ngram_left_out(engines: Sequence[str], ks: Sequence[int], lookups: Sequence[int]) -> list[str]:
    """A line per engine whose n-gram drafter would never draft at some of ``ks`` (``Engine.ngram_reason``): the
    modes ``latency_modes`` leaves out for that."""
    lines = []
    for engine in engines:
        kind = engine_class(engine)
        for n in (n for n in lookups if n and kind.takes_ngram):
            short = [k for k in ks if kind.ngram_reason(k, n)]
            if short:
                lines.append(f"n-gram K={','.join(map(str, short))} left out: {kind.ngram_reason(short[0], n)}")
    return lines


def run_latency(
    target: LoadedModel, engines: dict[str, Engine], modes: Sequence[Mode], prompts: Sequence[str | TaskPrompt],
    warmup_prompt: str, params: SamplingParams, max_new_tokens: int, seed: int, drafts: Sequence[LoadedModel] = (),
    progress: Progress | None = None, chat: bool = False, repeats: int = 1, split: str = "auto", ignore_eos: bool = False,
    left_out: Sequence[str] = (),
) -> LatencyRun:
    """Time every mode (``latency_modes``) on every prompt through its engine, interleaved prompt by prompt, the
    order of the modes rotating from one prompt to the next (``run_interleaved``).

    A completion ends at the target's end token or after ``max_new_tokens``, whichever comes first; with
    ``ignore_eos`` it always runs to ``max_new_tokens``. One untimed warm-up completion per mode comes first.
    Plain-string prompts are one-turn prompts; a TaskPrompt of several turns is completed turn by turn. The
    chat template is used for every prompt with ``chat``, else for the TaskPrompts that ask for it when the
    target has one. ``repeats`` passes over the prompts give the speedup's spread. ``split``: where the
    draft/target time split is measured (``separate_split_pass``); with a separate pass, the timed passes
    synchronize a GPU only at each completion's boundaries. Ctrl-C after at least one prompt returns the
    prompts completed in every mode (``interrupted``). ``target`` tokenizes; ``drafts`` are described in the rows;
    ``left_out``: modes asked for and not run, why (``ngram_left_out``), said in the run's notes. On a CPU, the
    copy bandwidth is probed after the first mode's completion of each prompt, for each completion's ms/token as a
    multiple of the target's one-token floor at that moment (``over_floor``).
    """
    prompts = as_task_prompts(prompts, chat)
    for how in modes:
        why = engines[how.engine].supports(how)
        if why:
            raise UserError(f"{how.name}: {why}")
    info = RunInfo.for_models(target, *drafts)
    elsewhere = {name: env for name, engine in engines.items() if (env := engine.environment(dict(info.env))) != info.env}
    if elsewhere and len(elsewhere) == len(engines):  # every engine ran elsewhere: the run's environment is theirs
        info.env = next(iter(elsewhere.values()))
    ours = engines.get("ours")
    separate = ours is not None and separate_split_pass(split, *ours.models())
    stopping = Stopping() if ignore_eos else Stopping(token_ids=target.eos_ids)
    setup = _setup(target, drafts, engines, prompts, params, max_new_tokens, chat, repeats, ignore_eos, separate)
    setup.left_out = list(left_out)
    setup.environments = elsewhere
    floor = floor_of(target, setup)

    def complete(how: Mode, prompt: TaskPrompt, index: int,
                 time_forwards: bool) -> tuple[GenerationStats, int, float, float, tuple[str, ...]]:
        engine = engines[how.engine]
        turns: list[tuple[int, int]] = []

        def generate(ids: torch.Tensor, messages: tuple[tuple[str, str], ...]) -> GenerationOutput:
            out = engine.complete(how, Request(ids, max_new_tokens, params, request_seed(seed, index), stopping,
                                               time_forwards=time_forwards, messages=messages))
            turns.append((ids.shape[-1], len(out.tokens)))
            return out

        stats, at_budget, answers = complete_turns(target, prompt, uses_chat_template(target, prompt, chat), generate)
        probed = floor is not None and index >= 0 and how == modes[0]
        return stats, at_budget, bandwidth_probe() if probed else float("nan"), mean_context(turns), tuple(answers)

    graphs, started = [compiled_graphs()], [cpu_snapshot()]

    def warmed() -> None:  # graphs the warm-up built are not in the figures, nor its time in the CPU shares
        graphs[0], started[0] = compiled_graphs(), cpu_snapshot()

    failures: list[str] = []
    steps, interrupted = run_interleaved(
        prompts, modes, complete, TaskPrompt("warm-up", (warmup_prompt,), False), repeats,
        [m for m in modes if engine_class(m.engine).splits_time] if separate else (), progress, describe=lambda p: p.task,
        warmed=warmed, failures=failures)
    setup.recompiles = compiled_graphs() - graphs[0]
    if all(engine.checks_busy for engine in engines.values()):
        setup.others_cpu_share = others_share(started[0], cpu_snapshot())
    probes = {(s.repeat, s.split_pass, s.index): s.result[2] for s in steps if s.result[2] == s.result[2]}
    if floor is not None and probes:
        setup.bandwidth_gbs, setup.bandwidth_probes = median(probes.values()) / 1e9, len(probes)
        setup.floor_bound = floor.at(median(probes.values())).ms(1)[1]
    floors = {key: floor.at(bandwidth) for key, bandwidth in probes.items()} if floor else {}

    def floor_ms(step: Any) -> float:  # at its round's probe, after its completion's mean context
        found = floors.get((step.repeat, step.split_pass, step.index))
        return found.ms(1, step.result[3])[0] if found else float("nan")
    timings = [PromptTiming(s.index, s.mode.mode, s.mode.k, s.result[0], s.mode.confidence, s.mode.lookup, s.repeat,
                            s.split_pass, prompts[s.index].task, len(prompts[s.index].turns), s.result[1], s.mode.engine,
                            s.mode.draft, s.mode.ngram, floor_ms(s), s.result[4])
               for s in steps]
    return LatencyRun(summaries_by_task(timings, modes, params.greedy), timings, setup, info, interrupted, "".join(failures))


def floor_of(target: LoadedModel, setup: LatencySetup) -> Floor | None:
    """The target's one-token floor on this CPU (``model_floor``), said in ``setup``; None on a GPU."""
    found = model_floor(target)
    if found is None:
        return None
    floor, setup.floor_precision = found
    setup.floor_weight_mb, setup.floor_cache_kb = floor.weight_bytes / 1e6, floor.cache_bytes / 1e3
    return floor


def mean_context(turns: Sequence[tuple[int, int]]) -> float:
    """The tokens cached on average when a completion's tokens were made, from each turn's (prompt tokens, new
    tokens): new token i of a turn reads its prompt and the i tokens before it."""
    made = sum(n for _, n in turns)
    if not made:
        return float(turns[-1][0]) if turns else 0.0
    return sum(n * (prompt + (n - 1) / 2) for prompt, n in turns) / made


def _setup(target: LoadedModel, drafts: Sequence[LoadedModel], engines: dict[str, Engine], prompts: Sequence[TaskPrompt],
           params: SamplingParams, max_new_tokens: int, chat: bool, repeats: int, ignore_eos: bool,
           separate: bool) -> LatencySetup:
    """What the run was asked to do, for its rows."""
    formats: dict[str, set[str]] = {}
    for prompt in prompts:
        formats.setdefault(prompt.task, set()).add("chat" if uses_chat_template(target, prompt, chat) else "raw")
    draft = drafts[0] if drafts else None
    setup = LatencySetup(target.name, draft.name if draft else None, target.precision, draft.precision if draft else "",
                         params, max_new_tokens, len(prompts), chat, repeats, ignore_eos, list(formats),
                         {task: f.pop() if len(f) == 1 else "mixed" for task, f in formats.items()},
                         SEPARATE_PASS if separate else SAME_PASS)
    setup.draft_kinds = {d.name: d.draft_kind for d in drafts}
    if len(drafts) > 1:
        setup.draft, setup.draft_precision = ", ".join(d.name for d in drafts), ""
        setup.draft_precisions = {d.name: d.precision for d in drafts}
    setup.engines = {name: engine.describe() for name, engine in engines.items()}
    return setup


def run_latency_ours(target: LoadedModel, draft: LoadedModel | None, prompts: Sequence[str | TaskPrompt],
                     warmup_prompt: str, ks: Sequence[int], params: SamplingParams, max_new_tokens: int, seed: int,
                     baseline: bool = True, vocab_size: int | None = None, confidences: Sequence[float] = (0.0,),
                     lookups: Sequence[int] = (0,), **options: Any) -> LatencyRun:
    """``run_latency`` of one pair on our engine alone (``options``: run_latency's keywords)."""
    drafts = [draft] if draft is not None else []
    engine = OursEngine(target, drafts, [vocab_size])
    modes = latency_modes([OursEngine.name], [d.name for d in drafts], ks, confidences, lookups, baseline)
    return run_latency(target, {"ours": engine}, modes, prompts, warmup_prompt, params, max_new_tokens, seed, drafts,
                       **options)
