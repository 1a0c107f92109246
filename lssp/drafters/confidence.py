"""The confidence stop as a wrapper over another drafter: K becomes a maximum.

The inner drafter stops proposing once its own (untempered) probability of the token it just proposed falls below
the threshold, like transformers' ``assistant_confidence_threshold``. The rule reads the draft alone, so sampling
stays exact.
"""
from __future__ import annotations

import torch

from lssp.decoding.kv import PrefixCache
from lssp.decoding.timing import Clock
from lssp.drafters.base import Drafter, Picker, Proposal


class ConfidenceStop(Drafter):
    def __init__(self, inner: Drafter, threshold: float) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"confidence threshold must be in (0, 1), got {threshold}")
        self.inner, self.threshold = inner, threshold
        self.needs_features = inner.needs_features

    @property
    def model(self) -> torch.nn.Module:
        return self.inner.model

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        self.inner.begin(seq, features, prefix, clock)

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        picker.stop_below = self.threshold
        return self.inner.propose(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        self.inner.commit(proposal, accepted, emitted, features)
