"""The context lookup (prompt lookup) as a wrapper over another drafter.

Where the text's last n tokens occurred before and the inner drafter is unsure of its own top token, the token
that followed their latest occurrence is proposed instead (greedy), or gets half of q's mass (sampling). q is
whatever the draft side proposes from, so the acceptance rule keeps SSp exact.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import argmax
from lssp.decoding.timing import Clock
from lssp.drafters.base import Drafter, DrafterWrapper, Picker, Proposal, probability

LOOKUP_BELOW = 0.5  # the lookup speaks only where the draft's own top probability is below this


class ContextLookup:
    """The token that followed the latest earlier occurrence of the text's last ``n`` tokens."""

    def __init__(self, n: int, tokens: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"lookup n-gram length must be >= 1, got {n}")
        self.n = n
        self.tokens: list[int] = []
        self.successor: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if len(self.tokens) >= self.n:
                self.successor[tuple(self.tokens[-self.n:])] = token
            self.tokens.append(token)

    def propose(self, drafted: Sequence[int] = ()) -> int | None:
        """The hint for the token after the text plus ``drafted``, or None where the n-gram is new."""
        tail = (self.tokens[-self.n:] + list(drafted))[-self.n:]
        return self.successor.get(tuple(tail)) if len(tail) == self.n else None


class LookupDrafter(DrafterWrapper):
    """``inner``'s drafts, with the context lookup over n-grams of length ``n`` where ``inner`` is unsure."""

    def __init__(self, inner: Drafter, n: int) -> None:
        super().__init__(inner)
        self.n = n
        self.context = ContextLookup(n, ())

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        self.context = ContextLookup(self.n, seq[0].tolist())
        self.inner.begin(seq, features, prefix, clock)

    def hint(self, drafted: Sequence[int], logits: torch.Tensor) -> int | None:
        """The lookup's token, where it has one and the draft is unsure of its own top token."""
        token = self.context.propose(drafted)
        if token is None or probability(logits, argmax(logits)) >= LOOKUP_BELOW:
            return None
        return token

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        picker.hint = self.hint
        return self.inner.propose(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        self.context.extend(emitted)
        self.inner.commit(proposal, accepted, emitted, features)
