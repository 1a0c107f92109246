"""The confidence stop as a wrapper over another drafter: K becomes a maximum.

The inner drafter stops proposing once its own (untempered) probability of the token it just proposed falls below
the threshold, like transformers' ``assistant_confidence_threshold``. The rule reads the draft alone, so sampling
stays exact.
"""
from __future__ import annotations

import torch

from lssp.drafters.base import Drafter, DrafterWrapper, Picker, Proposal


class ConfidenceStop(DrafterWrapper):
    def __init__(self, inner: Drafter, threshold: float) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"confidence threshold must be in (0, 1), got {threshold}")
        super().__init__(inner)
        self.threshold = threshold

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        picker.stop_below = self.threshold
        return self.inner.propose(seq, picker)
