"""Where models go on a node of GPUs: worked out on the meta device before anything is loaded.

The target is spread over the GPUs by accelerate's balanced placement (what transformers'
``device_map="auto"`` does); the draft is kept whole on the GPU with the most memory left
after the target. The same rules serve ``plan`` (a node described by ``--gpus`` and
``--gpu-memory``) and loading (the machine's own GPUs).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lssp.errors import UserError
from lssp.models.registry import ModelSpec

GiB = 2**30
PRECISIONS = ("16-bit", "8-bit", "4-bit")
# bitsandbytes stores 4-bit weights with one float32 scale per block of 64: 0.5 + 4/64 bytes a weight.
BYTES_PER_WEIGHT = {"16-bit": 2.0, "8-bit": 1.0, "4-bit": 0.5 + 4 / 64}
OFF_GPU = ("cpu", "disk")


def precision_of(spec: ModelSpec) -> str:
    """The storage precision an entry loads in: bitsandbytes 8-bit or 4-bit, else 16-bit."""
    return {"8bit": "8-bit", "4bit": "4-bit"}.get(spec.quantization, "16-bit")


def model_config(spec: ModelSpec) -> Any:
    """The transformers config of an entry, read without downloading weights.

    Random entries have theirs; others come from their folder, GGUF file or the hub cache.
    Where none is at hand (a hub model never downloaded), an architecture name in the entry's
    ``config`` stands in for it.
    """
    from transformers import AutoConfig

    from lssp.models.sources import model_source, random_config

    if spec.is_random or (spec.config and not spec.available_locally()):
        return random_config(spec)
    try:
        where, extra = model_source(spec)
        return AutoConfig.from_pretrained(where, **extra)
    except (OSError, ValueError) as exc:
        if spec.config:
            return random_config(spec)
        raise UserError(f"model {spec.name!r}: cannot read its config offline ({str(exc).splitlines()[0]}); "
                        "add 'config: <architecture>' to its entry (lssp/models/architectures.yaml lists them)") from None


def empty_model(config: Any, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model with every weight on the meta device (no memory), buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _dtypes(model: nn.Module, precision: str) -> tuple[Any, dict[str, Any]]:
    """accelerate's dtype and special_dtypes for weights stored at ``precision``: bitsandbytes
    quantizes the Linear layers of the decoder only; embeddings, norms and the output layer stay 16-bit."""
    if precision == "16-bit":
        return None, {}  # each weight's own dtype (the model is built in the dtype it will load in)
    from accelerate.utils import CustomDtype

    quantized = torch.int8 if precision == "8-bit" else CustomDtype.INT4
    output = model.get_output_embeddings()
    kept = {f"{name}.{p}": torch.bfloat16 for name, module in model.named_modules()
            if not isinstance(module, nn.Linear) or module is output
            for p, _ in module.named_parameters(recurse=False)}
    return quantized, kept


def weight_bytes(model: nn.Module, precision: str) -> int:
    """Bytes of the weights stored at ``precision`` (4-bit with its block scales; 16-bit: their own dtype)."""
    output = model.get_output_embeddings()
    total = 0.0
    for module in model.modules():
        quantized = isinstance(module, nn.Linear) and module is not output and precision != "16-bit"
        for p in module.parameters(recurse=False):
            total += p.numel() * (BYTES_PER_WEIGHT[precision] if quantized else p.element_size())
    return int(total)


def kv_bytes_per_token(config: Any, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token adds (keys and values of every layer, 16-bit)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * bytes_per_value


@dataclass
class Placement:
    """Where one model's blocks go and what each device then holds."""

    name: str
    precision: str
    weight_bytes: int
    device_map: dict[str, int | str]
    bytes_per_device: dict[int | str, int] = field(default_factory=dict)

    @property
    def missing_bytes(self) -> int:
        """Bytes that found no room on a GPU."""
        return sum(b for d, b in self.bytes_per_device.items() if d in OFF_GPU)

    @property
    def fits(self) -> bool:
        return self.missing_bytes == 0

    @property
    def gpus(self) -> list[int]:
        return sorted(d for d in self.bytes_per_device if isinstance(d, int))

    def blocks(self) -> list[tuple[str, int | str]]:
        """(module range, device) in model order, runs of numbered layers merged: ("model.layers.0-9", 0)."""
        merged: list[tuple[str, int | str]] = []
        run: tuple[str, int, int, int | str] | None = None  # prefix, first, last, device
        for module, device in self.device_map.items():
            m = re.fullmatch(r"(.*\.)(\d+)", module)
            if m and run and run[0] == m[1] and run[3] == device and int(m[2]) == run[2] + 1:
                run = (run[0], run[1], int(m[2]), device)
                continue
            if run:
                merged.append(_run_name(run))
            run = (m[1], int(m[2]), int(m[2]), device) if m else None
            if not m:
                merged.append((module, device))
        if run:
            merged.append(_run_name(run))
        return merged


def _run_name(run: tuple[str, int, int, int | str]) -> tuple[str, int | str]:
    prefix, first, last, device = run
    return (f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"), device


def _bytes_per_device(model: nn.Module, device_map: dict[str, int | str], precision: str) -> dict[int | str, int]:
    from accelerate.utils import compute_module_sizes

    dtype, special = _dtypes(model, precision)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
    per: dict[int | str, int] = defaultdict(int)
    for module, device in device_map.items():
        per[device] += int(sizes[module])
    return dict(per)


def place_target(model: nn.Module, name: str, precision: str, max_memory: dict[int | str, int]) -> Placement:
    """Balanced placement over the GPUs in ``max_memory`` (bytes each), as ``device_map="auto"`` does."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    dtype, special = _dtypes(model, precision)
    split = getattr(model, "_no_split_modules", None) or []
    balanced = get_balanced_memory(model, dict(max_memory), split, dtype, special)
    device_map = infer_auto_device_map(model, balanced, split, dtype, special)
    return Placement(name, precision, weight_bytes(model, precision), device_map,
                     _bytes_per_device(model, device_map, precision))


def emptiest(free: dict[int, int]) -> int:
    """The GPU with the most free bytes (ties: the lowest index): where a draft goes whole."""
    return max(sorted(free), key=lambda i: free[i])


def place_whole(model: nn.Module, name: str, precision: str, free: dict[int, int]) -> Placement:
    """The whole model on the emptiest GPU; "disk" where it has no room."""
    size = weight_bytes(model, precision)
    gpu = emptiest(free)
    device: int | str = gpu if size <= free[gpu] else "disk"
    return Placement(name, precision, size, {"": device}, {device: size})


@dataclass
class NodePlan:
    """Both models on a node of ``gpus`` GPUs of ``gpu_bytes`` each, ``reserve_bytes`` of each kept free."""

    gpus: int
    gpu_bytes: int
    reserve_bytes: int
    target: dict[str, Placement]  # by precision
    draft: dict[str, Placement]  # by the target's precision: placed after it
    kv_bytes_per_token: int = 0
    bandwidth: float = float("nan")  # bytes/s of one GPU (measured or given)

    @property
    def usable_bytes(self) -> int:
        return self.gpu_bytes - self.reserve_bytes

    def missing_bytes(self, precision: str) -> int:
        """Bytes of the target and the draft that find no room on a GPU at ``precision``."""
        draft = self.draft.get(precision)
        return self.target[precision].missing_bytes + (draft.missing_bytes if draft else 0)

    def fitting(self) -> str | None:
        """The widest precision at which the target (and the draft, if any) fit."""
        return next((p for p in PRECISIONS if not self.missing_bytes(p)), None)

    def floor_ms(self, placement: Placement) -> float:
        """Memory-bandwidth floor per forward: every weight read once, one GPU at a time (layers run in sequence)."""
        return 1000 * placement.weight_bytes / self.bandwidth if self.bandwidth == self.bandwidth else float("nan")


def plan_node(target: nn.Module, target_name: str, draft: nn.Module | None, draft_name: str | None, gpus: int,
              gpu_bytes: int, reserve_bytes: int, kv_per_token: int = 0,
              bandwidth: float = float("nan")) -> NodePlan:
    """Place the target at each precision, then the draft (same precision) whole on the emptiest GPU."""
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    usable = gpu_bytes - reserve_bytes
    if usable <= 0:
        raise UserError(f"--reserve ({reserve_bytes / GiB:.1f} GiB) leaves nothing of --gpu-memory ({gpu_bytes / GiB:.1f} GiB)")
    memory: dict[int | str, int] = {i: usable for i in range(gpus)}
    targets, drafts = {}, {}
    for precision in PRECISIONS:
        targets[precision] = placed = place_target(target, target_name, precision, memory)
        if draft is not None:
            free = {i: usable - placed.bytes_per_device.get(i, 0) for i in range(gpus)}
            drafts[precision] = place_whole(draft, draft_name or "draft", precision, free)
    return NodePlan(gpus, gpu_bytes, reserve_bytes, targets, drafts, kv_per_token, bandwidth)


def device_names(model: nn.Module) -> str:
    """The devices a model's weights are on, compactly: "cpu", "cuda:3", "cuda:0-3", "cuda:0,2+cpu"."""
    found = {p.device for p in model.parameters()}
    gpus = sorted(d.index or 0 for d in found if d.type == "cuda")
    others = sorted({d.type for d in found if d.type != "cuda"})
    names = []
    if gpus:
        consecutive = gpus == list(range(gpus[0], gpus[-1] + 1))
        names.append(f"cuda:{gpus[0]}" if len(gpus) == 1 else
                     f"cuda:{gpus[0]}-{gpus[-1]}" if consecutive else "cuda:" + ",".join(map(str, gpus)))
    return "+".join(names + others)


def parse_bytes(text: str, option: str) -> int:
    """"40GiB", "80GB", "512MiB" or a number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"{option} {text!r}: expected a size such as 40GiB or 80GB")
    unit = (m[2] or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m[1]) * scale)
