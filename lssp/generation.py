"""Regular sampling (RSp) and speculative sampling (SSp), both with KV caches.

SSp follows Chen et al. 2023 (Alg. 2) / Leviathan et al. 2022 (Alg. 1): the draft proposes
``k`` tokens, the target scores them all in one forward, token i is kept with probability
min(1, p_i(x)/q_i(x)), the first rejection is replaced by a draw from norm(max(0, p - q)),
and a full acceptance earns a bonus token from p_{k+1}. Both caches then roll back to the
accepted length. Greedy decoding is that rule with one-hot p and q, so it runs on argmaxes.

With ``lookup`` = n, the draft also looks back in the text (prompt lookup): where the last n
tokens occurred before and the draft is unsure of its own top token, the token that followed
them then is proposed instead (greedy), or gets half of q's mass (sampling). q is whatever the
draft side proposes from, so the acceptance rule keeps SSp exact.

Both models first prefill the prompt but its last token. Invariant between iterations: each
model's cache holds a prefix of ``seq``; whatever of ``seq`` it has not seen yet (one token,
two for the draft after a full acceptance) is fed at its next forward, so the draft never
falls out of step.

A feature draft (``lssp/eagle.py``) also reads the target's final hidden states: the target's
forwards return them, the real ones of the accepted tokens are queued for the head after each
verification, and the head drops every position it drafted on its own guesses.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from lssp.eagle import FeatureCache, FeatureDraft, forward_with_features
from lssp.sampling import SamplingParams, argmax, sample, sample_logits, warp
from lssp.stats import alpha_estimate
from lssp.timing import Clock

LOOKUP_BELOW = 0.5  # the lookup speaks only where the draft's own top probability is below this
LOOKUP_WEIGHT = 0.5  # sampling: the share of q moved onto the looked-up token

# Called with each block of newly emitted token ids and, per token, whether the draft proposed it.
TokenCallback = Callable[[list[int], list[bool]], None]


@dataclass
class GenerationStats:
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
    ttft_s: float = 0.0
    forwards_timed: bool = True  # False: no sync around forwards, so draft/target times are not measured (0)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def alpha(self) -> float:
        """Per-token acceptance α of the i.i.d. model (its maximum-likelihood estimate)."""
        return alpha_estimate(self.accepted, self.rejections)

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def decode_time_s(self) -> float:
        """Wall time after the prompt's prefill: every emitted token is made in it."""
        return self.total_time_s - self.prefill_time_s

    @property
    def other_time_s(self) -> float:
        """Decode time outside the models' forwards (sampling, verification, cache bookkeeping)."""
        return self.decode_time_s - self.target_time_s - self.draft_time_s

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_time_s / self.new_tokens if self.new_tokens else float("nan")


def combined(parts: Sequence[GenerationStats]) -> GenerationStats:
    """The stats of several generations in a row (the turns of a conversation) as one: counts and times add
    up, the time to first token is the first one's."""
    first = parts[0]
    total = GenerationStats(mode=first.mode, k=first.k, drafted_at=[0] * len(first.drafted_at),
                            accepted_at=[0] * len(first.accepted_at), ttft_s=first.ttft_s,
                            forwards_timed=all(p.forwards_timed for p in parts))
    for name in ("new_tokens", "target_forwards", "draft_forwards", "drafted", "accepted", "rejections", "looked_up",
                 "looked_up_accepted", "prefill_time_s", "target_time_s", "draft_time_s", "total_time_s"):
        setattr(total, name, sum(getattr(p, name) for p in parts))
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


class ContextLookup:
    """The token that followed the latest earlier occurrence of the text's last ``n`` tokens."""

    def __init__(self, n: int, tokens: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"lookup n-gram length must be >= 1, got {n}")
        self.n = n
        self.tokens: list[int] = []
        self.successor: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if len(self.tokens) >= self.n:
                self.successor[tuple(self.tokens[-self.n:])] = token
            self.tokens.append(token)

    def propose(self, drafted: Sequence[int] = ()) -> int | None:
        """The hint for the token after the text plus ``drafted``, or None where the n-gram is new."""
        tail = (self.tokens[-self.n:] + list(drafted))[-self.n:]
        return self.successor.get(tuple(tail)) if len(tail) == self.n else None


def model_device(model: PreTrainedModel) -> torch.device:
    """Where the input embeddings live: where ids go in and sampling happens."""
    return model.get_input_embeddings().weight.device


def logit_width(model: PreTrainedModel) -> int:
    """How many logits the model's output layer gives (its vocabulary, padded or not)."""
    return model.get_output_embeddings().out_features


@cache
def _accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def forward_logits(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache, last: int) -> torch.Tensor:
    """Logits of the ``last`` final positions, shape (last, vocab), extending ``kv``.

    They are returned on the device of the input embeddings, where sampling happens, also
    when accelerate has split the model over several GPUs.
    """
    kwargs = {"logits_to_keep": last} if _accepts_logits_to_keep(type(model)) else {}
    out = model(input_ids=ids, past_key_values=kv, use_cache=True, **kwargs)
    return out.logits[0, -last:].to(model_device(model))


def draft_logits(target: PreTrainedModel, draft: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits (1, vocab) for the token after ``ids`` (1, T), from scratch; a feature draft reads the
    target's features of ``ids`` first."""
    if not isinstance(draft, FeatureDraft):
        return forward_logits(draft, ids.to(model_device(draft)), new_cache(draft), 1)
    if ids.shape[1] == 1:
        raise ValueError("a feature draft needs the target's feature of a token before the last")
    _, features = forward_with_features(target, ids[:, :-1].to(model_device(target)), new_cache(target), 0)
    return forward_logits(draft, ids[:, -1:], draft.start(ids, features), 1)


def new_cache(model: PreTrainedModel, batch: int = 1) -> DynamicCache:
    """An empty KV cache of the kind ``model`` takes (a compact forward brings its own), for ``batch`` rows."""
    make = getattr(model, "new_cache", None)
    if make is None:
        return DynamicCache(config=model.config)
    return make() if batch == 1 else make(batch)


def _feed(model: PreTrainedModel, ids: torch.Tensor, kv: DynamicCache) -> None:
    """Extend ``kv`` with ``ids`` (B, n), computing no logits but the last position's."""
    kwargs = {"logits_to_keep": 1} if _accepts_logits_to_keep(type(model)) else {}
    model(input_ids=ids.to(model_device(model)), past_key_values=kv, use_cache=True, **kwargs)


def drop(kv: DynamicCache, positions: int) -> None:
    """Roll the cache back by ``positions`` (none when <= 0). Never ``crop(0)``: before transformers
    5.17 it empties a DynamicCache, and every full acceptance would re-feed the whole sequence."""
    if positions > 0:
        kv.crop(-positions)


class PrefixCache:
    """The keys and values of a prompt prefix that many completions share (an eval's few-shot lines), one
    cache per model: a completion whose prompt starts with the prefix copies nothing and recomputes nothing,
    it rolls the model's cache back to the prefix and feeds the rest of its prompt."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self._caches: dict[torch.nn.Module, DynamicCache] = {}
        self._features: dict[torch.nn.Module, torch.Tensor] = {}  # a target's features of the prefix

    def _extends(self, seq: torch.Tensor) -> bool:
        n = len(self.ids)
        return seq.shape[1] > n and all(row[:n].tolist() == self.ids for row in seq)

    def start_with_features(self, target: PreTrainedModel, draft: FeatureDraft,
                            seq: torch.Tensor) -> tuple[DynamicCache, FeatureCache] | None:
        """For SSp with a feature draft: the target's cache holding ``seq`` (1, T) but its last token and the head's
        started on the target's features, both from the prefix's caches; None where ``seq`` does not extend it."""
        n = len(self.ids)
        if seq.shape[0] != 1 or not self._extends(seq) or n < 2:
            return None
        kv = self._caches.get(target)
        if kv is None or target not in self._features:  # (a cache made for RSp has no features)
            kv = self._caches[target] = new_cache(target)
            _, self._features[target] = forward_with_features(target, seq[:, :n], kv, 0)
            head = self._caches[draft] = draft.new_cache()
            head.queue(self._features[target][:, :-1])
            draft(seq[:, 1:n], head)  # the prefix's pairs but the last
        else:
            drop(kv, kv.get_seq_length() - n)
            head = self._caches[draft]
            drop(head, head.length - (n - 1))
        features = self._features[target]
        if seq.shape[1] > n + 1:
            features = torch.cat([features, forward_with_features(target, seq[:, n:-1], kv, 0)[1]], dim=1)
        return kv, draft.start(seq, features, head)

    def start(self, model: PreTrainedModel, seq: torch.Tensor) -> DynamicCache | None:
        """``model``'s cache holding all of ``seq`` (1, T), or of every row of ``seq`` (B, T), but its last token;
        None where a row does not extend the prefix (its tokenization differs there, or it is no longer)."""
        n = len(self.ids)
        if not self._extends(seq):
            return None
        kv = self._caches.get(model)
        if kv is None:
            kv = self._caches[model] = new_cache(model)
            _feed(model, seq[:1, :n], kv)
        else:
            drop(kv, kv.get_seq_length() - n)
        if seq.shape[0] > 1:
            kv = repeated(model, kv, seq.shape[0])
        if seq.shape[1] > n + 1:
            _feed(model, seq[:, n:-1], kv)
        return kv


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


def _prefill(model: PreTrainedModel, seq: torch.Tensor, prefix: PrefixCache | None = None) -> DynamicCache:
    """A cache holding all of ``seq`` but its last token, which the first decode step feeds (from ``prefix``'s
    cache where ``seq`` extends it)."""
    kv = prefix.start(model, seq) if prefix is not None else None
    if kv is None:
        kv = new_cache(model, seq.shape[0])
        if seq.shape[1] > 1:
            _feed(model, seq[:, :-1], kv)
    return kv


def accepted_prefix(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None) -> int:
    """How many leading drafts pass: draft i is kept with probability min(1, p_i(x)/q_i(x)).

    All k uniforms are drawn at once and the run is counted on the device, so the
    iteration synchronizes once.
    """
    k = drafts.shape[0]
    if k == 0:
        return 0
    rows = torch.arange(k, device=drafts.device)
    p_draft, q_draft = p[rows, drafts], q[rows, drafts]
    accept = torch.rand(k, device=drafts.device, generator=generator) * q_draft < p_draft
    return int(accept.cumprod(0).sum())


def greedy_verification(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The rule above with one-hot p and q: drafts pass while they are the target's argmax,
    and the next token is the target's argmax where the run stopped (or after it)."""
    best = argmax(logits)
    n = int((drafts == best[:drafts.shape[0]]).cumprod(0).sum())
    return n, best[n]


def _probability(logits: torch.Tensor, token: torch.Tensor | int) -> float:
    """softmax(logits)[token], read on the host."""
    return float((logits[token].float() - logits.float().logsumexp(-1)).exp())


def _lookup_hint(context: ContextLookup | None, drafted: Sequence[int], draft_logits: torch.Tensor) -> int | None:
    """The lookup's token, where it has one and the draft is unsure of its own top token."""
    hint = context.propose(drafted) if context else None
    if hint is None or _probability(draft_logits, argmax(draft_logits)) >= LOOKUP_BELOW:
        return None
    return hint


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the law of the token that replaces a rejected draft."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the right law (no host sync).
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


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
    out = torch.empty(max_new_tokens, dtype=torch.long, device=device)
    tokens: list[int] = []
    stopped = False
    start = clock.now()
    kv = _prefill(model, seq, prefix)
    stats.prefill_time_s = clock.now() - start
    next_ids = seq[:, -1:]
    n = 0
    while n < max_new_tokens:
        t0 = clock.forward_now()
        logits = forward_logits(model, next_ids, kv, 1)
        stats.target_time_s += clock.forward_now() - t0
        stats.target_forwards += 1
        token = sample_logits(logits, params, generator)
        out[n] = token[0]
        next_ids = token.view(1, 1)
        n += 1
        if n == 1:
            stats.ttft_s = clock.now() - start
        if host_needed:
            tokens.append(int(token))
            if on_tokens:
                on_tokens(tokens[-1:], [False])
            if stopping.cut(tokens, n - 1) is not None:
                stopped = True
                break
    stats.total_time_s = clock.now() - start
    stats.new_tokens = n
    return GenerationOutput(out[:n].cpu(), stats, stopped)


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
    kv = _prefill(model, seq, prefix)
    prefill = clock.now() - start
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
                            prefill_time_s=prefill / batch, total_time_s=total / batch, forwards_timed=False)
    return [GenerationOutput(torch.tensor(row, dtype=torch.long), stats, done) for row, done in zip(rows, stopped)]


@torch.inference_mode()
def generate_speculative(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    stopping: Stopping = NO_STOP,
    on_tokens: TokenCallback | None = None,
    vocab_size: int | None = None,
    confidence: float = 0.0,
    lookup: int = 0,
    time_forwards: bool = True,
    prefix: PrefixCache | None = None,
) -> GenerationOutput:
    """Sample ``max_new_tokens`` tokens from ``target``'s distribution with ``draft`` proposing ``k`` at a time.

    ``vocab_size`` limits both models' logits to a common prefix (embedding matrices padded
    to different sizes); by default the smaller of the two output widths. With ``confidence``
    > 0, the draft stops proposing early once its own (untempered) probability of the token it
    just proposed falls below it, like transformers' ``assistant_confidence_threshold``: ``k``
    is then a maximum. The rule looks at the draft alone, so sampling stays exact. ``lookup`` > 0
    turns on the context lookup over n-grams of that length (module docstring). ``time_forwards`` and
    ``prefix`` as in ``generate_regular``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    device, draft_device = model_device(target), model_device(draft)
    clock = Clock.for_models(target, draft, per_forward=time_forwards)
    vocab = vocab_size or min(logit_width(target), logit_width(draft))
    stats = GenerationStats(mode="ssp", k=k, drafted_at=[0] * k, accepted_at=[0] * k, forwards_timed=clock.per_forward)
    seq = input_ids.to(device)
    tokens: list[int] = []
    stopped = False
    features = isinstance(draft, FeatureDraft)
    start = clock.now()
    started = prefix.start_with_features(target, draft, seq) if features and prefix is not None else None
    if started is not None:
        target_kv, draft_kv = started
    elif features:  # the head reads the target's features of the prompt
        target_kv = new_cache(target)
        _, prompt_features = (forward_with_features(target, seq[:, :-1], target_kv, 0) if seq.shape[1] > 1
                              else (None, seq.new_zeros(1, 0, 0, dtype=torch.float)))
        draft_kv = draft.start(seq, prompt_features)
    else:
        target_kv, draft_kv = _prefill(target, seq, prefix), _prefill(draft, seq, prefix)
    context = ContextLookup(lookup, input_ids[0].tolist()) if lookup else None
    stats.prefill_time_s = clock.now() - start
    while len(tokens) < max_new_tokens and not stopped:
        # Never draft past the budget: the iteration then emits at most what is left. A feature draft
        # drafts nothing until the target has given it a feature (a one-token prompt).
        k_now = min(k, max_new_tokens - len(tokens) - 1) if not features or draft_kv.ready else 0

        # 1. The draft proposes k_now tokens, keeping its distributions q_1..q_k (greedy needs only argmaxes).
        drafts = torch.empty(k_now, dtype=torch.long, device=device)
        q = None if params.greedy else torch.empty(k_now, vocab, device=device)
        pending = seq[:, draft_kv.get_seq_length():]
        drafted: list[int] = []  # the drafts on the host, kept for the lookup
        hinted: list[bool] = []
        for i in range(k_now):
            t0 = clock.forward_now()
            logits = forward_logits(draft, pending.to(draft_device), draft_kv, 1)
            stats.draft_time_s += clock.forward_now() - t0
            hint = _lookup_hint(context, drafted, logits[0, :vocab])
            hinted.append(hint is not None)
            if params.greedy:  # q is one-hot: only its argmax matters
                drafts[i] = argmax(logits[0, :vocab]).to(device) if hint is None else hint
            else:
                q[i] = warp(logits[:, :vocab].to(device), params)[0]
                if hint is not None:
                    q[i] *= 1 - LOOKUP_WEIGHT
                    q[i, hint] += LOOKUP_WEIGHT
                drafts[i] = sample(q[i], params, generator)
            pending = drafts[i].view(1, 1)
            if context:
                drafted.append(int(drafts[i]))
            if confidence and hint is None and i + 1 < k_now and _probability(logits[0, :vocab], drafts[i]) < confidence:
                k_now = i + 1
                drafts = drafts[:k_now]  # q's unused rows are never read
                break
        stats.draft_forwards += k_now

        # 2. One target forward scores every draft position and the bonus position.
        target_in = torch.cat([seq[:, target_kv.get_seq_length():], drafts.view(1, -1)], dim=1)
        t0 = clock.forward_now()
        if features:
            logits, fed_features = forward_with_features(target, target_in, target_kv, k_now + 1)
        else:
            logits = forward_logits(target, target_in, target_kv, k_now + 1)
        stats.target_time_s += clock.forward_now() - t0
        stats.target_forwards += 1

        # 3. Accept the longest run of drafts that passes, then draw one more token.
        if params.greedy:
            n, extra = greedy_verification(logits[:, :vocab], drafts)
        else:
            p = warp(logits[:, :vocab], params)
            n = accepted_prefix(p, q, drafts, generator)
            last = residual_distribution(p[n], q[n]) if n < k_now else p[k_now]
            extra = sample(last, params, generator)

        # 4. Emit, then roll both caches back to what is still valid.
        emitted = torch.cat([drafts[:n], extra.view(1)])
        drop(target_kv, k_now - n)
        if features:  # every position the head drafted read its own guesses: keep only the real features
            drop(draft_kv, k_now - 1)
            draft_kv.queue(fed_features[:, :target_in.shape[1] - (k_now - n)])
        else:
            drop(draft_kv, k_now - 1 - n)
        seq = torch.cat([seq, emitted.view(1, -1)], dim=1)
        new = emitted.tolist()
        if context:
            context.extend(new)
        stats.looked_up += sum(hinted)
        stats.looked_up_accepted += sum(hinted[:n])
        stats.drafted += k_now
        stats.accepted += n
        stats.rejections += int(n < k_now)
        for i in range(k_now):
            stats.drafted_at[i] += 1
            stats.accepted_at[i] += int(i < n)

        first_new = len(tokens)
        tokens.extend(new)
        keep = stopping.cut(tokens, first_new)
        if keep is not None:
            stopped = True
            del tokens[keep:]
        if first_new == 0:
            stats.ttft_s = clock.now() - start
        if on_tokens and len(tokens) > first_new:
            shown = tokens[first_new:]
            on_tokens(shown, [i < n for i in range(len(shown))])
    stats.total_time_s = clock.now() - start
    stats.new_tokens = len(tokens)
    return GenerationOutput(torch.tensor(tokens, dtype=torch.long), stats, stopped)
