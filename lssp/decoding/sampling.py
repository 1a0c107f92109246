"""Sampling parameters and the one function that turns logits into a distribution."""
from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch

from lssp.errors import UserError
from lssp.kernels import kernel_isa, kernel_unavailable
from lssp.models.sources import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. ``temperature == 0`` means greedy decoding."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature == float("inf"):  # nan compares false
            raise UserError(f"--temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        """The options as a user types them: "greedy", "T=0.7 top-k 50"."""
        if self.greedy:
            return "greedy"
        return " ".join([f"T={self.temperature:g}"] + ([f"top-k {self.top_k}"] if self.top_k else [])
                        + ([f"top-p {self.top_p:g}"] if self.top_p < 1 else []))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (first maximum on ties). On the CPU it runs through NumPy, whose
    vectorized argmax takes ~5 us over a 49k vocabulary where torch's takes ~50 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))
    return logits.argmax(-1)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float32, same shape as ``logits``) after temperature, top-k and top-p.

    Greedy gives the one-hot distribution of the argmax, so speculative sampling's
    acceptance rule and residual reduce exactly to greedy verification.
    """
    if params.greedy:
        probs = torch.zeros_like(logits, dtype=torch.float32)
        return probs.scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
    if params.top_k == 0 and params.top_p == 1.0 and on_kernel(logits):
        rows = torch.ops.lssp.softmax_rows(logits.reshape(-1, logits.shape[-1]), params.temperature)
        return rows.reshape(logits.shape)
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` (shape ``probs.shape[:-1]``)."""
    if params.greedy:
        return argmax(probs)
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, device=flat.device, generator=generator)
    return inverse_cdf(probs, u)


@functools.cache
def cpu_sampling() -> bool:
    """Whether sampling on this CPU runs through our kernel (``softmax_rows``, ``draw_from``: the rule its drafting
    chain draws by), building it the first time; False where it cannot run here (torch's ops then sample)."""
    if not kernel_isa():
        return False
    reason = kernel_unavailable(cache_root() / "kernels")
    if reason:
        log.warning("sampling through torch: %s", reason)
    return reason is None


def on_kernel(t: torch.Tensor) -> bool:
    """Whether sampling from ``t`` runs through our CPU kernel (float32 on a CPU it runs on): softmax in one pass
    and the draw over blocks, ~30 us a row of 49k tokens where torch's softmax and float64 cumsum took ~120."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and cpu_sampling()


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` that uniforms ``u`` (float64 in [0, 1), one per row) pick: the first
    whose cumulative probability exceeds u × the row's total. A zero-probability token never is (its CDF equals
    its predecessor's). ~0.1 ms over 49k tokens through torch, where torch.multinomial takes ~1.2 ms. The sum runs in
    float64 so rounding cannot shift the tail's mass; the clamp covers u * total rounding up to total (~1e-16)."""
    if on_kernel(probs):
        flat, points = probs.reshape(-1, probs.shape[-1]), u.reshape(-1).tolist()
        picked = [torch.ops.lssp.draw_from(row, None, point) for row, point in zip(flat, points)]
        return torch.tensor(picked, dtype=torch.long).reshape(probs.shape[:-1])
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)
    point = u.reshape(-1, 1).to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, point, right=True).clamp_(max=flat.shape[-1] - 1).reshape(probs.shape[:-1])


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """``sample_logits`` of one row (1, vocab) as a Python int; greedy on a CPU by NumPy alone, no torch op."""
    if params.greedy and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.detach().numpy().argmax())
    return int(sample_logits(logits, params, generator)[0])


def sample_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A token from the warped distribution of ``logits``; greedy takes the argmax without building it."""
    if params.greedy:
        return argmax(logits)
    return sample(warp(logits, params), params, generator)
