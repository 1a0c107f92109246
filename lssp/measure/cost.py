"""What a forward costs on this machine, by precision and by the number of tokens fed at once.

Speculative sampling pays off when scoring K+1 tokens in one target forward costs about as
much as scoring one. That holds where decoding is memory-bound (GPUs, CPUs with native bf16),
and fails where a precision is emulated: on an AVX2 CPU a bf16 forward of K+1 tokens costs
about K+1 times a 1-token one. These timings show which precision keeps verification cheap.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from statistics import median
from typing import Any

import torch
from transformers import PreTrainedModel

from lssp.decoding.kv import forward_logits, new_cache
from lssp.decoding.timing import Clock
from lssp.models.loading import LoadedModel, cpu_quantize
from lssp.models.modules import model_device
from lssp.models.registry import CPU_QUANTIZATIONS
from lssp.report.results import RunInfo, markdown_table

Progress = Callable[[str], None]  # called with what is being timed next


@dataclass
class ForwardCost:
    model: str
    precision: str
    tokens: int  # fed in one forward, after `context` cached tokens
    ms: float  # median over repeats
    relative: float  # ms ÷ the same precision's 1-token forward
    forward: str = "transformers"  # or "compact" (lssp.models.compact)


def with_precision(loaded: LoadedModel, precision: str) -> PreTrainedModel:
    """A copy of ``loaded``'s model in a float dtype or a CPU quantization (dynamic or weight-only)."""
    model = copy.deepcopy(loaded.model)
    if precision in CPU_QUANTIZATIONS:
        return cpu_quantize(model, replace(loaded.spec, quantization=precision))
    return model.to(getattr(torch, precision))


@torch.inference_mode()
def time_forwards(model: PreTrainedModel, token_counts: Sequence[int], context: int = 64, repeats: int = 15,
                  warmup: int = 3) -> dict[int, float]:
    """Median ms of a forward of n tokens on top of a ``context``-token cache, for each n."""
    device = model_device(model)
    clock = Clock.for_models(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab // 10, vocab // 2, (1, context + max(token_counts)), generator=generator).to(device)
    kv = new_cache(model)
    forward_logits(model, ids[:, :context], kv, 1)
    result = {}
    for n in token_counts:
        times = []
        for i in range(warmup + repeats):
            start = clock.now()
            forward_logits(model, ids[:, context: context + n], kv, n)
            if i >= warmup:
                times.append(clock.now() - start)
            kv.crop(-n)
        result[n] = 1000 * median(times)
    return result


def forward_costs(models: Sequence[LoadedModel], precisions: Sequence[str], token_counts: Sequence[int],
                  context: int = 64, repeats: int = 15, progress: Progress | None = None) -> list[ForwardCost]:
    """Every model under every precision (dynamic quantizations only on the CPU)."""
    counts = sorted({1, *token_counts})
    costs = []
    for loaded in models:
        for precision in precisions:
            if precision in CPU_QUANTIZATIONS and loaded.device.type != "cpu":
                continue
            if progress:
                progress(f"{loaded.name} in {precision}")
            model = with_precision(loaded, precision)
            ms = time_forwards(model, counts, context, repeats)
            forward = loaded.spec.forward
            costs += [ForwardCost(loaded.name, precision, n, ms[n], ms[n] / ms[1], forward) for n in counts]
            del model
    return costs


@dataclass
class CostRun:
    """A run of ``forward_costs`` with what it was asked and where it ran."""

    costs: list[ForwardCost]
    context: int
    repeats: int
    info: RunInfo = field(default_factory=RunInfo)

    def rows(self) -> list[dict[str, Any]]:
        return [{**self.info.head(), "engine": "ours", **asdict(c), "context": self.context, "repeats": self.repeats, **self.info.env}
                for c in self.costs]

    def markdown(self) -> str:
        return (f"# cost run {self.info.run_id}\n\n{self.info.describe()}; forwards of N tokens after {self.context} "
                f"cached, median of {self.repeats}\n\n"
                + markdown_table(self.rows(), ["model", "forward", "precision", "tokens", "ms", "relative"]))

    def cells(self) -> dict[tuple[str, str, str], dict[int, ForwardCost]]:
        """(model, forward, precision) → tokens → cost."""
        out: dict[tuple[str, str, str], dict[int, ForwardCost]] = {}
        for c in self.costs:
            out.setdefault((c.model, c.forward, c.precision), {})[c.tokens] = c
        return out

    def cost_ratios(self, target: str, target_forward: str, draft: str) -> dict[tuple[str, str], float]:
        """c = the draft's 1-token forward ÷ the target's (under its own forward), per (precision, draft forward)."""
        cells = self.cells()
        return {(precision, forward): cell[1].ms / cells[(target, target_forward, precision)][1].ms
                for (model, forward, precision), cell in cells.items()
                if model == draft and (target, target_forward, precision) in cells}


def run_costs(models: Sequence[LoadedModel], precisions: Sequence[str], token_counts: Sequence[int],
              context: int = 64, repeats: int = 15, progress: Progress | None = None) -> CostRun:
    costs = forward_costs(models, precisions, token_counts, context, repeats, progress)
    return CostRun(costs, context, repeats, RunInfo.here(models[0].device))
