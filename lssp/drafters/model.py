"""Drafters with a forward of their own: a small draft model, or a feature head (EAGLE) reading the target's features."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lssp.decoding.kv import PrefixCache, drop, forward_logits, new_cache, prefill
from lssp.decoding.timing import Clock
from lssp.drafters.base import Drafter, Picker, Proposal
from lssp.models.eagle import FeatureCache, FeatureDraft, forward_with_features
from lssp.models.modules import model_device


class DraftModel(Drafter):
    """A draft language model with its own KV cache: k forwards of one token each per iteration."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self.device = model_device(model)
        self.kv = None
        self.clock = Clock()

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        self.kv, self.clock = prefill(self._model, seq, prefix, role="draft"), clock

    def propose(self, seq: torch.Tensor, picker: Picker) -> Proposal:
        pending = seq[:, self.kv.get_seq_length():]  # one token, two after a full acceptance
        spent = 0.0
        while not picker.done:
            start = self.clock.forward_now()
            logits = forward_logits(self._model, pending.to(self.device), self.kv, 1)
            spent += self.clock.forward_now() - start
            pending = picker.add(logits[0]).view(1, 1)
        return picker.proposal(spent)

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        drop(self.kv, len(proposal) - 1 - accepted)  # the last draft was never fed


class FeatureHead(DraftModel):
    """A feature head: each position reads the target's feature of the token before; a drafted position reads the
    head's own guess, so after each verification it keeps only the positions fed real features."""

    needs_features = True

    @property
    def ready(self) -> bool:
        return self.kv.ready

    def begin(self, seq: torch.Tensor, features: torch.Tensor | None, prefix: PrefixCache | None, clock: Clock) -> None:
        started = prefix.start_head(self._model, seq, features) if prefix is not None else None
        self.kv, self.clock = started or self._model.start(seq, features), clock

    def commit(self, proposal: Proposal, accepted: int, emitted: list[int], features: torch.Tensor | None) -> None:
        drop(self.kv, len(proposal) - 1)
        self.kv.queue(features)


def draft_logits(target: PreTrainedModel, draft: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits (1, vocab) for the token after ``ids`` (1, T), from scratch; a feature head reads the
    target's features of ``ids`` first."""
    if not isinstance(draft, FeatureDraft):
        return forward_logits(draft, ids.to(model_device(draft)), new_cache(draft), 1)
    if ids.shape[1] == 1:
        raise ValueError("a feature draft needs the target's feature of a token before the last")
    _, features = forward_with_features(target, ids[:, :-1].to(model_device(target)), new_cache(target), 0)
    kv: FeatureCache = draft.start(ids, features)
    return forward_logits(draft, ids[:, -1:], kv, 1)
