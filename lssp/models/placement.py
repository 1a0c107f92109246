"""Where models go on a node of GPUs: worked out on the meta device before anything is loaded.

The target is spread over the GPUs by accelerate's balanced placement (what transformers'
``device_map="auto"`` does, within the entry's ``max_memory`` if it has one); the draft is kept
whole on the GPU with the most memory left after the target. The same rules serve ``plan`` (a
node described by ``--gpus`` and ``--gpu-memory``) and loading (the machine's own GPUs); where
they leave the draft no room, ``plan`` keeps its room first and says which ``max_memory`` line
makes loading do the same.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lssp.errors import UserError
from lssp.models.registry import GPU_WEIGHT_ONLY, ModelSpec

GiB = 2**30
PRECISIONS = ("16-bit", "8-bit", "4-bit")
# bitsandbytes stores 4-bit weights with one float32 scale per block of 64: 0.5 + 4/64 bytes a weight.
BYTES_PER_WEIGHT = {"16-bit": 2.0, "8-bit": 1.0, "4-bit": 0.5 + 4 / 64}
OFF_GPU = ("cpu", "disk")


def precision_of(spec: ModelSpec) -> str:
    """The storage precision an entry loads in on GPUs: bitsandbytes 8-bit or 4-bit (a weight-only entry's there
    too), else 16-bit."""
    bitsandbytes = GPU_WEIGHT_ONLY.get(spec.quantization, spec.quantization)
    return {"8bit": "8-bit", "4bit": "4-bit"}.get(bitsandbytes, "16-bit")


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
    except (OSError, ValueError, UserError) as exc:
        if spec.config:
            return random_config(spec)
        if isinstance(exc, UserError) and spec.local_path() is not None:
            raise
        why = str(exc) if isinstance(exc, UserError) else (
            f"model {spec.name!r}: cannot read its config offline ({str(exc).splitlines()[0]})")
        raise UserError(f"{why}; add 'config: <architecture>' to its entry (lssp/models/architectures.yaml lists "
                        "them)") from None


def empty_model(config: Any, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model with every weight on the meta device (no memory), buffers real, and its output layer tied to
    its embeddings where the config says so (else a tied model would be counted with two copies)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


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


def place_target(model: nn.Module, name: str, precision: str, max_memory: dict[int | str, int | str],
                 balanced: bool = True) -> Placement:
    """Placement over the GPUs in ``max_memory`` (bytes each, or sizes such as "38GiB"): balanced, as ``device_map="auto"`` does, or filling
    each in turn, as ``device_map="sequential"`` does."""
    from accelerate.utils import convert_file_size_to_int, infer_auto_device_map

    max_memory = {k: convert_file_size_to_int(v) for k, v in max_memory.items()}  # "38GiB" as the registry says it
    dtype, special = _dtypes(model, precision)
    split = getattr(model, "_no_split_modules", None) or []
    budgets = balanced_budgets(model, max_memory, split, dtype, special) if balanced else dict(max_memory)
    device_map = infer_auto_device_map(model, budgets, split, dtype, special)
    return Placement(name, precision, weight_bytes(model, precision), device_map,
                     _bytes_per_device(model, device_map, precision))


def balanced_budgets(model: nn.Module, max_memory: dict[int | str, int], split: list[str], dtype: Any,
                     special: dict[str, Any]) -> dict[int | str, int]:
    """What transformers' ``device_map="auto"`` lets each GPU take: every GPU but the last is capped at an even
    share of the model plus a buffer (1.25 × its largest unsplittable block or parameter-holding module)."""
    from accelerate.utils import compute_module_sizes

    gpus = sorted(k for k, v in max_memory.items() if isinstance(k, int) and v > 0)
    if len(gpus) < 2:
        return dict(max_memory)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
    pieces = [sizes[name] for name, module in model.named_modules()
              if name and (type(module).__name__ in split or next(module.parameters(recurse=False), None) is not None)]
    share = sizes[""] // len(gpus) + int(1.25 * max(pieces, default=0))
    return {k: min(v, share) if k in gpus[:-1] else v for k, v in max_memory.items()}


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
    """Both models on a node of ``gpus`` GPUs of ``gpu_bytes`` each, ``reserve_bytes`` of each kept free.

    At each precision the target is placed within ``budgets`` (bytes per GPU: the usable memory, or what the
    target entry's ``max_memory`` allows), then the draft whole beside it on the GPU with the most room left. Where
    that leaves the draft no room, its room is kept first on one GPU and the target placed in the rest
    (``draft_first``): loading does the same when the target's entry carries ``max_memory_line``.
    """

    gpus: int
    gpu_bytes: int
    reserve_bytes: int
    target: dict[str, Placement]  # by precision
    draft: dict[str, Placement]  # by the target's precision: placed after it
    kv_bytes_per_token: int = 0
    bandwidth: float = float("nan")  # bytes/s of one GPU (measured or given)
    budgets: dict[str, dict[int, int]] = field(default_factory=dict)  # by precision: what the target was allowed
    draft_first: dict[str, bool] = field(default_factory=dict)  # by precision: the draft's room kept before
    entry_max_memory: bool = False  # the budgets come from the target entry's max_memory
    gpus_needed: dict[str, int | None] = field(default_factory=dict)  # by precision that does not fit: GPUs that do
    fits_within: dict[str, dict[int, int]] = field(default_factory=dict)  # by precision the entry's max_memory stops
    sequential_fits: dict[str, bool] = field(default_factory=dict)  # ... and that device_map: sequential would fit
    balanced: bool = True  # the target spread evenly (device_map auto), else filling each GPU in turn (sequential)

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

    def max_memory_line(self, precision: str) -> str | None:
        """The ``max_memory`` the target's entry needs for loading to place it as planned at ``precision``; None
        where its entry as it is does (the balanced placement, or its own max_memory)."""
        return max_memory_line(self.budgets[precision]) if self.draft_first.get(precision) else None

    def other_max_memory_line(self, precision: str) -> str | None:
        """Where the entry's own max_memory is what stops the pair fitting at ``precision``: one that fits."""
        budgets = self.fits_within.get(precision)
        return max_memory_line(budgets) if budgets else None

    def floor_ms(self, placement: Placement) -> float:
        """Memory-bandwidth floor per forward: every weight read once, one GPU at a time (layers run in sequence)."""
        return 1000 * placement.weight_bytes / self.bandwidth if self.bandwidth == self.bandwidth else float("nan")


def format_gib(n: int) -> str:
    """Bytes as a max_memory value: 78GiB, 63.5GiB."""
    return f"{int(n / GiB * 10 + 1e-6) / 10:g}GiB"


def max_memory_line(budgets: dict[int, int]) -> str:
    """A registry line that gives the target these bytes per GPU: max_memory: {0: 63GiB, 1: 78GiB}."""
    return "max_memory: {" + ", ".join(f"{i}: {format_gib(b)}" for i, b in sorted(budgets.items())) + "}"


def _floor_gib(n: float) -> int:
    """Down to a tenth of a GiB, so that a max_memory line says exactly what was planned."""
    return int(n / GiB * 10) * GiB // 10


@dataclass
class PairPlan:
    """The target and the draft at one precision, and the budgets the target was placed within."""

    target: Placement
    draft: Placement | None
    budgets: dict[int, int]
    draft_first: bool = False

    @property
    def fits(self) -> bool:
        return self.target.fits and (self.draft is None or self.draft.fits)


def _beside(target: nn.Module, t_name: str, draft: nn.Module | None, d_name: str, precision: str,
            budgets: dict[int, int], usable: dict[int, int], balanced: bool, draft_first: bool = False) -> PairPlan:
    """The target within ``budgets``, then the draft whole on the GPU with the most of ``usable`` left."""
    placed = place_target(target, t_name, precision, dict(budgets), balanced)
    d = None
    if draft is not None:
        free = {i: room - placed.bytes_per_device.get(i, 0) for i, room in usable.items()}
        d = place_whole(draft, d_name, precision, free)
    return PairPlan(placed, d, budgets, draft_first)


def place_pair(target: nn.Module, t_name: str, draft: nn.Module | None, d_name: str, precision: str,
               budgets: dict[int, int], usable: dict[int, int], balanced: bool = True) -> PairPlan:
    """The draft beside the target as loading places them; where it then has no room, its room kept first on
    one GPU (each tried in turn) and the target placed in what is left."""
    pair = _beside(target, t_name, draft, d_name, precision, budgets, usable, balanced)
    if pair.fits or draft is None:
        return pair
    size = weight_bytes(draft, precision)
    for gpu in sorted(budgets):
        kept = {i: _floor_gib(min(b, usable[i] - size) if i == gpu else b) for i, b in budgets.items()}
        if kept[gpu] <= 0:
            continue
        tried = _beside(target, t_name, draft, d_name, precision, kept, usable, balanced, draft_first=True)
        if tried.fits:
            return tried
    return pair


def gpus_needed(target: nn.Module, draft: nn.Module | None, precision: str, gpus: int, usable: int,
                tries: int = 8) -> int | None:
    """The fewest GPUs of ``usable`` bytes (more than ``gpus``) on which the pair fits at ``precision``."""
    total = weight_bytes(target, precision) + (weight_bytes(draft, precision) if draft is not None else 0)
    first = max(gpus + 1, -(-total // usable))
    for n in range(first, first + tries):
        budgets = {i: usable for i in range(n)}
        if place_pair(target, "target", draft, "draft", precision, budgets, budgets).fits:
            return n
    return None


def entry_budgets(max_memory: dict[str, str] | None, gpus: int, usable: int) -> dict[int, int] | None:
    """Bytes per GPU an entry's ``max_memory`` allows on a node of ``gpus`` (each at most ``usable``); None when
    it names no GPU of the node."""
    if not max_memory:
        return None
    budgets = {int(k): min(usable, parse_bytes(v, f"max_memory {k}")) for k, v in max_memory.items()
               if str(k).isdigit() and int(k) < gpus}
    return budgets or None


def plan_node(target: nn.Module, target_name: str, draft: nn.Module | None, draft_name: str | None, gpus: int,
              gpu_bytes: int, reserve_bytes: int, kv_per_token: int = 0, bandwidth: float = float("nan"),
              max_memory: dict[str, str] | None = None, device_map: str | None = None) -> NodePlan:
    """Place the pair at each precision (``place_pair``), the target within its entry's ``max_memory`` if it has
    one (filling the GPUs in turn where its ``device_map`` is sequential, else balanced); for a precision that does
    not fit, how many GPUs of this size would, and whether another max_memory or device_map would."""
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    usable = gpu_bytes - reserve_bytes
    if usable <= 0:
        raise UserError(f"--reserve ({reserve_bytes / GiB:.1f} GiB) leaves nothing of --gpu-memory ({gpu_bytes / GiB:.1f} GiB)")
    room = {i: usable for i in range(gpus)}
    budgets = entry_budgets(max_memory, gpus, usable)
    balanced = device_map != "sequential"
    node = NodePlan(gpus, gpu_bytes, reserve_bytes, {}, {}, kv_per_token, bandwidth, entry_max_memory=bool(budgets),
                    balanced=balanced)
    names = (target_name, draft_name or "draft")
    for precision in PRECISIONS:
        pair = place_pair(target, names[0], draft, names[1], precision, budgets or room, room, balanced)
        node.target[precision], node.budgets[precision] = pair.target, pair.budgets
        node.draft_first[precision] = pair.draft_first
        if pair.draft is not None:
            node.draft[precision] = pair.draft
        if pair.fits:
            continue
        if budgets:  # is it the entry's max_memory, or balancing within it, that stops it?
            node.sequential_fits[precision] = balanced and place_pair(
                target, names[0], draft, names[1], precision, budgets, room, balanced=False).fits
            whole = {i: _floor_gib(usable) for i in room}
            freed = place_pair(target, names[0], draft, names[1], precision, whole, room, balanced)
            if freed.fits:
                node.fits_within[precision] = freed.budgets
        node.gpus_needed[precision] = gpus_needed(target, draft, precision, gpus, usable)
    return node


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


def parse_size(text: str, option: str) -> tuple[int, bool]:
    """A size where a bare number means GiB (``--gpu-memory 40``): the bytes, and whether GiB was assumed."""
    if re.fullmatch(r"\s*[\d.]+\s*", text):
        return parse_bytes(text.strip() + "GiB", option), True
    return parse_bytes(text, option), False


def parse_bytes(text: str, option: str) -> int:
    """"40GiB", "80GB", "512MiB" or a number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"{option} {text!r}: expected a size such as 40GiB or 80GB")
    unit = (m[2] or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m[1]) * scale)
