"""A compact forward for small Llama models: the same math as transformers' LlamaForCausalLM
with a fraction of its per-call Python work.

A 4-layer, hidden-256 draft spends most of a transformers forward outside its matmuls
(mask building, rotary recomputation, cache bookkeeping, one call per projection), which
decides its cost ratio c to the target. ``CompactLlama`` runs each layer's projections as
four Linears (q|k|v fused, o, gate|up fused, down), calls the model's own output layer,
and keeps keys and values in one preallocated buffer that ``crop`` rolls back. The fused
layers are plain Linears, so a dynamic quantization applied afterwards covers them too.
Set ``forward: compact`` on a registry entry to use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


class CompactCache:
    """Keys and values of every layer in one growing buffer (batch, layers, heads, positions, head_dim).

    It answers what the samplers ask of a transformers DynamicCache: ``get_seq_length``
    and ``crop`` (a negative argument drops that many positions).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256) -> None:
        self.keys = torch.empty(2, layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        self.length = max(0, self.length + max_length if max_length < 0 else min(max_length, self.length))

    def reserve(self, total: int) -> None:
        """Room for ``total`` positions (the buffer doubles when it runs out)."""
        capacity = self.keys.shape[4]
        if total > capacity:
            grown = self.keys.new_empty(*self.keys.shape[:4], max(total, 2 * capacity), self.keys.shape[5])
            grown[:, :, :, :, :self.length] = self.keys[:, :, :, :, :self.length]
            self.keys = grown


def float_weight(linear: nn.Module) -> torch.Tensor:
    """The weight of a plain or dynamically quantized Linear as a float tensor."""
    weight = linear.weight() if callable(linear.weight) else linear.weight
    return weight.dequantize() if weight.is_quantized else weight


def fused_linear(*linears: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """One bias-free Linear whose output is the concatenated outputs of ``linears``."""
    weight = torch.cat([float_weight(lin).to(dtype) for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


@dataclass
class CompactOutput:
    logits: torch.Tensor


def supports_compact(model: PreTrainedModel) -> str | None:
    """None if ``model`` can run compact, else why not."""
    config = model.config
    if config.model_type != "llama":
        return f"model type {config.model_type!r} (only llama)"
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope['rope_type']!r} (only default)"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biased projections"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    projections = [module for layer in model.model.layers
                   for module in (*layer.self_attn.children(), *layer.mlp.children()) if hasattr(module, "in_features")]
    if not all(type(m) is nn.Linear or type(m).__module__.startswith("torch.ao.nn.quantized") for m in projections):
        return f"{type(projections[0]).__name__} projections (only float or torch dynamically quantized Linear layers)"
    return None


class CompactLlama(nn.Module):
    """Batch-1 forward of a LlamaForCausalLM over a CompactCache; ``hf`` is the model it wraps."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        reason = supports_compact(model)
        if reason:
            raise ValueError(f"'forward: compact' does not support {reason}")
        self.hf = model
        config = model.config
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim)),
            persistent=False,
        )
        dtype = self.get_input_embeddings().weight.dtype
        self.qkv = nn.ModuleList(fused_linear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj, dtype=dtype)
                                 for l in model.model.layers)
        self.o = nn.ModuleList(fused_linear(l.self_attn.o_proj, dtype=dtype) for l in model.model.layers)
        self.gate_up = nn.ModuleList(fused_linear(l.mlp.gate_proj, l.mlp.up_proj, dtype=dtype) for l in model.model.layers)
        self.down = nn.ModuleList(fused_linear(l.mlp.down_proj, dtype=dtype) for l in model.model.layers)
        self.to(self.get_input_embeddings().weight.device)

    @property
    def generation_config(self):  # noqa: ANN201 - transformers' GenerationConfig
        return self.hf.generation_config

    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def new_cache(self) -> CompactCache:
        weight = self.get_input_embeddings().weight
        return CompactCache(self.config.num_hidden_layers, self.kv_heads, self.head_dim, weight.dtype, weight.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype) * weight

    def forward(self, input_ids: torch.Tensor, past_key_values: CompactCache, use_cache: bool = True,
                logits_to_keep: int = 0) -> CompactOutput:
        if input_ids.shape[0] != 1:
            raise ValueError("the compact forward runs batch size 1")
        kv = past_key_values
        start, n = kv.length, input_ids.shape[1]
        end = start + n
        kv.reserve(end)
        hidden = self.hf.model.embed_tokens(input_ids)
        freqs = torch.arange(start, end, device=hidden.device, dtype=torch.float)[:, None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (n, 1, head_dim): broadcast over heads
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        # Queries see every cached position and the new ones up to their own.
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=hidden.device).tril(diagonal=start)
        half, rotated = self.head_dim // 2, self.heads + self.kv_heads
        for i, layer in enumerate(self.hf.model.layers):
            x = self._rms_norm(hidden, layer.input_layernorm.weight)
            qkv = self.qkv[i](x).view(1, n, rotated + self.kv_heads, self.head_dim)
            qk = qkv[:, :, :rotated]  # rotary position embedding on queries and keys at once
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            q = qk[:, :, :self.heads].transpose(1, 2)
            kv.keys[0, i, :, :, start:end] = qk[:, :, self.heads:].transpose(1, 2)
            kv.keys[1, i, :, :, start:end] = qkv[:, :, rotated:].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, kv.keys[0, i, :, :, :end], kv.keys[1, i, :, :, :end], attn_mask=mask, scale=self.scale,
                enable_gqa=self.kv_heads != self.heads,
            )
            hidden = hidden + self.o[i](out.transpose(1, 2).reshape(1, n, -1))
            x = self._rms_norm(hidden, layer.post_attention_layernorm.weight)
            gate, up = self.gate_up[i](x).chunk(2, dim=-1)
            hidden = hidden + self.down[i](F.silu(gate) * up)
        kv.length = end
        hidden = self._rms_norm(hidden[:, -logits_to_keep:] if logits_to_keep else hidden, self.hf.model.norm.weight)
        return CompactOutput(self.hf.lm_head(hidden))
