"""``load --endpoint LABEL=URL``: servers already running anywhere (``lssp.engines.endpoint``), one serving RSp and
one or more serving SSp, loaded by our streaming client over the OpenAI-compatible completions API.

At most c requests in flight (``stream_requests``), each streamed event timed as it arrives, the request's token
count from the server's ``usage``: TTFT runs to the first event with text, TPOT is (last event − first) ÷ (tokens −
1), as vLLM's serving client computes it. Acceptance from each SSp server's ``/metrics`` counters, as deltas per
level, where it exports known ones.

What this run cannot know: the servers' hardware, their settings and whatever else loads them. It records what
they say (their URLs, the model id each serves and its version), and checks at the warm-up that greedy SSp writes
the same text as RSp, which it should if both serve the same target.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

from lssp.engines.base import Mode
from lssp.engines.endpoint import (
    ENGINE,
    RSP,
    Endpoint,
    completion_body,
    endpoint_counters,
    foreign_counts,
    remote_environment,
    stream_completion,
    usage_drafts,
    why_failed,
)
from lssp.engines.streaming import stream_requests
from lssp.errors import UserError
from lssp.measure.load import LoadBackend, LoadFailure, LoadRequest, LoadSetup, ModeLevel, poisson_arrivals
from lssp.measure.load_llamacpp import request_timing

WARM_UP_TOKENS = 8


def request_body(endpoint: Endpoint, request: LoadRequest, setup: LoadSetup, max_new_tokens: int) -> dict[str, Any]:
    """``completion_body`` of one request of a load run."""
    return completion_body(endpoint, request.ids, max_new_tokens, setup.params, request.seed, setup.ignore_eos,
                           messages=request.messages)


class EndpointLoadBackend(LoadBackend):
    """Servers already running (``Endpoint``), one per mode, loaded by ``stream_requests`` over /v1/completions;
    acceptance from each SSp server's /metrics where it exports known counters."""

    name = ENGINE
    checks_busy = False  # the servers may run on this machine, as processes that are not ours

    def __init__(self, endpoints: Sequence[Endpoint], setup: LoadSetup) -> None:
        self.endpoints = {e.mode: e for e in endpoints}
        self.setup = setup
        self.warm_up_notes: list[str] = []
        self.counted_events = False
        self.cancel = threading.Event()  # set on Ctrl-C: the streams in flight are dropped
        self.foreign: list[str] = []  # levels whose counters moved more than their requests could (other traffic)

    @property
    def version(self) -> str:
        return "; ".join(f"{e.label}: {e.version or '?'}" for e in self.endpoints.values())

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return remote_environment(env, list(self.endpoints.values()))

    def notes(self) -> list[str]:
        models = {e.model for e in self.endpoints.values()}
        return [f"Servers already running: {'; '.join(e.describe() for e in self.endpoints.values())}. Loaded by "
                "our streaming client (OpenAI /v1/completions, the target's token ids in, at most c in flight); TTFT "
                "to the first streamed text, TPOT (last event − first) ÷ (tokens − 1), tokens from each response's "
                "usage; acceptance from each server's /metrics where it exports vLLM's or llama.cpp's counters. "
                "Their hardware, settings and other load are theirs: this run knows their URLs, model ids and "
                "versions only (and does not check this machine for other work: the servers may run here).",
                *([f"The endpoints name different models ({', '.join(sorted(models))})."] if len(models) > 1 else []),
                *self.warm_up_notes,
                *(["Some responses carried no usage: their tokens were counted as streamed events, one token each "
                   "(an SSp event may hold several, so TPOT is overestimated there)."] if self.counted_events else []),
                *([f"The counters of {', '.join(self.foreign)} moved more than the level's requests could make "
                   "alone (other traffic on the server): acceptance left out there."] if self.foreign else [])]

    def close(self) -> None:
        self.cancel.set()  # nothing of ours runs on the servers: only streams to drop

    def check(self, mode: Mode, setup: LoadSetup) -> None:
        if mode not in self.endpoints:
            raise UserError(f"{mode.name}: no --endpoint serves it")

    def warm_up(self, modes: Sequence[Mode], request: LoadRequest) -> None:
        """One untimed request per endpoint; greedy, whether each SSp server writes the text the RSp one writes."""
        texts = {}
        for mode in modes:
            endpoint = self.endpoints[mode]
            (out,), _ = stream_requests(partial(stream_completion, endpoint.url),
                                        [request_body(endpoint, request, self.setup, WARM_UP_TOKENS)], 1)
            if out.error:
                raise UserError(f"--endpoint {endpoint.label}: its warm-up request failed "
                                f"({why_failed(endpoint, out.error)})")
            texts[endpoint.label] = out.text
        if self.setup.params.greedy:
            differ = [label for label, text in texts.items() if label != RSP and text != texts[RSP]]
            self.warm_up_notes = [f"Warm-up, greedy: {', '.join(differ)} wrote other text than rsp in its first "
                                  f"{WARM_UP_TOKENS} tokens; do they serve the same target?"] if differ else [
                f"Warm-up, greedy: every SSp server wrote rsp's text ({WARM_UP_TOKENS} tokens)."]

    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        endpoint = self.endpoints[mode]
        before = endpoint_counters(endpoint) if mode.mode == "ssp" else None
        arrivals = poisson_arrivals(len(requests), self.setup.request_rate, self.setup.seed)
        try:
            outs, wall = stream_requests(partial(stream_completion, endpoint.url, cancel=self.cancel),
                                         [request_body(endpoint, r, self.setup, self.setup.max_new_tokens)
                                          for r in requests], concurrency, arrivals if self.setup.request_rate else None)
        except KeyboardInterrupt:
            self.cancel.set()
            raise
        failed = [o.error for o in outs if o.error]
        if failed:
            raise LoadFailure(f"--endpoint {endpoint.label} ({endpoint.url}) at concurrency {concurrency}: "
                              f"{len(failed)} of {len(requests)} requests failed ({why_failed(endpoint, failed[0])})")
        self.counted_events |= any(o.timings.get("counted_events") for o in outs)
        after = endpoint_counters(endpoint) if before is not None else None
        delta = after - before if after is not None and before is not None else None
        said = usage_drafts(outs) if mode.mode == "ssp" else None  # where the responses' usage says what was drafted
        if delta is not None and foreign_counts(delta, sum(o.token_count for o in outs), len(outs)):
            if said is None:
                self.foreign.append(f"{endpoint.label} at c={concurrency}")
            delta = None  # other traffic counted too: the level's acceptance is not known from them
        if said is not None and (delta is None or not delta.drafts):
            delta = said
        return ModeLevel(mode, concurrency, wall, [request_timing(o, r.index) for r, o in zip(requests, outs)], delta,
                         client={"texts": {r.index: o.text for r, o in zip(requests, outs)}})
