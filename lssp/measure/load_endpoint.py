"""``load --endpoint LABEL=URL``: servers already running anywhere, one serving RSp and one or more serving SSp, loaded
by our streaming client over the OpenAI-compatible completions API.

Any server that speaks ``POST /v1/completions`` with ``"stream": true`` works: vLLM, SGLang, llama.cpp's
llama-server, TGI's OpenAI route, a cluster's gateway. The client sends the prompt as the target's token ids (so
every endpoint gets the same tokens, whatever its own chat template), our sampling fields and a seed per request,
at most c requests in flight (``stream_requests``); it times each streamed event as it arrives and takes the
request's token count from the server's ``usage`` (an SSp server's event may carry several tokens). TTFT runs to
the first event with text, TPOT is (last event − first) ÷ (tokens − 1), as vLLM's serving client computes it.
Acceptance comes from each SSp server's ``/metrics`` where it exports vLLM's (``vllm:spec_decode_*``) or
llama.cpp's (``llamacpp:spec_decode_*``) counters, as deltas per level; else it is not known.

What this run cannot know: the servers' hardware, their settings and whatever else loads them. It records what
they say (their URLs, the model id each serves and its version), and checks at the warm-up that greedy SSp writes
the same text as RSp, which it should if both serve the same target.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Mode
from lssp.engines.vllm import Counters
from lssp.engines.vllm_server import parse_counters
from lssp.errors import UserError
from lssp.measure.load import LoadBackend, LoadFailure, LoadRequest, LoadSetup, ModeLevel, poisson_arrivals
from lssp.measure.load_llamacpp import Streamed, posted_events, stream_requests

ENGINE = "endpoint"
WARM_UP_TOKENS = 8
INFO_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 600.0
RSP = "rsp"


@dataclass(frozen=True)
class Endpoint:
    """One server: its label (``rsp``, or the name of an SSp configuration), its base URL, what it says of
    itself."""

    label: str
    url: str  # scheme://host:port[/path], without a trailing /v1
    model: str = ""  # the first model id its /v1/models lists
    version: str = ""  # its /version (vLLM, SGLang) or /props build (llama.cpp); "" where it says none

    @property
    def mode(self) -> Mode:
        return Mode("rsp", engine=ENGINE) if self.label == RSP else Mode("ssp", engine=ENGINE, draft=self.label)

    def describe(self) -> str:
        said = ", ".join(filter(None, [self.model and f"model {self.model}",
                                       self.version and f"version {self.version}"]))
        return f"{self.label} = {self.url}" + (f" ({said})" if said else "")


def parse_endpoints(values: Sequence[str]) -> list[Endpoint]:
    """``--endpoint LABEL=URL`` options: exactly one labelled rsp, the others SSp, labels distinct; a URL with http or
    https and a host (a trailing /v1 is dropped). One line (``UserError``) for anything else."""
    endpoints = []
    for value in values:
        label, sep, url = value.partition("=")
        label, url = label.strip(), url.strip().rstrip("/")
        parts = urlsplit(url)
        if not sep or not label or not url:
            raise UserError(f"--endpoint {value!r}: give LABEL=URL, e.g. rsp=http://10.0.0.5:8000")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"--endpoint {value!r}: the URL needs http:// or https:// and a host")
        try:
            parts.port  # noqa: B018 - raises on a port that is no number
        except ValueError:
            raise UserError(f"--endpoint {value!r}: the port is not a number") from None
        endpoints.append(Endpoint(label, url[:-3] if url.endswith("/v1") else url))
    labels = [e.label for e in endpoints]
    if labels.count(RSP) != 1 or len(labels) < 2:
        raise UserError("--endpoint: give one labelled rsp (the server without speculation) and at least one other "
                        "(a server with it), e.g. --endpoint rsp=http://h:8000 --endpoint eagle=http://h:8001")
    if len(set(labels)) != len(labels):
        raise UserError(f"--endpoint: each label once, got {', '.join(labels)}")
    return endpoints


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=timeout), parts.path


def get(url: str, path: str, timeout: float = INFO_TIMEOUT_S) -> tuple[int, str]:
    """(HTTP status, body) of GET url + path."""
    connection, base = _connection(url, timeout)
    try:
        connection.request("GET", base + path)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def introduce(endpoint: Endpoint) -> Endpoint:
    """The endpoint with the model id it serves and its version; one line if it does not answer /v1/models."""
    try:
        status, text = get(endpoint.url, "/v1/models")
        models = json.loads(text).get("data") or [] if status == 200 else []
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url} did not answer /v1/models "
                        f"({type(exc).__name__}: {exc})") from None
    if status != 200 or not models:
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url}/v1/models answered HTTP {status} with no "
                        "model: is it an OpenAI-compatible server?")
    return replace(endpoint, model=str(models[0].get("id", "")), version=_version(endpoint.url))


def _version(url: str) -> str:
    for path, key in (("/version", "version"), ("/props", "build_info")):
        try:
            status, text = get(url, path)
            found = json.loads(text).get(key) if status == 200 else None
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            continue
        if found:
            return str(found)
    return ""


def counters(url: str) -> Counters | None:
    """The server's speculative counters from /metrics (vLLM's or llama.cpp's names); None where it exports none."""
    try:
        status, text = get(url, "/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    for prefix in ("vllm:", "llamacpp:"):
        if prefix + "spec_decode_" in text:
            return parse_counters(text, prefix)
    return None


def stream_completion(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S,
                      cancel: threading.Event | None = None) -> Streamed:
    """POST ``body`` to url/v1/completions, streamed: each event with text timed as it arrives, the text kept, the
    token count from the server's usage (else the events counted: one token each). ``cancel`` set: the stream is
    dropped at its next line (Ctrl-C: a remote server would otherwise keep the client reading to the end)."""
    out, events = Streamed(), 0
    connection, base = _connection(url, timeout_s)
    start = time.perf_counter()
    for event in posted_events(connection, base + "/v1/completions", body, out, cancel):
        text = "".join(choice.get("text") or "" for choice in event.get("choices") or ())
        if text:
            out.arrivals.append(time.perf_counter() - start)
            out.text += text
            events += 1
        usage = event.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            out.counted = int(usage["completion_tokens"])
    if out.counted is None:
        out.timings["counted_events"] = True
        out.counted = events
    return out


def remote_environment(env: dict[str, str], endpoints: Sequence[Endpoint]) -> dict[str, str]:
    """What every row says of where it ran: servers whose hardware is not known here, this client, what each said."""
    return {**env, "device": f"remote servers (their hardware is not known here; client: {env.get('device', '?')})",
            "placement": "; ".join(e.describe() for e in endpoints)}


def completion_body(model: str, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                    ignore_eos: bool) -> dict[str, Any]:
    """A streamed completions request: the prompt's token ids, our sampling law and a seed; ``ignore_eos`` (an
    extension vLLM, SGLang and llama.cpp read) only where asked."""
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "seed": seed % (2**31 - 1),
                            "temperature": 0.0 if params.greedy else params.temperature}
    if not params.greedy and params.top_p < 1:
        body["top_p"] = params.top_p
    if not params.greedy and params.top_k:
        body["top_k"] = params.top_k
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def request_body(model: str, request: LoadRequest, setup: LoadSetup, max_new_tokens: int) -> dict[str, Any]:
    """``completion_body`` of one request of a load run."""
    return completion_body(model, request.ids, max_new_tokens, setup.params, request.seed, setup.ignore_eos)


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
                   "(an SSp event may hold several, so TPOT is overestimated there)."] if self.counted_events else [])]

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
                                        [request_body(endpoint.model, request, self.setup, WARM_UP_TOKENS)], 1)
            if out.error:
                raise UserError(f"--endpoint {endpoint.label}: its warm-up request failed ({out.error})")
            texts[endpoint.label] = out.text
        if self.setup.params.greedy:
            differ = [label for label, text in texts.items() if label != RSP and text != texts[RSP]]
            self.warm_up_notes = [f"Warm-up, greedy: {', '.join(differ)} wrote other text than rsp in its first "
                                  f"{WARM_UP_TOKENS} tokens; do they serve the same target?"] if differ else [
                f"Warm-up, greedy: every SSp server wrote rsp's text ({WARM_UP_TOKENS} tokens)."]

    def serve(self, mode: Mode, requests: Sequence[LoadRequest], concurrency: int) -> ModeLevel:
        endpoint = self.endpoints[mode]
        before = counters(endpoint.url) if mode.mode == "ssp" else None
        arrivals = poisson_arrivals(len(requests), self.setup.request_rate, self.setup.seed)
        try:
            outs, wall = stream_requests(partial(stream_completion, endpoint.url, cancel=self.cancel),
                                         [request_body(endpoint.model, r, self.setup, self.setup.max_new_tokens)
                                          for r in requests], concurrency, arrivals if self.setup.request_rate else None)
        except KeyboardInterrupt:
            self.cancel.set()
            raise
        failed = [o.error for o in outs if o.error]
        if failed:
            raise LoadFailure(f"--endpoint {endpoint.label} ({endpoint.url}) at concurrency {concurrency}: "
                              f"{len(failed)} of {len(requests)} requests failed ({failed[0]})")
        self.counted_events |= any(o.timings.get("counted_events") for o in outs)
        after = counters(endpoint.url) if before is not None else None
        return ModeLevel(mode, concurrency, wall, [o.timing(r.index) for r, o in zip(requests, outs)],
                         after - before if after is not None and before is not None else None,
                         client={"texts": {r.index: o.text for r, o in zip(requests, outs)}})
