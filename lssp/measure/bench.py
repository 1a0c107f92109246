"""Our RSp and SSp against transformers' generate() and assisted generation, and against rival engines that run
their own RSp and SSp (vLLM, llama.cpp), in one run.

The engines run the same prompts, token budget, K and sampling parameters,
interleaved prompt by prompt so that machine drift hits all of them alike. Every engine
completes exactly ``max_new_tokens`` tokens (EOS disabled), counted from ids; ms/token is decode ms/token as
``lssp.decoding.generation.DECODE_TIMING`` defines it for every engine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import mean, median
from typing import Any

from lssp.decoding.generation import FIRST_TO_LAST, GenerationStats, timing_basis
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.timing import copy_bandwidth
from lssp.engines import ENGINES as ENGINE_KINDS
from lssp.engines import Engine, Mode, OursEngine, Request, TransformersEngine, engine_class, request_seed
from lssp.measure.cost import Floor, model_floor
from lssp.measure.latency import (
    NOISY_SPREAD,
    SAME_PASS,
    SEPARATE_PASS,
    PromptTiming,
    mean_context,
    noise_spreads,
    separate_split_pass,
    spread,
)
from lssp.measure.runloop import Progress, run_interleaved
from lssp.models.loading import LoadedModel
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share
from lssp.report.results import RunInfo, markdown_table, plural
from lssp.report.stats import alpha_estimate, predicted_speedup, ratio_interval

ENGINES = ("ours-rsp", "hf-generate", "ours-ssp", "hf-assisted")
# Rival engines that run their own RSp and SSp (their engine name: lssp.engines.ENGINES): each adds "NAME-rsp" and
# "NAME-ssp" rows, ours ÷ it per prompt, and its version, acceptance, α and SSp = RSp agreement.
RIVALS = ("vllm", "llamacpp")
LABELS = {"ours-rsp": ("ours", "rsp"), "hf-generate": ("hf", "rsp"),
          **{f"{r}-rsp": (r, "rsp") for r in RIVALS},
          "ours-ssp": ("ours", "ssp"), "hf-assisted": ("hf", "ssp"),
          **{f"{r}-ssp": (r, "ssp") for r in RIVALS}}  # in table order: RSp rows first


def engines_for(rivals: Sequence[str]) -> tuple[str, ...]:
    """The engines a bench runs: ours and each rival ("hf", "vllm", "llamacpp"), RSp ones first."""
    wanted = {"ours", *rivals}
    return tuple(label for label, (engine, _) in LABELS.items() if engine in wanted)


@dataclass
class EngineRun:
    engine: str
    prompt_index: int
    tokens: list[int]
    seconds: float
    ssp_other_s: float = float("nan")  # ours-ssp: decode time outside both models' forwards
    ssp_decode_s: float = float("nan")
    acceptance_rate: float = float("nan")
    accepted: int = 0
    rejections: int = 0
    draft_ms_per_forward: float = float("nan")
    target_ms_per_forward: float = float("nan")
    split_pass: bool = False  # ours, on a GPU: a pass synchronized around every forward, for c, v and shares only
    stats: GenerationStats | None = None  # the engine's stats (None: only the whole completion's seconds are known)

    @property
    def timing_fallback(self) -> bool:
        """ms/token is the whole completion's (``GenerationStats.timing_fallback``)."""
        return self.stats is None or self.stats.timing_fallback

    @property
    def timed_s(self) -> float:
        return self.seconds if self.stats is None else self.stats.timed_s

    @property
    def timed_tokens(self) -> int:
        return len(self.tokens) if self.stats is None else self.stats.timed_tokens

    @property
    def ms_per_token(self) -> float:
        """Decode ms/token (``DECODE_TIMING``), the whole completion's where that falls back."""
        return 1000 * self.timed_s / self.timed_tokens if self.timed_tokens else float("nan")


@dataclass
class Ratios:
    """Ours ÷ a rival, prompt by prompt: median, min, max; the geometric mean with its 95% t interval
    (``ratio_interval``), the verdict's figure."""

    median: float = float("nan")
    min: float = float("nan")
    max: float = float("nan")
    mean: float = float("nan")
    low: float = float("nan")
    high: float = float("nan")


@dataclass
class RivalFigures:
    """What a rival engine (``RIVALS``) reports of its own SSp, beside its RSp."""

    version: str = ""
    acceptance_rate: float = float("nan")  # its SSp: accepted / drafted, median over prompts
    alpha: float = float("nan")  # from its accepted drafts and rejecting steps, all prompts
    agreement: float = float("nan")  # share of prompts where its SSp's tokens equal its RSp's


@dataclass
class EngineSummary:
    engine: str
    ms_per_token: float  # all prompts: timed spans ÷ timed tokens (DECODE_TIMING)
    ms_per_token_median: float
    ms_per_token_min: float
    ms_per_token_max: float
    timing_fallbacks: int = 0  # completions whose ms/token is the whole completion's
    timing_basis: str = FIRST_TO_LAST
    ratio_median: float = float("nan")  # ours / hf per prompt (ours-* rows only)
    ratio_min: float = float("nan")
    ratio_max: float = float("nan")
    rival_ratios: dict[str, Ratios] = field(default_factory=dict)  # ours / each rival that ran (ours-* rows only)

    def rival_ratio(self, rival: str) -> Ratios:
        """Ours ÷ ``rival`` (hf or one of ``RIVALS``) per prompt; NaNs where it did not run or this is not ours."""
        return self.rival_ratios.get(rival, Ratios())


@dataclass
class BenchSetup:
    """What a bench run was asked to do (recorded in every row)."""

    target: str
    draft: str
    target_precision: str
    draft_precision: str
    target_weight_bytes: int
    params: SamplingParams
    max_new_tokens: int
    prompts: int
    confidence: float = 0.0
    split_timing: str = SAME_PASS  # where ours' c, v and overhead share were measured


@dataclass
class BenchRun:
    k: int
    runs: list[EngineRun]
    summaries: list[EngineSummary] = field(default_factory=list)
    setup: BenchSetup | None = None
    info: RunInfo = field(default_factory=RunInfo)
    bandwidth: float = float("nan")  # bytes/s of a large device-to-device copy
    forward_spread: float = float("nan")  # slowest ÷ median prompt's time per target forward (worst engine)
    noise_spread: float = float("nan")  # the worst headline completion's time per iteration, relative (noise_spreads)
    interrupted: bool = False  # Ctrl-C: the figures cover the prompts every engine completed
    failure: str = ""  # a rival's server that failed mid-run (``ServerFailure``): interrupted there, its line
    ssp_overhead_share: float = float("nan")
    acceptance_rate: float = float("nan")  # accepted / drafted, median over prompts
    alpha: float = float("nan")  # per-token acceptance of the i.i.d. model, all prompts
    cost_ratio: float = float("nan")  # c = draft ms/forward ÷ target ms per 1-token forward
    verify_ratio: float = float("nan")  # v = target ms per SSp (K+1-token) forward ÷ per RSp forward
    greedy_agreement: dict[str, float] = field(default_factory=dict)  # share of prompts equal to ours-rsp
    rivals: dict[str, RivalFigures] = field(default_factory=dict)  # each rival engine that ran (RIVALS order)
    others_cpu_share: float = float("nan")  # share of the CPUs' time other work took during the timed passes
    ssp_speedup: Ratios = field(default_factory=Ratios)  # our RSp ÷ our SSp, prompt by prompt (``ratios``)
    floor: Floor | None = None  # the target's one-token floor as latency counts it (``model_floor``), on a CPU
    floor_context: float = 0.0  # the tokens cached on average when a token was made (prompt + half the budget)

    @property
    def noisy(self) -> bool:
        """A headline completion stood out from its engine's and its prompt's typical time per iteration, as latency
        measures it (``noise_spread``; the split pass's ``forward_spread`` is only for reference), or other work took
        more than ``BUSY_SHARE`` of the CPUs while timing."""
        return self.noise_spread > NOISY_SPREAD or self.others_cpu_share > BUSY_SHARE

    @property
    def timing_fallbacks(self) -> int:
        return sum(x.timing_fallbacks for x in self.summaries)

    def has(self, rival: str) -> bool:
        """Whether engines of ``rival`` (hf, vllm, llamacpp) ran."""
        return any(x.engine.startswith(rival + "-") for x in self.summaries)

    def compared(self) -> list[str]:
        """The engines ours is compared with that ran (hf, then ``RIVALS``), in table order."""
        return [name for name in dict.fromkeys(owner for owner, _ in LABELS.values())
                if not ENGINE_KINDS[name].reference and self.has(name)]

    def _ms(self, engine: str) -> float:
        return next(x.ms_per_token for x in self.summaries if x.engine == engine)

    @property
    def measured_speedup(self) -> float:
        return self._ms("ours-rsp") / self._ms("ours-ssp")

    @property
    def predicted_speedup(self) -> float:
        """(1 − α^(K+1)) / ((1 − α)(K·c + 1)) from this run's α and c."""
        return predicted_speedup(self.alpha, self.k, self.cost_ratio)

    @property
    def predicted_speedup_v(self) -> float:
        """The same with the measured cost v of a (K+1)-token verification: (K·c + v)."""
        return predicted_speedup(self.alpha, self.k, self.cost_ratio, self.verify_ratio)

    @property
    def floor_ms(self) -> float:
        """The floor of one target token at the run's bandwidth: on a CPU, as ``latency`` counts it (the Linear
        layers' weights as stored and the cached keys and values at the mean context, read once, or their
        arithmetic); elsewhere every target weight read once."""
        if self.floor is not None:
            return self.floor.at(self.bandwidth).ms(1, self.floor_context)[0]
        return 1000 * self.setup.target_weight_bytes / self.bandwidth

    def floor_words(self) -> str:
        """What the floor reads, in words."""
        cache = (f" + {self.floor.cache_bytes / 1e3:.3g} kB per cached token ({self.floor_context:.0f} on average)"
                 if self.floor is not None and self.floor.cache_bytes else "")
        return f"target weights {self.setup.target_weight_bytes / 1e6:.0f} MB{cache}"

    def rows(self) -> list[dict[str, Any]]:
        setup = self.setup
        return [{
            **self.info.head(), "engine": x.engine, "target": setup.target, "draft": setup.draft, "k": self.k,
            "draft_confidence": setup.confidence, **setup.params.as_dict(), "max_new_tokens": setup.max_new_tokens,
            "prompts": setup.prompts, "ms_per_token": x.ms_per_token, "ms_per_token_median": x.ms_per_token_median,
            "ms_per_token_min": x.ms_per_token_min, "ms_per_token_max": x.ms_per_token_max,
            "ours_over_hf_median": x.ratio_median, "ours_over_hf_min": x.ratio_min, "ours_over_hf_max": x.ratio_max,
            **self._rival_columns(x),
            "greedy_agreement": self.greedy_agreement.get(x.engine, float("nan")),
            "ssp_overhead_share": self.ssp_overhead_share, "acceptance_rate": self.acceptance_rate, "alpha": self.alpha,
            "cost_ratio": self.cost_ratio, "verify_ratio": self.verify_ratio,
            "ssp_speedup_measured": self.measured_speedup, "ssp_speedup_geomean": self.ssp_speedup.mean,
            "ssp_speedup_low": self.ssp_speedup.low, "ssp_speedup_high": self.ssp_speedup.high,
            "ssp_speedup_predicted": self.predicted_speedup,
            "ssp_speedup_predicted_v": self.predicted_speedup_v, "target_weight_bytes": setup.target_weight_bytes,
            "copy_bandwidth_gbs": self.bandwidth / 1e9, "bandwidth_floor_ms": self.floor_ms,
            "forward_spread": self.forward_spread, "noise_spread": self.noise_spread, "noisy": self.noisy,
            "others_cpu_share": round(self.others_cpu_share, 3),
            "interrupted": self.interrupted, "split_timing": setup.split_timing, "decode_timing": ENGINE_KINDS[LABELS[x.engine][0]].decode_timing,
            "timing_basis": x.timing_basis, "timing_fallbacks": x.timing_fallbacks,
            "target_precision": setup.target_precision, "draft_precision": setup.draft_precision, **self.info.env,
        } for x in self.summaries]

    def _rival_columns(self, x: EngineSummary) -> dict[str, Any]:
        """Per rival R (every one of ``RIVALS``, so that every run writes the same columns): ours ÷ R on ours' rows
        (``ours_over_R_median``, ``_min``, ``_max``; ``_geomean`` with its 95% interval ``_low``, ``_high``), R's version on its rows (column ``R``), and on its SSp row its
        SSp = RSp agreement, acceptance rate and α (``R_ssp_equals_R_rsp``, ``R_acceptance_rate``, ``R_alpha``)."""
        columns: dict[str, Any] = {}
        for r in RIVALS:
            ratio, figures, ssp = x.rival_ratio(r), self.rivals.get(r, RivalFigures()), x.engine == f"{r}-ssp"
            columns.update({f"ours_over_{r}_median": ratio.median, f"ours_over_{r}_min": ratio.min,
                            f"ours_over_{r}_max": ratio.max, f"ours_over_{r}_geomean": ratio.mean,
                            f"ours_over_{r}_low": ratio.low, f"ours_over_{r}_high": ratio.high,
                            r: figures.version if x.engine.startswith(r + "-") else ""})
            columns.update({f"{r}_ssp_equals_{r}_rsp": figures.agreement, f"{r}_acceptance_rate": figures.acceptance_rate,
                            f"{r}_alpha": figures.alpha} if ssp else dict.fromkeys(
                (f"{r}_ssp_equals_{r}_rsp", f"{r}_acceptance_rate", f"{r}_alpha"), float("nan")))
        return columns

    def markdown(self) -> str:
        setup = self.setup
        columns = ["engine", "ms_per_token", "ms_per_token_median", "ms_per_token_min", "ms_per_token_max",
                   "ours_over_hf_median", "ours_over_hf_min", "ours_over_hf_max", "ours_over_hf_geomean",
                   "ours_over_hf_low", "ours_over_hf_high",
                   *(f"ours_over_{r}_{what}" for r in self.rivals for what in ("geomean", "low", "high")),
                   "greedy_agreement"]
        return (f"# bench run {self.info.run_id}\n\ntarget `{setup.target}` ({setup.target_precision}), draft "
                f"`{setup.draft}`, K={self.k}, {plural(setup.prompts, 'prompt')} x {setup.max_new_tokens} tokens, {setup.params}"
                f"\n\n{self.info.describe()}\n\n" + markdown_table(self.rows(), columns) +
                f"\nour SSp overhead outside forwards: {self.ssp_overhead_share:.1%} of decode time; α {self.alpha:.3f}; "
                f"c = {self.cost_ratio:.3f}; v = {self.verify_ratio:.3f}; SSp speedup measured {self.measured_speedup:.2f}x "
                f"(per prompt {self.ssp_speedup.mean:.2f}x [{self.ssp_speedup.low:.2f}-{self.ssp_speedup.high:.2f}], "
                "geometric mean, 95% t interval), "
                f"predicted {self.predicted_speedup:.2f}x (v = 1), {self.predicted_speedup_v:.2f}x (measured v)\n\n"
                + "".join(f"{r} {x.version}: SSp α {x.alpha:.3f}, accepted/drafted {x.acceptance_rate:.1%}, SSp tokens "
                          f"equal its RSp's on {x.agreement:.0%} of prompts\n\n" for r, x in self.rivals.items()) +
                f"{self.floor_words()}, copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, "
                f"floor {self.floor_ms:.2f} ms/token, ours-rsp {self._ms('ours-rsp') / self.floor_ms:.2f}x the floor\n"
                + (f"\nFallback: {plural(self.timing_fallbacks, 'completion')} had no timed first emission or nothing "
                   "after it: their ms/token is the whole completion ÷ tokens (timing_basis).\n"
                   if self.timing_fallbacks else "")
                + (f"\nNoisy: a completion's time per iteration stood {self.noise_spread:.1f}x above its engine's and its "
                   "prompt's typical one.\n" if self.noise_spread > NOISY_SPREAD else "")
                + (f"\nBusy: other work took {self.others_cpu_share:.0%} of the CPUs' time while timing.\n"
                   if self.others_cpu_share > BUSY_SHARE else ""))


def bench_modes(labels: Sequence[str], k: int, confidence: float = 0.0) -> dict[str, Mode]:
    """Each engine label's mode: RSp, or SSp at ``k`` (``confidence`` > 0: both of ours and assisted generation
    stop drafting early)."""
    modes = {}
    for label in labels:
        engine, mode = LABELS[label]
        modes[label] = Mode("rsp", engine=engine) if mode == "rsp" else \
            Mode("ssp", k, confidence if engine not in RIVALS else 0.0, engine=engine)
    return modes


def run_bench(target: LoadedModel, draft: LoadedModel, prompts: Sequence[str], warmup_prompt: str, k: int,
              params: SamplingParams, max_new_tokens: int, seed: int, vocab_size: int | None = None,
              engines: Sequence[str] = ENGINES, progress: Progress | None = None, confidence: float = 0.0,
              measure_bandwidth: bool = False, rivals: dict[str, Engine] | None = None) -> BenchRun:
    """Every engine on every prompt, interleaved through the run loop; ``confidence`` > 0 lets ours and assisted
    generation stop drafting early. ``rivals``: the started engine of each rival (``RIVALS``) the labels name, keyed
    by its name. ``measure_bandwidth`` adds the device's copy bandwidth (for the memory-bandwidth floor)."""
    runners: dict[str, Engine] = {"ours": OursEngine(target, [draft], [vocab_size]), "hf": TransformersEngine(target, draft),
                                  **(rivals or {})}
    modes = bench_modes(engines, k, confidence)
    label_of = {mode: label for label, mode in modes.items()}
    separate = separate_split_pass("auto", target.model, draft.model)
    nan = float("nan")

    def once(mode: Mode, text: str, index: int, timed: bool) -> EngineRun:
        request = Request(target.encode(text), max_new_tokens, params, request_seed(seed, index), time_forwards=timed)
        out = runners[mode.engine].complete(mode, request)
        st, tokens = out.stats, out.tokens.tolist()
        if not engine_class(mode.engine).splits_time:
            return EngineRun(label_of[mode], index, tokens, st.total_time_s, acceptance_rate=st.acceptance_rate,
                             accepted=st.accepted, rejections=st.rejections, stats=st)
        return EngineRun(label_of[mode], index, tokens, st.total_time_s, st.other_time_s if timed else nan,
                         st.decode_time_s, st.acceptance_rate, st.accepted, st.rejections,
                         1000 * st.draft_time_s / st.draft_forwards if timed and st.draft_forwards else nan,
                         1000 * st.target_time_s / st.target_forwards if timed else nan, stats=st)

    split = [m for m in modes.values() if engine_class(m.engine).splits_time]
    started = [cpu_snapshot()]  # from the end of the warm-ups
    failures: list[str] = []
    steps, interrupted = run_interleaved(prompts, list(modes.values()), once, warmup_prompt,
                                         split_modes=split if separate else (), progress=progress, label=label_of.get,
                                         warmed=lambda: started.__setitem__(0, cpu_snapshot()), failures=failures)
    others = others_share(started[0], cpu_snapshot())
    runs = []
    for step in steps:
        step.result.split_pass = step.split_pass
        runs.append(step.result)
    bench = summarize(k, runs, engines, confidence)
    bench.interrupted, bench.others_cpu_share, bench.failure = interrupted, others, "".join(failures)
    bench.setup = BenchSetup(target.name, draft.name, target.precision, draft.precision, target.weight_bytes, params,
                             max_new_tokens, len([r for r in runs if not r.split_pass]) // len(engines), confidence,
                             SEPARATE_PASS if separate else SAME_PASS)
    bench.info = RunInfo.for_models(target, draft)
    for name, figures in bench.rivals.items():
        figures.version = runners[name].version
    if measure_bandwidth:
        bench.bandwidth = copy_bandwidth(target.device)
        found = model_floor(target, bench.bandwidth)
        if found is not None:
            bench.floor = found[0]
            bench.setup.target_weight_bytes = bench.floor.weight_bytes
            bench.floor_context = mean(mean_context([(target.encode(text).shape[-1], max_new_tokens)])
                                       for text in prompts)
    return bench


def summarize(k: int, runs: list[EngineRun], engines: Sequence[str] = ENGINES, confidence: float = 0.0) -> BenchRun:
    """Engine figures from the timed runs; ours' c, v, overhead share and forward spread from the split pass where
    there is one; the noise flag from the timed (headline) runs of every engine."""
    bench = BenchRun(k, runs)
    by = {e: [r for r in runs if r.engine == e and not r.split_pass] for e in engines}
    split = {e: [r for r in runs if r.engine == e and r.split_pass] or by[e] for e in engines}
    for engine in engines:
        rs = by[engine]
        per = [r.ms_per_token for r in rs]
        fallbacks = sum(r.timing_fallback for r in rs)
        summary = EngineSummary(engine, 1000 * sum(r.timed_s for r in rs) / sum(r.timed_tokens for r in rs),
                                median(per), min(per), max(per), fallbacks, timing_basis(fallbacks, len(rs)))
        if engine in ("ours-rsp", "ours-ssp"):
            mode = engine.split("-")[1]
            hf = "hf-generate" if mode == "rsp" else "hf-assisted"
            if hf in by:
                hf_ratio = ratios(rs, by[hf])
                summary.ratio_median, summary.ratio_min, summary.ratio_max = hf_ratio.median, hf_ratio.min, hf_ratio.max
                summary.rival_ratios[LABELS[hf][0]] = hf_ratio
            summary.rival_ratios |= {r: ratios(rs, by[f"{r}-{mode}"]) for r in RIVALS if f"{r}-{mode}" in by}
        bench.summaries.append(summary)
    bench.rivals = {r: rival_figures(by.get(f"{r}-rsp"), by.get(f"{r}-ssp")) for r in RIVALS
                    if f"{r}-rsp" in by or f"{r}-ssp" in by}
    if "ours-ssp" in by:
        ssp, ssp_split = by["ours-ssp"], split["ours-ssp"]
        bench.ssp_overhead_share = sum(r.ssp_other_s for r in ssp_split) / sum(r.ssp_decode_s for r in ssp_split)
        bench.acceptance_rate = median(r.acceptance_rate for r in ssp)
        bench.alpha = alpha_estimate(sum(r.accepted for r in ssp), sum(r.rejections for r in ssp))
        if "ours-rsp" in by:
            bench.ssp_speedup = ratios(by["ours-rsp"], ssp)
            one_token_ms = median(r.target_ms_per_forward for r in split["ours-rsp"])
            bench.cost_ratio = median(r.draft_ms_per_forward for r in ssp_split) / one_token_ms
            bench.verify_ratio = median(r.target_ms_per_forward for r in ssp_split) / one_token_ms
    # For reference: the spread across prompts of the target's time per forward (ours, split pass) or per token
    # (hf-generate). The noise flag reads the headline runs of every engine, as latency's does (noise_spreads).
    spreads = [spread([r.target_ms_per_forward for r in split[e]]) for e in ("ours-rsp", "ours-ssp") if e in by]
    spreads += [spread([r.ms_per_token for r in by["hf-generate"]])] if "hf-generate" in by else []
    bench.forward_spread = max((x for x in spreads if x == x), default=float("nan"))
    noise = noise_spreads(headline_timings(by, k, confidence)).values()
    bench.noise_spread = max((x for x in noise if x == x), default=float("nan"))
    if "ours-rsp" in by:
        reference = {r.prompt_index: r.tokens for r in by["ours-rsp"]}
        for engine in engines:
            same = [r.tokens == reference[r.prompt_index] for r in by[engine]]
            bench.greedy_agreement[engine] = sum(same) / len(same)
    return bench


def ratios(ours: list[EngineRun], rival: list[EngineRun]) -> Ratios:
    """Ours ÷ the rival, prompt by prompt (runs in the same prompt order): median, min, max, and the geometric mean
    with its 95% t interval."""
    pairs = [(a.ms_per_token, b.ms_per_token) for a, b in zip(ours, rival)]
    values = [a / b for a, b in pairs]
    interval = ratio_interval(pairs)
    return Ratios(median(values), min(values), max(values), interval.estimate, interval.low, interval.high)


def rival_figures(rsp: list[EngineRun] | None, ssp: list[EngineRun] | None) -> RivalFigures:
    """A rival's acceptance, α and SSp = RSp agreement from its timed runs (the version comes from its engine)."""
    figures = RivalFigures()
    if ssp:
        figures.acceptance_rate = median(r.acceptance_rate for r in ssp)
        figures.alpha = alpha_estimate(sum(r.accepted for r in ssp), sum(r.rejections for r in ssp))
        if rsp:
            reference = {r.prompt_index: r.tokens for r in rsp}
            figures.agreement = sum(r.tokens == reference[r.prompt_index] for r in ssp) / len(ssp)
    return figures


def headline_timings(by: dict[str, list[EngineRun]], k: int, confidence: float = 0.0) -> list[PromptTiming]:
    """The timed runs that carry stats, as latency's per-completion records (one mode per engine label)."""
    timings = []
    for label, runs in by.items():
        modes = bench_modes([label], k, confidence)
        how = modes[label]
        timings += [PromptTiming(r.prompt_index, how.mode, how.k, r.stats, how.confidence, engine=how.engine)
                    for r in runs if r.stats is not None]
    return timings
