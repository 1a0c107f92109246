"""The drafter interface: what the SSp loops (one completion, or the rows of a batch) ask of whatever proposes tokens.

A drafter is begun once per completion (``begin``), then each iteration proposes up to k tokens with the law q
they were drawn from (``propose``) and is told what the target kept (``commit``); for a batch it begins the rows'
state (``begin_rows``: a ``DraftRows``), which proposes for every row at once and commits, keeps and merges rows.
How a draft token comes out of the drafter's logits is the ``Picker``'s job, and ``PickPolicy``s (the context lookup,
the confidence stop) change the picking of any drafter, row by row, without knowing how it computes its logits.
The drafters themselves live in ``lssp.drafters``; this interface sits here, below the loops that use it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
                 device: torch.device, room: int = 0) -> None:
        self.k, self.vocab, self.params, self.generator, self.device = k, vocab, params, generator, device
        self.room = max(k, room)  # the most this iteration may draft (a copied chain may run past k)
        self.q = None if params.greedy else torch.empty(k, vocab, device=device)
        self.looked_up: list[bool] = []
        self.drafted: list[int] = []  # the drafts, on the host
        self.hint: Hint | None = None
        self.stop_below = 0.0

    @property
    def done(self) -> bool:
        return len(self.looked_up) >= self.k

    @property
    def plain(self) -> bool:
        """Whether each draft is the drafter's own argmax, or a draw from its logits at the temperature alone (no
        top-k or top-p), with no hint or stop reading them: a drafter may then pick them all itself (``extend``)."""
        return self.hint is None and not self.stop_below and self.params.top_k == 0 and self.params.top_p == 1.0

    def uniforms(self) -> torch.Tensor:
        """The uniforms (k,) float64 that ``add`` would draw for k sampled drafts, one after the other."""
        return torch.cat([torch.rand(1, dtype=torch.float64, device=self.device, generator=self.generator)
                          for _ in range(self.k)])

    def extend(self, drafts: Sequence[int], q: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> None:
        """Add the drafts a drafter picked itself where ``plain`` (what ``add`` would have picked): its argmaxes, or
        its draws with their laws ``q`` (one row per draft) over the vocabulary ids ``ids`` (None: the first
        columns)."""
        if q is not None:
            rows = self.q[len(self.drafted):len(self.drafted) + len(drafts)].zero_()
            if ids is None:
                rows[:, :q.shape[1]] = q
            else:
                rows.index_copy_(1, ids.to(self.device), q.to(self.device))
        self.drafted += drafts
        self.looked_up += [False] * len(drafts)

    def fresh(self, k: int) -> Picker:
        """A fresh picker for the same iteration drafting up to ``k`` (``room``: a copied chain's; 0: none)."""
        return Picker(k, self.vocab, self.params, self.generator, self.device)

    def add(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> int:
        """The next draft from the drafter's ``logits`` at its position (its own width: where narrower than the
        target's ``vocab``, the tokens beyond it get q = 0, never drafted, and the residual keeps their mass; with
        ``ids``, the increasing vocabulary ids of its columns, every other token gets q = 0: sampled over those
        columns alone, the same draw as over the widened row); returns it (to feed next)."""
        i = len(self.looked_up)
        logits = logits[:self.vocab] if ids is None else logits
        hint = self.hint(self.drafted, logits) if self.hint else None  # a hint reads the top probability alone
        if self.q is None:  # greedy: on the host, a few ints
            column = int(argmax(logits)) if hint is None else None
            token = hint if column is None else column if ids is None else int(ids[column])
        elif ids is not None and hint is None:
            narrow = warp(logits.unsqueeze(0).to(self.device), self.params)[0]
            self.q[i].zero_().index_copy_(0, ids.to(self.device), narrow)
            column = int(sample(narrow, self.params, self.generator))
            token = int(ids[column])
        else:
            if ids is not None:
                logits = logits.new_full((self.vocab,), float("-inf")).index_copy_(0, ids, logits)
            width = logits.shape[-1]
            self.q[i, :width] = warp(logits.unsqueeze(0).to(self.device), self.params)[0]
            self.q[i, width:] = 0.0  # the target's tokens beyond the draft's logits: never drafted
            if hint is not None:
                self.q[i] *= 1 - LOOKUP_WEIGHT
                self.q[i, hint] += LOOKUP_WEIGHT
            token = column = int(sample(self.q[i], self.params, self.generator))
        self.looked_up.append(hint is not None)
        self.drafted.append(token)
        if self.stop_below and hint is None and i + 1 < self.k and probability(logits, column) < self.stop_below:
            self.k = i + 1
        return token

    def add_certain(self, token: int) -> int:
        """Add ``token`` with q one-hot on it (a copied token): what ``add`` gives for logits of -inf but at
        ``token`` (no hint or stop speaks where the draft is certain), without building them or drawing a uniform
        (a one-hot law leaves nothing to draw)."""
        if self.q is not None:
            self.q[len(self.looked_up)].zero_()[token] = 1.0
        self.looked_up.append(False)
        self.drafted.append(token)
        return token

    def proposal(self, forward_s: float = 0.0) -> Proposal:
        n = len(self.looked_up)
        tokens = torch.tensor(self.drafted, dtype=torch.long, device=self.device)
        return Proposal(tokens, self.q[:n] if self.q is not None else None, self.looked_up, forward_s)


class PickPolicy(ABC):
    """A rule that changes how a drafter picks (a hook on each iteration's ``Picker``), with a state per row."""

    def start(self, prompt: Sequence[int]) -> Any:
        """This policy's state for a row whose text starts as ``prompt``."""
        return None

    @abstractmethod
    def prepare(self, state: Any, picker: Picker) -> None:
        """Hook the row's picker before it drafts."""

    def commit(self, state: Any, emitted: Sequence[int]) -> None:  # noqa: B027 - most policies keep no state
        """The row's text grew by ``emitted``."""


class PolicyRows:
    """Every row's state of each of ``policies``: what a one-row completion and a batch's rows share."""

    def __init__(self, policies: Sequence[PickPolicy], prompts: Sequence[Sequence[int]]) -> None:
        self.policies = list(policies)
        self.states = [[policy.start(prompt) for policy in self.policies] for prompt in prompts]

    def prepare(self, row: int, picker: Picker) -> None:
        for policy, state in zip(self.policies, self.states[row]):
            policy.prepare(state, picker)

    def commit(self, row: int, emitted: Sequence[int]) -> None:
        for policy, state in zip(self.policies, self.states[row]):
            policy.commit(state, emitted)

    def keep(self, rows: Sequence[int]) -> None:
        self.states = [self.states[r] for r in rows]

    def merge(self, other: PolicyRows) -> None:
        self.states += other.states


class DraftRows(ABC):
    """A drafter's state for the rows of a batch: it drafts for every row at once, each row as it would alone."""

    def __init__(self, policies: PolicyRows) -> None:
        self.policies = policies

    def ready(self, row: int) -> bool:
        """Whether ``row`` can propose now (a feature head waits for the target's first feature)."""
        return True

    def caches(self) -> list[Any]:
        """The row caches it keeps (``lssp.decoding.batched.RowCache``), which the batch repacks."""
        return []

    def propose(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]:
        """Each row's drafts for its text ``seqs[r]`` until ``pickers[r]`` is done (a picker of k 0: none)."""
        for r, picker in enumerate(pickers):
            self.policies.prepare(r, picker)
        return self.draft(seqs, pickers)

    def commit(self, row: int, proposal: Proposal, accepted: int, emitted: Sequence[int],
               features: torch.Tensor | None) -> None:
        """The target kept ``accepted`` of ``row``'s drafts and emitted ``emitted``; ``features``: its hidden states
        of the positions it fed that stay valid."""
        self.policies.commit(row, emitted)
        self.advance(row, proposal, accepted, features)

    def skip(self, row: int, emitted: Sequence[int], features: torch.Tensor | None) -> None:
        """An iteration of ``row`` another drafter proposed (a mix, per iteration), as ``Drafter.skip``."""
        self.policies.commit(row, emitted)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (increasing) of the batch."""
        self.policies.keep(rows)
        self.keep_rows(rows)

    def merge(self, other: DraftRows) -> None:
        """Add ``other``'s rows (begun apart: rows joining a running batch) below these."""
        self.policies.merge(other.policies)
        self.merge_rows(other)

    @abstractmethod
    def draft(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]: ...

    @abstractmethod
    def advance(self, row: int, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None: ...

    @abstractmethod
    def keep_rows(self, rows: list[int]) -> None: ...

    @abstractmethod
    def merge_rows(self, other: DraftRows) -> None: ...


class Drafter(ABC):
    """Proposes tokens for speculative sampling, one method per class: for one completion at a time (``begin``,
    ``propose``, ``commit``), and, where ``rows_reason`` is None, for the rows of a batch (``begin_rows``). Its
    ``policies`` change its picks in both."""

    needs_features = False  # whether it reads the target's final hidden states

    def __init__(self, policies: Sequence[PickPolicy] = ()) -> None:
        self.policies = list(policies)
        self.policy_states = PolicyRows(self.policies, [[]])  # one completion's policy states

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module | None:
        """The module whose forwards draft (for clocks and devices), or None: a drafter without a model."""

    @property
    def ready(self) -> bool:
        """Whether it can propose now (a feature head waits for the target's first feature)."""
        return True

    def longest(self, k: int) -> int:
        """The most drafts it proposes in one iteration at draft length ``k``."""
        return k

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        """Start a completion of ``seq`` (1, T); ``features``: the target's of all but its last token (or None)."""
        self.policy_states = PolicyRows(self.policies, [seq[0].tolist()])
        self.start(seq, features, prefix, clock)

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        """Drafts for the text ``seq`` until ``picker`` is done."""
        self.policy_states.prepare(0, picker)
        return self.draft(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        """The target kept ``accepted`` drafts and emitted ``emitted``; ``features``: its hidden states of the
        positions it fed that stay valid."""
        self.policy_states.commit(0, emitted)
        self.advance(proposal, accepted, features)

    def skip(self, emitted: list[int], features: torch.Tensor | None) -> None:
        """An iteration another drafter proposed (a mix, per iteration): the target emitted ``emitted``, and
        ``features`` as in ``commit``. Keeps the policies' states in step; the next ``draft`` feeds what it has not
        seen of the text."""
        self.policy_states.commit(0, emitted)

    @abstractmethod
    def start(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None,
              clock: Clock) -> None: ...

    @abstractmethod
    def draft(self, seq: torch.Tensor, picker: Picker) -> Proposal: ...

    @abstractmethod
    def advance(self, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None: ...

    def rows_reason(self, target: torch.nn.Module) -> str | None:
        """Why it cannot draft for the rows of a batch over ``target`` (callers then go one completion at a time),
        or None."""
        return f"{type(self).__name__} drafts one completion at a time"

    def begin_rows(self, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                   features: Sequence[torch.Tensor] | None) -> DraftRows:
        """The state of rows starting as ``prompts`` (``features``: the target's of each prompt but its last token,
        where ``needs_features``)."""
        raise ValueError(f"{type(self).__name__} drafts one completion at a time")
