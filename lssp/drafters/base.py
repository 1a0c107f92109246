"""The drafter interface: what the SSp loop asks of whatever proposes tokens.

A drafter is begun once per completion (``begin``), then each iteration proposes up to k tokens with the law q
they were drawn from (``propose``) and is told what the target kept (``commit``). How a draft token comes out of
the drafter's logits is the ``Picker``'s job, so wrappers (the context lookup, the confidence stop) change the
picking of any drafter without knowing how it computes its logits.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import SamplingParams, argmax, sample, warp
from lssp.decoding.timing import Clock

LOOKUP_WEIGHT = 0.5  # sampling: the share of q moved onto a hinted token

# A hint: given the drafts so far this iteration and the draft's logits at the next position, a token to propose
# instead of the draft's own choice, or None.
Hint = Callable[[Sequence[int], torch.Tensor], "int | None"]


@dataclass
class Proposal:
    """What a drafter proposed in one iteration."""

    tokens: torch.Tensor  # (n,) on the target's device
    q: torch.Tensor | None  # (n, vocab): the law each draft was drawn from (None when greedy: q is one-hot)
    looked_up: list[bool]  # per draft: proposed (greedy) or reweighted (sampling) by a hint
    forward_s: float = 0.0  # time in the drafter's forwards (0 where forwards are not timed)

    def __len__(self) -> int:
        return self.tokens.shape[0]


def probability(logits: torch.Tensor, token: torch.Tensor | int) -> float:
    """softmax(logits)[token], read on the host."""
    return float((logits[token].float() - logits.float().logsumexp(-1)).exp())


class Picker:
    """Turns the drafter's logits at each position into a draft, up to ``k`` of them: the argmax (greedy) or a draw
    from q = the warped logits. A ``hint`` replaces the argmax, or gets LOOKUP_WEIGHT of q; ``stop_below`` > 0 ends
    the proposal once the draft's own (untempered) probability of its token falls below it (K becomes a maximum;
    the rule reads the draft alone, so sampling stays exact)."""

    def __init__(self, k: int, vocab: int, params: SamplingParams, generator: torch.Generator | None,
                 device: torch.device) -> None:
        self.k, self.vocab, self.params, self.generator, self.device = k, vocab, params, generator, device
        self.tokens = torch.empty(k, dtype=torch.long, device=device)
        self.q = None if params.greedy else torch.empty(k, vocab, device=device)
        self.looked_up: list[bool] = []
        self.drafted: list[int] = []  # the drafts on the host, kept for hints
        self.hint: Hint | None = None
        self.stop_below = 0.0

    @property
    def done(self) -> bool:
        return len(self.looked_up) >= self.k

    def add(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft from the drafter's ``logits`` (vocab,) at its position; returns it (to feed next)."""
        i = len(self.looked_up)
        logits = logits[:self.vocab]
        hint = self.hint(self.drafted, logits) if self.hint else None
        if self.q is None:
            self.tokens[i] = argmax(logits).to(self.device) if hint is None else hint
        else:
            self.q[i] = warp(logits.unsqueeze(0).to(self.device), self.params)[0]
            if hint is not None:
                self.q[i] *= 1 - LOOKUP_WEIGHT
                self.q[i, hint] += LOOKUP_WEIGHT
            self.tokens[i] = sample(self.q[i], self.params, self.generator)
        self.looked_up.append(hint is not None)
        if self.hint:
            self.drafted.append(int(self.tokens[i]))
        if self.stop_below and hint is None and i + 1 < self.k and probability(logits, self.tokens[i]) < self.stop_below:
            self.k = i + 1
        return self.tokens[i]

    def proposal(self, forward_s: float = 0.0) -> Proposal:
        n = len(self.looked_up)
        return Proposal(self.tokens[:n], self.q[:n] if self.q is not None else None, self.looked_up, forward_s)


class Drafter(ABC):
    """Proposes tokens for one completion at a time, its state kept in step with the target's."""

    needs_features = False  # whether commit() takes the target's final hidden states

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The module whose forwards draft (for clocks and devices)."""

    @property
    def ready(self) -> bool:
        """Whether it can propose now (a feature head waits for the target's first feature)."""
        return True

    @abstractmethod
    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        """Start a completion of ``seq`` (1, T); ``features``: the target's of all but its last token (or None)."""

    @abstractmethod
    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        """Drafts for the text ``seq`` until ``picker`` is done."""

    @abstractmethod
    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        """The target kept ``accepted`` drafts and emitted ``emitted``; ``features``: its hidden states of the
        positions it fed that stay valid."""


class DrafterWrapper(Drafter):
    """A drafter that changes how ``inner`` picks (a hook on the picker) and hands everything else to it."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
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
        return self.inner.propose(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        self.inner.commit(proposal, accepted, emitted, features)
