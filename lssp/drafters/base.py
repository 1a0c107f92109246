"""The drafter interface (``lssp.decoding.drafting``, below the loops that use it), and a wrapper to build on."""
from __future__ import annotations

import torch

from lssp.decoding.drafting import Drafter, DraftRows, Picker, PickPolicy, Proposal, probability
from lssp.decoding.kv import PrefixCache
from lssp.decoding.timing import Clock

__all__ = ["DraftRows", "Drafter", "DrafterWrapper", "PickPolicy", "Picker", "Proposal", "probability"]


class DrafterWrapper(Drafter):
    """A drafter that hands everything to ``inner`` (one completion at a time): override what it changes."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__()
        self.inner = inner
        self.needs_features = inner.needs_features

    @property
    def model(self) -> torch.nn.Module | None:
        return self.inner.model

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def longest(self, k: int) -> int:
        return self.inner.longest(k)

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        self.inner.begin(seq, features, prefix, clock)

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        return self.inner.propose(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        self.inner.commit(proposal, accepted, emitted, features)

    def skip(self, emitted: list[int], features: torch.Tensor | None) -> None:
        self.inner.skip(emitted, features)

    def start(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None,
              clock: Clock) -> None:
        self.inner.start(seq, features, prefix, clock)

    def draft(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        return self.inner.draft(seq, picker)

    def advance(self, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        self.inner.advance(proposal, accepted, features)
