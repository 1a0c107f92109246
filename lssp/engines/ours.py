"""Our engine: RSp and SSp in this process, with our KV caches, samplers and drafters."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lssp.decoding.batched import batchable, generate_regular_rows, joinable, speculative_decode_batch
from lssp.decoding.generation import GenerationOutput, generate_regular, generate_regular_batch
from lssp.decoding.speculative import speculative_decode
from lssp.drafters import drafter_for
from lssp.engines.base import Engine, Mode, Request
from lssp.models.loading import LoadedModel


class OursEngine(Engine):
    name = "ours"
    splits_time = True

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
        if mode.mode == "ssp" and not self.drafts:
            return "SSp needs a draft model"
        return None

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        r = request
        if mode.mode == "rsp":
            return generate_regular(self.target.model, r.ids, r.max_new_tokens, r.params, self.generator(r.seed),
                                    r.stopping, r.on_tokens, r.time_forwards, r.prefix)
        draft, vocab = self.drafts[mode.draft or self.default]
        drafter = drafter_for(draft.model, mode.lookup, mode.confidence)
        return speculative_decode(self.target.model, drafter, r.ids, r.max_new_tokens, mode.k, r.params,
                                  self.generator(r.seed), r.stopping, r.on_tokens, vocab, r.time_forwards, r.prefix)

    def complete_rsp_batch(self, ids: torch.Tensor | Sequence[torch.Tensor], request: Request,
                           seeds: Sequence[int], concurrency: int = 0,
                           arrivals: Sequence[float] = ()) -> list[GenerationOutput]:
        """RSp of several prompts in one batch, each row as it would run alone with its seed: prompts of equal length
        (``ids`` (B, T)) share positions, unpadded, the batch's stats shared by its rows (``generate_regular_batch``);
        one (1, T) tensor per row, of any lengths, run at positions of their own, each row with its own first and
        last token times (``generate_regular_rows``; with ``concurrency``, at most that many at once, the next
        joining as one ends, and with ``arrivals`` not before its time: see ``joining_reason``)."""
        generators = [self.generator(s) for s in seeds]
        if isinstance(ids, torch.Tensor):
            return generate_regular_batch(self.target.model, ids, request.max_new_tokens, request.params, generators,
                                          request.stopping, request.prefix)
        return generate_regular_rows(self.target.model, ids, request.max_new_tokens, request.params, generators,
                                     request.stopping, request.prefix, concurrency, arrivals)

    def joining_reason(self, mode: Mode) -> str | None:
        """Why requests cannot join a running batch of ``mode`` (continuous batching: ``concurrency`` and
        ``arrivals`` in the batch methods), or None: they can."""
        if mode.mode == "ssp":
            draft, _ = self.drafts[mode.draft or self.default]
            return self.unbatched_reason(mode) or joinable(self.target.model, draft.model)
        return joinable(self.target.model)

    def unbatched_reason(self, mode: Mode) -> str | None:
        """Why ``complete_ssp_batch`` runs ``mode`` one completion at a time (a feature head, the context lookup,
        the confidence stop), or None: it runs batched."""
        draft, _ = self.drafts[mode.draft or self.default]
        return batchable(draft.model, mode.lookup, mode.confidence, self.target.model)

    def complete_ssp_batch(self, mode: Mode, ids: torch.Tensor | Sequence[torch.Tensor], request: Request,
                           seeds: Sequence[int], concurrency: int = 0,
                           arrivals: Sequence[float] = ()) -> list[GenerationOutput]:
        """SSp of several prompts (``ids`` (B, T), or one (1, T) tensor per row, of any lengths) in one batched loop,
        each row giving the tokens it gives alone with its seed (``speculative_decode_batch``: each row's own first
        and last token times, the batch's time totals shared by its rows). ``request`` gives what every row shares
        (budget, sampling, stopping, prefix). Where ``unbatched_reason(mode)``, the rows run one after another.
        ``concurrency`` and ``arrivals`` as in ``complete_rsp_batch``."""
        rows = [row.reshape(1, -1) for row in ids]
        if self.unbatched_reason(mode):
            return [self.complete(mode, replace(request, ids=row, seed=seed)) for row, seed in zip(rows, seeds)]
        draft, vocab = self.drafts[mode.draft or self.default]
        return speculative_decode_batch(self.target.model, draft.model, rows, request.max_new_tokens, mode.k,
                                        request.params, [self.generator(s) for s in seeds], request.stopping, vocab,
                                        request.prefix, concurrency, arrivals)
