"""Quantized Linear layers for a CPU: every Linear layer's weights in int4 groups or int8 rows, multiplied by torch's
weight-only kernels without widening them (``torch.ops.aten._weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``), or
in Q4_1 groups (the output layer in Q8_0) multiplied by our own kernel with int8 activations (``q4_1``:
``lssp.kernels``).

int4: groups of 32 input weights, each with a scale and a zero (w = (q - 8) * scale + zero, q in 0..15): the layout of
a GGUF's Q4_1 blocks (w = q * d + m, so scale = d and zero = m + 8d). The weights are quantized again from the
loaded (dequantized) ones, each group over its own minimum and maximum. int8: one scale per output row. Activations
enter the kernels in bfloat16 (their float32 paths are an order of magnitude slower); the layers take and return the
model's dtype.

q4_1: a GGUF's arithmetic, as llama.cpp computes it. Weights in groups of 32, w = q * d + m with d = (max - min) / 15
and m = min stored in fp16 (Q4_1; the output layer in Q8_0, w = q8 * d, as the default target's GGUF stores it): from
a GGUF loaded in float32 this gives back its blocks exactly. Activations are quantized to int8 in groups of 32 at each
call (llama.cpp's Q8_1). Each row's result does not depend on the other
rows of the call, so a verification forward reproduces the one-token forward's numbers.
"""
from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32
KERNEL_DTYPE = torch.bfloat16


class Int4Linear(nn.Module):
    """A bias-free Linear whose weight is packed int4 in groups of ``INT4_GROUP`` input weights."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features, self.group = in_features, out_features, group
        grouped = weight.detach().float().reshape(out_features, in_features // group, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 1)
        self.register_buffer("packed", packed)
        zero = low + 8 * scale
        self.register_buffer("scale_zero", torch.stack([scale.t(), zero.t()], -1).contiguous().to(KERNEL_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scale_zero)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight it multiplies by, as a float tensor (out, in)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero)
        return out.t().float()


class Int8Linear(nn.Module):
    """A bias-free Linear whose weight is int8 with one scale per output row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scale.float()[:, None]


def q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) as llama.cpp quantizes a Q4_1 tensor: q (N, K) uint8 in 0..15, and per group of 32 d and m
    (N, K/32) float32 holding fp16 values, w ~ q * d + m."""
    grouped = weight.detach().float().reshape(weight.shape[0], -1, INT4_GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.floor((grouped - low[..., None]) * inverse[..., None] + 0.5).clamp(0, 15)
    return q.to(torch.uint8).reshape(weight.shape), d.half().float(), low.half().float()


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) as llama.cpp quantizes a Q8_0 tensor (w ~ q8 * d, q8 in -127..127), in ``q4_1_blocks``'s
    form: q = q8 + 128 (uint8) and m = -128 d."""
    grouped = weight.detach().float().reshape(weight.shape[0], -1, INT4_GROUP)
    d = grouped.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    scaled = grouped * inverse[..., None]
    q8 = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127)  # C's roundf: halves away from zero
    d = d.half().float()
    return (q8 + 128).to(torch.uint8).reshape(weight.shape), d, -128 * d


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """(N, G) -> (N/16, G, 16): per-group values of each block of 16 rows side by side."""
    return t.reshape(t.shape[0] // 16, 16, t.shape[1]).transpose(1, 2).contiguous()


class BlockLinear(nn.Module):
    """A bias-free Linear in groups of 32 weights, 4-bit (Q4_1) or 8-bit (Q8_0), multiplied by our kernel
    ``torch.ops.lssp.block_mm`` with int8 activations (AVX512-VNNI or AVX2, ``lssp.kernels``)."""

    def __init__(self, weight: torch.Tensor, bits: int = 4) -> None:
        super().__init__()
        from lssp.kernels import block_kernel
        from lssp.models.sources import cache_root

        block_kernel(cache_root() / "kernels")
        self.out_features, self.in_features = weight.shape
        self.bits = bits
        self.in_arena = False  # its weights moved into a buffer of huge pages (into_arena)
        q, d, m = q4_1_blocks(weight) if bits == 4 else q8_0_blocks(weight)
        # The kernel's layout: blocks of 16 rows, each 64 bytes holding 4 (8-bit) or 8 (4-bit) inputs of every row.
        if bits == 4:
            b = q.reshape(self.out_features // 16, 16, self.in_features // 8, 2, 4)
            b = b[:, :, :, 0] | (b[:, :, :, 1] << 4)  # inputs 8c+j (low nibble) and 8c+4+j (high)
        else:
            b = q.reshape(self.out_features // 16, 16, self.in_features // 4, 4)
        self.register_buffer("packed", b.permute(0, 2, 1, 3).reshape(self.out_features, -1).contiguous())
        self.register_buffer("scales", _rows16(d).half())  # fp16 values: exact
        self.register_buffer("mins", _rows16(m).half())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.lssp.block_mm(x.reshape(-1, self.in_features), self.packed, self.scales, self.mins)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """packed, scales, mins: what ``torch.ops.lssp`` kernels take."""
        return self.packed, self.scales, self.mins

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (N, K) uint8, d and m (N, K/32) float32: what the layer holds, in the weight's own layout."""
        n, k = self.out_features, self.in_features
        b = self.packed.reshape(n // 16, -1, 16, 4).permute(0, 2, 1, 3)  # (N/16, 16, chunks, 4)
        q = torch.stack([b & 15, b >> 4], dim=3) if self.bits == 4 else b
        unblock = lambda t: t.float().transpose(1, 2).reshape(n, -1)  # noqa: E731
        return q.reshape(n, k), unblock(self.scales), unblock(self.mins)

    def dequantized(self) -> torch.Tensor:
        q, d, m = self.blocks()
        grouped = q.float().reshape(self.out_features, -1, INT4_GROUP)
        return (grouped * d[..., None] + m[..., None]).reshape(self.out_features, self.in_features)


def stacked_blocks(*layers: BlockLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed, scales, mins of one layer whose outputs are those of ``layers`` in turn (inputs as wide and bits
    alike: each output row's blocks are its own, so this is the concatenated weight's quantization)."""
    if len({(m.in_features, m.bits) for m in layers}) != 1:
        raise ValueError("stacked layers take inputs as wide, in blocks of as many bits")
    return tuple(torch.cat(parts) for parts in zip(*(m.weights() for m in layers)))  # type: ignore[return-value]


def into_arena(layers: list[BlockLinear]) -> None:
    """Move the weights of ``layers`` into one buffer of huge pages (``torch.ops.lssp.arena``), in the order given
    (the order a forward reads them): streaming them then misses the TLB once per 2 MiB, not per 4 KiB (~10% of a
    forward of the default target on an AMD EPYC). Layers already moved stay where they are."""
    layers = [layer for layer in layers if not layer.in_arena]
    padded = lambda t: (t.numel() * t.element_size() + 63) // 64 * 64  # noqa: E731 - 64-byte aligned slots
    arena = torch.ops.lssp.arena(sum(padded(t) for layer in layers for t in layer.weights()))
    offset = 0
    for layer in layers:
        views = []
        for t in layer.weights():
            view = arena[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            views.append(view.copy_(t))
            offset += padded(t)
        layer.packed, layer.scales, layer.mins = views
        layer.in_arena = True


def arena_huge_pages(model: nn.Module) -> float | None:
    """The share of ``model``'s weights arenas (``into_arena``) in huge pages; None where it has none (or off Linux)."""
    from lssp.kernels import huge_page_share

    arenas = {m.packed.untyped_storage().data_ptr(): m.packed.untyped_storage().nbytes()
              for m in model.modules() if isinstance(m, BlockLinear) and m.in_arena}
    return huge_page_share(list(arenas.items())) if arenas else None


def packable(linear: nn.Module, kind: str) -> bool:
    """Whether ``linear`` is a plain bias-free Linear the ``kind`` kernel takes (int4, q4_1: input width a multiple
    of the group, output width of 16)."""
    if type(linear) is not nn.Linear or linear.bias is not None:
        return False
    return kind == "int8" or (linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0)


WEIGHT_ONLY_LAYERS = {"int4": Int4Linear, "int8": Int8Linear, "q4_1": BlockLinear}
OUTPUT_LAYER = "lm_head"  # q4_1 keeps it in 8 bits (Q8_0), as the default target's GGUF does


def weight_only_quantize(model: nn.Module, kind: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, int]:
    """Every packable Linear of ``model`` (on the CPU) replaced by its ``kind`` (int4, int8, q4_1) layer, the rest of
    the model in ``dtype``; returns the model and how many layers stayed float (shapes the kernel refuses)."""
    model = model.to(dtype)
    make = WEIGHT_ONLY_LAYERS[kind]
    kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                if packable(child, kind):
                    eight = kind == "q4_1" and name == OUTPUT_LAYER
                    setattr(parent, name, make(child.weight, bits=8) if eight else make(child.weight))
                else:
                    kept += 1
    return model, kept
