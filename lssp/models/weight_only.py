"""Weight-only quantization for a CPU: every Linear layer's weights in int4 groups or int8 rows, multiplied by torch's
weight-only kernels without widening them (``torch.ops.aten._weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``).

int4: groups of 32 input weights, each with a scale and a zero (w = (q - 8) * scale + zero, q in 0..15): the layout of
a GGUF's Q4_1 blocks (w = q * d + m, so scale = d and zero = m + 8d). The weights are quantized again from the
loaded (dequantized) ones, each group over its own minimum and maximum. int8: one scale per output row. Activations
enter the kernels in bfloat16 (their float32 paths are an order of magnitude slower); the layers take and return the
model's dtype.
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


def packable(linear: nn.Module, kind: str) -> bool:
    """Whether ``linear`` is a plain bias-free Linear the ``kind`` kernel takes (int4: input width a multiple of the
    group, output width of 16)."""
    if type(linear) is not nn.Linear or linear.bias is not None:
        return False
    return kind == "int8" or (linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0)


def weight_only_quantize(model: nn.Module, kind: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, int]:
    """Every packable Linear of ``model`` (on the CPU) replaced by its ``kind`` (int4 or int8) weight-only layer, the
    rest of the model in ``dtype``; returns the model and how many layers stayed float (shapes the kernel refuses)."""
    model = model.to(dtype)
    make = Int4Linear if kind == "int4" else Int8Linear
    kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                if packable(child, kind):
                    setattr(parent, name, make(child.weight))
                else:
                    kept += 1
    return model, kept
