"""``load --engine llamacpp``: one llama-server per mode with C parallel slots, loaded by a small streaming client.

Each mode's server (``LlamacppServers``: RSp, the draft model at K, n-gram lookup at K) is started with
``--parallel C`` slots, C the highest concurrency level, and continuous batching: the requests in flight share each
forward pass, a new one joining as soon as a slot frees. llama-server splits its context between the slots, so each
slot gets (the longest prompt + the token budget + K + a margin) tokens.

Why not vLLM's benchmark client (``run_client``), as ``--engine vllm`` uses: llama-server's OpenAI-compatible
``/v1/completions`` takes our token ids, seeds and sampling, but its last streamed event carries the request's
``choices`` (empty text) *and* its ``usage`` in one event; vLLM's client reads ``usage`` only from an event
without choices, so it would never see the token count and re-count the tokens by re-tokenizing the text (not the
tokens generated), and it would take that final event for one more token. Nor is vLLM installed where only
``./setup.sh --llamacpp`` was run. So the load comes from ``stream_requests`` below: at most c requests in flight
(c worker threads; the next request starts when one ends), all sent at once (closed loop) or at Poisson arrival
times (``--request-rate``, seeded), each streamed from llama-server's native ``/completion`` with
``return_tokens``: the client times each request's first and last streamed token itself and reads the token ids
(exact counts; the tokens themselves, so that greedy SSp can be checked against RSp) and the final event's
``timings`` (``draft_n``, ``draft_n_accepted``).

Acceptance: each SSp server's ``/metrics`` counters (``llamacpp:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``, per position) read before and after every level,
as deltas; the per-request ``timings`` summed over the level are kept beside them (they agree).
"""
from __future__ import annotations

import http.client
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from lssp.decoding.generation import NO_STOP, Stopping
from lssp.engines.base import Mode
from lssp.engines.llamacpp import REQUEST_TIMEOUT_S, LlamacppServers, LlamaServer, request_body
from lssp.engines.streaming import Streamed, posted_events, stream_requests
from lssp.engines.vllm import Counters
from lssp.errors import UserError
from lssp.measure.load import (
    LoadBackend,
    LoadFailure,
    LoadRequest,
    LoadSetup,
    ModeLevel,
    RequestTiming,
    poisson_arrivals,
)

WARM_UP_TOKENS = 8
CONTEXT_MARGIN = 16  # tokens per slot beyond prompt + budget + K (the draft's last K tokens, BOS, rounding)


def slot_context(prompt_lengths: Sequence[int], max_new_tokens: int, k: int) -> int:
    """Tokens one slot needs: the longest prompt, the budget, a last draft of K and a margin, rounded up to 64."""
    need = max(prompt_lengths, default=0) + max_new_tokens + k + CONTEXT_MARGIN
    return -(-need // 64) * 64


def request_timing(out: Streamed, index: int) -> RequestTiming:
    """A streamed completion's timing as a load level counts it: TTFT from its arrival time, first to last token."""
    if out.error or not out.token_count or not out.arrivals:
        return RequestTiming(index, out.token_count, float("nan"), float("nan"), out.error or "no token streamed")
    return RequestTiming(index, out.token_count, out.waited_s + out.arrivals[0], out.arrivals[-1] - out.arrivals[0])


def stream_completion(server: LlamaServer, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> Streamed:
    """POST ``body`` to the server's /completion, streamed: every event's tokens timed as they arrive."""
    out = Streamed()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    start = time.perf_counter()
    events = posted_events(connection, "/completion", {**body, "stream": True, "return_tokens": True}, out)
    for event in events:
        now = time.perf_counter() - start
        for token in event.get("tokens") or ():
            out.tokens.append(int(token))
            out.arrivals.append(now)
        if event.get("stop"):
            out.timings = event.get("timings") or {}
            events.close()  # the connection closed now
            break
    if not out.error and not out.timings:
        out.error = "the stream ended before its final event"
    return out


def metric_counters(metrics: dict[str, float]) -> Counters:
    """llama-server's cumulative speculative counters (``LlamaServer.metrics``) as ``Counters``."""
    positions = sorted((int(name.split('"')[1]), value) for name, value in metrics.items()
                       if name.startswith("spec_decode_num_accepted_tokens_per_pos_total{"))
    return Counters(int(metrics.get("spec_decode_num_drafts_total", 0)),
                    int(metrics.get("spec_decode_num_draft_tokens_total", 0)),
                    int(metrics.get("spec_decode_num_accepted_tokens_total", 0)),
                    tuple(int(value) for _, value in positions))


class LlamacppLoadBackend(LoadBackend):
    """One llama-server per mode with C parallel slots (continuous batching), loaded by ``stream_requests``;
    acceptance from each server's /metrics counters, read before and after every level."""

    name = "llamacpp"

    def __init__(self, servers: LlamacppServers, setup: LoadSetup, stopping: Stopping = NO_STOP) -> None:
        self.servers, self.setup, self.stopping = servers, setup, stopping
        self.slots = servers.slots
        self.slot_tokens = servers.context // servers.slots if servers.context else 0

    @property
    def version(self) -> str:
        return self.servers.version

    def notes(self) -> list[str]:
        context = f", {self.slot_tokens} context tokens each" if self.slot_tokens else ""
        return [f"llama.cpp {self.version}: one llama-server per mode (127.0.0.1) with {self.slots} parallel "
                f"slot{'s' if self.slots != 1 else ''}{context}, continuous batching; loaded by our streaming client "
                "(native /completion, at most c in flight; vLLM's client cannot read llama-server's last streamed "
                "event, see docs/load.md); TTFT and TPOT timed by the client from the streamed tokens; acceptance "
                "from each server's /metrics counters, as deltas per level."]

    def check(self, mode: Mode, setup: LoadSetup) -> None:
        if mode.confidence:
            raise UserError(f"{mode.name}: --draft-confidence has no llama.cpp equivalent here")
        if mode.lookup:
            raise UserError(f"{mode.name}: no context lookup over a draft's picks here (its n-gram drafter alone: "
                            "Mode.ngram)")
        if self.key(mode) not in self.servers.servers:
            raise UserError(f"{mode.name}: no llama-server was started for it")

    def _bodies(self, requests: Sequence[LoadRequest], max_new_tokens: int) -> list[dict[str, Any]]:
        return [request_body(r.ids, max_new_tokens, self.setup.params, r.seed, self.stopping) for r in requests]

    def warm_up(self, modes: Sequence[Mode], request: LoadRequest) -> None:
        for mode in modes:
            server = self.servers.servers[self.key(mode)]
            (out,), _ = stream_requests(partial(stream_completion, server),
                                        self._bodies([request], min(WARM_UP_TOKENS, self.setup.max_new_tokens)), 1)
            if out.error:
                raise self.servers.failed(server, f"on its warm-up request ({out.error})")

    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        server = self.servers.servers[self.key(mode)]
        try:
            if not server.alive:
                raise self.servers.failed(server, f"before concurrency {concurrency}")
            before = metric_counters(server.metrics()) if mode.mode == "ssp" else None
            arrivals = poisson_arrivals(len(requests), self.setup.request_rate, self.setup.seed)
            outs, wall = stream_requests(partial(stream_completion, server),
                                         self._bodies(requests, self.setup.max_new_tokens), concurrency,
                                         arrivals if self.setup.request_rate else None)
            failed = [o.error for o in outs if o.error]
            if failed:
                raise self.servers.failed(server, f"at concurrency {concurrency}: {len(failed)} of {len(requests)} "
                                          f"requests failed ({failed[0]})")
            after = metric_counters(server.metrics()) if before is not None else None
        except (UserError, OSError) as exc:  # the levels done are kept; the run ends with this line
            self.servers.keep_logs = True
            raise LoadFailure(str(exc)) from None
        cut = [o.cut(self.stopping) for o in outs]
        client = {"tokens": {r.index: o.tokens for r, o in zip(requests, cut)},
                  "timings_draft_tokens": sum(int(o.timings.get("draft_n", 0)) for o in outs),
                  "timings_accepted_tokens": sum(int(o.timings.get("draft_n_accepted", 0)) for o in outs)}
        return ModeLevel(mode, concurrency, wall, [request_timing(o, r.index) for r, o in zip(requests, cut)],
                         after - before if after is not None and before is not None else None, client=client)

    def close(self) -> None:
        self.servers.close()
