"""The engine interface: one way to run a completion, whatever runs it (ours, transformers, vLLM).

Every command that generates goes through ``Engine.complete(mode, request)`` for one request, or
``Engine.complete_many(mode, rows, request, seeds)`` for many (one batch where ``batch_reason(mode)`` is None, requests
joining a running batch where ``joining_reason(mode)`` is None; else one after another): the engine is started
(models loaded, servers or engines up) before anything is timed and closed after. A ``Mode`` says how to generate
(RSp, or SSp with its drafting settings), a ``Request`` what (ids, budget, sampling, seed).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    lookup: int = 0  # SSp: n-gram length of the context lookup, a hint over the draft's picks (ours); 0: off
    engine: str = "ours"
    draft: str = ""  # in a run of several drafts: which one ("" in a run of one)
    ngram: int = 0  # SSp: n-gram length of the engine's n-gram drafter, drafting alone (no draft model); 0: off
    max_rows: int = 0  # SSp in a batch (ours): positions a step verifies at most, rows x (drafts + 1); 0: no limit

    @property
    def name(self) -> str:
        return ((f"{self.engine} " if self.engine != "ours" else "") + self.mode + (f" {self.draft}" if self.draft else "")
                + (f" k={self.k}" if self.k else "") + (f" p>={self.confidence:g}" if self.confidence else "")
                + (f" lookup={self.lookup}" if self.lookup else "") + (f" ngram={self.ngram}" if self.ngram else "")
                + (f" rows<={self.max_rows}" if self.max_rows else ""))


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
    messages: tuple[tuple[str, str], ...] = ()  # the conversation the ids encode, (role, text), where there is one

    @property
    def ignore_eos(self) -> bool:
        return not (self.stopping.token_ids or self.stopping.strings)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says of itself for rows and output: its version, the precision it computes the target in where
    that is its own, and its drafting method with a draft model where that is one of its own ("": the draft's kind)."""

    name: str
    label: str
    version: str = ""
    target_precision: str = ""
    draft_method: str = ""
    note: str = ""  # how its figures differ from ours, for the output ("": they do not)


class Engine(ABC):
    """Runs completions of one target (and its drafts): one request (``complete``) or many (``complete_many``)."""

    name: ClassVar[str]
    label: ClassVar[str] = ""  # its name in tables and verdicts ("" : the name)
    decode_timing: ClassVar[str] = DECODE_TIMING  # decode ms/token, in words: one definition for every engine
    splits_time: ClassVar[bool] = False  # whether it times draft and target forwards apart (a split pass applies,
    #   and its draft/target ratio c is the run's)
    reference: ClassVar[bool] = False  # the engine the others are compared with (``ours ÷ it``) and RSp's baseline
    runs_our_weights: ClassVar[bool] = True  # whether it computes with the models loaded here (our exact laws apply)
    runs_feature_heads: ClassVar[bool] = True  # whether it drafts with our feature heads (EAGLE layout)
    runs_each_draft: ClassVar[bool] = False  # whether it runs every draft of a run of several (else the first)
    takes_lookup: ClassVar[bool] = True  # whether it takes the context lookup as a hint over a draft's picks
    #   (``Mode.lookup``)
    takes_ngram: ClassVar[bool] = True  # whether it has an n-gram drafter that drafts alone (``Mode.ngram``)
    marks_drafts: ClassVar[bool] = True  # whether its streamed tokens say which the draft proposed (else whole
    #   answers: nothing to colour)
    version_column: ClassVar[str] = ""  # the results column that holds its version, where it has one of its own
    names_modes: ClassVar[bool] = False  # whether its SSp modes are servers' configurations named by the user
    #   (``Mode.draft``), not K and a drafter of ours
    checks_busy: ClassVar[bool] = True  # whether other work on this machine's CPUs is said (not where its servers
    #   may run here as processes that are not ours: ``--endpoint``)

    @property
    def version(self) -> str:
        return ""

    def describe(self) -> EngineInfo:
        """What it says of itself (rows, output)."""
        return EngineInfo(self.name, self.label or self.name, self.version)

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """What every row says of where it ran (``env``: this machine's); an engine on other machines says so."""
        return env

    @staticmethod
    def key(mode: Mode) -> tuple[int, int]:
        """The (K, n-gram length) of the server or engine that runs ``mode`` where an engine starts one per mode
        ((0, 0): RSp; (K, 0): the draft model at K)."""
        return (mode.k, mode.ngram) if mode.mode == "ssp" else (0, 0)

    @classmethod
    def ssp_mode(cls, engine: str, k: int, lookup: int = 0, confidence: float = 0.0, draft: str = "",
                 has_draft: bool = True) -> Mode:
        """SSp at ``k`` on engine ``engine`` (of this class) with an n-gram length ``lookup``: our context lookup over
        the draft's picks where it takes that (``takes_lookup``) and there is a draft, else its n-gram drafter alone
        (``Mode.ngram``); ``draft`` named where it runs each draft of a run."""
        hint = bool(lookup and has_draft and cls.takes_lookup)
        ngram = 0 if hint else lookup
        return Mode("ssp", k, confidence, lookup if hint else 0, engine,
                    draft if cls.runs_each_draft and not ngram else "", ngram)

    @classmethod  # noqa: B027 - most engines need nothing
    def check_ready(cls, confidences: Sequence[float] = (0.0,)) -> None:
        """Before anything loads: one line (``UserError``) if the engine is not installed or built here, or refuses
        an option asked for (``confidences``: the confidence stops)."""

    @classmethod
    def refuses(cls, mode: Mode) -> str | None:
        """Why no engine of this class can run ``mode``, whatever it started, or None."""
        if mode.lookup and not cls.takes_lookup:
            return f"{cls.label or cls.name} takes no context lookup over a draft's picks"
        if mode.ngram and not cls.takes_ngram:
            return f"{cls.label or cls.name} has no n-gram drafter here"
        if mode.max_rows and not cls.runs_our_weights:
            return f"{cls.label or cls.name} sets its own draft lengths in a batch (a row budget is ours)"
        return cls.ngram_reason(mode.k, mode.ngram) if mode.mode == "ssp" and mode.ngram else None

    @classmethod
    def ngram_reason(cls, k: int, n: int) -> str | None:
        """Why its n-gram drafter, looking up ``n``-grams, would never draft at K = ``k``, or None."""
        return None

    def supports(self, mode: Mode) -> str | None:
        """Why this engine cannot run ``mode``, or None."""
        return self.refuses(mode)

    @abstractmethod
    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        """One completion, timed, with its stats in our definitions."""

    caches_prefixes: ClassVar[bool] = False  # whether it reuses a shared prompt prefix's caches (``Request.prefix``)

    def batch_reason(self, mode: Mode) -> str | None:
        """Why ``complete_many`` runs ``mode``'s requests one after another, or None: in one batch, each row giving
        what it gives alone with its seed."""
        return f"the {self.name} engine runs one request at a time here"

    def joining_reason(self, mode: Mode) -> str | None:
        """Why requests of ``mode`` cannot join a running batch (``complete_many``'s ``concurrency`` and
        ``arrivals``), or None: they can."""
        return self.batch_reason(mode)

    def complete_many(self, mode: Mode, rows: Sequence[torch.Tensor], request: Request, seeds: Sequence[int],
                      concurrency: int = 0, arrivals: Sequence[float] = ()) -> list[GenerationOutput]:
        """Completions of ``rows`` (each (1, T) or (T,), of any lengths), row i seeded ``seeds[i]``; ``request`` gives
        what they share (budget, sampling, stopping, prefix). One after another here; an engine that batches says so
        in ``batch_reason`` (and with ``concurrency``, at most that many at once, the next joining as one ends, not
        before its ``arrivals`` time: ``joining_reason``)."""
        if (concurrency or arrivals) and self.joining_reason(mode):
            raise ValueError(self.joining_reason(mode))
        return [self.complete(mode, replace(request, ids=row.reshape(1, -1), seed=seed))
                for row, seed in zip(rows, seeds, strict=True)]

    def close(self) -> None:  # noqa: B027 - most engines start nothing to stop
        """Stop what the engine started (processes, servers)."""
