"""The registry as a catalogue: one row per entry with its size (counted from its shape, nothing loaded), precision,
where its weights come from and whether they are on disk."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lssp.errors import UserError
from lssp.models.hub import cached_file
from lssp.models.registry import PACKAGE_PREFIX, ModelSpec, Registry

SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "auto": "auto"}
SHORT_QUANTIZATIONS = {"8bit": "8bit", "4bit": "4bit", "dynamic-fp16": "dyn-fp16", "dynamic-int8": "dyn-int8",
                       "int4": "int4", "int8": "int8", "q4_1": "q4_1", "auto": "auto"}


@dataclass(frozen=True)
class CatalogRow:
    """One entry as ``models`` shows it: the compact view's four columns first, then the rest."""

    name: str
    size: str  # "8.0B" parameters, "EAGLE head", "67 MB file", or "?" where the shape is unknown here
    precision: str  # "bf16", "8bit", "dyn-fp16", ...
    where: str  # "hub (cached) · 4 GPUs", "package", "folder", "random init", "missing"
    role: str  # "default target", "default draft" or ""
    parameters: int | None
    shape: str | None  # the architecture named by its `config:`, if any
    path: str
    source: str  # hub, package, folder, file, random
    on_disk: bool
    dtype: str
    quantization: str
    forward: str
    placement: str  # "auto", or what the entry asks: device_map, gpus, max_memory, vLLM keys
    description: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def catalog(registry: Registry) -> list[CatalogRow]:
    """Every entry of ``registry``, in its order."""
    roles = {registry.default_draft_model: "default draft model", registry.default_target: "default target",
             registry.default_draft: "default draft"}
    return [entry_row(spec, roles.get(spec.name, "")) for spec in registry.models.values()]


def entry_row(spec: ModelSpec, role: str = "") -> CatalogRow:
    source, on_disk, local = _source(spec)
    fields = _config_fields(spec, source, local)
    parameters = parameter_count(fields) if fields else None
    if (fields and fields.get("feature_head")) or spec.speculative_method in ("eagle", "eagle3"):
        size = "EAGLE head"
    elif parameters:
        size = format_count(parameters)
    elif local is not None and local.is_file():
        size = f"{local.stat().st_size / 1e6:,.0f} MB file"
    else:
        size = "?"
    placement = _placement(spec)
    where = _where(source, on_disk) + ("" if placement == "auto" else f" · {_short_placement(spec)}")
    return CatalogRow(
        name=spec.name, size=size, precision=short_precision(spec), where=where, role=role, parameters=parameters,
        shape=spec.config if isinstance(spec.config, str) else None, path=spec.path, source=source, on_disk=on_disk,
        dtype=spec.dtype, quantization=spec.quantization, forward=spec.forward, placement=placement,
        description=spec.description)


def short_precision(spec: ModelSpec) -> str:
    """The quantization where there is one (bitsandbytes, torch's dynamic or weight-only one, the GGUF's Q4_1 blocks,
    or ``auto``: the fastest of them on the CPU that loads it), else the dtype."""
    return SHORT_QUANTIZATIONS.get(spec.quantization) or SHORT_DTYPES.get(spec.dtype, spec.dtype)


def format_count(n: int) -> str:
    """Parameters the way model names give them: 8.0B, 135M, 12K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)


def parameter_count(fields: dict[str, Any]) -> int | None:
    """Weights of a dense decoder (Llama, Qwen2, Mistral shapes) from its config fields; None for other shapes."""
    try:
        vocab, hidden, inner = fields["vocab_size"], fields["hidden_size"], fields["intermediate_size"]
        layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    except KeyError:
        return None
    if fields.get("num_local_experts") or fields.get("num_experts"):
        return None  # mixture of experts: another count
    kv_heads = fields.get("num_key_value_heads") or heads
    head_dim = fields.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if fields.get("model_type") == "qwen2" or fields.get("attention_bias"):
        attention += heads * head_dim + 2 * kv_heads * head_dim + (hidden if fields.get("attention_bias") else 0)
    per_layer = attention + 3 * hidden * inner + 2 * hidden
    head_rows = len(fields.get("head_token_ids") or []) or vocab
    output = 0 if fields.get("tie_word_embeddings") else head_rows * hidden
    return vocab * hidden + layers * per_layer + hidden + output


def _source(spec: ModelSpec) -> tuple[str, bool, Path | None]:
    """(kind, on disk, the local file or folder if any)."""
    if spec.is_random:
        return "random", True, None
    try:
        local = spec.local_path()
    except UserError:
        return "package", False, None
    if local is None:
        return "hub", cached_file(spec.path, revision=spec.revision) is not None, None
    kind = "package" if spec.path.startswith(PACKAGE_PREFIX) else "file" if spec.is_gguf else "folder"
    return kind, local.exists(), local


def _config_fields(spec: ModelSpec, source: str, local: Path | None) -> dict[str, Any] | None:
    """The shape: the entry's ``config``, else the config.json on disk (folder, hub cache, GGUF's converted copy)."""
    from lssp.models.sources import architectures, gguf_copy_dir

    if isinstance(spec.config, dict):
        return spec.config
    if isinstance(spec.config, str) and spec.config in architectures():
        return architectures()[spec.config]
    config: Path | None = None
    if source == "hub":
        config = cached_file(spec.path, revision=spec.revision)
    elif local is not None and local.is_dir():
        config = local / "config.json"
    elif local is not None and local.is_file() and spec.is_gguf:
        config = gguf_copy_dir(local, spec.dtype) / "config.json"
    try:
        return json.loads(config.read_text()) if config is not None and config.is_file() else None
    except (OSError, ValueError):
        return None


def _where(source: str, on_disk: bool) -> str:
    if source == "hub":
        return "hub (cached)" if on_disk else "hub"
    if source == "random":
        return "random init"
    return source if on_disk else f"{source} missing"


def _placement(spec: ModelSpec) -> str:
    parts = [spec.device_map or ""]
    if spec.gpus:
        parts.append(f"{spec.gpus} GPUs")
    if spec.max_memory:
        parts.append("max_memory {" + ", ".join(f"{k}: {v}" for k, v in spec.max_memory.items()) + "}")
    vllm = [f"pipeline {spec.pipeline_parallel_size}" if spec.pipeline_parallel_size else "",
            spec.distributed_executor_backend or "", spec.speculative_method or ""]
    if any(vllm):
        parts.append("vLLM: " + ", ".join(v for v in vllm if v))
    return ", ".join(p for p in parts if p) or "auto"


def _short_placement(spec: ModelSpec) -> str:
    """The placement in a few characters: 4 GPUs, cuda:1, max_memory, eagle."""
    if spec.max_memory:
        return "max_memory"
    if spec.gpus:
        return f"{spec.gpus} GPUs"
    return spec.device_map or spec.speculative_method or "vLLM keys"


BYTES_PER_WEIGHT = {"8bit": 1.0, "4bit": 0.5, "float32": 4.0}  # otherwise 2 (16-bit)


def memory_note(spec: ModelSpec) -> str:
    """" (once there, its weights need ~61 GiB in float16)" where the entry's shape is known, else nothing."""
    parameters = entry_row(spec).parameters
    if not parameters:
        return ""
    precision = spec.quantization if spec.quantization not in (None, "", "none") else spec.dtype or "float16"
    gib = parameters * BYTES_PER_WEIGHT.get(precision, 2.0) / 2**30
    return f" (once there, its weights need ~{gib:.0f} GiB in {precision})"
