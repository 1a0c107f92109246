"""The engines ``load`` drives: vLLM servers loaded by vLLM's own benchmark client, and our engine (continuous
batching; llama.cpp's servers: ``lssp.measure.load_llamacpp``).

Adding an engine is one ``LoadBackend`` subclass here (``serve(mode, requests, concurrency)`` giving per-request
timings, the level's wall time and counter deltas) and its line in the CLI.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from lssp.decoding.generation import GenerationOutput, Stopping
from lssp.engines.base import Engine, Mode, Request
from lssp.engines.vllm import Counters, sampled_ssp_caveat
from lssp.engines.vllm_server import ClientRequest, VllmServers, run_client, sampling_body
from lssp.errors import UserError
from lssp.measure.load import (
    LoadBackend,
    LoadFailure,
    LoadRequest,
    LoadSetup,
    ModeLevel,
    RequestTiming,
    mode_label,
    poisson_arrivals,
)

WARM_UP_TOKENS = 8


class VllmLoadBackend(LoadBackend):
    """One vLLM server per mode (``VllmServers``), loaded by vLLM's benchmark client (``run_client``); acceptance
    from each server's /metrics counters, read before and after every level."""

    times_from_send = True  # vLLM's client starts a request's clock when its max-concurrency semaphore lets it go

    name = "vllm"

    def __init__(self, servers: VllmServers, setup: LoadSetup, stop_ids: Sequence[int], tokenizer=None) -> None:
        self.servers, self.setup, self.tokenizer = servers, setup, tokenizer
        self.body = sampling_body(setup.params, stop_ids, setup.ignore_eos)

    @property
    def version(self) -> str:
        return self.servers.version

    def notes(self) -> list[str]:
        return [f"vLLM {self.version}: one server per mode (the server `vllm serve` runs, on 127.0.0.1), loaded by "
                "vLLM's own benchmark client (vllm.benchmarks.serve); TTFT and TPOT timed by the client from the "
                "streamed tokens; acceptance from each server's /metrics counters, as deltas per level.",
                *filter(None, [sampled_ssp_caveat(self.setup.params)])]

    def check(self, mode: Mode, setup: LoadSetup) -> None:
        if mode.lookup:
            raise UserError(f"{mode.name}: no context lookup over a draft's picks here (its n-gram drafter alone: "
                            "Mode.ngram)")
        if self.key(mode) not in self.servers.servers:
            raise UserError(f"{mode.name}: no vLLM server was started for it")

    def _client(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int, max_new_tokens: int,
                rate: float | None):
        server = self.servers.server(*self.key(mode))
        return server, run_client(server, self.setup.target, [ClientRequest(r.ids, r.seed) for r in requests],
                                  max_new_tokens, self.body, self.setup.ignore_eos, concurrency, rate, self.setup.seed,
                                  self.tokenizer)

    def warm_up(self, modes: Sequence[Mode], request: LoadRequest) -> None:
        for mode in modes:
            server, result = self._client(mode, [request], 1, min(WARM_UP_TOKENS, self.setup.max_new_tokens), None)
            if any(result.errors):
                raise self.servers.failed(server, f"on its warm-up request ({first_error(result.errors)})")

    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        server = self.servers.server(*self.key(mode))
        if not server.alive:
            raise LoadFailure(str(self.servers.failed(server, f"before concurrency {concurrency}")))
        try:
            before = server.counters() if mode.mode == "ssp" else None
            _, result = self._client(mode, requests, concurrency, self.setup.max_new_tokens, self.setup.request_rate)
            if any(result.errors):
                raise self.servers.failed(server, f"at concurrency {concurrency}: {sum(map(bool, result.errors))} of "
                                          f"{len(requests)} requests failed ({first_error(result.errors)})")
            after = server.counters() if before is not None else None
        except UserError as exc:  # the levels done are kept; the run ends with this line
            self.servers.keep_logs = True
            raise LoadFailure(str(exc)) from None
        timings = [RequestTiming(r.index, tokens, ttft, max(0.0, latency - ttft)) for r, tokens, ttft, latency
                   in zip(requests, result.output_tokens, result.ttft_s, result.latency_s)]
        return ModeLevel(mode, concurrency, result.duration_s, timings, after - before if after else None,
                         client=result.summary)

    def close(self) -> None:
        self.servers.close()


def first_error(errors: Sequence[str]) -> str:
    text = next((e for e in errors if e), "")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "no message")[:200]


def static_batches(requests: Sequence[LoadRequest], size: int) -> list[list[LoadRequest]]:
    """The requests in batches of ``size``, shortest prompts first (so that a batch holds similar lengths and its rows
    pad little: each row runs at positions of its own)."""
    ordered = sorted(requests, key=lambda r: (len(r.ids), r.index))
    return [ordered[start:start + size] for start in range(0, len(ordered), size)]


def ssp_counters(outputs: Sequence[GenerationOutput]) -> Counters:
    """Verification steps that drafted, drafted and accepted tokens of our completions."""
    return Counters(sum(o.stats.drafted_at[0] if o.stats.drafted_at else 0 for o in outputs),
                    sum(o.stats.drafted for o in outputs), sum(o.stats.accepted for o in outputs))


class EngineLoadBackend(LoadBackend):
    """An engine of this process (ours) under a closed loop of C = concurrency clients, or Poisson arrivals with at
    most C at once (``--request-rate``), through ``Engine.complete_many``. Where requests can join a running batch
    (``joining_reason``: ours under compact forwards), continuous batching: each request that ends lets the next join
    the running batch at the next iteration, not before its arrival. Elsewhere static batches of C (closed loop
    only): the next C start when the whole batch is done. Modes the engine batches (``batch_reason``) run batched over
    whole prompts of any lengths, others one request after another, said in the output as not batched."""

    def __init__(self, engine: Engine, setup: LoadSetup, stopping: Stopping) -> None:
        self.engine, self.setup, self.stopping = engine, setup, stopping
        self.name = engine.name

    @property
    def version(self) -> str:
        return self.engine.version

    def unbatched_reason(self, mode: Mode) -> str | None:
        """Why the engine serves ``mode`` one request at a time, or None: it batches it."""
        return self.engine.batch_reason(mode)

    def joins(self, mode: Mode) -> bool:
        """Whether ``mode``'s requests join a running batch (continuous batching, unless static batches were
        asked for)."""
        return self.setup.batching == "continuous" and self.engine.joining_reason(mode) is None

    def notes(self) -> list[str]:
        joining = [mode_label(m) for m in self.setup.modes if self.joins(m)]
        static = [mode_label(m) for m in self.setup.modes if not self.joins(m)]
        lines = []
        if joining:
            arrive = (f"requests arriving at Poisson times ({self.setup.request_rate:g}/s), at most C = concurrency "
                      "at once" if self.setup.request_rate else "a closed loop of C = concurrency clients")
            lines.append(f"{self.name} {', '.join(joining)}: continuous batching, {arrive}: a request joins the running "
                         "batch at the next iteration once it may (prefilled alone, then merged), each row whole at "
                         "positions of its own; TTFT from when it joined.")
        if static:
            first = next(m for m in self.setup.modes if not self.joins(m))
            why = "as asked (--batching static)" if self.setup.batching == "static" else self.engine.joining_reason(first)
            lines.append(f"{self.name} {', '.join(static)}: static batches of C = concurrency (the next batch starts when "
                         f"one ends; {why}), similar prompt lengths together; each row its own first and last "
                         "token times.")
        ssp = [m for m in self.setup.modes if m.mode == "ssp"]
        for mode in ssp:
            reason = self.unbatched_reason(mode)
            if reason:
                lines.append(f"{self.name} {mode_label(mode)} is NOT batched ({reason}): each batch's requests "
                             "run one after another (TTFT includes the wait for those before it); its throughput is "
                             "that of one request at a time.")
        return lines

    def check(self, mode: Mode, setup: LoadSetup) -> None:
        why = self.engine.supports(mode)
        if why:
            raise UserError(f"{mode.name}: {why}")
        if setup.request_rate and not self.joins(mode):
            raise UserError(f"--request-rate: --engine {self.name} serves {mode_label(mode)} in static batches "
                            "(closed loop only; requests join a running batch only under the compact forward, in "
                            "batched modes, without --batching static)")

    def close(self) -> None:
        self.engine.close()

    def _request(self, ids: list[int], seed: int, max_new_tokens: int | None = None) -> Request:
        return Request(torch.tensor([ids], dtype=torch.long), max_new_tokens or self.setup.max_new_tokens,
                       self.setup.params, seed, self.stopping, time_forwards=False)

    def warm_up(self, modes: Sequence[Mode], request: LoadRequest) -> None:
        budget = min(8, self.setup.max_new_tokens)
        for mode in modes:
            self.engine.complete(mode, self._request(request.ids, request.seed, budget))
            rows = [torch.tensor([request.ids]), torch.tensor([request.ids[1:] or request.ids])]  # two lengths
            if self.unbatched_reason(mode) is None:
                self.engine.complete_many(mode, rows, self._request(request.ids, 0, budget), [0, 1])

    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        timings: list[RequestTiming] = []
        outputs: list[GenerationOutput] = []
        batched = self.unbatched_reason(mode) is None
        start = time.perf_counter()
        if batched and self.joins(mode):
            # a closed loop gives no arrival times: a client sends as its last request ends, and it joins then
            rate = self.setup.request_rate
            arrivals = poisson_arrivals(len(requests), rate, self.setup.seed) if rate else []
            batches = [sorted(requests, key=lambda r: r.index)]
            timings, outputs = self._batch(mode, batches[0], concurrency, arrivals)
        else:
            batches = static_batches(requests, concurrency)
            for batch in batches:
                done = self._batch(mode, batch) if batched else self._one_at_a_time(mode, batch)
                timings += done[0]
                outputs += done[1]
        wall = time.perf_counter() - start
        # each request's output, in the order served: greedy SSp is set beside RSp (``same_as_rsp``)
        tokens = {r.index: o.tokens.tolist() for r, o in zip([r for b in batches for r in b], outputs, strict=True)}
        timings.sort(key=lambda t: t.index)
        return ModeLevel(mode, concurrency, wall, timings, ssp_counters(outputs) if mode.mode == "ssp" else None,
                         batched=batched, scheduling="continuous" if batched and self.joins(mode) else "static",
                         client={"tokens": tokens})

    def _batch(self, mode: Mode, batch: list[LoadRequest], concurrency: int = 0,
               arrivals: Sequence[float] = ()) -> tuple[list[RequestTiming], list[GenerationOutput]]:
        """One batched loop (``complete_many`` over whole prompts of any lengths; with ``concurrency``, at most that
        many at once, the next joining as one ends, not before its ``arrivals`` time): each row's own first and last
        token times, from when it joined."""
        rows = [torch.tensor([r.ids], dtype=torch.long) for r in batch]
        request, seeds = self._request(batch[0].ids, batch[0].seed), [r.seed for r in batch]
        start = time.perf_counter()
        outs = self.engine.complete_many(mode, rows, request, seeds, concurrency, arrivals)
        wall = time.perf_counter() - start
        timings = []
        for r, o in zip(batch, outs):
            s = o.stats
            ttft = s.ttft_s if s.ttft_s > 0 else wall
            after = s.after_first_s if s.after_first_s == s.after_first_s else max(0.0, wall - ttft)
            timings.append(RequestTiming(r.index, len(o.tokens), ttft, after))
        return timings, outs

    def _one_at_a_time(self, mode: Mode, batch: list[LoadRequest]) -> tuple[list[RequestTiming], list[GenerationOutput]]:
        """The batch's requests one after another: a request's TTFT counts the wait for those before it."""
        waited, timings, outs = 0.0, [], []
        for r in batch:
            start = time.perf_counter()
            out = self.engine.complete(mode, self._request(r.ids, r.seed))
            s = out.stats
            after = s.after_first_s if s.after_first_s == s.after_first_s else 0.0
            timings.append(RequestTiming(r.index, len(out.tokens), waited + s.ttft_s, after))
            outs.append(out)
            waited += time.perf_counter() - start
        return timings, outs
