"""Regular sampling (RSp): one target forward per token, with a KV cache; and what every generation reports.

The speculative loop is ``lssp.decoding.speculative``; both share ``GenerationStats``, ``Stopping`` and the
caches of ``lssp.decoding.kv``.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lssp.decoding.kv import PrefixCache, forward_logits, prefill
from lssp.decoding.sampling import SamplingParams, pick, sample_logits
from lssp.decoding.timing import Clock
from lssp.models.modules import model_device
from lssp.report.metrics import SpecMetrics

# Called with each block of newly emitted token ids and, per token, whether the draft proposed it.
TokenCallback = Callable[[list[int], list[bool]], None]

# Decode ms/token, the same for every engine (it goes into every row as ``decode_timing``).
DECODE_TIMING = ("(time of the last token - time of the first emission) / tokens emitted after the first emission; "
                 "whole completion / tokens where there is no timed first emission or nothing after it")
FIRST_TO_LAST = "first-to-last"  # the timing basis of a completion measured as DECODE_TIMING says
WHOLE_COMPLETION = "whole completion (fallback)"  # one that fell back: prefill included


def timing_basis(fallbacks: int, completions: int) -> str:
    """How the ms/token of ``completions`` completions was measured, ``fallbacks`` of them on the whole completion."""
    if not fallbacks:
        return FIRST_TO_LAST
    if fallbacks >= completions:
        return WHOLE_COMPLETION
    return f"mixed: {fallbacks} of {completions} {WHOLE_COMPLETION}"


@dataclass
class GenerationStats(SpecMetrics):
    """What one generation did and where its time went (seconds)."""

    mode: str
    k: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # iterations that ended on a rejected draft
    looked_up: int = 0  # drafts the context lookup proposed (greedy) or reweighted q for (sampling)
    looked_up_accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    total_time_s: float = 0.0
    ttft_s: float = 0.0  # when the first emission came out (the prefill included)
    first_emission_tokens: int = 0  # tokens the first emission carried (SSp: its accepted drafts too); 0: not timed
    after_first_s: float = float("nan")  # from the first emission to the last token
    forwards_timed: bool = True  # False: no sync around forwards, so draft/target times are not measured (0)

    @property
    def decode_time_s(self) -> float:
        """Wall time after the prompt's prefill: every emitted token is made in it."""
        return self.total_time_s - self.prefill_time_s

    @property
    def other_time_s(self) -> float:
        """Decode time outside the models' forwards (sampling, verification, cache bookkeeping)."""
        return self.decode_time_s - self.target_time_s - self.draft_time_s

    @property
    def timing_fallback(self) -> bool:
        """ms/token is the whole completion's: no timed first emission, or no token after it."""
        return not (0 < self.first_emission_tokens < self.new_tokens and self.after_first_s > 0)

    @property
    def timing_basis(self) -> str:
        return WHOLE_COMPLETION if self.timing_fallback else FIRST_TO_LAST

    @property
    def timed_tokens(self) -> int:
        """The tokens ms/token counts: those after the first emission (all of them where it falls back)."""
        return self.new_tokens if self.timing_fallback else self.new_tokens - self.first_emission_tokens

    @property
    def timed_s(self) -> float:
        """The time ms/token divides: first emission to last token (the whole completion where it falls back)."""
        return self.total_time_s if self.timing_fallback else self.after_first_s

    @property
    def ms_per_token(self) -> float:
        """Decode ms/token as ``DECODE_TIMING`` defines it, for every engine."""
        return 1000 * self.timed_s / self.timed_tokens if self.timed_tokens else float("nan")


def combined(parts: Sequence[GenerationStats]) -> GenerationStats:
    """The stats of several generations in a row (the turns of a conversation) as one: counts and times add
    up, the time to first token is the first one's; ms/token counts each turn from its own first emission (every
    turn's must be timed, else it falls back)."""
    first = parts[0]
    total = GenerationStats(mode=first.mode, k=first.k, drafted_at=[0] * len(first.drafted_at),
                            accepted_at=[0] * len(first.accepted_at), ttft_s=first.ttft_s,
                            forwards_timed=all(p.forwards_timed for p in parts))
    for name in ("new_tokens", "target_forwards", "draft_forwards", "drafted", "accepted", "rejections", "looked_up",
                 "looked_up_accepted", "prefill_time_s", "target_time_s", "draft_time_s", "total_time_s"):
        setattr(total, name, sum(getattr(p, name) for p in parts))
    if all(p.first_emission_tokens > 0 and p.after_first_s >= 0 for p in parts):
        total.first_emission_tokens = sum(p.first_emission_tokens for p in parts)
        total.after_first_s = sum(p.after_first_s for p in parts)
    for part in parts:
        total.drafted_at = [a + b for a, b in zip(total.drafted_at, part.drafted_at)]
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, part.accepted_at)]
    return total


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # 1-D LongTensor of new tokens, on the CPU
    stats: GenerationStats
    stopped: bool = False  # ended at a stop token or string before max_new_tokens


@dataclass(frozen=True)
class Stopping:
    """When to end early: a token id in ``token_ids`` or a string in ``strings`` appears."""

    token_ids: Collection[int] = ()
    strings: Sequence[str] = ()
    tokenizer: PreTrainedTokenizerBase | None = None

    def cut(self, tokens: list[int], first_new: int) -> int | None:
        """Length to keep if ``tokens[first_new:]`` completes a stop, else None."""
        for i in range(first_new, len(tokens)):
            if tokens[i] in self.token_ids:
                return i + 1
        if self.strings and self.tokenizer is not None:
            for i in range(first_new, len(tokens)):
                text = self.tokenizer.decode(tokens[: i + 1])
                if any(s in text for s in self.strings):
                    return i + 1
        return None


NO_STOP = Stopping()


@torch.inference_mode()
def generate_regular(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    stopping: Stopping = NO_STOP,
    on_tokens: TokenCallback | None = None,
    time_forwards: bool = True,
    prefix: PrefixCache | None = None,
) -> GenerationOutput:
    """Sample ``max_new_tokens`` tokens from ``model``: prefill once, then one token per forward.

    Tokens stay on the device unless a stop condition or a callback needs them on the host,
    so a GPU never waits for the CPU between steps. ``time_forwards`` False synchronizes a GPU
    only at the completion's start, end of prefill, first token and end (see ``Clock``). ``prefix``: a shared
    prompt prefix whose cache the prefill starts from.
    """
    device = model_device(model)
    clock = Clock.for_models(model, per_forward=time_forwards)
    stats = GenerationStats(mode="rsp", forwards_timed=clock.per_forward)
    host_needed = bool(on_tokens or stopping.token_ids or stopping.strings)
    seq = input_ids.to(device)
    # On a CPU the tokens stay on the host, the next one fed through a buffer written by NumPy: each torch op between
    # two forwards runs cold there (the weights just streamed through the caches), ~40 us apiece.
    fed = torch.empty(1, 1, dtype=torch.long) if device.type == "cpu" else None
    out = torch.empty(max_new_tokens, dtype=torch.long, device=device) if fed is None else None
    tokens: list[int] = []
    stopped = False
    start = clock.now()
    kv = prefill(model, seq, prefix)
    stats.prefill_time_s = clock.now() - start
    next_ids = seq[:, -1:]
    n = 0
    while n < max_new_tokens:
        t0 = clock.forward_now()
        logits = forward_logits(model, next_ids, kv, 1)
        stats.target_time_s += clock.forward_now() - t0
        stats.target_forwards += 1
        if fed is not None:
            tokens.append(pick(logits, params, generator))
            fed.numpy()[0, 0] = tokens[-1]
            next_ids = fed
        else:
            token = sample_logits(logits, params, generator)
            out[n] = token[0]
            next_ids = token.view(1, 1)
        n += 1
        if n == 1:
            stats.ttft_s, stats.first_emission_tokens = clock.now() - start, 1
        if host_needed:
            if fed is None:
                tokens.append(int(token))
            if on_tokens:
                on_tokens(tokens[-1:], [False])
            if stopping.cut(tokens, n - 1) is not None:
                stopped = True
                break
    stats.total_time_s = clock.now() - start
    stats.after_first_s = stats.total_time_s - stats.ttft_s
    stats.new_tokens = n
    return GenerationOutput(torch.tensor(tokens[:n], dtype=torch.long) if out is None else out[:n].cpu(), stats, stopped)


@torch.inference_mode()
def generate_regular_batch(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generators: Sequence[torch.Generator | None],
    stopping: Stopping = NO_STOP,
    prefix: PrefixCache | None = None,
) -> list[GenerationOutput]:
    """RSp of prompts of equal length (``input_ids`` (B, T)) in one batch: each row gives the tokens
    ``generate_regular`` gives it alone with its own generator (rows share positions, so nothing is padded;
    each row draws from its generator exactly as it would alone). A row stops at its stop condition; the
    batch runs until every row has stopped. The stats are the batch's, shared by its rows (times divided by B).
    ``prefix``: a prompt prefix every row shares, whose cache the prefill starts from."""
    batch = input_ids.shape[0]
    device = model_device(model)
    clock = Clock.for_models(model)
    seq = input_ids.to(device)
    rows: list[list[int]] = [[] for _ in range(batch)]
    stopped = [False] * batch
    start = clock.now()
    kv = prefill(model, seq, prefix)
    prefill_s = clock.now() - start
    next_ids = seq[:, -1:]
    forwards = 0
    while not all(stopped) and forwards < max_new_tokens:
        logits = model(input_ids=next_ids, past_key_values=kv, use_cache=True).logits[:, -1].to(device)
        forwards += 1
        tokens = [sample_logits(logits[i:i + 1], params, generators[i])[0] for i in range(batch)]
        next_ids = torch.stack(tokens).view(batch, 1)
        for i, token in enumerate(tokens):
            if not stopped[i]:
                rows[i].append(int(token))
                stopped[i] = stopping.cut(rows[i], len(rows[i]) - 1) is not None
    total = clock.now() - start
    stats = GenerationStats(mode="rsp", new_tokens=sum(map(len, rows)) // batch, target_forwards=forwards,
                            prefill_time_s=prefill_s / batch, total_time_s=total / batch, forwards_timed=False)
    return [GenerationOutput(torch.tensor(row, dtype=torch.long), stats, done) for row, done in zip(rows, stopped)]
