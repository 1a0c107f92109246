"""Servers already running anywhere, reached over the OpenAI-compatible completions API: ``--endpoint LABEL=URL``.

Any server that speaks ``POST /v1/completions`` with ``"stream": true`` works: vLLM, SGLang, llama.cpp's
llama-server, TGI's OpenAI route, a cluster's gateway (``,api=chat``: one with ``/v1/chat/completions`` only). One
server per way of generating: the one labelled ``rsp`` serves the target alone, each other one SSp as it was started
(its draft, K and method are the server's, not ours).
The client sends the prompt as the target's token ids (every endpoint gets the same tokens, whatever its chat
template), our sampling fields and a seed per request; it times each streamed event as it arrives and takes the token
count from the server's ``usage`` (an SSp server's event may carry several tokens). Acceptance comes from the
server's ``/metrics`` where it exports vLLM's (``vllm:spec_decode_*``) or llama.cpp's (``llamacpp:spec_decode_*``)
counters, else from the response's usage where the server says its drafts there (OpenAI's accepted and rejected
prediction tokens), else it is not known. Behind a gateway that exports none, ``,metrics=URL`` names the server
(or each replica) whose /metrics counts for that configuration.

``EndpointEngine`` puts them behind the engine interface, one request at a time (``latency``, ``compare``,
``eval``); ``lssp.measure.load_endpoint`` loads them with many requests in flight.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import torch

from lssp.decoding.generation import GenerationOutput, GenerationStats
from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Engine, EngineInfo, Mode, Request
from lssp.engines.streaming import Streamed, posted_events
from lssp.engines.vllm import Counters
from lssp.engines.vllm_server import parse_counters
from lssp.errors import ServerFailure, UserError

ENGINE = "endpoint"
INFO_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 600.0
RSP = "rsp"
API_KEY_VARIABLE = "LLAMASSP_API_KEY"


@dataclass(frozen=True)
class Endpoint:
    """One server: its label (``rsp``, or the name of an SSp configuration), its base URL, what it says of
    itself."""

    label: str
    url: str  # scheme://host:port[/path], without a trailing /v1
    model: str = ""  # the first model id its /v1/models lists
    version: str = ""  # its /version (vLLM, SGLang) or /props build (llama.cpp); "" where it says none
    metrics: tuple[str, ...] = ()  # where its counters are read, behind a gateway (summed); (): url itself
    text_prompt: bool = False  # the prompt sent as text (``,prompt=text``: a server that takes no token ids)
    chat: bool = False  # the chat API (``,api=chat``: /v1/chat/completions, the conversation as messages)
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False, repr=False)  # ids -> that text

    def prompt(self, ids: list[int]) -> list[int] | str:
        """What goes in a request's ``prompt``: the target's token ids, or with ``text_prompt`` their text."""
        if not self.text_prompt:
            return ids
        if self.decode is None:
            raise UserError(f"--endpoint {self.label}: prompt=text needs the target's tokenizer (with_tokenizer)")
        return self.decode(ids)

    @property
    def mode(self) -> Mode:
        return Mode("rsp", engine=ENGINE) if self.label == RSP else Mode("ssp", engine=ENGINE, draft=self.label)

    def describe(self) -> str:
        said = ", ".join(filter(None, [self.model and f"model {self.model}",
                                       self.version and f"version {self.version}",
                                       self.metrics and f"counters from {' + '.join(self.metrics)}",
                                       self.text_prompt and "prompts as text",
                                       self.chat and "chat API"]))
        return f"{self.label} = {self.url}" + (f" ({said})" if said else "")


OPTIONS = re.compile(r",(?=(?:metrics|prompt|api)=)")  # where an endpoint's URL ends and each option begins


def with_tokenizer(endpoint: Endpoint, tokenizer: Any) -> Endpoint:
    """The endpoint able to send its prompts as text: ``tokenizer``'s decoding of the ids (special tokens as text,
    which servers read back as those tokens; a leading BOS left to the server, which adds its own)."""
    bos = getattr(tokenizer, "bos_token_id", None)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids[1:] if ids and ids[0] == bos else ids, skip_special_tokens=False)
    return replace(endpoint, decode=decode)


def parse_endpoints(values: Sequence[str]) -> list[Endpoint]:
    """``--endpoint LABEL=URL[#MODEL][,metrics=URL…][,prompt=text]`` options: exactly one labelled rsp, the others
    SSp, labels distinct; a URL with http or https and a host (a trailing /v1 is dropped); after a #, the model id to
    ask for where the server serves several (a gateway: one URL, a model per configuration); after each
    ``,metrics=``, a server whose /metrics counts for an SSp configuration behind a gateway that exports none
    (several: its replicas, summed); ``,prompt=text``: prompts sent as text, for a server that takes no token ids;
    ``,api=chat``: the chat API (every endpoint of a run alike). One line (``UserError``) for anything else."""
    endpoints = []
    for value in values:
        label, sep, rest = value.partition("=")
        rest, *options = OPTIONS.split(rest)
        url, _, model = rest.partition("#")  # a fragment: the model id to ask for (never sent as part of the URL)
        label = label.strip()
        if not sep or not label or not url.strip():
            raise UserError(f"--endpoint {value!r}: give LABEL=URL, e.g. rsp=http://10.0.0.5:8000")
        metrics = [option.partition("=")[2] for option in options if option.startswith("metrics=")]
        prompts = [option.partition("=")[2].strip() for option in options if option.startswith("prompt=")]
        apis = [option.partition("=")[2].strip() for option in options if option.startswith("api=")]
        if any(a not in ("chat", "completions") for a in apis) or (apis[-1:] == ["chat"] and prompts):
            raise UserError(f"--endpoint {value!r}: api= takes chat or completions (the default); with chat the "
                            "server is sent the conversation, so prompt= does not apply")
        if metrics and label == RSP:
            raise UserError(f"--endpoint {value!r}: metrics= names where an SSp server's counters are read; the rsp "
                            "server has none to read")
        if any(p not in ("text", "ids") for p in prompts):
            raise UserError(f"--endpoint {value!r}: prompt= takes text or ids (the default)")
        endpoints.append(Endpoint(label, _base_url(value, url), model.strip(),
                                  metrics=tuple(_base_url(value, m) for m in metrics),
                                  text_prompt=prompts[-1:] == ["text"], chat=apis[-1:] == ["chat"]))
    labels = [e.label for e in endpoints]
    if labels.count(RSP) != 1 or len(labels) < 2:
        raise UserError("--endpoint: give one labelled rsp (the server without speculation) and at least one other "
                        "(a server with it), e.g. --endpoint rsp=http://h:8000 --endpoint eagle=http://h:8001")
    if len({e.chat for e in endpoints}) > 1:
        raise UserError("--endpoint: give every server api=chat or none (the same requests to each: "
                        f"{', '.join(e.label for e in endpoints if e.chat)} with it, the others without)")
    if len(set(labels)) != len(labels):
        raise UserError(f"--endpoint: each label once, got {', '.join(labels)}")
    return endpoints


def _base_url(value: str, url: str) -> str:
    """``url`` checked (http or https, a host, a numeric port), without a trailing / or /v1."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--endpoint {value!r}: {url or 'a URL'} needs http:// or https:// and a host")
    try:
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError:
        raise UserError(f"--endpoint {value!r}: the port of {url} is not a number") from None
    return url[:-3] if url.endswith("/v1") else url


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=timeout), parts.path


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer KEY`` where ``LLAMASSP_API_KEY`` holds a key (servers started with ``--api-key``,
    gateways); nothing else: a key never goes on the command line, into the rows or to a server unasked."""
    key = os.environ.get(API_KEY_VARIABLE, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def get(url: str, path: str, timeout: float = INFO_TIMEOUT_S) -> tuple[int, str]:
    """(HTTP status, body) of GET url + path."""
    connection, base = _connection(url, timeout)
    try:
        connection.request("GET", base + path, headers=auth_headers())
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def post(url: str, path: str, body: dict[str, Any], timeout: float = INFO_TIMEOUT_S) -> tuple[int, str]:
    """(HTTP status, body) of POST url + path with ``body`` as JSON."""
    connection, base = _connection(url, timeout)
    try:
        connection.request("POST", base + path, body=json.dumps(body),
                           headers={"Content-Type": "application/json", **auth_headers()})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


# Plain lowercase ASCII, digits and arithmetic: every tokenizer has these, the tests' character tokenizer too.
TOKENIZER_PROBE = "the quick brown fox jumps over the lazy dog, 12 * 34 = 408. speculative sampling!"


def _probe_tokens(url: str, model: str) -> list[int] | None:
    """The ids the server at ``url`` splits the probe text into (``model``: the one to ask, "" its own); None where
    it does not say."""
    body = {"prompt": TOKENIZER_PROBE, "add_special_tokens": False, "content": TOKENIZER_PROBE, "add_special": False,
            **({"model": model} if model else {})}
    try:
        status, text = post(url, "/tokenize", body)
        theirs = json.loads(text).get("tokens") if status == 200 else None
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return None
    return theirs if isinstance(theirs, list) and all(isinstance(t, int) for t in theirs) else None


def tokenizer_mismatch(endpoint: Endpoint, encode: Callable[[str], list[int]]) -> str | None:
    """Whether the server splits a probe text into our tokenizer's ids (``encode``, no special tokens), where it
    tokenizes (``POST /tokenize``: vLLM's and llama.cpp's fields both sent; behind a gateway without the route, the
    first ``metrics`` server): a line saying how they differ, or None (the same ids, a leading BOS of its own aside,
    or no /tokenize to ask)."""
    theirs = _probe_tokens(endpoint.url, endpoint.model)
    if theirs is None and endpoint.metrics:  # the server behind the gateway, under its own model name
        theirs = _probe_tokens(endpoint.metrics[0], "")
    if theirs is None:
        return None
    ours = list(encode(TOKENIZER_PROBE))
    if theirs == ours or theirs[1:] == ours:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"it splits a probe text into {len(theirs)} tokens, the tokenizer given as TARGET into {len(ours)}, "
            f"differing from token {first}")


def introduce(endpoint: Endpoint) -> Endpoint:
    """The endpoint with the model id it serves and its version; one line if it does not answer /v1/models."""
    try:
        status, text = get(endpoint.url, "/v1/models")
        models = json.loads(text).get("data") or [] if status == 200 else []
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url} did not answer /v1/models "
                        f"({type(exc).__name__}: {exc})") from None
    if status in (401, 403):
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url}/v1/models answered HTTP {status}: a server "
                        f"that asks for a key takes it from {API_KEY_VARIABLE}")
    if status != 200 or not models:
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url}/v1/models answered HTTP {status} with no "
                        "model: is it an OpenAI-compatible server?")
    served = [str(m.get("id", "")) for m in models]
    if endpoint.model and endpoint.model not in served:
        raise UserError(f"--endpoint {endpoint.label}: {endpoint.url} serves no model {endpoint.model!r} (it lists "
                        f"{', '.join(served)})")
    for url in endpoint.metrics:
        if counters(url) is None:
            raise UserError(f"--endpoint {endpoint.label}: metrics={url} exports no speculative-decoding counters "
                            "(vLLM's or llama.cpp's) at /metrics")
    return replace(endpoint, model=endpoint.model or served[0], version=_version(endpoint.url))


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


def counters(url: str, model: str = "") -> Counters | None:
    """The server's speculative counters from /metrics (vLLM's or llama.cpp's names), those of ``model`` alone where
    they name their model; None where it exports none."""
    try:
        status, text = get(url, "/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    for prefix in ("vllm:", "llamacpp:"):
        if prefix + "spec_decode_" in text:
            return parse_counters(text, prefix, model)
    return None


def endpoint_counters(endpoint: Endpoint) -> Counters | None:
    """An SSp endpoint's counters now: its own /metrics (its model's lines), or those of its ``metrics`` servers
    summed; None where one of them gives none."""
    if not endpoint.metrics:
        return counters(endpoint.url, endpoint.model)
    found = [counters(url) for url in endpoint.metrics]
    if any(c is None for c in found):
        return None
    return sum(found[1:], found[0])


def stream_completion(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S,
                      cancel: threading.Event | None = None, on_text: Callable[[str], None] | None = None) -> Streamed:
    """POST ``body`` to url/v1/completions, streamed: each event with text timed as it arrives, the text kept, the
    token count from the server's usage (else the events counted: one token each). ``cancel`` set: the stream is
    dropped at its next line (Ctrl-C: a remote server would otherwise keep the client reading to the end);
    ``on_text`` gets each event's text as it comes."""
    out, events = Streamed(), 0
    connection, base = _connection(url, timeout_s)
    start = time.perf_counter()
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for event in posted_events(connection, base + route, body, out, cancel, auth_headers()):
        text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                       for choice in event.get("choices") or ())
        if text:
            out.arrivals.append(time.perf_counter() - start)
            out.text += text
            events += 1
            if on_text is not None:
                on_text(text)
        reason = next((c.get("finish_reason") for c in event.get("choices") or () if c.get("finish_reason")), None)
        if reason:
            out.timings["finish_reason"] = reason
        usage = event.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            out.counted = int(usage["completion_tokens"])
        details = usage.get("completion_tokens_details") or {}
        for key in PREDICTION_KEYS:  # OpenAI's drafted-token counts, where a server fills them (SGLang can)
            if details.get(key) is not None:
                out.timings[key] = int(details[key])
    if out.counted is None:
        out.timings["counted_events"] = True
        out.counted = events
    return out


def remote_environment(env: dict[str, str], endpoints: Sequence[Endpoint]) -> dict[str, str]:
    """What every row says of where it ran: servers whose hardware is not known here, this client, what each said."""
    return {**env, "device": f"remote servers (their hardware is not known here; client: {env.get('device', '?')})",
            "placement": "; ".join(e.describe() for e in endpoints)}


def why_failed(endpoint: Endpoint, error: str) -> str:
    """A request's error, with what to try where the server refused the request itself and was sent token ids."""
    refused = error.startswith(("HTTP 400", "HTTP 422"))
    return error + (" (a server that takes no token ids as the prompt: add ,prompt=text to its --endpoint)"
                    if refused and not endpoint.text_prompt else "")


def completion_body(endpoint: Endpoint, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                    ignore_eos: bool, stop: Sequence[str] = (), messages: Sequence[tuple[str, str]] = ()
                    ) -> dict[str, Any]:
    """A streamed completions request to ``endpoint``: the prompt's token ids (or their text, ``prompt=text``; with
    ``api=chat`` the conversation they encode, ``messages``, for the server's own chat template), our sampling law
    and a seed; ``ignore_eos`` (an extension vLLM, SGLang and llama.cpp read) only where asked; ``stop`` strings
    where given."""
    if endpoint.chat and not messages:
        raise UserError(f"--endpoint {endpoint.label}: api=chat sends a conversation, and this command sends a raw "
                        "prompt (latency, compare and load take api=chat)")
    said = {"messages": [{"role": role, "content": text} for role, text in messages]} if endpoint.chat else \
        {"prompt": endpoint.prompt(ids)}
    body: dict[str, Any] = {"model": endpoint.model, **said, "max_tokens": max_new_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "seed": seed % (2**31 - 1),
                            "temperature": 0.0 if params.greedy else params.temperature}
    if not params.greedy and params.top_p < 1:
        body["top_p"] = params.top_p
    if not params.greedy and params.top_k:
        body["top_k"] = params.top_k
    if ignore_eos:
        body["ignore_eos"] = True
    if stop:
        body["stop"] = list(stop)
    return body


ENDPOINT_TIMING = "streamed events: (last - first) / (tokens - 1), tokens from the server's usage"


def foreign_counts(delta: Counters, tokens: int, completions: int = 1) -> bool:
    """Whether a server's counters moved more than ``completions`` making ``tokens`` in all could: each drafting step
    emits its accepted drafts and one token of the target's, so accepted + steps <= tokens - 1 a completion, plus
    at most K drafts accepted past the budget or the end token in its last step. More: other traffic on the server
    counted too."""
    k = round(delta.draft_tokens / delta.drafts) if delta.drafts else 0
    return delta.accepted + delta.drafts > tokens - completions + completions * k


PREDICTION_KEYS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def usage_drafts(outs: Sequence[Streamed]) -> Counters | None:
    """Drafted and accepted tokens as the responses' usage says them (``completion_tokens_details``: accepted and
    rejected prediction tokens; per request, so other traffic cannot move them), summed; None where a response says
    none. Draft steps are not said (``drafts`` 0)."""
    said = [(o.timings.get(PREDICTION_KEYS[0]), o.timings.get(PREDICTION_KEYS[1])) for o in outs]
    if not said or any(a is None and r is None for a, r in said):
        return None
    accepted, rejected = sum(a or 0 for a, _ in said), sum(r or 0 for _, r in said)
    return Counters(0, accepted + rejected, accepted) if accepted + rejected else None


def stats_from_stream(mode: str, out: Streamed, wall_s: float, delta: Counters | None) -> GenerationStats:
    """GenerationStats of one streamed completion: the first event is the first emission (one token, the
    prompt's), ms/token runs from it to the last event over the server's token count less one; drafted, accepted
    and target forwards from the server's counter deltas over this completion, else (none, or moved by other
    traffic) drafted and accepted from its usage where the server says them there, else not known."""
    tokens = out.token_count
    stats = GenerationStats(mode=mode, new_tokens=tokens, total_time_s=wall_s, forwards_timed=False)
    if out.arrivals:
        stats.ttft_s = stats.prefill_time_s = out.arrivals[0]
        if tokens > 1 and len(out.arrivals) > 1:
            stats.first_emission_tokens, stats.after_first_s = 1, out.arrivals[-1] - out.arrivals[0]
    if mode == "rsp":
        stats.target_forwards = tokens
        return stats
    if delta is None or not delta.drafts or foreign_counts(delta, tokens):
        said = usage_drafts([out])
        if said is not None:
            stats.drafted, stats.accepted = said.draft_tokens, said.accepted
        return stats
    k = round(delta.draft_tokens / delta.drafts)
    stats.k, stats.drafted, stats.accepted = k, delta.draft_tokens, delta.accepted
    undrafted = max(0, tokens - 1 - delta.accepted - delta.drafts)  # steps that drafted nothing
    stats.target_forwards = 1 + delta.drafts + undrafted
    if delta.draft_tokens == delta.drafts * k and len(delta.accepted_per_position) >= k > 0:
        stats.drafted_at = [delta.drafts] * k  # every step drafted K: each position drafted once per step
        stats.accepted_at = list(delta.accepted_per_position[:k])
        stats.rejections = delta.drafts - delta.accepted_per_position[k - 1]
    return stats


class EndpointEngine(Engine):
    """Servers already running (``Endpoint``), one per mode, one request at a time: each completion streamed over
    /v1/completions, timed by its events; its tokens the text retokenized by the target's tokenizer (the count the
    server's); acceptance from the SSp server's /metrics counter deltas over the completion, where it exports them
    (nothing else may load that server meanwhile)."""

    name = ENGINE
    label = "endpoint"
    decode_timing = ENDPOINT_TIMING
    runs_our_weights = False  # the servers' own weights and arithmetic
    runs_feature_heads = False  # each server drafts as it was started
    runs_each_draft = True  # each SSp server is a mode of its own, named by its label (``Mode.draft``)
    names_modes = True
    takes_lookup = False
    takes_ngram = False
    marks_drafts = False  # streamed text: which tokens were drafted is not said
    checks_busy = False  # the servers may run on this machine, as processes that are not ours

    def __init__(self, endpoints: Sequence[Endpoint], tokenizer: Any) -> None:
        self.endpoints = {e.mode: e for e in endpoints}
        self.tokenizer = tokenizer
        self.counted_events = False  # a response carried no usage: its tokens counted as events
        self.foreign = 0  # completions whose counters moved more than they could alone (other traffic)
        self.counted: dict[str, list[int]] = {}  # per SSp label: [completions with counters read, drafts counted]

    def cautions(self) -> list[str]:
        """What the run's figures from these servers should be read with: counters moved by other traffic, counters
        that never moved (another server's /metrics?), token counts taken from events."""
        still = [label for label, (read, drafts) in self.counted.items() if read and not drafts]
        return [*([f"On {self.foreign} completion{'s' * (self.foreign != 1)} (warm-ups counted) a server's counters "
                   "moved more than it could make alone (other traffic on it): their acceptance is left out."]
                  if self.foreign else []),
                *([f"The counters read for {', '.join(still)} never moved (no draft counted over any completion): "
                   "are they the /metrics of the server that answered (metrics=)?"] if still else []),
                *(["Some responses carried no usage: their tokens were counted as streamed events, one each (an SSp "
                   "event may hold several, so ms/token is overestimated there)."] if self.counted_events else [])]

    @property
    def version(self) -> str:
        return "; ".join(f"{e.label}: {e.version or '?'}" for e in self.endpoints.values())

    def describe(self) -> EngineInfo:
        return EngineInfo(self.name, self.label, self.version, draft_method="server",
                          note="servers already running (--endpoint): "
                          + "; ".join(e.describe() for e in self.endpoints.values())
                          + "; ms/token from the streamed events, first to last, over the server's token count")

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return remote_environment(env, list(self.endpoints.values()))

    def _show(self, on_tokens: Callable[[list[int], list[bool]], None], text: str) -> None:
        """A streamed event's text to ``Request.on_tokens`` as the target's tokens (which were drafted: not said)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        on_tokens(ids, [False] * len(ids))

    def endpoint(self, mode: Mode) -> Endpoint | None:
        """The server of ``mode``: its own, or for an SSp mode named by no label (``eval``: RSp and SSp), the one
        SSp server where there is one."""
        if mode in self.endpoints:
            return self.endpoints[mode]
        ssp = [e for m, e in self.endpoints.items() if m.mode == "ssp"]
        return ssp[0] if mode.mode == "ssp" and not mode.draft and len(ssp) == 1 else None

    def supports(self, mode: Mode) -> str | None:
        return None if self.endpoint(mode) is not None else "no --endpoint serves it"

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        endpoint = self.endpoint(mode)
        if endpoint is None:
            raise UserError(f"{mode.name}: no --endpoint serves it")
        r = request
        body = completion_body(endpoint, r.ids[0].tolist(), r.max_new_tokens, r.params, r.seed, r.ignore_eos,
                               r.stopping.strings, r.messages)
        before = endpoint_counters(endpoint) if endpoint.mode.mode == "ssp" else None
        shown = None if r.on_tokens is None else partial(self._show, r.on_tokens)
        start = time.perf_counter()
        out = stream_completion(endpoint.url, body, on_text=shown)
        wall = time.perf_counter() - start
        if out.error:
            raise ServerFailure(f"--endpoint {endpoint.label} ({endpoint.url}) failed a request: "
                                f"{why_failed(endpoint, out.error)}")
        after = endpoint_counters(endpoint) if before is not None else None
        delta = after - before if after is not None and before is not None else None
        self.foreign += delta is not None and foreign_counts(delta, out.token_count) and usage_drafts([out]) is None
        if delta is not None:
            read = self.counted.setdefault(endpoint.label, [0, 0])
            read[0], read[1] = read[0] + 1, read[1] + delta.drafts
        self.counted_events |= bool(out.timings.get("counted_events"))
        ids = self.tokenizer.encode(out.text, add_special_tokens=False) if out.text else []
        stats = stats_from_stream(endpoint.mode.mode, out, wall, delta)
        stopped = out.timings.get("finish_reason") == "stop" and not r.ignore_eos
        cut = r.stopping.cut(ids, 0)  # a stop token the server does not know (eval: the answer's newline)
        if cut is not None:
            ids, stopped = ids[:cut], True
        return GenerationOutput(torch.tensor(ids, dtype=torch.long), stats, stopped)
