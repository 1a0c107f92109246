"""Drafters: what proposes tokens for speculative sampling, one class per method behind one interface
(``base.Drafter``). ``drafter_for`` builds the drafter a draft model (or feature head) and the options ask for."""
from __future__ import annotations

from transformers import PreTrainedModel

from lssp.drafters.base import Drafter, Picker, Proposal
from lssp.drafters.confidence import ConfidenceStop
from lssp.drafters.lookup import ContextLookup, LookupDrafter
from lssp.drafters.model import DraftModel, FeatureHead
from lssp.models.eagle import FeatureDraft

__all__ = ["ConfidenceStop", "ContextLookup", "DraftModel", "Drafter", "FeatureHead", "LookupDrafter", "Picker",
           "Proposal", "drafter_for"]


def drafter_for(draft: PreTrainedModel, lookup: int = 0, confidence: float = 0.0) -> Drafter:
    """The drafter for ``draft`` (a feature head reads the target's features), with the context lookup over
    ``lookup``-grams (0: off) and the confidence stop below ``confidence`` (0: off) around it."""
    drafter: Drafter = FeatureHead(draft) if isinstance(draft, FeatureDraft) else DraftModel(draft)
    if lookup:
        drafter = LookupDrafter(drafter, lookup)
    if confidence:
        drafter = ConfidenceStop(drafter, confidence)
    return drafter
