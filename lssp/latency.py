"""Latency of RSp and SSp on a prompt list, measured side by side in one run."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import NamedTuple

import torch

from lssp.generation import GenerationStats, generate_regular, generate_speculative
from lssp.loading import LoadedModel
from lssp.sampling import SamplingParams
from lssp.stats import alpha_estimate

Progress = Callable[[str], None]  # called with a short description after each timed completion


@dataclass
class PromptTiming:
    """One timed completion of one prompt in one mode."""

    prompt_index: int
    mode: str
    k: int
    stats: GenerationStats
    confidence: float = 0.0  # SSp: the draft stops early below this own-probability (0: always k)
    lookup: int = 0  # SSp: n-gram length of the context lookup (0: off)


class Mode(NamedTuple):
    """One way of generating that a run times: rsp, or ssp with its drafting settings."""

    mode: str
    k: int = 0
    confidence: float = 0.0
    lookup: int = 0

    @property
    def name(self) -> str:
        return (self.mode + (f" k={self.k}" if self.k else "") + (f" p>={self.confidence:g}" if self.confidence else "")
                + (f" lookup={self.lookup}" if self.lookup else ""))


@dataclass
class ModeSummary:
    """Figures for one mode (rsp, or ssp at one k) over all prompts of a run."""

    mode: str
    k: int
    prompts: int
    new_tokens: int
    ms_per_token: float  # total decode time / total new tokens
    ms_per_token_median: float
    ms_per_token_min: float
    ms_per_token_max: float
    ttft_ms: float  # mean time to first token, prefill included
    acceptance_rate: float = float("nan")  # accepted / drafted
    alpha: float = float("nan")  # per-token acceptance of the i.i.d. model (accepted / (accepted + rejections))
    mean_accepted: float = float("nan")  # tokens per target forward (the bonus counted)
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_share: float = 0.0  # of decode time
    target_share: float = 0.0
    other_share: float = 0.0
    target_ms_per_forward: float = float("nan")
    draft_ms_per_forward: float = float("nan")
    speedup: float = float("nan")  # RSp ms/token / this ms/token, same run
    best: bool = False
    confidence: float = 0.0  # SSp: k is a maximum, drafting stops below this draft probability
    draft_forwards_per_iteration: float = float("nan")
    lookup: int = 0  # SSp: n-gram length of the context lookup (0: off)
    lookup_share: float = float("nan")  # of drafts, those the lookup proposed
    lookup_acceptance: float = float("nan")  # of those, the share accepted


def summarize(timings: Sequence[PromptTiming], how: Mode = Mode("rsp")) -> ModeSummary:
    mode, k = how.mode, how.k
    stats = [t.stats for t in timings]
    per_prompt = [s.ms_per_token for s in stats]
    tokens = sum(s.new_tokens for s in stats)
    decode = sum(s.decode_time_s for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    looked_up = sum(s.looked_up for s in stats)
    target_fw, draft_fw = sum(s.target_forwards for s in stats), sum(s.draft_forwards for s in stats)
    target_t, draft_t = sum(s.target_time_s for s in stats), sum(s.draft_time_s for s in stats)
    by_position = []
    if mode == "ssp":
        for i in range(k):
            d = sum(s.drafted_at[i] for s in stats)
            by_position.append(sum(s.accepted_at[i] for s in stats) / d if d else float("nan"))
    nan = float("nan")
    return ModeSummary(
        mode=mode, k=k, prompts=len(stats), new_tokens=tokens,
        ms_per_token=1000 * decode / tokens if tokens else nan,
        ms_per_token_median=median(per_prompt), ms_per_token_min=min(per_prompt), ms_per_token_max=max(per_prompt),
        ttft_ms=1000 * sum(s.ttft_s for s in stats) / len(stats),
        acceptance_rate=accepted / drafted if drafted else nan,
        alpha=alpha_estimate(accepted, sum(s.rejections for s in stats)),
        mean_accepted=tokens / target_fw if mode == "ssp" and target_fw else nan,
        acceptance_by_position=by_position,
        draft_share=draft_t / decode if decode else nan,
        target_share=target_t / decode if decode else nan,
        other_share=(decode - draft_t - target_t) / decode if decode else nan,
        target_ms_per_forward=1000 * target_t / target_fw if target_fw else nan,
        draft_ms_per_forward=1000 * draft_t / draft_fw if draft_fw else nan,
        confidence=how.confidence,
        draft_forwards_per_iteration=draft_fw / target_fw if mode == "ssp" and target_fw else nan,
        lookup=how.lookup,
        lookup_share=looked_up / drafted if how.lookup and drafted else nan,
        lookup_acceptance=sum(s.looked_up_accepted for s in stats) / looked_up if looked_up else nan,
    )


@dataclass
class LatencyRun:
    summaries: list[ModeSummary]
    timings: list[PromptTiming]

    @property
    def baseline(self) -> ModeSummary | None:
        return next((s for s in self.summaries if s.mode == "rsp"), None)

    @property
    def cost_ratio(self) -> float:
        """c: draft ms per forward / target ms per 1-token forward (from RSp)."""
        base = self.baseline
        drafts = [s.draft_ms_per_forward for s in self.summaries if s.mode == "ssp"]
        if base is None or not drafts:
            return float("nan")
        return median(drafts) / base.target_ms_per_forward


def run_latency(
    target: LoadedModel, draft: LoadedModel | None, prompts: Sequence[str], warmup_prompt: str, ks: Sequence[int], params: SamplingParams,
    max_new_tokens: int, seed: int, baseline: bool = True, vocab_size: int | None = None,
    progress: Progress | None = None, confidences: Sequence[float] = (0.0,), chat: bool = False,
    lookups: Sequence[int] = (0,),
) -> LatencyRun:
    """Time RSp and SSp (each k, draft confidence threshold and lookup length) on every prompt, interleaved prompt by prompt.

    Each completion runs to exactly ``max_new_tokens`` (no early stop at EOS), after one
    untimed warm-up completion per mode. ``chat`` feeds each prompt as a user turn in the
    target's chat template.
    """
    modes = [Mode("rsp")] if baseline or draft is None else []
    if draft is not None:
        modes += [Mode("ssp", k, c, n) for n in lookups for c in confidences for k in ks]

    def complete(how: Mode, text: str, index: int) -> GenerationStats:
        ids = target.encode(text, chat=chat)
        generator = torch.Generator(device=target.device).manual_seed(seed + index)
        if how.mode == "rsp":
            return generate_regular(target.model, ids, max_new_tokens, params, generator).stats
        return generate_speculative(target.model, draft.model, ids, max_new_tokens, how.k, params, generator,
                                    vocab_size=vocab_size, confidence=how.confidence, lookup=how.lookup).stats

    for how in modes:
        complete(how, warmup_prompt, -1)
        if progress:
            progress("warm-up " + how.name)
    timings = []
    for index, text in enumerate(prompts):
        for how in modes:
            timings.append(PromptTiming(index, how.mode, how.k, complete(how, text, index), how.confidence, how.lookup))
            if progress:
                progress(f"prompt {index + 1}/{len(prompts)} " + how.name)
    summaries = [summarize([t for t in timings if Mode(t.mode, t.k, t.confidence, t.lookup) == how], how) for how in modes]
    rsp = next((s for s in summaries if s.mode == "rsp"), None)
    ssp = [s for s in summaries if s.mode == "ssp"]
    for s in ssp:
        if rsp is not None:
            s.speedup = rsp.ms_per_token / s.ms_per_token
    if ssp:
        min(ssp, key=lambda s: s.ms_per_token).best = True
    return LatencyRun(summaries, timings)
