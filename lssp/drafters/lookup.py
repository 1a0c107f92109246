"""The context lookup (prompt lookup): a policy over another drafter's picks, a drafter of its own, or the first
choice of a mix.

Where the text's last n tokens occurred before, the token that followed their latest occurrence is a guess. As a
policy (``LookupHint``) it speaks where the drafter is unsure of its own top token: proposed instead (greedy), or
given half of q's mass (sampling). As a drafter (``NgramDrafter``, no model) it proposes the chain of such guesses
with q one-hot on each, as vLLM's and llama.cpp's n-gram drafters do. Copy first (``CopyFirst``, a draft entry's
``prompt_lookup``) chooses per iteration: the chain where the text's last n tokens occurred before (up to K, or
``prompt_lookup_chain`` tokens; with ``prompt_lookup_min``, where only a shorter tail did, up to K), the draft model
or feature head elsewhere. q is whatever the draft side proposes from, so the acceptance rule keeps SSp exact in
every case.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from lssp.decoding.drafting import Drafter, DraftRows, Picker, PickPolicy, PolicyRows, Proposal, probability
from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import argmax
from lssp.decoding.timing import Clock
from lssp.drafters.base import DrafterWrapper

LOOKUP_BELOW = 0.5  # the lookup speaks only where the draft's own top probability is below this


class ContextLookup:
    """The token that followed the latest earlier occurrence of the text's last ``n`` tokens; with ``shortest`` < n,
    of its last n - 1, ..., ``shortest`` tokens where the longer tail is new (the longest match first, as vLLM's
    n-gram drafter looks between its prompt_lookup_max and prompt_lookup_min)."""

    def __init__(self, n: int, tokens: Sequence[int], shortest: int | None = None) -> None:
        shortest = n if shortest is None else shortest
        if not 1 <= shortest <= n:
            raise ValueError(f"lookup n-gram lengths must satisfy 1 <= shortest <= n, got n={n}, shortest={shortest}")
        self.n, self.shortest = n, shortest
        self.tokens: list[int] = []
        self.successors: dict[int, dict[tuple[int, ...], int]] = {m: {} for m in range(shortest, n + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            for m, successor in self.successors.items():
                if len(self.tokens) >= m:
                    successor[tuple(self.tokens[-m:])] = token
            self.tokens.append(token)

    def catch_up(self, text: Sequence[int]) -> None:
        """Extend to ``text``, of which the tokens read so far are the start."""
        self.extend(text[len(self.tokens):])

    def propose(self, drafted: Sequence[int] = ()) -> int | None:
        """The hint for the token after the text plus ``drafted``, or None where every tail from n down to
        ``shortest`` tokens is new."""
        return self.match(drafted)[0]

    def match(self, drafted: Sequence[int] = ()) -> tuple[int | None, int]:
        """(the hint, the length of the tail it followed), or (None, 0)."""
        tail = (self.tokens[-self.n:] + list(drafted))[-self.n:]
        for m in range(min(self.n, len(tail)), self.shortest - 1, -1):
            token = self.successors[m].get(tuple(tail[-m:]))
            if token is not None:
                return token, m
        return None, 0


def copy_room(context: ContextLookup, picker: Picker) -> int:
    """How many tokens copy first may copy this iteration (0: no tail of the text occurred before, the draft's
    turn): up to the picker's room (a copied chain's) where the whole n-token tail matched, up to K where only a
    shorter one did (their chains are more often wrong past the first tokens)."""
    if picker.k == 0:
        return 0
    token, length = context.match()
    if token is None:
        return 0
    return picker.room if length == context.n else picker.k


def unsure_hint(context: ContextLookup, drafted: Sequence[int], logits: torch.Tensor) -> int | None:
    """The lookup's token, where it has one and the draft is unsure of its own top token."""
    token = context.propose(drafted)
    if token is None or probability(logits, argmax(logits)) >= LOOKUP_BELOW:
        return None
    return token


class LookupHint(PickPolicy):
    """The context lookup over n-grams of length ``n``, where the drafter is unsure."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"lookup n-gram length must be >= 1, got {n}")
        self.n = n

    def start(self, prompt: Sequence[int]) -> ContextLookup:
        return ContextLookup(self.n, prompt)

    def prepare(self, state: ContextLookup, picker: Picker) -> None:
        picker.hint = partial(unsure_hint, state)

    def commit(self, state: ContextLookup, emitted: Sequence[int]) -> None:
        state.extend(emitted)


def ngram_drafts(context: ContextLookup, text: Sequence[int], picker: Picker) -> Proposal:
    """The chain of lookups after ``text``, each with a one-hot q, until ``picker`` is done or the n-gram is new."""
    context.catch_up(text)
    drafted: list[int] = []
    while not picker.done:
        token = context.propose(drafted)
        if token is None:
            break
        drafted.append(picker.add_certain(token))
    return picker.proposal()


class NgramDrafter(Drafter):
    """Drafts from the text alone (no model): the context lookup's chain of guesses over n-grams of length ``n``."""

    def __init__(self, n: int, policies: Sequence[PickPolicy] = ()) -> None:
        super().__init__(policies)
        self.n = n
        self.context = ContextLookup(n, ())

    @property
    def model(self) -> None:
        return None

    def start(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None,
              clock: Clock) -> None:
        self.context = ContextLookup(self.n, ())

    def draft(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        return ngram_drafts(self.context, seq[0].tolist(), picker)

    def advance(self, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        pass  # the next draft reads the text

    def rows_reason(self, target: torch.nn.Module) -> str | None:
        return None

    def begin_rows(self, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                   features: Sequence[torch.Tensor] | None) -> NgramRows:
        return NgramRows(self.n, PolicyRows(self.policies, prompts), len(prompts))


class NgramRows(DraftRows):
    """The n-gram drafter's rows: one context per row."""

    def __init__(self, n: int, policies: PolicyRows, rows: int) -> None:
        super().__init__(policies)
        self.contexts = [ContextLookup(n, ()) for _ in range(rows)]

    def draft(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]:
        return [ngram_drafts(context, seq, picker) for context, seq, picker in zip(self.contexts, seqs, pickers)]

    def advance(self, row: int, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        self.contexts = [self.contexts[r] for r in rows]

    def merge_rows(self, other: DraftRows) -> None:
        self.contexts += other.contexts


class CopyFirst(DrafterWrapper):
    """Copy where the answer copies, chosen per iteration: where the text's last ``n`` tokens occurred before, the
    chain that followed them (up to ``chain`` tokens, at least K; q one-hot, as ``NgramDrafter``), and with
    ``shortest``, where only a shorter tail of at least that many tokens did, up to K (``copy_room``); elsewhere
    ``inner`` (a draft model or feature head, up to K), which then feeds the tokens it did not draft (with a head,
    their features) at its next turn."""

    def __init__(self, inner: Drafter, n: int, chain: int = 0, shortest: int | None = None) -> None:
        super().__init__(inner)
        self.context = ContextLookup(n, (), shortest)
        self.chain = chain
        self.copied = False  # whether the last proposal was the lookup's

    def longest(self, k: int) -> int:
        return max(self.inner.longest(k), self.chain)

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        self.context, self.copied = ContextLookup(self.context.n, (), self.context.shortest), False
        self.inner.begin(seq, features, prefix, clock)

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        self.context.extend(seq[0, len(self.context.tokens):].tolist())
        room = copy_room(self.context, picker)
        self.copied = room > 0
        if self.copied:
            return ngram_drafts(self.context, self.context.tokens, picker.fresh(room))
        return self.inner.propose(seq, picker)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        if self.copied:
            self.inner.skip(emitted, features)
        else:
            self.inner.commit(proposal, accepted, emitted, features)

    def rows_reason(self, target: torch.nn.Module) -> str | None:
        # A batch verifies every row as long as its longest proposal: unless the target's forward skips the padding,
        # rows copying chains past K make the others pay for them (eval --both on the default pair before it did:
        # 51-52 s batched against 44-45 s one at a time, AMD EPYC).
        if self.chain and not getattr(target, "skips_holes", False):
            return "copied chains past K would pad every row's verification: one completion at a time"
        return self.inner.rows_reason(target)

    def begin_rows(self, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                   features: Sequence[torch.Tensor] | None) -> CopyRows:
        return CopyRows(self.inner.begin_rows(prompts, prefix, features), self.context.n, len(prompts),
                        self.context.shortest)


class CopyRows(DraftRows):
    """``CopyFirst`` for the rows of a batch: each row copies or lets ``inner`` draft, chosen per row and iteration
    as it would alone; ``inner`` drafts for the rows that do not copy (the others get a picker of k 0) and skips the
    iterations it did not draft."""

    def __init__(self, inner: DraftRows, n: int, rows: int, shortest: int | None = None) -> None:
        super().__init__(PolicyRows([], [[] for _ in range(rows)]))  # the policies are the inner drafter's
        self.inner = inner
        self.contexts = [ContextLookup(n, (), shortest) for _ in range(rows)]
        self.copied = [False] * rows

    def ready(self, row: int) -> bool:
        return self.inner.ready(row)

    def caches(self) -> list:
        return self.inner.caches()

    def draft(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]:
        rooms = []
        for r, (context, seq, picker) in enumerate(zip(self.contexts, seqs, pickers)):
            context.catch_up(seq)
            rooms.append(copy_room(context, picker))
            self.copied[r] = rooms[-1] > 0
        drafted = self.inner.propose(seqs, [p.fresh(0) if c else p for p, c in zip(pickers, self.copied)])
        return [ngram_drafts(context, context.tokens, picker.fresh(room)) if room else proposal
                for context, picker, room, proposal in zip(self.contexts, pickers, rooms, drafted)]

    def commit(self, row: int, proposal: Proposal, accepted: int, emitted: Sequence[int],
               features: torch.Tensor | None) -> None:
        if self.copied[row]:
            self.inner.skip(row, emitted, features)
        else:
            self.inner.commit(row, proposal, accepted, emitted, features)

    def skip(self, row: int, emitted: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.skip(row, emitted, features)

    def advance(self, row: int, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        raise AssertionError("CopyRows.commit hands each iteration to its inner drafter")

    def keep_rows(self, rows: list[int]) -> None:
        self.inner.keep(rows)
        self.contexts = [self.contexts[r] for r in rows]
        self.copied = [self.copied[r] for r in rows]

    def merge_rows(self, other: DraftRows) -> None:
        self.inner.merge(other.inner)
        self.contexts += other.contexts
        self.copied += other.copied
