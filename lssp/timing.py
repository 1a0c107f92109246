"""Wall clocks that wait for the accelerator before every reading."""
from __future__ import annotations

import time

import torch


class Clock:
    """``perf_counter`` that synchronizes CUDA first, so queued kernels are counted."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

