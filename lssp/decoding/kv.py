"""KV caches and the forwards that extend them.

Every decoding loop keeps one invariant: a model's cache holds a prefix of the text, and whatever of the text it
has not seen yet is fed at its next forward. ``prefill`` leaves the prompt's last token unfed, so the first step
feeds it and gets the first token's logits.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from functools import cache

import torch
from transformers import DynamicCache, PreTrainedModel

from lssp.models.eagle import FeatureCache, FeatureDrafting, forward_with_features
from lssp.models.modules import model_device

NO_FEATURES = None  # what prefill_target gives when the drafter reads no features


@cache
def accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def forward_logits(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache, last: int) -> torch.Tensor:
    """Logits of the ``last`` final positions, shape (last, vocab), extending ``kv``.

    They are returned on the device of the input embeddings, where sampling happens, also
    when accelerate has split the model over several GPUs.
    """
    kwargs = {"logits_to_keep": last} if accepts_logits_to_keep(type(model)) else {}
    out = model(input_ids=ids, past_key_values=kv, use_cache=True, **kwargs)
    logits, device = out.logits[0, -last:], model_device(model)
    return logits if logits.device == device else logits.to(device)


def new_cache(model: PreTrainedModel, batch: int = 1) -> DynamicCache:
    """An empty KV cache of the kind ``model`` takes (a compact forward brings its own), for ``batch`` rows."""
    make = getattr(model, "new_cache", None)
    if make is None:
        return DynamicCache(config=model.config)
    return make() if batch == 1 else make(batch)


def feed(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache) -> None:
    """Extend ``kv`` with ``ids`` (B, n), computing no logits but the last position's."""
    kwargs = {"logits_to_keep": 1} if accepts_logits_to_keep(type(model)) else {}
    model(input_ids=ids.to(model_device(model)), past_key_values=kv, use_cache=True, **kwargs)


def drop(kv: DynamicCache, positions: int) -> None:
    """Roll the cache back by ``positions`` (none when <= 0). Never ``crop(0)``: before transformers
    5.17 it empties a DynamicCache, and every full acceptance would re-feed the whole sequence."""
    if positions > 0:
        kv.crop(-positions)


def repeated(model: PreTrainedModel, kv: DynamicCache, batch: int) -> DynamicCache:
    """A new cache of ``batch`` rows, each a copy of one-row ``kv``."""
    if hasattr(kv, "keys_values"):  # a compact forward's cache
        out = model.new_cache(batch)
        out.reserve(kv.length)
        for mine, theirs in zip(out.keys_values, kv.keys_values):
            mine[:, :, :kv.length] = theirs[:, :, :kv.length]
        out.length = kv.length
        return out
    out = copy.deepcopy(kv)
    out.batch_repeat_interleave(batch)
    return out


class PrefixCache:
    """The keys and values of a prompt prefix that many completions share (an eval's few-shot lines), one
    cache per model and role: a completion whose prompt starts with the prefix copies nothing and recomputes
    nothing, it rolls the model's cache back to the prefix and feeds the rest of its prompt. Roles keep a model
    that drafts for itself from sharing one cache with its target side."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self._caches: dict[tuple[str, torch.nn.Module], DynamicCache] = {}
        self._features: dict[torch.nn.Module, torch.Tensor] = {}  # a target's features of the prefix

    def extends(self, seq: torch.Tensor) -> bool:
        """Whether every row of ``seq`` starts with the prefix and goes beyond it."""
        n = len(self.ids)
        return seq.shape[1] > n and all(row[:n].tolist() == self.ids for row in seq)

    def start(self, model: PreTrainedModel, seq: torch.Tensor, role: str = "target",
              own: bool = False) -> DynamicCache | None:
        """``model``'s cache holding all of ``seq`` (1, T), or of every row of ``seq`` (B, T), but its last token;
        None where a row does not extend the prefix (its tokenization differs there, or it is no longer). One row
        gets the stored cache itself (the next start rolls it back) unless ``own``: a caller that removes rows
        (a batch) needs a copy, or the prefix would lose its only row."""
        n = len(self.ids)
        if not self.extends(seq):
            return None
        kv = self._caches.get((role, model))
        if kv is None:
            kv = self._caches[(role, model)] = new_cache(model)
            feed(model, seq[:1, :n], kv)
        else:
            drop(kv, kv.get_seq_length() - n)
        if seq.shape[0] > 1 or own:
            kv = repeated(model, kv, seq.shape[0])
        if seq.shape[1] > n + 1:
            feed(model, seq[:, n:-1], kv)
        return kv

    def start_with_features(self, target: PreTrainedModel, seq: torch.Tensor) -> tuple[DynamicCache, torch.Tensor] | None:
        """The target's cache holding ``seq`` (1, T) but its last token, and its features of those tokens; None
        where ``seq`` does not extend the prefix."""
        n = len(self.ids)
        if seq.shape[0] != 1 or not self.extends(seq) or n < 2:
            return None
        key = ("features", target)
        kv = self._caches.get(key)
        if kv is None:
            kv = self._caches[key] = new_cache(target)
            _, self._features[target] = forward_with_features(target, seq[:, :n], kv, 0)
        else:
            drop(kv, kv.get_seq_length() - n)
        features = self._features[target]
        if seq.shape[1] > n + 1:
            features = torch.cat([features, forward_with_features(target, seq[:, n:-1], kv, 0)[1]], dim=1)
        return kv, features

    def head_prefix(self, head: FeatureDrafting, seq: torch.Tensor, features: torch.Tensor) -> FeatureCache | None:
        """A feature head's cache holding the prefix's pairs but the last (each token after the first with the
        feature, in ``features`` (1, T-1, d), of the one before), computed once and rolled back to them at each call;
        None where ``seq`` (1, T) does not extend the prefix. A caller that keeps it past the next call copies it."""
        n = len(self.ids)
        if seq.shape[0] != 1 or not self.extends(seq) or n < 2:
            return None
        kv = self._caches.get(("head", head))
        if kv is None:
            kv = self._caches[("head", head)] = head.new_cache()
            kv.queue(features[:, :n - 1])
            head(seq[:, 1:n], kv)
        else:
            drop(kv, kv.length - (n - 1))
        return kv

    def start_head(self, head: FeatureDrafting, seq: torch.Tensor, features: torch.Tensor) -> FeatureCache | None:
        """A feature head's cache started on ``seq``'s ``features``, its pairs over the prefix computed once."""
        kv = self.head_prefix(head, seq, features)
        return head.start(seq, features, kv) if kv is not None else None


def prefill(model: PreTrainedModel, seq: torch.Tensor, prefix: PrefixCache | None = None,
            role: str = "target") -> DynamicCache:
    """A cache holding all of ``seq`` but its last token, which the first decode step feeds (from ``prefix``'s
    cache where ``seq`` extends it)."""
    kv = prefix.start(model, seq, role) if prefix is not None else None
    if kv is None:
        kv = new_cache(model, seq.shape[0])
        if seq.shape[1] > 1:
            feed(model, seq[:, :-1], kv)
    return kv


def prefill_with_features(target: PreTrainedModel, seq: torch.Tensor,
                          prefix: PrefixCache | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """``prefill`` for a drafter that reads the target's features: the cache and the features (1, T-1, d)."""
    started = prefix.start_with_features(target, seq) if prefix is not None else None
    if started is not None:
        return started
    kv = new_cache(target)
    if seq.shape[1] == 1:
        return kv, seq.new_zeros(1, 0, 0, dtype=torch.float)
    _, features = forward_with_features(target, seq[:, :-1], kv, 0)
    return kv, features


def scoring_forward(target: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache, last: int,
                    features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits of the ``last`` final positions of ``ids``, and with ``features`` its final hidden
    states of all of them."""
    if features:
        return forward_with_features(target, ids, kv, last)
    return forward_logits(target, ids, kv, last), None
