"""Drafters: what proposes tokens for speculative sampling, one class per method behind one interface
(``lssp.decoding.drafting.Drafter``: one completion, or the rows of a batch), and the policies any of them applies to
its picks (the context lookup, the confidence stop). ``drafter_for`` builds the drafter that a draft model (or
feature head) and the options ask for."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from lssp.decoding.drafting import Drafter, DraftRows, Picker, PickPolicy, Proposal
from lssp.decoding.generation import NO_STOP, GenerationOutput, Stopping, TokenCallback
from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.speculative import speculative_decode
from lssp.drafters.confidence import ConfidenceStop
from lssp.drafters.lookup import ContextLookup, CopyFirst, LookupHint, NgramDrafter
from lssp.drafters.model import DraftModel, FeatureHead
from lssp.models.eagle import FeatureDrafting

if TYPE_CHECKING:
    from lssp.models.loading import LoadedModel

__all__ = ["ConfidenceStop", "ContextLookup", "CopyFirst", "DraftModel", "DraftRows", "Drafter", "FeatureHead", "LookupHint",
           "NgramDrafter", "PickPolicy", "Picker", "Proposal", "drafter_for", "entry_drafter", "generate_speculative"]


def drafter_for(draft: PreTrainedModel | None, lookup: int = 0, confidence: float = 0.0,
                copy_first: int = 0, copy_chain: int = 0, copy_shortest: int = 0) -> Drafter:
    """The drafter for ``draft`` (a feature head reads the target's features; None: the n-gram drafter over
    ``lookup``-grams, no model), with the context lookup over ``lookup``-grams (0: off) and the confidence stop below
    ``confidence`` (0: off) as its policies; ``copy_first`` > 0: the chain of the prompt lookup over
    ``copy_first``-grams wherever it has one (up to ``copy_chain`` tokens, at least K), the draft elsewhere
    (``CopyFirst``; ``copy_shortest`` > 0: down to tails of that many tokens where the longer ones are new)."""
    policies: list[PickPolicy] = [LookupHint(lookup)] if lookup and draft is not None else []
    if confidence:
        policies.append(ConfidenceStop(confidence))
    if draft is None:
        if not lookup:
            raise ValueError("the n-gram drafter needs an n-gram length (lookup >= 1)")
        return NgramDrafter(lookup, policies)
    drafter = FeatureHead(draft, policies) if isinstance(draft, FeatureDrafting) else DraftModel(draft, policies)
    return CopyFirst(drafter, copy_first, copy_chain, copy_shortest or None) if copy_first else drafter


def entry_drafter(draft: LoadedModel, lookup: int = 0, confidence: float = 0.0) -> Drafter:
    """The drafter over a loaded draft as its registry entry describes it (its confidence stop unless ``confidence``
    is given, its prompt lookup first), with the context lookup over ``lookup``-grams."""
    spec = draft.spec
    return drafter_for(draft.model, lookup, confidence or spec.confidence or 0.0, spec.prompt_lookup or 0,
                       spec.prompt_lookup_chain or 0, spec.prompt_lookup_min or 0)


def generate_speculative(target: PreTrainedModel, draft: PreTrainedModel | Drafter, input_ids: torch.Tensor,
                         max_new_tokens: int, k: int, params: SamplingParams, generator: torch.Generator | None = None,
                         stopping: Stopping = NO_STOP, on_tokens: TokenCallback | None = None,
                         vocab_size: int | None = None, confidence: float = 0.0, lookup: int = 0,
                         time_forwards: bool = True, prefix: PrefixCache | None = None) -> GenerationOutput:
    """``speculative_decode`` with ``draft`` a drafter, or a draft model (or feature head) made one by
    ``drafter_for`` with the context lookup over ``lookup``-grams and the confidence stop below ``confidence``."""
    drafter = draft if isinstance(draft, Drafter) else drafter_for(draft, lookup, confidence)
    return speculative_decode(target, drafter, input_ids, max_new_tokens, k, params, generator, stopping, on_tokens,
                              vocab_size, time_forwards, prefix)
