"""The engine interface: one way to run a completion, whatever runs it (ours, transformers, vLLM).

Every command that generates goes through ``Engine.complete(mode, request)``: the engine is started (models loaded,
servers or engines up) before anything is timed, completes one request at a time, and is closed after. A ``Mode``
says how to generate (RSp, or SSp with its drafting settings), a ``Request`` what (ids, budget, sampling, seed).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from lssp.decoding.generation import DECODE_TIMING, NO_STOP, GenerationOutput, Stopping, TokenCallback
from lssp.decoding.kv import PrefixCache
from lssp.decoding.sampling import SamplingParams

SEED_STRIDE = 1_000_003  # the seed rule: prompts of different runs' seeds never share a seed below this many prompts


def request_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index`` in a run seeded ``seed``: the same in every mode and engine, so that RSp and
    SSp samples pair up (index -1: the warm-up)."""
    return seed * SEED_STRIDE + index


@dataclass(frozen=True)
class Mode:
    """One way of generating that a run times: rsp, or ssp with its drafting settings, on one engine."""

    mode: str  # rsp or ssp
    k: int = 0
    confidence: float = 0.0  # SSp: drafting stops below this draft probability (0: always k)
    lookup: int = 0  # SSp: n-gram length of the context lookup (vLLM: its n-gram drafter alone); 0: off
    engine: str = "ours"
    draft: str = ""  # in a run of several drafts: which one ("" in a run of one)

    @property
    def name(self) -> str:
        return ((f"{self.engine} " if self.engine != "ours" else "") + self.mode + (f" {self.draft}" if self.draft else "")
                + (f" k={self.k}" if self.k else "") + (f" p>={self.confidence:g}" if self.confidence else "")
                + (f" lookup={self.lookup}" if self.lookup else ""))


@dataclass
class Request:
    """What to complete: prompt ids (1, T), the budget, sampling and the seed (``request_seed``)."""

    ids: torch.Tensor
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stopping: Stopping = NO_STOP
    on_tokens: TokenCallback | None = None  # streamed tokens, with whether the draft proposed each
    time_forwards: bool = True  # ours: synchronize around every forward (the draft/target split)
    prefix: PrefixCache | None = None  # ours: a shared prompt prefix's caches

    @property
    def ignore_eos(self) -> bool:
        return not (self.stopping.token_ids or self.stopping.strings)


class Engine(ABC):
    """Runs completions of one target (and its drafts), one request at a time."""

    name: ClassVar[str]
    decode_timing: ClassVar[str] = DECODE_TIMING  # decode ms/token, in words: one definition for every engine
    splits_time: ClassVar[bool] = False  # whether it times draft and target forwards apart (a split pass applies)
    runs_our_weights: ClassVar[bool] = True  # whether it computes with the models loaded here (our exact laws apply)
    runs_feature_heads: ClassVar[bool] = True  # whether it drafts with our feature heads (EAGLE layout)

    @property
    def version(self) -> str:
        return ""

    def supports(self, mode: Mode) -> str | None:
        """Why this engine cannot run ``mode``, or None."""
        return None

    @abstractmethod
    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        """One completion, timed, with its stats in our definitions."""

    def close(self) -> None:  # noqa: B027 - most engines start nothing to stop
        """Stop what the engine started (processes, servers)."""
