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
from lssp.decoding.timing import Clock, copy_bandwidth
from lssp.models.loading import LoadedModel, cpu_quantize
from lssp.models.modules import model_device
from lssp.models.registry import CPU_QUANTIZATIONS
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share
from lssp.report.results import RunInfo, markdown_table

Progress = Callable[[str], None]  # called with what is being timed next
BANDWIDTH_PROBE_MB = 256  # the copy that measures bandwidth: well past the caches


@dataclass
class ForwardCost:
    model: str
    precision: str
    tokens: int  # fed in one forward, after `context` cached tokens
    ms: float  # median over repeats
    relative: float  # ms ÷ the same precision's 1-token forward
    forward: str = "transformers"  # or "compact" (lssp.models.compact)
    weight_bytes: int = 0  # the Linear layers' weights a forward reads (as stored in this precision)
    floor_ms: float = float("nan")  # this machine's floor for the forward (``Floor``)
    bound: str = ""  # memory or compute: which limit sets the floor
    cache_bytes: int = 0  # the cached keys and values the forward reads (``context`` tokens' worth)

    @property
    def over_floor(self) -> float:
        """ms ÷ the floor: how far the forward is from what the machine can do."""
        return self.ms / self.floor_ms if self.floor_ms > 0 else float("nan")


def with_precision(loaded: LoadedModel, precision: str) -> PreTrainedModel:
    """A copy of ``loaded``'s model in a float dtype or a CPU quantization (dynamic or weight-only)."""
    model = copy.deepcopy(loaded.model)
    if precision in CPU_QUANTIZATIONS:
        return cpu_quantize(model, replace(loaded.spec, quantization=precision))
    return model.to(getattr(torch, precision))


@dataclass(frozen=True)
class Floor:
    """The least a forward of n tokens after ``context`` cached tokens can take here: its Linear layers' weights and
    the cached keys and values (which attention reads whole) read once at the machine's copy bandwidth, against the
    Linear layers' arithmetic (2 FLOPs per weight and token) at the throughput this precision's own kernel reaches
    on a large matmul; the larger of the two. Attention's arithmetic and the norms are left out, so the floor is
    below what any forward can reach."""

    weight_bytes: int
    weights: int  # weights of the Linear layers (FLOPs: 2 per weight and token)
    bandwidth: float  # bytes/s
    throughput: float  # FLOP/s of this precision's kernel
    cache_bytes: int = 0  # keys and values one cached token holds (``cache_bytes_per_token``)

    @classmethod
    def of(cls, model: torch.nn.Module, bandwidth: float, throughput: float) -> Floor:
        """The floor of ``model``'s forward: the Linear layers it runs, as stored, and its cache's dtype."""
        sizes = [stored_bytes(layer) for layer in linear_layers(model)]
        return cls(sum(b for b, _ in sizes), sum(w for _, w in sizes), bandwidth, throughput,
                   cache_bytes_per_token(model))

    def at(self, bandwidth: float) -> Floor:
        """The same floor at another bandwidth (a probe taken later)."""
        return replace(self, bandwidth=bandwidth)

    def ms(self, tokens: int, context: float = 0) -> tuple[float, str]:
        """ms of a forward of ``tokens`` tokens after ``context`` cached ones, and what bounds it."""
        memory = (self.weight_bytes + context * self.cache_bytes) / self.bandwidth
        compute = 2 * self.weights * tokens / self.throughput
        return 1000 * max(memory, compute), "memory" if memory >= compute else "compute"


def cache_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one cached token holds over every layer, in the dtype the model's cache keeps them
    (``cache_dtype`` where set, as the compact forward's float16 cache; else its embeddings'); 0 where the model
    says no shapes."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 0)
    if not heads or not hasattr(model, "get_input_embeddings"):
        return 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = getattr(model, "cache_dtype", None) or model.get_input_embeddings().weight.dtype
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Linear layers a forward of ``model`` runs (the compact forward: its fused ones and the output layer)."""
    from lssp.models.compact import CompactLlama

    if isinstance(model, CompactLlama):
        return [*model.qkv, *model.o, *model.gate_up, *model.down, model.hf.lm_head]
    return [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def stored_bytes(layer: torch.nn.Module) -> tuple[int, int]:
    """(bytes, weights) of one Linear-like layer as stored: float, weight-only (packed) or dynamic (prepacked)."""
    weights = layer.in_features * layer.out_features
    tensors = [t for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False))]
    if tensors:
        return sum(t.numel() * t.element_size() for t in tensors), weights
    packed = getattr(layer, "_packed_params", None)  # torch's dynamic quantization: fp16 or int8, prepacked
    return weights * (2 if packed is not None and packed.dtype == torch.float16 else 1), weights


def matmul_throughput(precision: str, size: int = 2048, tokens: int = 256, repeats: int = 3) -> float:
    """FLOP/s of ``precision``'s own Linear kernel on a ``size`` × ``size`` layer fed ``tokens`` tokens (compute
    bound)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    from lssp.models.registry import WEIGHT_ONLY_QUANTIZATIONS
    from lssp.models.weight_only import WEIGHT_ONLY_LAYERS

    weight = torch.randn(size, size) * 0.02
    if precision in WEIGHT_ONLY_QUANTIZATIONS:
        layer: torch.nn.Module = WEIGHT_ONLY_LAYERS[precision](weight)
        x = torch.randn(tokens, size)  # each layer takes it into its kernel's own dtype
    elif precision in ("dynamic-fp16", "dynamic-int8"):
        layer = torch.nn.Sequential(torch.nn.Linear(size, size, bias=False))
        with torch.no_grad():
            layer[0].weight.copy_(weight)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
            layer = quantize_dynamic(layer, {torch.nn.Linear}, dtype=torch.float16 if precision == "dynamic-fp16"
                                     else torch.qint8)
        x = torch.randn(tokens, size)
    else:
        dtype = getattr(torch, precision)
        layer = torch.nn.Linear(size, size, bias=False, dtype=dtype)
        x = torch.randn(tokens, size, dtype=dtype)
    clock = Clock(torch.device("cpu"))
    with torch.inference_mode():
        layer(x)
        best = float("inf")
        for _ in range(repeats):
            start = clock.now()
            layer(x)
            best = min(best, clock.now() - start)
    return 2 * size * size * tokens / best


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


ROW_BUDGET_SLACK = 0.25  # an automatic row budget: positions a forward takes for at most this much more than one
ROW_BUDGET_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)  # positions timed, until one costs more


@dataclass(frozen=True)
class RowBudget:
    """A row budget for batched SSp chosen by timing the target here (``row_budget``)."""

    rows: int  # positions a step verifies at most
    ms: dict[int, float]  # a forward's median ms by the positions it took
    ratio: dict[int, float]  # ÷ a one-token forward's: the median over turns of the two timed together

    def describe(self) -> str:
        """One line: the budget and the times it stands on."""
        over = min((n for n in self.ms if n > self.rows), default=None)
        return (f"row budget auto -> {self.rows} positions: a forward of {self.rows} took {self.ratio[self.rows]:.2f}x "
                f"one token's ({self.ms[self.rows]:.2f} ms against {self.ms[1]:.2f}; at most "
                f"{1 + ROW_BUDGET_SLACK:.2f}x)" + (f", of {over} {self.ratio[over]:.2f}x" if over else ""))


@torch.inference_mode()
def row_budget(model: PreTrainedModel, least: int, context: int = 64, rounds: int = 7) -> RowBudget:
    """The most positions one forward of ``model`` takes here for at most ROW_BUDGET_SLACK more time than a
    one-token forward, and at least ``least`` (one request's K + 1): where verifying more rows stops being nearly
    free. Each count is timed in ``rounds`` turns with the one-token forward, their ratio per turn (a host's
    bandwidth drifts from second to second), one row of n positions standing in for n rows of one."""
    ones: list[float] = []
    ms: dict[int, float] = {}
    ratio: dict[int, float] = {1: 1.0}
    for n in sorted({*ROW_BUDGET_COUNTS[1:], least}):
        turns = [time_forwards(model, [1, n], context, repeats=3, warmup=1) for _ in range(rounds)]
        ones += [t[1] for t in turns]
        ms[n] = median(t[n] for t in turns)
        ratio[n] = median(t[n] / t[1] for t in turns)  # each turn's pair in the same spell of the host
        if n >= least and ratio[n] > 1 + ROW_BUDGET_SLACK:
            break
    ms[1] = median(ones)
    return RowBudget(max(least, *(n for n, r in ratio.items() if r <= 1 + ROW_BUDGET_SLACK)), ms, ratio)


def forward_costs(models: Sequence[LoadedModel], precisions: Sequence[str], token_counts: Sequence[int],
                  context: int = 64, repeats: int = 15, progress: Progress | None = None,
                  limits: Limits | None = None) -> list[ForwardCost]:
    """Every model under every precision (CPU quantizations only on the CPU), with its floor where ``limits``."""
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
            floor = Floor.of(model, limits.bandwidth, limits.throughput.get(precision, float("nan"))) if limits else None
            for n in counts:
                cost = ForwardCost(loaded.name, precision, n, ms[n], ms[n] / ms[1], forward)
                if floor:
                    cost.floor_ms, cost.bound = floor.ms(n, context)
                    cost.weight_bytes, cost.cache_bytes = floor.weight_bytes, context * floor.cache_bytes
                costs.append(cost)
            del model
    return costs


@dataclass
class CostRun:
    """A run of ``forward_costs`` with what it was asked and where it ran."""

    costs: list[ForwardCost]
    context: int
    repeats: int
    info: RunInfo = field(default_factory=RunInfo)
    limits: Limits | None = None
    others_cpu_share: float = float("nan")  # share of the CPUs' time other work took while timing

    def rows(self) -> list[dict[str, Any]]:
        limits = self.limits
        return [{**self.info.head(), "engine": "ours", **asdict(c), "over_floor": c.over_floor,
                 "others_cpu_share": round(self.others_cpu_share, 3), "noisy": self.others_cpu_share > BUSY_SHARE,
                 "bandwidth_gbs": limits.bandwidth / 1e9 if limits else float("nan"),
                 "throughput_gflops": limits.throughput.get(c.precision, float("nan")) / 1e9 if limits else float("nan"),
                 "context": self.context, "repeats": self.repeats, **self.info.env}
                for c in self.costs]

    def markdown(self) -> str:
        return (f"# cost run {self.info.run_id}\n\n{self.info.describe()}; forwards of N tokens after {self.context} "
                f"cached, median of {self.repeats}\n\n"
                + markdown_table(self.rows(), ["model", "forward", "precision", "tokens", "ms", "relative", "floor_ms",
                                               "over_floor", "bound"]))

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


@dataclass(frozen=True)
class Limits:
    """This machine's copy bandwidth and each precision's large-matmul throughput (``Floor``)."""

    bandwidth: float  # bytes/s
    throughput: dict[str, float]  # precision -> FLOP/s


def machine_limits(models: Sequence[LoadedModel], precisions: Sequence[str]) -> Limits | None:
    """The limits on the CPU (None elsewhere: a GPU's are bench's)."""
    if models[0].device.type != "cpu":
        return None
    return Limits(copy_bandwidth("cpu", BANDWIDTH_PROBE_MB), {p: matmul_throughput(p) for p in precisions})


def bandwidth_probe() -> float:
    """This CPU's copy bandwidth now, in bytes/s: the short probe a latency run takes beside its completions (it
    drifts by a third from minute to minute on a shared machine)."""
    return copy_bandwidth("cpu", BANDWIDTH_PROBE_MB, repeats=3)


def model_floor(loaded: LoadedModel, bandwidth: float | None = None) -> tuple[Floor, str] | None:
    """The floor of one forward of ``loaded`` as it is (its precision, its forward) on this CPU, and that precision's
    name; None on a GPU or for a model whose weights are not here (another engine's)."""
    if loaded.device.type != "cpu" or not isinstance(getattr(loaded, "model", None), torch.nn.Module):
        return None
    quantization = loaded.spec.quantization
    precision = quantization if quantization in CPU_QUANTIZATIONS else loaded.dtype
    floor = Floor.of(loaded.model, bandwidth or bandwidth_probe(), float("nan"))
    if not floor.weight_bytes:
        return None
    return replace(floor, throughput=matmul_throughput(precision)), precision


def run_costs(models: Sequence[LoadedModel], precisions: Sequence[str], token_counts: Sequence[int],
              context: int = 64, repeats: int = 15, progress: Progress | None = None) -> CostRun:
    if progress:
        progress("the machine's bandwidth and matmul throughput")
    start = cpu_snapshot()
    limits = machine_limits(models, precisions)
    costs = forward_costs(models, precisions, token_counts, context, repeats, progress, limits)
    return CostRun(costs, context, repeats, RunInfo.for_models(*models), limits,
                   others_share(start, cpu_snapshot()))
