"""How good must the draft be? SSp with an oracle draft of set acceptance (``lssp.drafters.oracle``) against RSp
and the real drafter, in one interleaved run of our engine, greedy.

Every prompt is first completed by RSp (the reference the oracle proposes from); then, pass after pass, each prompt
is completed by RSp, by the real drafter at each K and by the oracle at each alpha and K, in an order that turns
with the prompt and the pass. Each completion runs its whole budget (end tokens ignored) and its ms/token counts
after its first emission. A speedup is the geometric mean of the per-completion ratios RSp ms / SSp ms, with a 95%
t interval (``ratio_interval``); ``alpha_needed`` reads where the oracle's speedup crosses a bar.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lssp.decoding.drafting import Drafter
from lssp.decoding.generation import GenerationOutput, generate_regular
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import drafter_for
from lssp.drafters.oracle import Oracle
from lssp.models.loading import LoadedModel, encode_prompt
from lssp.report.contention import cpu_snapshot, others_share
from lssp.report.results import RunInfo, markdown_table
from lssp.report.stats import alpha_estimate, ratio_interval
from lssp.workloads.tasks import TaskPrompt

GREEDY = SamplingParams(temperature=0.0)
ALL = "all"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Arm:
    """One way of completing: RSp (k 0), a real draft (``draft``, alpha None) or the oracle at ``alpha`` (drafting
    alongside ``draft``), at draft length k."""

    k: int = 0
    alpha: float | None = None
    oracle: bool = False
    draft: str = ""

    @property
    def name(self) -> str:
        if not self.k:
            return "rsp"
        return f"oracle alpha={self.alpha:g} k={self.k}" if self.oracle else f"{self.draft} k={self.k}"


@dataclass
class CeilingCell:
    """An arm's figures over one task's completions (or all of them)."""

    task: str
    arm: str
    draft: str  # the real draft timed, or the one drafting alongside the oracle
    k: int
    alpha: float | None  # the oracle's set alpha; None for a real draft
    ms_per_token: float
    speedup: float
    speedup_low: float
    speedup_high: float
    tokens_per_forward: float
    measured_alpha: float  # accepted / (accepted + rejections): alpha of the i.i.d. model


@dataclass
class CeilingRun:
    drafts: list[str]  # the real drafts timed; the first drafts alongside the oracle
    cells: list[CeilingCell]
    rsp_ms: dict[str, float]  # by task, and ALL
    prompts: int
    repeats: int
    max_new_tokens: int
    not_equal: int  # completions whose tokens differ from RSp's (greedy SSp must give none)
    info: RunInfo = field(default_factory=RunInfo)
    others_cpu_share: float = 0.0
    interrupted: bool = False  # Ctrl-C: the cells cover the completions done by every way
    completions: int = 0  # of each way (prompts × passes where not interrupted)

    def cell(self, task: str, k: int, alpha: float | None, draft: str | None = None) -> CeilingCell:
        """The oracle's cell at ``alpha``, or (alpha None) ``draft``'s (default: the first)."""
        draft = draft or self.drafts[0]
        return next(c for c in self.cells if c.task == task and c.k == k and c.alpha == alpha
                    and (alpha is not None or c.draft == draft))

    def ways(self) -> list[tuple[str, float | None, str]]:
        """(label, alpha, draft) of each way, in the order shown: each real draft, then the oracle by alpha."""
        return ([(d, None, d) for d in self.drafts]
                + [(f"oracle α={a:g}", a, self.drafts[0]) for a in self.alphas])

    @property
    def ks(self) -> list[int]:
        return sorted({c.k for c in self.cells})

    @property
    def tasks(self) -> list[str]:
        """The tasks of the prompts, without ALL."""
        return sorted({c.task for c in self.cells} - {ALL})

    @property
    def alphas(self) -> list[float]:
        return sorted({c.alpha for c in self.cells if c.alpha is not None})

    def alpha_needed(self, bar: float, task: str = ALL) -> dict[int, float | None]:
        """By K, the oracle's alpha where its speedup on ``task`` first reaches ``bar`` (linear between the alphas
        measured; None where none reaches it)."""
        return {k: crossing([(a, self.cell(task, k, a).speedup) for a in self.alphas], bar) for k in self.ks}

    def rows(self) -> list[dict[str, Any]]:
        return [{**self.info.head(), **asdict(c), "rsp_ms_per_token": self.rsp_ms[c.task],
                 "prompts": self.prompts, "repeats": self.repeats, "max_new_tokens": self.max_new_tokens,
                 "not_equal_to_rsp": self.not_equal, "others_cpu_share": round(self.others_cpu_share, 3),
                 "interrupted": self.interrupted, "completions": self.completions,
                 **self.info.env} for c in self.cells]

    def markdown(self) -> str:
        columns = ["drafting"] + [f"K={k}" for k in self.ks]
        rows = [{"drafting": label, **{f"K={k}": cell_text(self.cell(ALL, k, a, d)) for k in self.ks}}
                for label, a, d in self.ways()]
        return (f"# Ceiling run {self.info.run_id}\n\n{self.info.env.get('device', '')} · RSp "
                f"{self.rsp_ms[ALL]:.2f} ms/token · {self.prompts} prompts × {self.repeats} passes, greedy\n\n"
                + markdown_table(rows, columns))


def cell_text(c: CeilingCell) -> str:
    interval = "no interval" if math.isnan(c.speedup_low) else f"[{c.speedup_low:.2f}-{c.speedup_high:.2f}]"
    return f"{c.speedup:.2f}× {interval}, {c.tokens_per_forward:.2f} tok/fwd"


def crossing(points: Sequence[tuple[float, float]], bar: float) -> float | None:
    """The x where y first reaches ``bar`` along the (x, y) points in x order, linear between them."""
    points = sorted(points)
    if points and points[0][1] >= bar:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= bar:
            return round(x0 + (x1 - x0) * (bar - y0) / (y1 - y0), 3)
    return None


def arms_of(drafts: Sequence[str], ks: Sequence[int], alphas: Sequence[float]) -> list[Arm]:
    return ([Arm()] + [Arm(k, draft=d) for d in drafts for k in ks]
            + [Arm(k, a, True, drafts[0]) for a in alphas for k in ks])


def run_ceiling(target: LoadedModel, drafts: Sequence[LoadedModel], make_drafter: Callable[[LoadedModel], Drafter],
                prompts: Sequence[TaskPrompt], ks: Sequence[int], alphas: Sequence[float], repeats: int = 2,
                max_new_tokens: int = 64, seed: int = 0, progress: Progress | None = None) -> CeilingRun:
    """RSp, each real draft (``make_drafter``: a fresh drafter over it per completion) at each K, and the oracle at
    each alpha and K (the first draft's model drafting alongside, no copying), over ``prompts`` ``repeats`` times,
    interleaved."""
    model, names = target.model, [d.spec.name for d in drafts]
    by_name, arms = dict(zip(names, drafts)), arms_of(names, ks, alphas)
    ids = [torch.tensor([encode_prompt(target.tokenizer, p.text, p.chat)]) for p in prompts]
    start = cpu_snapshot()
    outs: dict[Arm, list[tuple[str, GenerationOutput]]] = {arm: [] for arm in arms}
    not_equal, interrupted = 0, False
    with torch.inference_mode():
        references = [generate_regular(model, x, max_new_tokens, GREEDY, time_forwards=False).tokens.tolist()
                      for x in ids]
        try:
            for rep in range(repeats):
                for i, (prompt, x) in enumerate(zip(prompts, ids)):
                    if progress:
                        progress(f"pass {rep + 1} of {repeats}, prompt {i + 1} of {len(prompts)}")
                    turn = (i + rep) % len(arms)
                    for arm in arms[turn:] + arms[:turn]:
                        if not arm.k:
                            out = generate_regular(model, x, max_new_tokens, GREEDY, time_forwards=False)
                        else:
                            drafter = make_drafter(by_name[arm.draft]) if not arm.oracle else Oracle(
                                drafter_for(drafts[0].model), references[i], x.shape[1], arm.alpha,
                                seed + 1000 * rep + i)
                            out = speculative_decode(model, drafter, x, max_new_tokens, arm.k, GREEDY,
                                                     time_forwards=False)
                        not_equal += out.tokens.tolist() != references[i]
                        outs[arm].append((prompt.task, out))
        except KeyboardInterrupt:  # keep the prompts every way completed; none: nothing to keep
            done = min(len(o) for o in outs.values())
            if not done:
                raise
            outs, interrupted = {arm: o[:done] for arm, o in outs.items()}, True
    done_prompts = [task for task, _ in outs[arms[0]]]
    cells, rsp_ms = summarize(outs, arms, sorted(set(done_prompts)))
    return CeilingRun(names, cells, rsp_ms, len(prompts), repeats, max_new_tokens, not_equal,
                      RunInfo.for_models(target, *drafts), others_share(start, cpu_snapshot()), interrupted,
                      len(done_prompts))


def per_token_ms(out: GenerationOutput) -> float:
    """ms per token after the completion's first emission."""
    s = out.stats
    return 1000 * (s.total_time_s - s.ttft_s) / max(s.new_tokens - s.first_emission_tokens, 1)


def summarize(outs: dict[Arm, list[tuple[str, GenerationOutput]]], arms: Sequence[Arm],
              tasks: Sequence[str]) -> tuple[list[CeilingCell], dict[str, float]]:
    """Each SSp arm's cell per task and over all; RSp's mean ms/token per task and over all. The arms' completions
    are in the same order (prompt by prompt, pass by pass), so the i-th of each pair up."""
    rsp = outs[arms[0]]
    cells, rsp_ms = [], {}
    for task in [*tasks, ALL]:
        mine = [i for i, (t, _) in enumerate(rsp) if task in (t, ALL)]
        rsp_ms[task] = sum(per_token_ms(rsp[i][1]) for i in mine) / len(mine)
        for arm in arms[1:]:
            done = [outs[arm][i][1] for i in mine]
            ratio = ratio_interval([(per_token_ms(rsp[i][1]), per_token_ms(o)) for i, o in zip(mine, done)])
            stats = [o.stats for o in done]
            cells.append(CeilingCell(
                task, arm.name, arm.draft, arm.k, arm.alpha if arm.oracle else None,
                round(sum(per_token_ms(o) for o in done) / len(done), 3), round(ratio.estimate, 3),
                round(ratio.low, 3), round(ratio.high, 3),
                round(sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats), 3),
                round(alpha_estimate(sum(s.accepted for s in stats), sum(s.rejections for s in stats)), 3)))
    return cells, rsp_ms
