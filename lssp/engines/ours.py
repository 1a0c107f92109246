"""Our engine: RSp and SSp in this process, with our KV caches, samplers and drafters."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lssp.decoding.batched import generate_regular_rows, joinable, speculative_decode_batch
from lssp.decoding.generation import GenerationOutput, generate_regular, generate_regular_batch
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import Drafter, drafter_for, entry_drafter
from lssp.engines.base import Engine, Mode, Request
from lssp.models.loading import LoadedModel


class OursEngine(Engine):
    name = "ours"
    splits_time = True
    reference = True
    runs_each_draft = True
    caches_prefixes = True

    def __init__(self, target: LoadedModel, drafts: Sequence[LoadedModel] = (), vocabs: Sequence[int | None] = ()) -> None:
        """``drafts`` with the logit width each shares with the target (``check_compatible``)."""
        self.target = target
        vocabs = list(vocabs) or [None] * len(drafts)
        self.drafts = {d.name: (d, v) for d, v in zip(drafts, vocabs)}
        self.default = drafts[0].name if drafts else None

    def models(self) -> list[torch.nn.Module]:
        return [self.target.model, *(d.model for d, _ in self.drafts.values())]

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.target.device).manual_seed(seed)

    def supports(self, mode: Mode) -> str | None:
        if mode.mode == "ssp" and not self.drafts and not mode.ngram:
            return "SSp needs a draft model (or the n-gram drafter)"
        return super().supports(mode)

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        r = request
        if mode.mode == "rsp":
            return generate_regular(self.target.model, r.ids, r.max_new_tokens, r.params, self.generator(r.seed),
                                    r.stopping, r.on_tokens, r.time_forwards, r.prefix)
        drafter, vocab = self.drafter(mode)
        return speculative_decode(self.target.model, drafter, r.ids, r.max_new_tokens, mode.k, r.params,
                                  self.generator(r.seed), r.stopping, r.on_tokens, vocab, r.time_forwards, r.prefix)

    def drafter(self, mode: Mode) -> tuple[Drafter, int | None]:
        """The drafter ``mode`` asks for (``Mode.ngram``: the n-gram drafter, no model), and the logit width it shares
        with the target (None: all of it)."""
        if mode.ngram:
            return drafter_for(None, mode.ngram, mode.confidence), None
        draft, vocab = self.drafts[mode.draft or self.default]
        return entry_drafter(draft, mode.lookup, mode.confidence), vocab

    def batch_reason(self, mode: Mode) -> str | None:
        """None where ``complete_many`` runs ``mode`` in one batched loop: RSp always, SSp unless the drafter drafts
        one completion at a time (a feature head over a target not under the compact forward). Not where a subclass
        changed how one completion runs: its own ``complete`` is then what runs (and what an audit checks)."""
        if type(self).complete is not OursEngine.complete:
            return "this engine's complete is its own"
        return self.drafter(mode)[0].rows_reason(self.target.model) if mode.mode == "ssp" else None

    def joining_reason(self, mode: Mode) -> str | None:
        draft = self.drafter(mode)[0].model if mode.mode == "ssp" else None
        return self.batch_reason(mode) or joinable(self.target.model, draft)

    def complete_many(self, mode: Mode, rows: Sequence[torch.Tensor], request: Request, seeds: Sequence[int],
                      concurrency: int = 0, arrivals: Sequence[float] = ()) -> list[GenerationOutput]:
        """One batched loop where ``batch_reason(mode)`` is None, each row giving the tokens it gives alone with its
        seed, at positions of its own (``generate_regular_rows``, ``speculative_decode_batch``: each row's own first
        and last token times, the batch's time totals shared by its rows); rows of one length given as one (B, T)
        tensor in RSp share positions, unpadded (``generate_regular_batch``)."""
        if self.batch_reason(mode):
            return super().complete_many(mode, rows, request, seeds, concurrency, arrivals)
        generators = [self.generator(s) for s in seeds]
        r = request
        if mode.mode == "rsp" and isinstance(rows, torch.Tensor) and not (concurrency or arrivals):
            return generate_regular_batch(self.target.model, rows, r.max_new_tokens, r.params, generators, r.stopping,
                                          r.prefix)
        rows = [row.reshape(1, -1) for row in rows]
        if mode.mode == "rsp":
            return generate_regular_rows(self.target.model, rows, r.max_new_tokens, r.params, generators, r.stopping,
                                         r.prefix, concurrency, arrivals)
        drafter, vocab = self.drafter(mode)
        return speculative_decode_batch(self.target.model, drafter, rows, r.max_new_tokens, mode.k, r.params,
                                        generators, r.stopping, vocab, r.prefix, concurrency, arrivals, mode.max_rows)
