"""llama.cpp as a peer engine: the same prompts, budgets, K, sampling and seeds through ``llama-server``.

llama-server fixes its speculative settings when it starts, so each way of generating is one server, on a free
loopback port, started before anything is timed: RSp (the target alone), SSp with the draft model at K
(``--spec-type draft-simple -md DRAFT.gguf --spec-draft-n-max K``), n-gram lookup at K (``ngram-simple``: the
text's last N tokens looked up, the K tokens after the match drafted). Requests go one at a time to the native
``/completion`` endpoint with the prompt's token ids; the response's ``timings`` and token ids become our stats.

Definitions match ours and vLLM's: acceptance rate = accepted ÷ drafted (``draft_n_accepted`` ÷ ``draft_n``);
decode ms/token = llama-server's ``predicted_ms`` ÷ (tokens − 1), the time from the end of the prompt's
processing (when the first token is emitted) to the last token, over the tokens after the first. Each
verification step's accepted/drafted counts come from the server's log (``LLAMA_TRACE=1`` makes it write one line
per step), checked against the response's totals: they give α, acceptance by position and target forwards.
"""
from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lssp.decoding.generation import NO_STOP, GenerationOutput, GenerationStats, Stopping
from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Engine, EngineInfo, Mode, Request
from lssp.engines.llamacpp_build import LlamacppBuild, gguf_path, last_error_line, require_build
from lssp.errors import ServerFailure, UserError
from lssp.models.eagle3 import is_eagle3_head
from lssp.models.loading import ModelHandle, load_tokenizer
from lssp.models.registry import ModelSpec

DECODE_TIMING = "llama-server timings: predicted_ms / (tokens - 1)"
NO_CONFIDENCE = "--draft-confidence has no llama.cpp equivalent here (its drafts are K long, p-min 0)"
START_TIMEOUT_S = float(os.environ.get("LLAMASSP_LLAMACPP_START_TIMEOUT", 300))
REQUEST_TIMEOUT_S = float(os.environ.get("LLAMASSP_LLAMACPP_REQUEST_TIMEOUT", 1800))
STEP_LINE = re.compile(r"\| task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens")
# Our law is the plain warped softmax: temperature, then top-k, then top-p (lssp.decoding.sampling.warp); every
# other llama.cpp sampler (penalties, DRY, min-p, XTC, typical, top-n-sigma) is left out of the chain.
SAMPLERS = ["temperature", "top_k", "top_p"]


def check_ready(confidences: tuple[float, ...] | list[float] = (0.0,)) -> LlamacppBuild:
    """Before anything loads: the build (one line naming the setup option if missing), and options llama.cpp has no
    equivalent for refused in one line."""
    build = require_build()
    if any(confidences):
        raise UserError(f"--engine llamacpp: {NO_CONFIDENCE}")
    return build


class LlamacppModel(ModelHandle):
    """A registry entry that llama.cpp runs: our side only tokenizes, decodes and describes it."""

    def __init__(self, spec: ModelSpec, build: LlamacppBuild, target: LlamacppModel | None = None) -> None:
        """``target``: the model a draft drafts for (an EAGLE-3 head is converted with it and shares its tokenizer)."""
        self.spec = spec
        local = spec.local_path()
        self.eagle3 = target is not None and local is not None and is_eagle3_head(local)  # its draft-eagle3
        self.gguf = gguf_path(spec, build, target.spec if target is not None else None)
        self.tokenizer = target.tokenizer if self.eagle3 else load_tokenizer(spec)
        self.build = build
        self.engine_placement = f"llama.cpp {build.version}"

    @property
    def draft_kind(self) -> str:
        return "eagle" if self.eagle3 else "draft"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self.build.flavor == "cuda" else "cpu")

    @property
    def placement(self) -> str:
        return self.engine_placement

    @property
    def precision(self) -> str:
        return f"{self.gguf.name} (llama.cpp)"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer) if self.tokenizer is not None else 0

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def weight_bytes(self) -> int:
        return self.gguf.stat().st_size


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STARTED: list[LlamaServer] = []  # every server still running: stopped at exit whatever happened
_GROUPS: list[LlamacppServers] = []  # every set of servers not closed yet
_MADE = [0]  # llama-servers (and sets of them) made by this process so far


def servers_started() -> int:
    """How many llama-servers this process has made so far (``stop_servers(since=...)`` takes it)."""
    return _MADE[0]


def _next_serial() -> int:
    _MADE[0] += 1
    return _MADE[0]


@atexit.register
def stop_servers(since: int = 0) -> None:
    """Stop the llama-servers this process started after the ``since``-th and has not stopped yet (all by default),
    and remove their logs where nothing failed."""
    for group in list(_GROUPS):
        if group.serial > since:
            group.close()
    for server in list(_STARTED):
        if server.serial > since:
            server.close()


@dataclass
class LlamaServer:
    """One llama-server process on a loopback port, its log in ``log_path``."""

    build: LlamacppBuild
    label: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    port: int = 0
    log_offset: int = 0
    serial: int = field(default_factory=_next_serial)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until it answers /health; one line naming its log if it does not."""
        self.port = free_port()
        command = [str(self.build.server), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", "--metrics",
                   *self.args]
        env = {**os.environ, "LLAMA_TRACE": "1"}
        self.log_path.write_text(" ".join(command) + "\n")
        with open(self.log_path, "a") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)
        _STARTED.append(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.close()
                raise UserError(f"llama-server ({self.label}) exited at start with code {code}: "
                                f"{last_error_line(self.log_path)} (log: {self.log_path})")
            if self._healthy():
                self.log_offset = self.log_path.stat().st_size
                return
            time.sleep(0.2)
        self.close()
        raise UserError(f"llama-server ({self.label}) did not answer within {timeout_s:.0f} s (log: {self.log_path})")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _healthy(self) -> bool:
        try:
            status, _ = self._call("GET", "/health", None, timeout=2)
        except OSError:
            return False
        return status == 200

    def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, dict[str, Any]]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=json.dumps(body) if body is not None else None,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(data or b"{}")
        except ValueError:
            return response.status, {"raw": data[:200].decode(errors="replace")}

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """POST /completion: the response and the wall seconds it took."""
        if self.process is None or self.process.poll() is not None:
            raise ServerFailure(f"llama-server ({self.label}) is not running (log: {self.log_path})")
        start = time.perf_counter()
        try:
            status, answer = self._call("POST", "/completion", body, REQUEST_TIMEOUT_S)
        except OSError as exc:
            raise ServerFailure(f"llama-server ({self.label}) failed a request: {exc} (log: {self.log_path})") from None
        wall = time.perf_counter() - start
        if status != 200:
            message = answer.get("error", {}).get("message") if isinstance(answer.get("error"), dict) else answer
            raise ServerFailure(f"llama-server ({self.label}) refused a request (HTTP {status}): {message} "
                            f"(log: {self.log_path})")
        return answer, wall

    def metrics(self) -> dict[str, float]:
        """The server's cumulative counters (GET /metrics, Prometheus text): ``spec_decode_num_drafts_total`` (verification
        steps), ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``, ...; per-position
        ones keyed ``NAME{position="i"}``."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode(errors="replace")
        finally:
            connection.close()
        found = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line[len("llamacpp:"):].rpartition(" ")
                found[name] = float(value)
        return found

    def steps_since(self, drafted: int, accepted: int, wait_s: float = 2.0) -> list[tuple[int, int]] | None:
        """The (accepted, drafted) of each verification step logged since the last call, once they add up to the
        response's totals (the log is written by a thread of its own, so it may lag); None if they never do."""
        deadline = time.monotonic() + wait_s
        while True:
            with open(self.log_path, "rb") as source:
                source.seek(self.log_offset)
                text = source.read().decode(errors="replace")
            complete = text[:text.rfind("\n") + 1]
            steps = [(int(a), int(d)) for _, a, d in STEP_LINE.findall(complete)]
            if sum(d for _, d in steps) == drafted and sum(a for a, _ in steps) == accepted:
                self.log_offset += len(complete.encode())
                return steps
            if time.monotonic() > deadline:
                self.log_offset += len(complete.encode())
                return None
            time.sleep(0.01)

    def close(self) -> None:
        """Stop the server (terminate, then kill after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self in _STARTED:
            _STARTED.remove(self)


def threads() -> int:
    """llama.cpp's threads: as many as our engine's (torch's intra-op threads), unless LLAMASSP_LLAMACPP_THREADS says.
    Its default (every hardware thread) spins against anything else running: on a busy 2-core machine a tiny model's
    steps took seconds instead of milliseconds."""
    return int(os.environ.get("LLAMASSP_LLAMACPP_THREADS") or torch.get_num_threads())


def server_args(target: LlamacppModel, draft: LlamacppModel | None, k: int, lookup: int, slots: int = 1,
                context: int = 0) -> list[str]:
    """llama-server's model, slot and speculative flags for one mode (k = 0: RSp).

    ``slots``: requests served at once (``--parallel``); one slot serves one request at a time, as every command
    but ``load`` times them; more run side by side in each forward (continuous batching). ``context``: the KV
    cache's tokens over all slots (``--ctx-size``; 0: the model's own context); llama-server splits it evenly
    between the slots (``--no-kv-unified``: each slot its own share, whatever the others hold)."""
    args = ["-m", str(target.gguf), "--threads", str(threads()), "--parallel", str(slots)]
    args += ["--cont-batching", "--no-kv-unified"] if slots > 1 else ["--no-cont-batching"]
    if context:
        args += ["--ctx-size", str(context)]
    if target.build.flavor == "cuda":
        args += ["--n-gpu-layers", "all"]
    if target.spec.dtype == "float32":  # fp32 keys, values and attention (llama.cpp's CPU flash attention: f16)
        args += ["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"]
    if k and lookup:
        args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup),
                 "--spec-ngram-simple-size-m", str(k), "--spec-ngram-simple-min-hits", "1"]
    elif k:
        if draft is None:
            raise UserError("--engine llamacpp: SSp needs a draft model (or --lookup for n-gram drafts)")
        spec_type = "draft-eagle3" if draft.eagle3 else "draft-simple"
        args += ["-md", str(draft.gguf), "--spec-type", spec_type, "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
        if target.build.flavor == "cuda":
            args += ["--spec-draft-ngl", "all"]
        if draft.spec.dtype == "float32":
            args += ["--spec-draft-type-k", "f32", "--spec-draft-type-v", "f32"]
    return args


def request_body(ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                 stopping: Stopping = NO_STOP) -> dict[str, Any]:
    """A /completion request: token ids in, token ids out, our sampling law and nothing else, no prompt cache;
    without stop conditions (``--ignore-eos``) it runs to the budget past the end token."""
    ignore_eos = not (stopping.token_ids or stopping.strings)
    return {"prompt": ids, **({"stop": list(stopping.strings)} if stopping.strings else {}), "n_predict": max_new_tokens, "return_tokens": True, "stream": False,
            "cache_prompt": False, "ignore_eos": ignore_eos, "seed": seed % (2**32 - 1),  # 2^32-1: "random"
            "temperature": 0.0 if params.greedy else params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": 0.0, "samplers": SAMPLERS, "n_probs": 0}


def stats_from_response(mode: str, k: int, tokens: int, wall_s: float, timings: dict[str, Any],
                        steps: list[tuple[int, int]] | None) -> GenerationStats:
    """GenerationStats from llama-server's ``timings`` and the per-step record (None: not available)."""
    stats = GenerationStats(mode=mode, k=k, new_tokens=tokens, total_time_s=wall_s, forwards_timed=False,
                            drafted_at=[0] * k, accepted_at=[0] * k)
    predicted_s = float(timings.get("predicted_ms", 0.0)) / 1000  # the first token's emission to the last token's
    if tokens > 1 and predicted_s > 0:
        decode = predicted_s * tokens / (tokens - 1)  # per-token rate of tokens 2..n, over all n tokens
        stats.prefill_time_s = max(0.0, wall_s - decode)
        stats.first_emission_tokens, stats.after_first_s = 1, predicted_s
    else:
        stats.prefill_time_s = wall_s
    stats.ttft_s = max(0.0, wall_s - predicted_s)  # the request's start (HTTP included) to the first token
    stats.drafted = int(timings.get("draft_n", 0))
    stats.accepted = int(timings.get("draft_n_accepted", 0))
    if mode == "rsp":
        stats.target_forwards = tokens
        return stats
    if steps is None:  # totals only: forwards and α cannot be told apart
        return stats
    undrafted = max(0, tokens - 1 - sum(a + 1 for a, _ in steps))
    stats.target_forwards = 1 + len(steps) + undrafted
    stats.rejections = sum(a < d for a, d in steps)
    for a, d in steps:
        for i in range(min(d, k)):
            stats.drafted_at[i] += 1
            stats.accepted_at[i] += int(i < a)
    return stats


class LlamacppServers:
    """One llama-server per (k, lookup) mode, all started before anything is timed; stopped by ``close``. ``slots``
    and ``context``: as ``server_args`` (``load`` serves several requests at once; the other commands one)."""

    def __init__(self, target: LlamacppModel, draft: LlamacppModel | None, modes: list[tuple[int, int]],
                 log_started: Any = None, slots: int = 1, context: int = 0) -> None:
        self.build = target.build
        self.target, self.draft = target, draft
        self.serial = _next_serial()
        _GROUPS.append(self)
        self.log_dir = Path(tempfile.mkdtemp(prefix="llamassp-llamacpp-"))
        self.keep_logs = False  # set on a failure: the logs its message names stay
        self.slots, self.context = slots, context
        self.servers: dict[tuple[int, int], LlamaServer] = {}
        try:
            for key in dict.fromkeys(modes):
                label = "rsp" if key[0] == 0 else f"ngram n={key[1]} k={key[0]}" if key[1] else f"draft k={key[0]}"
                name = label.replace(" ", "-").replace("=", "")
                server = LlamaServer(self.build, label, server_args(target, draft, *key, slots, context),
                                     self.log_dir / f"{name}.log")
                self.servers[key] = server
                server.start()
                if log_started:
                    log_started(key)
        except BaseException:
            self.keep_logs = True
            self.close()
            raise
        target.engine_placement = f"llama.cpp {self.build.version}"
        if draft is not None:
            draft.engine_placement = f"llama.cpp {self.build.version} ({draft.gguf.name})"

    @property
    def version(self) -> str:
        return self.build.version

    def generate(self, k: int, lookup: int, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                 stopping: Stopping = NO_STOP) -> GenerationOutput:
        """One request through the server of (k, lookup), timed and measured; the tokens end where ``stopping``
        says (llama-server stops at its GGUF's end-of-generation tokens and at stop strings)."""
        server = self.servers[(k, lookup)]
        try:
            answer, wall = server.complete(request_body(ids, max_new_tokens, params, seed, stopping))
        except UserError:
            self.keep_logs = True
            raise
        tokens = [int(t) for t in answer.get("tokens", [])]
        timings = answer.get("timings", {})
        steps = server.steps_since(int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))) if k else []
        stopped = answer.get("stop_type") in ("eos", "word") and bool(stopping.token_ids or stopping.strings)
        cut = stopping.cut(tokens, 0)
        if cut is not None:
            tokens, stopped = tokens[:cut], True
        stats = stats_from_response("ssp" if k else "rsp", k, len(tokens), wall, timings, steps)
        return GenerationOutput(torch.tensor(tokens, dtype=torch.long), stats, stopped)

    def failed(self, server: LlamaServer, what: str) -> ServerFailure:
        """The error for a server that failed mid-run (its log kept and named)."""
        self.keep_logs = True
        state = "failed requests" if server.alive else "is no longer running"
        return ServerFailure(f"llama-server ({server.label}) {state} {what}: {last_error_line(server.log_path)} "
                         f"(log: {server.log_path})")

    def close(self) -> None:
        """Stop every server; their logs are removed unless something failed (the error named them)."""
        for server in self.servers.values():
            server.close()
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self in _GROUPS:
            _GROUPS.remove(self)


class LlamacppEngine(Engine):
    """llama.cpp behind the engine interface: each mode's (k, n-gram length) server, started by ``LlamacppServers``."""

    name = "llamacpp"
    label = "llama.cpp"
    decode_timing = DECODE_TIMING
    runs_our_weights = False  # its own kernels and number formats: our exact law is a reference, not the verdict
    runs_feature_heads = False  # its draft-eagle3 takes EAGLE-3 heads (three target layers), not EAGLE-1 ones
    takes_lookup = False  # its n-gram drafter drafts alone (Mode.ngram), never as a hint over a draft model
    marks_drafts = False  # whole answers: which tokens were drafted is not streamed
    version_column = "llamacpp"

    def __init__(self, servers: LlamacppServers) -> None:
        self.servers = servers

    @classmethod
    def check_ready(cls, confidences: Sequence[float] = (0.0,)) -> None:
        check_ready(list(confidences))

    @classmethod
    def ngram_reason(cls, k: int, n: int) -> str | None:
        # common_ngram_simple_draft returns no draft where fewer than size_n tokens follow the match (size_m = K)
        if k < n:
            return f"llama.cpp's ngram-simple drafts only at K >= the n-gram length {n}"
        return None

    @property
    def version(self) -> str:
        return self.servers.version

    def describe(self) -> EngineInfo:
        return EngineInfo(self.name, self.label, self.version, draft_method="draft-simple",
                          note=f"llama.cpp {self.version}: llama-server, one per mode; decode ms/token from its timings, "
                          "first token to last")

    def supports(self, mode: Mode) -> str | None:
        if mode.confidence:
            return NO_CONFIDENCE
        if super().supports(mode):
            return super().supports(mode)
        return None if self.key(mode) in self.servers.servers else f"no llama-server was started for {mode.name}"

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        r = request
        out = self.servers.generate(*self.key(mode), r.ids[0].tolist(), r.max_new_tokens, r.params, r.seed,
                                    r.stopping)
        if r.on_tokens is not None and len(out.tokens):
            r.on_tokens(out.tokens.tolist(), [False] * len(out.tokens))  # whole completions: nothing to colour
        return out

    def close(self) -> None:
        self.servers.close()
