"""Batched speculative sampling: B completions in one loop, each row accepting its own number of drafts.

The rows drift apart in length; one rule keeps every row exact. Each forward writes the new keys and values of all
rows into the same cache slots (a DynamicCache appends them, a compact cache writes them at its length), and each
row keeps, per model (``RowCache``):

- its position counter: how many of its own tokens the cache holds, the position of its next one (``position_ids``);
- which slots hold its tokens (``valid``), turned into an additive mask at every forward: 0 on its valid slots up to
  the query's own slot, -inf everywhere else.

A slot that holds none of a row's tokens is a hole, masked for good: the left padding of a shorter prompt, the
padding of a row that feeds fewer tokens than another in the same forward, and the slots of its rejected drafts.

Why it is exact: attention at a query is softmax over the slots of (scores + mask). exp(-inf) is exactly 0, so a
hole gets weight 0 and adds exactly 0 to the output; its value is finite, since a hole's own query attends to its own
slot (no fully masked row, so no NaN). A row's query therefore sums over exactly the keys and values it would see
alone, each computed at the position it would have alone (rotary embeddings read the position, never the slot),
and everything else in the model (embeddings, norms, MLPs, the output layer) acts on each token by itself. So each
row's logits are those of its own text, up to the order of floating-point sums in batched kernels. Each row also
draws from its own generator in the order ``speculative_decode`` does (its drafts, then its acceptance uniforms and
next token, through the same ``Picker`` and ``verify_proposal``), so its tokens are the ones it gets alone.

Rows can also join a running batch (continuous batching, ``run_rows``): a joining row's prompt is prefilled apart and
its slots added at the end of the caches (``merge_rows``), the other rows holding holes there; when holes come to
outnumber a cache's tokens, each row's tokens move together to fewer slots (``repack_rows``). Neither changes what a
row's queries see, so joining rows stay exact too.

The drafter's side of the rows is the drafter's own (``Drafter.begin_rows``: a draft model's cache, a feature head's
pairs of features and tokens, an n-gram drafter's contexts), with its policies (the context lookup, the confidence
stop) applied to each row's picker as for one completion; ``Drafter.rows_reason`` says where a drafter cannot
(a feature head over a target not under the compact forward).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from lssp.decoding.drafting import Drafter, DraftRows, Picker, Proposal
from lssp.decoding.generation import NO_STOP, GenerationOutput, GenerationStats, Stopping
from lssp.decoding.kv import PrefixCache, accepts_logits_to_keep, drop, new_cache, repeated
from lssp.decoding.sampling import SamplingParams, argmax, sample_logits
from lssp.decoding.speculative import count_iteration, verify_proposal
from lssp.decoding.timing import Clock
from lssp.models.compact import CompactCache
from lssp.models.eagle import feature_width
from lssp.models.modules import logit_width, model_device


def joinable(*models: torch.nn.Module | None) -> str | None:
    """Why rows cannot join a running batch of these models (``run_rows``'s continuous batching; None: a drafter's
    missing model), or None."""
    if all(callable(getattr(m, "new_cache", None)) for m in models if m is not None):  # compact forwards: CompactCaches
        return None
    return "rows join a running batch only under the compact forward"


@dataclass
class RowCache:
    """One model's KV cache shared by the rows: which of its slots hold each row's tokens, and each row's next
    position (how many of its tokens the cache holds)."""

    model: PreTrainedModel
    kv: Any  # a DynamicCache, or a compact forward's CompactCache
    valid: torch.Tensor  # (rows, slots) bool
    positions: torch.Tensor  # (rows,) long

    @property
    def slots(self) -> int:
        return self.valid.shape[1]


@dataclass
class Row:
    """One completion of the batch: its text so far, its generator and what it has done."""

    seq: list[int]  # prompt and emitted tokens
    generator: torch.Generator | None
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    done: bool = False
    finished_s: float = 0.0  # when its last token came out, from the run's start
    arrived_s: float = 0.0  # when its request arrived (its scheduled time, else when it joined), from the run's start


def forward_rows(cache: RowCache, pieces: Sequence[Sequence[int]], keep: int, left: bool) -> torch.Tensor:
    """Feed each row its tokens ``pieces[r]`` (maybe none) in one forward, padded with holes on the ``left`` (else on
    the right); returns the logits of the last ``keep`` columns (rows, keep, vocab)."""
    kwargs = {"logits_to_keep": keep} if accepts_logits_to_keep(type(cache.model)) else {}
    return feed_rows(cache, pieces, left, **kwargs).logits[:, -keep:].to(model_device(cache.model))


def feed_rows(cache: RowCache, pieces: Sequence[Sequence[int]], left: bool, **model_kwargs: Any) -> Any:
    """``forward_rows``'s forward, returning the model's output (``model_kwargs``: e.g. a compact forward's
    ``features=True``)."""
    device = model_device(cache.model)
    width = max(map(len, pieces))
    ids = torch.zeros(len(pieces), width, dtype=torch.long)
    used = torch.zeros(len(pieces), width, dtype=torch.bool)
    for r, piece in enumerate(pieces):
        if piece:
            at = slice(width - len(piece), width) if left else slice(0, len(piece))
            ids[r, at], used[r, at] = torch.tensor(piece, dtype=torch.long), True
    ids, used = ids.to(device), used.to(device)
    positions = cache.positions[:, None] + (used.long().cumsum(1) - 1).clamp(min=0)  # holes: any finite position
    valid = torch.cat([cache.valid, used], dim=1)
    slot = torch.arange(valid.shape[1], device=device)[None, None, :]
    query = cache.slots + torch.arange(width, device=device)[None, :, None]
    allowed = (valid[:, None, :] & (slot <= query)) | (slot == query)  # a hole sees only itself
    dtype = cache.model.get_input_embeddings().weight.dtype
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    if hasattr(cache.model, "skips_holes"):  # a compact forward: where it can, it does not compute the padding
        model_kwargs["used"] = used
    out = cache.model(input_ids=ids, past_key_values=cache.kv, use_cache=True, attention_mask=bias[:, None],
                      position_ids=positions, **model_kwargs)
    cache.valid, cache.positions = valid, cache.positions + used.sum(1)
    return out


def empty_rows(model: PreTrainedModel, rows: int) -> RowCache:
    """An empty cache for ``rows`` rows at positions of their own."""
    device = model_device(model)
    return RowCache(model, new_cache(model, rows), torch.ones(rows, 0, dtype=torch.bool, device=device),
                    torch.zeros(rows, dtype=torch.long, device=device))


def shared_prefix(prefix: PrefixCache | None, prompts: Sequence[list[int]]) -> int:
    """How many tokens of ``prefix`` every prompt starts with and goes beyond: all of them, or 0."""
    n = len(prefix.ids) if prefix is not None else 0
    return n if n and all(len(p) > n and p[:n] == prefix.ids for p in prompts) else 0


def rows_after_prefix(model: PreTrainedModel, kv: Any, rows: int, n: int) -> RowCache:
    """``rows`` rows over ``kv``, which holds the first ``n`` tokens of each."""
    device = model_device(model)
    return RowCache(model, kv, torch.ones(rows, n, dtype=torch.bool, device=device),
                    torch.full((rows,), n, dtype=torch.long, device=device))


def begin_rows(model: PreTrainedModel, prompts: Sequence[list[int]], prefix: PrefixCache | None, role: str) -> RowCache:
    """``model``'s cache holding every prompt but its last token: the shared ``prefix``'s keys and values once for all
    rows where every prompt extends it, then each row's rest of its prompt, left-padded."""
    n = shared_prefix(prefix, prompts)
    kv = prefix.start(model, torch.tensor([p[:n + 1] for p in prompts], device=model_device(model)), role,
                      own=True) if n else None
    if kv is None:
        return prefill_rows(model, [p[:-1] for p in prompts])[0]
    cache = rows_after_prefix(model, kv, len(prompts), n)
    rest = [p[n:-1] for p in prompts]
    if any(rest):
        forward_rows(cache, rest, 1, left=True)
    return cache


ALONE_BELOW = 0.8  # prefill rows one by one where their tokens fill less than this share of the padded batch


def prefill_rows(model: PreTrainedModel, pieces: Sequence[Sequence[int]],
                 features: bool = False) -> tuple[RowCache, list[torch.Tensor] | None]:
    """A cache holding each row's ``pieces``, left-padded with holes, and with ``features`` each row's final hidden
    states of them (a compact forward's). Under a compact forward each row runs alone and its keys and values are
    copied into place: nothing is computed for the padding, which for prompts of unequal lengths (a ShareGPT
    batch: tens to hundreds of tokens) costs more than the batch saves. Rows of about one length, and other models,
    get one padded forward."""
    cache = empty_rows(model, len(pieces))
    width = max(map(len, pieces), default=0)
    if width == 0:
        return cache, [torch.zeros(0, feature_width(model), device=model_device(model)) for _ in pieces] \
            if features else None
    kwargs = {"features": True} if features else {}
    if not isinstance(cache.kv, CompactCache) or sum(map(len, pieces)) > ALONE_BELOW * len(pieces) * width:
        out = feed_rows(cache, pieces, True, logits_to_keep=1, **kwargs)
        return cache, [out.features[r, width - len(p):] for r, p in enumerate(pieces)] if features else None
    cache.kv.reserve(width)
    for buffer in cache.kv.keys_values:  # holes hold finite values: a masked slot's weight is 0, and 0 * NaN is NaN
        buffer[:, :, :width].zero_()
    found = [_prefill_alone(cache, r, piece, width, kwargs) for r, piece in enumerate(pieces)]
    cache.kv.length = width
    lengths = torch.tensor([len(p) for p in pieces], device=cache.valid.device)
    cache.valid = torch.arange(width, device=lengths.device)[None, :] >= width - lengths[:, None]
    cache.positions = lengths
    return cache, found if features else None


def _prefill_alone(cache: RowCache, row: int, piece: Sequence[int], width: int, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run ``piece`` alone and copy its keys and values into ``row`` of the compact ``cache``, right-aligned at
    ``width``; its features (empty without ``features`` in ``kwargs``)."""
    model, kv = cache.model, cache.kv
    if not piece:
        return torch.zeros(0, feature_width(model), device=model_device(model))
    alone = new_cache(model)
    out = model(input_ids=torch.tensor([piece], device=model_device(model)), past_key_values=alone, use_cache=True,
                logits_to_keep=1, **kwargs)
    for mine, theirs in zip(kv.keys_values, alone.keys_values, strict=True):
        mine[row, :, width - len(piece):width] = theirs[0, :, :len(piece)]
    return out.features[0] if kwargs.get("features") else torch.zeros(0, feature_width(model))


def drop_row(cache: RowCache, row: int, tokens: int) -> None:
    """Forget the last ``tokens`` tokens of ``row`` (none when <= 0): their slots become holes."""
    if tokens > 0:
        slots = cache.valid[row].nonzero().flatten()[-tokens:]
        cache.valid[row, slots] = False
        cache.positions[row] -= tokens


def keep_rows(cache: RowCache, rows: list[int]) -> None:
    """Keep only ``rows`` of the batch (the others are done), then drop the slots at the end that no row holds."""
    if len(rows) < cache.valid.shape[0]:
        index = torch.tensor(rows, dtype=torch.long, device=cache.valid.device)
        if hasattr(cache.kv, "keys_values"):  # a compact forward's cache
            cache.kv.select(index)
        else:
            cache.kv.batch_select_indices(index)
        cache.valid, cache.positions = cache.valid[index], cache.positions[index]
    held = cache.valid.any(0).nonzero()
    end = int(held[-1]) + 1 if len(held) else 0
    if 0 < end < cache.slots:
        drop(cache.kv, cache.slots - end)
        cache.valid = cache.valid[:, :end]


def begin_rows_with_features(target: PreTrainedModel, prompts: Sequence[list[int]],
                             prefix: PrefixCache | None = None) -> tuple[RowCache, list[torch.Tensor]]:
    """The target's cache holding every prompt but its last token, and its features of those tokens, per row: the
    shared ``prefix``'s keys, values and features computed once where every prompt extends it (as ``begin_rows``)."""
    n = shared_prefix(prefix, prompts)
    started = prefix.start_with_features(target, torch.tensor([prompts[0][:n + 1]], device=model_device(target))) \
        if n else None
    if started is None:
        cache, features = prefill_rows(target, [p[:-1] for p in prompts], features=True)
        return cache, features if features is not None else []
    kv, shared = started
    cache = rows_after_prefix(target, repeated(target, kv, len(prompts)), len(prompts), n)
    rest = [p[n:-1] for p in prompts]
    if not any(rest):
        return cache, [shared[0] for _ in prompts]
    out = feed_rows(cache, rest, True, logits_to_keep=1, features=True)
    width = max(map(len, rest))
    return cache, [torch.cat([shared[0], out.features[r, width - len(p):]]) for r, p in enumerate(rest)]


def score_rows(cache: RowCache, pieces: Sequence[Sequence[int]], features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits at every position of each row's ``pieces`` (right-padded), and with ``features`` its
    final hidden states there."""
    if not features:
        return forward_rows(cache, pieces, max(map(len, pieces)), left=False), None
    out = feed_rows(cache, pieces, False, logits_to_keep=max(map(len, pieces)), features=True)
    return out.logits.to(model_device(cache.model)), out.features


def verify_rows(logits: torch.Tensor, proposals: Sequence[Proposal], params: SamplingParams,
                generators: Sequence[torch.Generator | None], vocab: int) -> list[tuple[int, torch.Tensor]]:
    """Each row's (accepted drafts, next token): row r verifies its own drafts against its own target logits
    ``logits[r]`` with its own generator, as ``speculative_decode`` does alone (no row reads another's)."""
    if params.greedy and not any(map(len, proposals)):  # no drafts: every row's argmax in one call
        return [(0, token) for token in argmax(logits[:, 0, :vocab].contiguous())]
    return [verify_proposal(logits[r, :len(p) + 1, :vocab], p, params, g)
            for r, (p, g) in enumerate(zip(proposals, generators, strict=True))]


def emit(row: Row, proposal: Proposal, accepted: int, new: list[int], stopping: Stopping, max_new_tokens: int,
         now: float) -> None:
    """Add one verification's tokens ``new`` (its ``accepted`` drafts and the target's token) to ``row``, up to a
    stop, and count the iteration as ``speculative_decode``."""
    first_new = len(row.tokens)
    row.seq += new
    row.tokens += new
    keep = stopping.cut(row.tokens, first_new)
    if keep is not None:
        row.stopped = True
        del row.tokens[keep:]
    count_iteration(row.stats, proposal, accepted, len(row.tokens) - first_new)
    if first_new == 0:
        row.stats.ttft_s, row.stats.first_emission_tokens = now - row.arrived_s, len(row.tokens)
    row.finished_s = now
    row.done = row.stopped or len(row.tokens) >= max_new_tokens


class RowsRun:
    """Rows generating together: ``admit`` adds rows (the first ones prefilled as one batch; rows joining a running
    batch prefilled apart and merged in: compact caches only), ``step`` runs one iteration for every live row,
    ``retire`` lets the rows done leave. Times are seconds from ``start`` on ``clock``; the totals (prefill, target,
    draft) are the run's, shared by its rows at the end."""

    def __init__(self, clock: Clock, start: float, max_new_tokens: int) -> None:
        self.clock, self.start, self.max_new_tokens = clock, start, max_new_tokens
        self.live: list[Row] = []
        self.prefill_s = self.target_s = self.draft_s = 0.0

    def now(self) -> float:
        return self.clock.now() - self.start

    def models(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def caches(self) -> list[RowCache]:
        raise NotImplementedError

    def _begin(self, rows: Sequence[Row]) -> Any:
        """Prefill ``rows``' prompts, giving what ``_merge`` or ``_adopt`` takes."""
        raise NotImplementedError

    def _merge(self, begun: Any) -> None:
        raise NotImplementedError

    def _adopt(self, begun: Any) -> None:
        raise NotImplementedError

    def _keep(self, kept: list[int]) -> None:
        for cache in self.caches():
            keep_rows(cache, kept)

    def admit(self, rows: Sequence[Row], arrived: Sequence[float] = ()) -> None:
        """Add ``rows``; they run from the next ``step``. Each row's times count from ``arrived`` (its request's
        scheduled arrival, seconds from the run's start: the wait for a slot and for the step in flight included),
        else from now."""
        t0 = self.clock.now()
        for i, row in enumerate(rows):
            row.arrived_s = arrived[i] if arrived else t0 - self.start
        begun = self._begin(rows)
        if self.live:
            self._merge(begun)
        else:  # nothing to merge into: the new rows' caches become the run's
            self._adopt(begun)
        self.prefill_s += self.clock.now() - t0
        self.live += rows if self.max_new_tokens > 0 else []

    def retire(self) -> None:
        """The rows done leave the batch (and the caches drop what no row holds any more)."""
        kept = [r for r, row in enumerate(self.live) if not row.done]
        self._keep(kept)
        if len(kept) < len(self.live):
            self.live = [self.live[r] for r in kept]
            for cache in self.caches():
                repack_rows(cache)


def merge_rows(cache: RowCache, joining: RowCache) -> None:
    """Add ``joining``'s rows below ``cache``'s (compact caches): its slots right-aligned at the end of the merged
    ones, holes before them; ``cache``'s rows get holes in the slots added at its end, if any."""
    kv, theirs = cache.kv, joining.kv
    if not isinstance(kv, CompactCache) or not isinstance(theirs, CompactCache):
        raise ValueError("rows join a running batch only under the compact forward")
    width = max(cache.slots, joining.slots)
    if width > cache.slots:
        kv.reserve(width)
        for buffer in kv.keys_values:
            buffer[:, :, kv.length:width].zero_()
        kv.length = width
        cache.valid = torch.cat([cache.valid, cache.valid.new_zeros(cache.valid.shape[0], width - cache.slots)], 1)
    kv.add_rows(theirs, width - joining.slots)
    valid = joining.valid.new_zeros(joining.valid.shape[0], width)
    valid[:, width - joining.slots:] = joining.valid
    cache.valid = torch.cat([cache.valid, valid])
    cache.positions = torch.cat([cache.positions, joining.positions])


REPACK_ABOVE = 2.0  # repack a compact cache when its slots outnumber its fullest row's tokens by this factor


def repack_rows(cache: RowCache) -> None:
    """Drop the holes of a compact cache whose slots are mostly holes: each row's tokens move, in order, to the end of
    as many slots as its fullest row holds (exact: a hole adds exactly 0, and positions are the rows' own)."""
    kv = cache.kv
    counts = cache.valid.sum(1)
    width = int(counts.max()) if len(counts) else 0
    if not isinstance(kv, CompactCache) or cache.slots <= REPACK_ABOVE * width + 16:
        return
    order = torch.sort((~cache.valid).to(torch.uint8), dim=1, stable=True).indices  # each row's valid slots first
    column = torch.arange(width, device=counts.device)[None, :] - (width - counts[:, None])  # its i-th token, or < 0
    valid = column >= 0
    source = order.gather(1, column.clamp(min=0))
    for buffer in kv.keys_values:
        index = source[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
        buffer[:, :, :width] = buffer[:, :, :kv.length].gather(2, index)
    kv.length = width
    cache.valid = valid


class RegularRows(RowsRun):
    """RSp rows of ``model`` (``generate_regular_rows``)."""

    def __init__(self, model: PreTrainedModel, params: SamplingParams, stopping: Stopping, max_new_tokens: int,
                 prefix: PrefixCache | None, clock: Clock, start: float) -> None:
        super().__init__(clock, start, max_new_tokens)
        self.model, self.params, self.stopping, self.prefix = model, params, stopping, prefix
        self.cache: RowCache | None = None

    def models(self) -> list[torch.nn.Module]:
        return [self.model]

    def caches(self) -> list[RowCache]:
        return [self.cache] if self.cache is not None else []

    def _begin(self, rows: Sequence[Row]) -> RowCache:
        return begin_rows(self.model, [row.seq for row in rows], self.prefix, "target")

    def _merge(self, begun: RowCache) -> None:
        merge_rows(self.cache, begun)

    def _adopt(self, begun: RowCache) -> None:
        self.cache = begun

    def step(self) -> None:
        logits = forward_rows(self.cache, [[row.seq[-1]] for row in self.live], 1, left=True)[:, -1]
        now = self.now()
        for r, row in enumerate(self.live):
            token = int(sample_logits(logits[r:r + 1], self.params, row.generator)[0])
            row.seq.append(token)
            row.tokens.append(token)
            row.stats.target_forwards += 1
            if len(row.tokens) == 1:
                row.stats.ttft_s, row.stats.first_emission_tokens = now - row.arrived_s, 1
            row.stopped = self.stopping.cut(row.tokens, len(row.tokens) - 1) is not None
            row.finished_s = now
            row.done = row.stopped or len(row.tokens) >= self.max_new_tokens


def drafts_per_row(k: int, rows: int, max_rows: int) -> int:
    """A step's K: ``k``, or under a row budget ``max_rows`` > 0 the most drafts each of ``rows`` rows may propose
    with the step verifying at most that many positions (rows x (drafts + 1)), down to none (an RSp step). A K set
    by the batch's size alone keeps SSp exact, as any K chosen from what happened before."""
    return k if not max_rows else max(0, min(k, max_rows // max(rows, 1) - 1))


class SpeculativeRows(RowsRun):
    """SSp rows of ``target`` with ``drafter`` (``speculative_decode_batch``); ``max_rows``: ``drafts_per_row``."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter, k: int, params: SamplingParams,
                 stopping: Stopping, max_new_tokens: int, vocab: int, prefix: PrefixCache | None, clock: Clock,
                 start: float, max_rows: int = 0) -> None:
        super().__init__(clock, start, max_new_tokens)
        refused = drafter.rows_reason(target)
        if refused:
            raise ValueError(refused)
        self.target, self.drafter, self.k, self.params, self.stopping = target, drafter, k, params, stopping
        self.max_rows = max_rows
        self.vocab, self.prefix, self.device = vocab, prefix, model_device(target)
        self.target_cache: RowCache | None = None
        self.drafting: DraftRows | None = None  # the drafter's state of the live rows

    def models(self) -> list[torch.nn.Module]:
        return [m for m in (self.target, self.drafter.model) if m is not None]

    def caches(self) -> list[RowCache]:
        return [self.target_cache, *self.drafting.caches()] if self.drafting is not None else []

    def _begin(self, rows: Sequence[Row]) -> tuple[RowCache, DraftRows]:
        texts = [row.seq for row in rows]
        if self.drafter.needs_features:  # a feature head reads the target's features of each prompt
            cache, features = begin_rows_with_features(self.target, texts, self.prefix)
            return cache, self.drafter.begin_rows(texts, self.prefix, features)
        return begin_rows(self.target, texts, self.prefix, "target"), self.drafter.begin_rows(texts, self.prefix, None)

    def _merge(self, begun: tuple[RowCache, DraftRows]) -> None:
        merge_rows(self.target_cache, begun[0])
        self.drafting.merge(begun[1])

    def _adopt(self, begun: tuple[RowCache, DraftRows]) -> None:
        self.target_cache, self.drafting = begun

    def _keep(self, kept: list[int]) -> None:
        if self.drafting is not None:
            keep_rows(self.target_cache, kept)
            self.drafting.keep(kept)

    def step(self) -> None:
        live, max_new_tokens = self.live, self.max_new_tokens
        # 1. Each row drafts up to k tokens (fewer where the batch outgrows the row budget: no copied chain past
        #    them), never past its budget (the iteration then emits at most what is left).
        k = drafts_per_row(self.k, len(live), self.max_rows)
        longest = self.drafter.longest(k) if k == self.k else k
        lefts = [max_new_tokens - len(row.tokens) - 1 if self.drafting.ready(r) else 0 for r, row in enumerate(live)]
        pickers = [Picker(min(k, left), self.vocab, self.params, row.generator, self.device, min(longest, left))
                   for row, left in zip(live, lefts)]
        t0 = self.clock.now()
        # A step no row drafts in (the batch outgrew the row budget) asks the drafter nothing: it skips the step,
        # reading what it missed at its next draft.
        drafting = any(picker.k for picker in pickers)
        proposals = self.drafting.propose([row.seq for row in live], pickers) if drafting else \
            [picker.proposal() for picker in pickers]
        t1 = self.clock.now()

        # 2. One target forward scores every row's drafts and the position after them.
        pieces = [[row.seq[-1], *p.tokens.tolist()] for row, p in zip(live, proposals)]
        logits, features = score_rows(self.target_cache, pieces, self.drafter.needs_features)
        t2 = self.clock.now()
        self.draft_s, self.target_s = self.draft_s + t1 - t0, self.target_s + t2 - t1

        # 3. Each row keeps its longest run of drafts that passes and one token of the target's; the target's cache
        #    forgets the drafts it rejected, the drafter what no longer holds.
        verdicts = verify_rows(logits, proposals, self.params, [row.generator for row in live], self.vocab)
        for r, (row, proposal, (accepted, extra)) in enumerate(zip(live, proposals, verdicts)):
            drop_row(self.target_cache, r, len(proposal) - accepted)
            new = [*proposal.tokens[:accepted].tolist(), int(extra)]
            kept = features[r, :1 + accepted] if features is not None else None
            if drafting:
                self.drafting.commit(r, proposal, accepted, new, kept)
            else:
                self.drafting.skip(r, new, kept)
            emit(row, proposal, accepted, new, self.stopping, max_new_tokens, self.now())


def run_rows(run: RowsRun, rows: Sequence[Row], concurrency: int = 0, arrivals: Sequence[float] = (),
             wait: Callable[[float], None] = time.sleep) -> None:
    """Run ``rows`` through ``run`` until they are done: all at once by default; with ``concurrency``, continuous
    batching, at most that many live at once and the next joining (in order) as rows leave; with ``arrivals``
    (seconds from the run's start, one per row, increasing), a row joins once its time has come, and a run with no
    live row ``wait``s for the next. Joining a running batch takes compact forwards. A row's times count from its
    arrival time where ``arrivals`` are given (what a user waits: for a free slot and for the iteration in flight
    too), else from when it joined (a closed loop: a client sends when its last request ends, and it joins then)."""
    concurrency = concurrency or len(rows)
    times = list(arrivals) or [0.0] * len(rows)
    refused = joinable(*run.models()) if concurrency < len(rows) or any(times) else None
    if refused:
        raise ValueError(refused)
    queue = list(zip(rows, times))
    while run.live or queue:
        joining = []
        while queue and len(run.live) + len(joining) < concurrency and queue[0][1] <= run.now():
            joining.append(queue.pop(0))
        if joining:
            run.admit([row for row, _ in joining], [at for _, at in joining] if arrivals else ())
        if run.live:
            run.step()
            run.retire()
        elif queue:
            wait(max(0.0, queue[0][1] - run.now()))


def _rows(prompts: Sequence[torch.Tensor], generators: Sequence[torch.Generator | None],
          stats: Callable[[], GenerationStats]) -> list[Row]:
    return [Row(p.reshape(-1).tolist(), g, stats()) for p, g in zip(prompts, generators, strict=True)]


@torch.inference_mode()
def generate_regular_rows(model: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                          params: SamplingParams, generators: Sequence[torch.Generator | None],
                          stopping: Stopping = NO_STOP, prefix: PrefixCache | None = None,
                          concurrency: int = 0, arrivals: Sequence[float] = ()) -> list[GenerationOutput]:
    """RSp of several prompts (each (T,) or (1, T), of any lengths) in one loop, each row at positions of its own:
    each row gives the tokens ``generate_regular`` gives it alone with its generator, and leaves the batch at its
    stop or budget. ``concurrency`` and ``arrivals``: continuous batching (``run_rows``). Stats as
    ``speculative_decode_batch``'s."""
    clock = Clock.for_models(model)
    rows = _rows(prompts, generators, lambda: GenerationStats(mode="rsp", forwards_timed=False))
    run = RegularRows(model, params, stopping, max_new_tokens, prefix, clock, clock.now())
    run_rows(run, rows, concurrency, arrivals)
    total = run.now()
    return _outputs(rows, total, run.prefill_s, total - run.prefill_s, 0.0)


@torch.inference_mode()
def speculative_decode_batch(target: PreTrainedModel, drafter: Drafter, prompts: Sequence[torch.Tensor],
                             max_new_tokens: int, k: int, params: SamplingParams,
                             generators: Sequence[torch.Generator | None], stopping: Stopping = NO_STOP,
                             vocab: int | None = None, prefix: PrefixCache | None = None,
                             concurrency: int = 0, arrivals: Sequence[float] = (),
                             max_rows: int = 0) -> list[GenerationOutput]:
    """SSp of several prompts (each (T,) or (1, T), of any lengths) with ``drafter`` (one whose ``rows_reason(target)``
    is None), in one loop: each row gives the tokens ``speculative_decode``
    gives it alone with its generator (see the module's docstring). A row leaves the batch at its stop or budget;
    ``concurrency`` and ``arrivals``: continuous batching (``run_rows``). Each row's stats count its own drafts,
    acceptances and forwards; its ``ttft_s`` and ``after_first_s`` are its own (what a user waiting on it sees, from
    when it joined), while the time totals (prefill, target, draft) are the run's shared by its rows (divided by B,
    as ``generate_regular_batch``). ``vocab`` and ``prefix`` as in ``speculative_decode``; ``max_rows``: each step's
    K from the live rows (``drafts_per_row``): a row then follows the target's law with other drafts than alone
    (greedy: the same tokens)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    models = [m for m in (target, drafter.model) if m is not None]
    vocab = vocab or logit_width(target)
    clock = Clock.for_models(*models)
    longest = drafter.longest(k)
    rows = _rows(prompts, generators, lambda: GenerationStats(mode="ssp", k=k, drafted_at=[0] * longest,
                                                               accepted_at=[0] * longest, forwards_timed=clock.per_forward))
    run = SpeculativeRows(target, drafter, k, params, stopping, max_new_tokens, vocab, prefix, clock, clock.now(),
                          max_rows)
    run_rows(run, rows, concurrency, arrivals)
    return _outputs(rows, run.now(), run.prefill_s, run.target_s, run.draft_s)


def _outputs(rows: Sequence[Row], total_s: float, prefill_s: float, target_s: float,
             draft_s: float) -> list[GenerationOutput]:
    """Each row's output: its own counts and first/last token times, the run's time totals shared by its rows."""
    share = len(rows)
    outputs = []
    for row in rows:
        s = row.stats
        s.new_tokens = len(row.tokens)
        s.total_time_s, s.prefill_time_s = total_s / share, prefill_s / share
        s.target_time_s, s.draft_time_s = target_s / share, draft_s / share
        s.after_first_s = row.finished_s - row.arrived_s - s.ttft_s if row.tokens else float("nan")
        outputs.append(GenerationOutput(torch.tensor(row.tokens, dtype=torch.long), s, row.stopped))
    return outputs
