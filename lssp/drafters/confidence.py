"""The confidence stop, a policy any drafter applies: K becomes a maximum.

The drafter stops proposing once its own (untempered) probability of the token it just proposed falls below the
threshold, like transformers' ``assistant_confidence_threshold``. The rule reads the draft alone, so sampling stays
exact.
"""
from __future__ import annotations

from typing import Any

from lssp.decoding.drafting import Picker, PickPolicy


class ConfidenceStop(PickPolicy):
    def __init__(self, threshold: float) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"confidence threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold

    def prepare(self, state: Any, picker: Picker) -> None:
        picker.stop_below = self.threshold
