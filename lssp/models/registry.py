"""The model registry: ``models.yaml`` loaded and validated into typed specs."""
from __future__ import annotations

import difflib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lssp.errors import UserError
from lssp.models.hub import cached_file, is_repo_id, offline_reason

DTYPES = ("auto", "float32", "float16", "bfloat16")
# 8bit/4bit: bitsandbytes. dynamic-*: torch's dynamic quantization of every Linear layer (CPU only):
# fbgemm keeps the weights prepacked, so a (K+1)-token verification forward costs about a 1-token one.
# int4/int8: weight-only quantization (CPU only, lssp.models.weight_only): int4 groups of 32 (a GGUF's Q4_1 layout)
# or int8 rows, multiplied by torch's weight-only kernels with bfloat16 activations. q4_1: a GGUF's Q4_1 groups with
# int8 activations (llama.cpp's arithmetic), multiplied by our kernel (lssp.kernels: AVX512-VNNI or AVX2). auto: the fastest
# of q4_1, int4 and dynamic-fp16 on this CPU, measured once and cached (lssp.models.calibration); none on a GPU.
QUANTIZATIONS = ("none", "8bit", "4bit", "dynamic-fp16", "dynamic-int8", "int4", "int8", "q4_1", "auto")
BITSANDBYTES_QUANTIZATIONS = ("8bit", "4bit")
DYNAMIC_QUANTIZATIONS = ("dynamic-fp16", "dynamic-int8")
WEIGHT_ONLY_QUANTIZATIONS = ("int4", "int8", "q4_1")
CPU_QUANTIZATIONS = DYNAMIC_QUANTIZATIONS + WEIGHT_ONLY_QUANTIZATIONS  # applied after loading, on a CPU only
# On a GPU a weight-only entry loads through bitsandbytes instead (its CPU kernels do not run there).
GPU_WEIGHT_ONLY = {"int8": "8bit", "int4": "4bit", "q4_1": "4bit"}
INITS = ("pretrained", "random")
# transformers: the model's own forward. compact: lssp.models.compact's fused batch-1 forward for small
# Llama models (a draft's cost ratio c is mostly per-call overhead).
FORWARDS = ("transformers", "compact")
KV_CACHE_DTYPES = ("float32", "float16")  # kv_cache: what our one-call decoder stores keys and values in
# compile: true (torch.compile's mode reduce-overhead on a GPU, i.e. CUDA graphs; default on the CPU) or a mode.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SPEC_KEYS = {
    "path", "tokenizer", "dtype", "quantization", "device_map", "gpus", "max_memory",
    "attn_implementation", "revision", "init", "config", "description", "forward", "compile",
    # --engine vllm only (passed to vllm.LLM; tensor_parallel_size defaults to gpus):
    "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "gpu_memory_utilization",
    "max_model_len", "enforce_eager", "speculative_method", "draft_sample_method",
    "k",  # on a draft: its default draft length
    "prompt_lookup",  # on a draft, ours: copy first (the prompt lookup's chain where it has one, the draft elsewhere)
    "prompt_lookup_chain",  # with prompt_lookup: the longest chain copied in one iteration (default: K)
    "prompt_lookup_min",  # with prompt_lookup: the shortest tail looked up where the longer ones are new (default: N)
    "confidence",  # on a draft, ours: the confidence stop it drafts with (--draft-confidence overrides)
    "kv_cache",  # ours, q4_1 on a CPU: the KV cache's element type (float16 or float32, the default)
}
DEFAULT_K = 4  # draft tokens per iteration when neither --k nor the draft's registry entry says
EXECUTOR_BACKENDS = ("mp", "ray")
SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "medusa")  # vLLM's, for a draft entry
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM: argmax drafts with one-hot q, or draws from q (as ours)
TOP_KEYS = {"default_target", "default_draft", "default_draft_model", "models"}
PACKAGE_PREFIX = "pkg:"
# Where the registry is looked for when --config is not given, or given as a relative path not found here.
TOOL_DIR = Path(__file__).resolve().parents[2]
DEFAULT_REGISTRY = "models.yaml"
REGISTRY_ENV = "LLAMASSP_CONFIG"  # a user's own registry, used where --config is not given


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: where a model comes from and how to place it."""

    name: str
    path: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str = "none"
    device_map: str | None = None
    gpus: int | None = None
    max_memory: dict[str, str] | None = None
    attn_implementation: str | None = None
    revision: str | None = None
    init: str = "pretrained"
    config: dict[str, Any] | str | None = None
    description: str = ""
    forward: str = "transformers"
    compile: bool | str = False  # run the compact forward's decode steps under torch.compile (True or a mode)
    tensor_parallel_size: int | None = None  # vLLM: worker processes (GPUs, or CPU core groups); default gpus
    pipeline_parallel_size: int | None = None  # vLLM: pipeline stages (no speculative decoding with > 1)
    distributed_executor_backend: str | None = None  # vLLM: mp (one node) or ray (several nodes)
    gpu_memory_utilization: float | None = None  # vLLM: share of each GPU's memory per engine
    max_model_len: int | None = None  # vLLM: longest context (prompt + completion) it reserves KV cache for
    enforce_eager: bool | None = None  # vLLM: no CUDA graphs / torch.compile (default: eager on a CPU only)
    speculative_method: str | None = None  # vLLM, on a draft: draft_model (default), eagle, eagle3, mtp, ...
    draft_sample_method: str | None = None  # vLLM, on a draft: greedy (vLLM's default) or probabilistic (as ours)
    k: int | None = None  # on a draft: draft tokens per iteration when --k is not given (chosen by measurement)
    prompt_lookup: int | None = None  # on a draft (ours): copy first, the chain that followed the text's last N
    #   tokens where they occurred before, the draft elsewhere (per iteration)
    prompt_lookup_chain: int | None = None  # with prompt_lookup: the longest chain copied at once (default: K)
    prompt_lookup_min: int | None = None  # with prompt_lookup: copy from tails down to this many tokens (default: N)
    confidence: float | None = None  # on a draft (ours): stop drafting below this probability of its own token
    kv_cache: str | None = None  # ours, q4_1 on a CPU: keys and values stored in float16 (half what attention reads)
    base_dir: Path = field(default=Path("."), compare=False)

    @property
    def is_random(self) -> bool:
        return self.init == "random"

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def needs_gpu(self) -> bool:
        return bool(self.gpus) or (self.device_map or "").startswith("cuda")

    def local_path(self) -> Path | None:
        """The file or folder on disk this entry names, or None for a hub repo id."""
        if self.path.startswith(PACKAGE_PREFIX):
            package, _, rest = self.path[len(PACKAGE_PREFIX):].partition("/")
            found = importlib.util.find_spec(package)  # finds without importing the package
            if found is None or not found.submodule_search_locations:
                raise UserError(f"model {self.name!r}: Python package {package!r} is not installed (run ./setup.sh)")
            return Path(next(iter(found.submodule_search_locations))) / rest
        path = Path(self.path).expanduser()
        if not path.is_absolute():
            path = self.base_dir / path
        if self.path.startswith((".", "/", "~")) or path.exists():
            return path
        return None

    def available_locally(self) -> bool:
        """True when loading needs no download (random init, a local path, or the hub cache)."""
        if self.is_random:
            return True
        try:
            local = self.local_path()
        except UserError:
            return False
        if local is not None:
            return local.exists()
        return cached_file(self.path, revision=self.revision) is not None


@dataclass(frozen=True)
class Registry:
    """The entries of one models.yaml; ``get`` also takes a hub id or a local folder or .gguf file that is not
    an entry (loaded with defaults, announced once through ``notify``)."""

    models: dict[str, ModelSpec]
    default_target: str | None
    default_draft: str | None
    source: Path
    notify: Callable[[str], None] | None = field(default=None, compare=False)
    unlisted: dict[str, ModelSpec] = field(default_factory=dict, compare=False)
    default_draft_model: str | None = None  # the default where a feature head cannot run (it is no model)
    said: set[str] = field(default_factory=set, compare=False)

    def get(self, name: str) -> ModelSpec:
        if name in self.models:
            return self.models[name]
        if name not in self.unlisted:
            self.unlisted[name] = spec = self._unlisted_spec(name)
            if self.notify is not None:
                self.notify(spec.description)
        return self.unlisted[name]

    def _unlisted_spec(self, name: str) -> ModelSpec:
        """A name that is no entry: an existing folder or .gguf file, or a hub id (cached, or the hub answers)."""
        unknown = f"unknown model {name!r} in {self.source}"
        path = Path(name).expanduser()
        if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
            return unlisted_spec(name, str(path.resolve()), self.source, _config_file(path),
                                 "the GGUF file" if path.is_file() else "the folder")
        if not is_repo_id(name):
            looks_like_path = name.startswith((".", "/", "~")) or name.endswith(".gguf") or os.sep in name
            raise UserError(unknown + (", and no such file or folder" if looks_like_path else "")
                            + _suggest(name, self.models))
        by_path = [n for n, spec in self.models.items() if spec.path.lower() == name.lower()]
        hint = (f"; did you mean {by_path[0]!r} (its entry has that path)?" if by_path
                else _suggest(name, self.models))
        config = cached_file(name)
        if config is None:
            reason = offline_reason()
            if reason:
                raise UserError(f"{unknown}, and as a hub id not in the local Hugging Face cache (the hub is "
                                f"{reason}){hint}")
            config = _download_config(name, unknown)
        return unlisted_spec(name, name, self.source, config, "the hub model")

    def target_name(self, name: str | None) -> str:
        return self._name_or_default(name, self.default_target, "default_target", "a target model")

    def draft_name(self, name: str | None, heads: bool = True) -> str:
        """``name``'s entry name, else the default draft; ``heads``: whether what runs it runs feature heads
        (where not, the default is ``default_draft_model`` when the registry sets one)."""
        if not name and not heads and self.default_draft_model:
            if self.default_draft_model != self.default_draft and self.notify and "fallback" not in self.said:
                self.said.add("fallback")
                self.notify(f"drafting with {self.default_draft_model}, the default_draft_model of {self.source.name}"
                            f" (its default_draft {self.default_draft} is a feature head, which this engine or command cannot run)")
            return self.default_draft_model
        return self._name_or_default(name, self.default_draft, "default_draft", "a draft model")

    def draft_k(self, name: str | None, heads: bool = True) -> int:
        """The draft length to use when none is given: the draft's own ``k`` (chosen by measurement), else 4."""
        if not name and not self.default_draft:
            return DEFAULT_K
        return self.get(self.draft_name(name, heads)).k or DEFAULT_K

    def _name_or_default(self, name: str | None, default: str | None, key: str, what: str) -> str:
        if name:
            return self.get(name).name
        if not default:
            raise UserError(f"no {what} given and {self.source} sets no {key}")
        return default


def _config_file(folder: Path) -> Path | None:
    return folder / "config.json" if (folder / "config.json").is_file() else None


def _download_config(repo_id: str, unknown: str) -> Path:
    """config.json of a hub model not yet cached (small; the weights come when it loads)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # noqa: BLE001 - not found, gated, no network: one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"{unknown}, and the hub gives no config for it ({type(exc).__name__}: {first})") from None


def unlisted_spec(name: str, path: str, registry: Path, config: Path | None, kind: str) -> ModelSpec:
    """An entry made for a model named by its hub id or path: the dtype its config.json gives (a GGUF file has
    none: bfloat16 on a GPU, float32 on a CPU), placed by the machine (over the GPUs it has, else the CPU)."""
    import torch

    gpus = torch.cuda.device_count()
    dtype, said = "auto", "the dtype it was saved in"
    try:
        fields = json.loads(config.read_text()) if config is not None else {}
    except (OSError, ValueError):
        fields = {}
    saved = fields.get("dtype") or fields.get("torch_dtype")
    if saved in DTYPES:
        dtype, said = saved, f"{saved} (its config's)"
    elif path.endswith(".gguf"):
        dtype = "bfloat16" if gpus else "float32"
        said = f"{dtype} (a GGUF file on a {'GPU' if gpus else 'CPU'})"
    where = "on this machine's GPUs" if gpus else "on the CPU (no GPU visible)"
    description = f"{name} is not in {registry.name}: loading {kind} with defaults, {said}, {where}"
    return ModelSpec(name=name, path=path, dtype=dtype, description=description)


def _suggest(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    if close:
        return "; did you mean " + ", ".join(repr(c) for c in close) + "?"
    if len(choices) > 8:  # a registry's ~50 models: where to see them, not all of them
        return f"; none of the {len(choices)} known is close (`llamassp.py models` lists them)"
    return "; known: " + ", ".join(sorted(choices))


class _Located:
    """Turn a YAML node into Python data while remembering each mapping key's line."""

    def __init__(self, source: Path) -> None:
        self.source = source

    def where(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}"

    def error(self, node: yaml.Node, message: str) -> UserError:
        return UserError(f"{self.where(node)}: {message}")


def _python(node: yaml.Node) -> Any:
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def registry_path(given: str | Path | None = None) -> Path:
    """The registry to read: ``given`` (--config), else $LLAMASSP_CONFIG, else models.yaml; a relative path not
    found in the working directory is looked for next to the tool (the repository's own models.yaml)."""
    if given is None:
        given = os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY
    path = Path(given).expanduser()
    if path.is_absolute() or path.exists() or not (TOOL_DIR / path).exists():
        return path
    return TOOL_DIR / path


def load_registry(path: str | Path) -> Registry:
    """Read and validate a models.yaml; any mistake raises UserError naming file, line and key."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        where = "" if source.is_absolute() else f" (looked in the working directory and in {TOOL_DIR})"
        raise UserError(f"cannot read model registry {source}: {exc.strerror or exc}{where}") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{source}{line}: malformed YAML: {getattr(exc, 'problem', exc)}") from None
    loc = _Located(source)
    if not isinstance(root, yaml.MappingNode):
        raise UserError(f"{source}: expected a mapping with a 'models' key")
    top: dict[str, yaml.Node] = {}
    for key_node, value_node in root.value:
        key = key_node.value
        if key not in TOP_KEYS:
            raise loc.error(key_node, f"unknown top-level key {key!r}{_suggest(key, TOP_KEYS)}")
        top[key] = value_node
    models_node = top.get("models")
    if not isinstance(models_node, yaml.MappingNode):
        raise UserError(f"{source}: 'models' must be a mapping of name -> entry")
    models: dict[str, ModelSpec] = {}
    for name_node, entry_node in models_node.value:
        name = str(name_node.value)
        if name in models:
            raise loc.error(name_node, f"model {name!r} is defined twice")
        models[name] = _spec(loc, name, entry_node, source.parent)
    defaults = {}
    for key in ("default_target", "default_draft", "default_draft_model"):
        node = top.get(key)
        if node is None:
            defaults[key] = None
            continue
        value = str(node.value)
        if value not in models:
            raise loc.error(node, f"{key} names unknown model {value!r}{_suggest(value, models)}")
        defaults[key] = value
    return Registry(models, defaults["default_target"], defaults["default_draft"], source,
                    default_draft_model=defaults["default_draft_model"])


def _spec(loc: _Located, name: str, node: yaml.Node, base_dir: Path) -> ModelSpec:
    if not isinstance(node, yaml.MappingNode):
        raise loc.error(node, f"model {name!r}: expected a mapping of settings")
    values: dict[str, Any] = {}
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in SPEC_KEYS:
            raise loc.error(key_node, f"model {name!r}: unknown key {key!r}{_suggest(key, SPEC_KEYS)}")
        values[key] = _python(value_node)
        at = loc.where(value_node)
        _check_value(name, key, values[key], at)
    init = values.get("init", "pretrained")
    if init == "pretrained" and not values.get("path"):
        raise loc.error(node, f"model {name!r}: 'path' is required (or 'init: random' with a 'config')")
    if init == "random" and not values.get("config"):
        raise loc.error(node, f"model {name!r}: 'init: random' needs a 'config' (a mapping or an architecture name)")
    for key in ("prompt_lookup_chain", "prompt_lookup_min"):
        if key in values and not values.get("prompt_lookup"):
            raise loc.error(node, f"model {name!r}: '{key}' needs 'prompt_lookup' (the n-gram length)")
    if values.get("prompt_lookup_min", 0) > values.get("prompt_lookup", 0):
        raise loc.error(node, f"model {name!r}: 'prompt_lookup_min' ({values['prompt_lookup_min']}) is above "
                              f"'prompt_lookup' ({values['prompt_lookup']})")
    if "max_memory" in values:
        values["max_memory"] = {str(k): str(v) for k, v in values["max_memory"].items()}
    return ModelSpec(name=name, base_dir=base_dir, **values)


def _check_value(name: str, key: str, value: Any, at: str) -> None:
    def bad(expected: str) -> UserError:
        return UserError(f"{at}: model {name!r}: bad {key} {value!r}; expected {expected}")

    choices = {"dtype": DTYPES, "quantization": QUANTIZATIONS, "init": INITS, "forward": FORWARDS,
               "kv_cache": KV_CACHE_DTYPES}.get(key)
    if choices is not None:
        if value not in choices:
            raise UserError(f"{at}: model {name!r}: bad {key} {value!r}; expected one of {', '.join(choices)}")
    elif key in ("gpus", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "k",
                 "prompt_lookup", "prompt_lookup_chain", "prompt_lookup_min"):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "gpus" else 1):
            raise bad("a whole number >= " + ("0" if key == "gpus" else "1"))
    elif key == "gpu_memory_utilization":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            raise bad("a fraction in (0, 1]")
    elif key == "confidence":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
            raise bad("a probability in (0, 1)")
    elif key == "enforce_eager":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif key in ("distributed_executor_backend", "speculative_method", "draft_sample_method"):
        choices = {"distributed_executor_backend": EXECUTOR_BACKENDS, "speculative_method": SPECULATIVE_METHODS,
                   "draft_sample_method": DRAFT_SAMPLE_METHODS}[key]
        if value not in choices:
            raise UserError(f"{at}: model {name!r}: bad {key} {value!r}; expected one of {', '.join(choices)}")
    elif key == "max_memory":
        if not isinstance(value, dict) or not value:
            raise bad("a mapping such as {0: 38GiB, 1: 38GiB, cpu: 64GiB}")
    elif key == "compile":
        if not isinstance(value, bool) and value not in COMPILE_MODES:
            raise bad(f"true, false or a torch.compile mode ({', '.join(COMPILE_MODES)})")
    elif key == "config":
        if not isinstance(value, (dict, str)):
            raise bad("a mapping of config fields or an architecture name")
    elif not isinstance(value, str):
        raise bad("a string")
