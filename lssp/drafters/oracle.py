"""An oracle draft: what a draft of a given quality would give in this loop (``lssp.measure.ceiling``).

It knows the target's greedy continuation of the prompt (from an RSp run) and proposes it, each draft right with
probability ``alpha`` by itself (a seeded draw per draft; else a wrong token), while a real drafter drafts the same
number of tokens alongside for its cost and its picks are thrown away: the target's forwards, the draft's and the
loop's own work are real, only which drafts are right is set. Greedy only: q is one-hot on each draft.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from lssp.decoding.drafting import Drafter, Picker, Proposal
from lssp.drafters.base import DrafterWrapper


class Oracle(DrafterWrapper):
    """Proposes ``reference`` (the target's greedy tokens after a prompt of ``prompt_length``), each draft right with
    probability ``alpha``; ``inner`` (a drafter proposing exactly K, no copying) drafts alongside for its cost."""

    def __init__(self, inner: Drafter, reference: Sequence[int], prompt_length: int, alpha: float, seed: int) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        super().__init__(inner)
        self.reference, self.prompt_length = list(reference), prompt_length
        self.alpha, self.rng = alpha, random.Random(seed)
        self.inner_proposal: Proposal | None = None

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        if not picker.params.greedy:
            raise ValueError("the oracle draft is greedy only")
        self.inner_proposal = self.inner.propose(seq, picker)
        at = seq.shape[1] - self.prompt_length
        tokens = []
        for i in range(len(self.inner_proposal)):
            right = self.reference[at + i] if at + i < len(self.reference) else 0
            tokens.append(right if self.rng.random() < self.alpha else wrong(right))
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=self.inner_proposal.tokens.device), None,
                        [False] * len(tokens), self.inner_proposal.forward_s)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        # The inner drafter keeps its own proposal's state (as many drafts, as many accepted).
        self.inner.commit(self.inner_proposal or proposal, accepted, emitted, features)


def wrong(token: int) -> int:
    """A token other than ``token`` (within any vocabulary that holds it and one more)."""
    return token - 1 if token > 0 else 1

