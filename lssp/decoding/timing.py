"""Wall clocks that wait for every accelerator the models use before each reading."""
from __future__ import annotations

import time
import weakref
from collections.abc import Iterable

import torch

# A model's devices, found once: walking every weight takes ~10 ms for the default target (fused layers besides the
# Hugging Face modules), which a clock made per request (eval's one-at-a-time SSp) paid on every problem.
_devices_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _devices(model: torch.nn.Module) -> frozenset[torch.device]:
    first = next(iter(model.parameters()), None)
    key = first.device if first is not None else None  # a model moved since is walked again
    known = _devices_of.get(model)
    if known is None or known[0] != key:
        known = (key, frozenset(t.device for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"))
        _devices_of[model] = known
    return known[1]


def cuda_devices(*models: torch.nn.Module) -> list[torch.device]:
    """Every CUDA device holding a weight or buffer of these models (a split model spans several)."""
    return sorted(set().union(*(_devices(m) for m in models)), key=lambda d: d.index or 0)


class Clock:
    """``perf_counter`` that synchronizes each given CUDA device first, so queued kernels are counted.

    ``torch.cuda.synchronize()`` with no argument waits on the current device only: a model split
    over GPUs, or placed on ``cuda:1``, would be read before its work is done.

    ``per_forward`` False keeps the decode loop free of synchronizations: ``forward_now`` then
    reads nothing (0.0), so the draft/target split is not measured, and the CPU can queue the
    next kernels while the GPU works, as in a real decode loop. On the CPU there is nothing to
    synchronize, so forwards are always timed.
    """

    def __init__(self, devices: Iterable[torch.device | str] | torch.device | str = (), per_forward: bool = True) -> None:
        if isinstance(devices, (str, torch.device)):
            devices = [devices]
        found = {torch.device(d) for d in devices}
        self.cuda = sorted((d for d in found if d.type == "cuda"), key=lambda d: d.index or 0)
        self.per_forward = per_forward or not self.cuda

    @classmethod
    def for_models(cls, *models: torch.nn.Module, per_forward: bool = True) -> Clock:
        return cls(cuda_devices(*models), per_forward)

    def now(self) -> float:
        for device in self.cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def forward_now(self) -> float:
        """A reading around one forward: synchronized when forwards are timed, else 0.0."""
        return self.now() if self.per_forward else 0.0


def copy_bandwidth(device: torch.device | str, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of a large device-to-device copy (bytes read plus written)."""
    device = torch.device(device)
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    clock = Clock(device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = clock.now()
        dst.copy_(src)
        best = min(best, clock.now() - start)
    return 2 * src.numel() * src.element_size() / best
