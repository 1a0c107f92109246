"""Streaming completions over HTTP: server-sent events read as they arrive, and requests sent with at most c in flight
(closed loop or at arrival times). Shared by llama-server's native client, the OpenAI-compatible client that reaches
servers already running (``lssp.engines.endpoint``) and the load backends."""
from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lssp.decoding.generation import Stopping


@dataclass
class Streamed:
    """One streamed completion (seconds from its send): token ids and each one's arrival, the final timings. A
    client that sees text, not ids (``lssp.engines.endpoint``), keeps each event's arrival and the server's
    token count (``counted``)."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    waited_s: float = 0.0  # from its scheduled arrival to its send (Poisson arrivals: a free client awaited)
    counted: int | None = None  # tokens the server says it made, where the stream carries text, not ids
    text: str = ""

    @property
    def token_count(self) -> int:
        return self.counted if self.counted is not None else len(self.tokens)

    def cut(self, stopping: Stopping) -> Streamed:
        """The completion ended where ``stopping`` says (at and including a stop token the server ran past)."""
        end = stopping.cut(self.tokens, 0)
        if end is None:
            return self
        return Streamed(self.tokens[:end], self.arrivals[:end], self.timings, self.error, self.waited_s)


class StreamError(Exception):
    """A stream that ended in an error event, or was cancelled."""


def sse_events(response: http.client.HTTPResponse, cancel: threading.Event | None = None) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events stream (``data: {...}`` lines) up to its end or ``[DONE]``; an event
    that carries ``error`` raises ``StreamError`` with it, and so does ``cancel`` set (at the next line)."""
    for raw in iter(response.readline, b""):
        if cancel is not None and cancel.is_set():
            raise StreamError("cancelled")
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data:"):])
        if "error" in event:
            raise StreamError(str(event["error"])[:200])
        yield event


def posted_events(connection: http.client.HTTPConnection, path: str, body: dict[str, Any], out: Streamed,
                  cancel: threading.Event | None = None,
                  headers: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """POST ``body`` (JSON) to ``path`` and yield the streamed events (``sse_events``); an HTTP error, a failed
    connection, an error event or ``cancel`` end them with ``out.error`` set. The connection is closed after."""
    try:
        connection.request("POST", path, body=json.dumps(body),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
            return
        yield from sse_events(response, cancel)
    except StreamError as exc:
        out.error = str(exc)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()


def stream_requests(send: Callable[[dict[str, Any]], Streamed], bodies: Sequence[dict[str, Any]], concurrency: int,
                    arrivals: Sequence[float] | None = None) -> tuple[list[Streamed], float]:
    """Every body once through ``send`` (one streamed request), at most ``concurrency`` in flight (a pool of that
    many threads takes them in order: the next starts when one ends, not before its arrival time): (the completions
    in order, the wall seconds from the first send to the last completion). With ``arrivals``, each completion's ``waited_s`` is from its arrival time to its
    send (a closed loop has none: a client sends when its last request ends)."""
    scheduled = arrivals is not None
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(bodies)
    results: list[Streamed | None] = [None] * len(bodies)
    lock, start = threading.Lock(), time.perf_counter()
    ends: list[float] = []

    def one(i: int) -> None:
        wait = start + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        late = time.perf_counter() - (start + arrivals[i])
        results[i] = send(bodies[i])
        if scheduled:
            results[i].waited_s = max(0.0, late)
        with lock:
            ends.append(time.perf_counter())

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llamassp-load")
    try:
        for future in [pool.submit(one, i) for i in range(len(bodies))]:
            future.result()
    except BaseException:  # Ctrl-C: no new request; those in flight end when the servers stop
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [r if r is not None else Streamed(error="not sent") for r in results], max(ends, default=start) - start
