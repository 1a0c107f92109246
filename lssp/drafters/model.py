"""Drafters with a forward of their own: a small draft model, or a feature head (EAGLE) reading the target's features;
each drafts for one completion, or for the rows of a batch (``ModelRows``, ``HeadRows``: see ``lssp.decoding.batched``
for why rows stay exact)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from lssp.decoding.batched import (
    begin_rows,
    drop_row,
    empty_rows,
    feed_rows,
    forward_rows,
    keep_rows,
    merge_rows,
    rows_after_prefix,
    shared_prefix,
)
from lssp.decoding.drafting import Drafter, DraftRows, Picker, PickPolicy, PolicyRows, Proposal
from lssp.decoding.kv import PrefixCache, drop, forward_logits, new_cache, prefill, repeated
from lssp.decoding.timing import Clock
from lssp.models.compact import CompactLlama
from lssp.models.eagle import FeatureCache, FeatureDrafting, forward_with_features
from lssp.models.modules import model_device


class DraftModel(Drafter):
    """A draft language model with its own KV cache: k forwards of one token each per iteration."""

    def __init__(self, model: PreTrainedModel, policies: Sequence[PickPolicy] = ()) -> None:
        super().__init__(policies)
        self._model = model
        self.device = model_device(model)
        self.kv = None
        self.clock = Clock()

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    def start(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None,
              clock: Clock) -> None:
        self.kv, self.clock = prefill(self._model, seq, prefix, role="draft"), clock

    def draft(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        pending = seq[:, self.kv.get_seq_length():]  # one token, two after a full acceptance
        spent = 0.0
        while not picker.done:
            start = self.clock.forward_now()
            logits, ids = self._logits(pending.to(self.device))
            spent += self.clock.forward_now() - start
            pending = torch.tensor([[picker.add(logits, ids)]])
        return picker.proposal(spent)

    def _logits(self, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's logits after ``pending`` (vocab,), and the vocabulary ids of their columns (None: all)."""
        return forward_logits(self._model, pending, self.kv, 1)[0], None

    def advance(self, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        drop(self.kv, len(proposal) - 1 - accepted)  # the last draft was never fed

    def rows_reason(self, target: torch.nn.Module) -> str | None:
        return None

    def begin_rows(self, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                   features: Sequence[torch.Tensor] | None) -> ModelRows:
        return ModelRows(self._model, prompts, prefix, PolicyRows(self.policies, prompts))


class FeatureHead(DraftModel):
    """A feature head: each position reads the target's feature of the token before; a drafted position reads the
    head's own guess, so after each verification it keeps only the positions fed real features."""

    needs_features = True
    chains = True  # plain drafts in one kernel call where the head can (FeatureDraft.draft_chain)

    @property
    def ready(self) -> bool:
        return self.kv.ready

    def draft(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        if self.chains and picker.plain and not picker.done and self._model.can_chain:
            pending = seq[:, self.kv.get_seq_length():]
            start = self.clock.forward_now()
            temperature = picker.params.temperature  # 0: greedy
            uniforms = picker.uniforms() if temperature else None
            drafts, q = self._model.draft_chain(pending.to(self.device), self.kv, picker.k, temperature, uniforms)
            picker.extend(drafts, q, self._model.draft_ids)
            return picker.proposal(self.clock.forward_now() - start)
        return super().draft(seq, picker)

    def start(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None,
              clock: Clock) -> None:
        started = prefix.start_head(self._model, seq, features) if prefix is not None else None
        self.kv, self.clock = started or self._model.start(seq, features), clock

    def _logits(self, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._model.draft_logits(pending, self.kv)

    def advance(self, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        drop(self.kv, len(proposal) - 1)
        self.kv.queue(features)

    def skip(self, emitted: list[int], features: torch.Tensor | None) -> None:
        super().skip(emitted, features)
        self.kv.queue(features)  # paired with the tokens it has not read at its next draft

    def rows_reason(self, target: torch.nn.Module) -> str | None:
        if not isinstance(target, CompactLlama):
            return "a feature head drafts batched only for a target under the compact forward"
        return None

    def begin_rows(self, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                   features: Sequence[torch.Tensor] | None) -> HeadRows:
        return HeadRows(self._model, prompts, features or [], PolicyRows(self.policies, prompts), prefix)


def draft_logits(target: PreTrainedModel, draft: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits (1, vocab) for the token after ``ids`` (1, T), from scratch; a feature head reads the
    target's features of ``ids`` first."""
    if not isinstance(draft, FeatureDrafting):
        return forward_logits(draft, ids.to(model_device(draft)), new_cache(draft), 1)
    if ids.shape[1] == 1:
        raise ValueError("a feature draft needs the target's feature of a token before the last")
    _, features = forward_with_features(target, ids[:, :-1].to(model_device(target)), new_cache(target), 0)
    kv: FeatureCache = draft.start(ids, features)
    return forward_logits(draft, ids[:, -1:], kv, 1)


def _next_draft(picker: Picker, logits: torch.Tensor, ids: torch.Tensor | None = None) -> list[int]:
    """The row's next draft from its ``logits`` (of the vocabulary ids ``ids``; None: all), as the token to feed
    next ([] once it has drafted its budget)."""
    token = picker.add(logits, ids)
    return [] if picker.done else [token]


class ModelRows(DraftRows):
    """A draft model drafting for every row of the batch, in a cache of its own: one draft forward per step for the
    rows still drafting; as for one completion, a row's first step feeds what its draft cache lacks and its last
    draft is never fed."""

    def __init__(self, draft: PreTrainedModel, prompts: Sequence[list[int]], prefix: PrefixCache | None,
                 policies: PolicyRows) -> None:
        super().__init__(policies)
        self.cache = begin_rows(draft, prompts, prefix, "draft")

    def caches(self) -> list:
        return [self.cache]

    def draft(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]:
        pending = [seq[p:] if picker.k else [] for seq, picker, p in zip(seqs, pickers, self.cache.positions.tolist())]
        while any(pending):
            logits = forward_rows(self.cache, pending, 1, left=True)[:, -1]
            pending = [_next_draft(picker, logits[r]) if pending[r] else [] for r, picker in enumerate(pickers)]
        return [picker.proposal() for picker in pickers]

    def advance(self, row: int, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        drop_row(self.cache, row, len(proposal) - 1 - accepted)  # its last draft was never fed

    def keep_rows(self, rows: list[int]) -> None:
        keep_rows(self.cache, rows)

    def merge_rows(self, other: DraftRows) -> None:
        merge_rows(self.cache, other.cache)


class HeadRows(DraftRows):
    """A feature head drafting for every row. A row's head positions each pair the target's feature of a token with
    the token after it; the features the target gave for tokens the head has not read yet wait in ``queued`` (its
    first draft forward reads them), and each later draft reads the head's own guess of the feature before it."""

    def __init__(self, head: FeatureDrafting, prompts: Sequence[list[int]], features: Sequence[torch.Tensor],
                 policies: PolicyRows, prefix: PrefixCache | None = None) -> None:
        super().__init__(policies)
        self.width = head.config.hidden_size
        self.fused = head.fused
        self.ids = head.draft_ids  # the logits' vocabulary ids: a subset head's drafts come from its own tokens
        # The pairs of each prompt but the last: those over a shared prefix computed once, copied to every row.
        first = torch.tensor([prompts[0]], device=model_device(head)) if prompts else None
        shared = prefix.head_prefix(head, first, features[0][None]) \
            if features and shared_prefix(prefix, prompts) else None
        done = shared.length if shared is not None else 0  # each row's pairs already in the cache
        self.cache = rows_after_prefix(head, repeated(head, shared, len(prompts)), len(prompts), done) \
            if shared is not None else empty_rows(head, len(prompts))
        features = [self.fused(f) for f in features]
        if any(len(p) > done + 2 for p in prompts):
            self._forward([p[done + 1:-1] for p in prompts], [f[done:-1] for f in features])
        self.queued: list[torch.Tensor | None] = [f[-1:] if len(f) else None for f in features]

    def ready(self, row: int) -> bool:
        return self.queued[row] is not None

    def caches(self) -> list:
        return [self.cache]

    def _forward(self, pieces: Sequence[Sequence[int]],
                 features: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row its tokens with their features (left-padded, as ``feed_rows`` pads the tokens); the logits
        and the head's guess at each row's last column."""
        width = max(map(len, pieces))
        paired = torch.zeros(len(pieces), width, self.width, device=self.cache.valid.device)
        for r, (piece, feature) in enumerate(zip(pieces, features)):
            if piece:
                paired[r, width - len(piece):] = feature
        out = feed_rows(self.cache, pieces, True, input_features=paired, logits_to_keep=1, widen=False)
        return out.logits[:, -1], self.cache.kv.guess[:, -1]

    def draft(self, seqs: Sequence[Sequence[int]], pickers: Sequence[Picker]) -> list[Proposal]:
        budgets = [picker.k for picker in pickers]
        pending = [seq[p + 1:] if b else [] for seq, b, p in zip(seqs, budgets, self.cache.positions.tolist())]
        features = [self.queued[r] if b else None for r, b in enumerate(budgets)]
        self.queued = [None if b else q for q, b in zip(self.queued, budgets)]
        while any(pending):
            logits, guesses = self._forward(pending, features)
            for r, picker in enumerate(pickers):
                if pending[r]:
                    pending[r], features[r] = _next_draft(picker, logits[r], self.ids), guesses[r:r + 1]
        return [picker.proposal() for picker in pickers]

    def advance(self, row: int, proposal: Proposal, accepted: int, features: torch.Tensor | None) -> None:
        drop_row(self.cache, row, len(proposal) - 1)  # the positions that read a guess
        self._queue(row, features)

    def skip(self, row: int, emitted: Sequence[int], features: torch.Tensor | None) -> None:
        super().skip(row, emitted, features)
        self._queue(row, features)  # paired with the tokens it has not read at its next draft

    def _queue(self, row: int, features: torch.Tensor) -> None:
        features = self.fused(features)
        queued = self.queued[row]
        self.queued[row] = features if queued is None else torch.cat([queued, features])

    def keep_rows(self, rows: list[int]) -> None:
        keep_rows(self.cache, rows)
        self.queued = [self.queued[r] for r in rows]

    def merge_rows(self, other: DraftRows) -> None:
        merge_rows(self.cache, other.cache)
        self.queued += other.queued
