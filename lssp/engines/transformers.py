"""transformers as an engine: ``generate()`` for RSp, assisted generation (a constant K) for SSp."""
from __future__ import annotations

import copy
import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from lssp.decoding.generation import GenerationOutput, GenerationStats
from lssp.decoding.sampling import SamplingParams
from lssp.decoding.timing import Clock
from lssp.engines.base import Engine, EngineInfo, Mode, Request
from lssp.models.loading import LoadedModel


def generation_config(model: LoadedModel, request: Request) -> Any:
    """``model``'s generation config for ``request``: its sampling, and its budget (all of it under --ignore-eos)."""
    params: SamplingParams = request.params
    cfg = copy.deepcopy(model.hf_model.generation_config)
    cfg.max_new_tokens = request.max_new_tokens
    if request.ignore_eos:
        cfg.min_new_tokens = request.max_new_tokens  # never stop early: the same work as ours
    else:
        cfg.eos_token_id = sorted(request.stopping.token_ids)
    cfg.do_sample = not params.greedy
    cfg.temperature = params.temperature if not params.greedy else None
    cfg.top_k = params.top_k if not params.greedy else None
    cfg.top_p = params.top_p if not params.greedy else None
    tokenizer = model.tokenizer
    cfg.pad_token_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return cfg


class EmissionTimes(BaseStreamer):
    """A streamer that notes when ``generate()`` emits tokens: its first ``put`` is the prompt, each later one the
    tokens of one step (one token; in assisted generation the accepted drafts and the target's own). The tokens
    reach it on the host, so the device has finished them (``perf_counter`` readings)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.first_tokens = self.tokens = 0
        self.first_s = self.last_s = float("nan")

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        n = int(value.numel())  # batch 1: (n,) or (1, n)
        if n and not self.tokens:
            self.first_tokens, self.first_s = n, now
        if n:
            self.tokens += n
            self.last_s = now

    def end(self) -> None:
        """Nothing to flush."""

    def record(self, stats: GenerationStats, start: float) -> None:
        """The first emission's time and size into ``stats``, where the streamed tokens are the completion's."""
        if self.tokens and self.tokens == stats.new_tokens:
            stats.ttft_s, stats.first_emission_tokens = self.first_s - start, self.first_tokens
            stats.after_first_s = self.last_s - self.first_s


class TransformersEngine(Engine):
    name = "hf"
    label = "hf"
    runs_feature_heads = False  # assisted generation takes a draft model
    takes_lookup = takes_ngram = False  # assisted generation, no context lookup or n-gram drafter in this tool

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        self.target, self.draft = target, draft

    @property
    def version(self) -> str:
        import transformers

        return transformers.__version__

    def describe(self) -> EngineInfo:
        return EngineInfo(self.name, self.label, self.version, draft_method="assisted",
                          note="hf: assisted generation does not report acceptance")

    def supports(self, mode: Mode) -> str | None:
        if mode.mode == "ssp" and self.draft is None:
            return "SSp needs a draft model"
        if mode.mode == "ssp" and self.draft.draft_kind == "eagle":
            return "assisted generation cannot run the feature head"
        return super().supports(mode)

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        """generate(), plain or assisted with a constant K (its schedule state reset every call)."""
        target, draft = self.target, self.draft if mode.mode == "ssp" else None
        cfg = generation_config(target, request)
        kwargs = {}
        if draft is not None:
            saved = draft.hf_model.generation_config
            assistant = copy.deepcopy(saved)  # fresh schedule state: transformers keeps it across calls
            assistant.num_assistant_tokens = mode.k
            assistant.num_assistant_tokens_schedule = "constant"
            assistant.assistant_confidence_threshold = mode.confidence  # 0: always draft K tokens, as ours then
            draft.hf_model.generation_config = assistant
            kwargs["assistant_model"] = draft.hf_model
        ids = request.ids.to(target.device)
        clock = Clock.for_models(target.model, *([draft.model] if draft is not None else []))
        torch.manual_seed(request.seed)
        emissions = EmissionTimes()
        try:
            start = clock.now()
            with torch.inference_mode():
                out = target.hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                                               streamer=emissions, **kwargs)
            seconds = clock.now() - start
        finally:
            if draft is not None:
                draft.hf_model.generation_config = saved
        tokens = out[0, ids.shape[1]:]
        stopped = bool(len(tokens)) and int(tokens[-1]) in request.stopping.token_ids and not request.ignore_eos
        stats = GenerationStats(mode=mode.mode, k=mode.k, new_tokens=len(tokens), total_time_s=seconds, ttft_s=seconds,
                                forwards_timed=False, drafted_at=[0] * mode.k, accepted_at=[0] * mode.k)  # not reported
        emissions.record(stats, start)
        return GenerationOutput(tokens.cpu(), stats, stopped)
