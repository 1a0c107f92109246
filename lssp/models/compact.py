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

import itertools
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


class CompactCache:
    """Keys and values of each layer in preallocated buffers (batch, kv_heads, positions, head_dim) that grow by doubling.

    It answers what the samplers ask of a transformers DynamicCache: ``get_seq_length``
    and ``crop`` (a negative argument drops that many positions, 0 none). Each layer has
    buffers of its own, so a compiled step writes a few positions in place rather than
    copying one shared buffer.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256, buffers: list[torch.Tensor] | None = None, batch: int = 1) -> None:
        self.keys_values = buffers or [torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
                                       for _ in range(2 * layers)]  # layer i: keys at 2i, values at 2i + 1
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys_values[0].shape[2]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, tokens: int) -> None:
        """Drop the last ``-tokens`` positions (``tokens`` <= 0; 0 keeps all, as in transformers 5)."""
        if tokens > 0:
            raise ValueError(f"crop takes the negative number of positions to drop, got {tokens}")
        self.length = max(0, self.length + tokens)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (increasing indices) of the batch. The rows after the first one left move up in place,
        their filled positions only (rows leave a batch often: copying whole buffers cost more than a forward)."""
        batch = self.keys_values[0].shape[0]
        moved = next((i for i, row in enumerate(rows.tolist()) if row != i), len(rows))
        if len(rows) > batch or (len(rows) > 1 and bool((rows[1:] <= rows[:-1]).any())):
            raise ValueError("select takes increasing row indices")
        if moved < len(rows):
            for buffer in self.keys_values:
                buffer[moved:len(rows), :, :self.length] = buffer[rows[moved:], :, :self.length]
        self.keys_values = [buffer[:len(rows)] for buffer in self.keys_values]

    def add_rows(self, other: CompactCache, at: int) -> None:
        """Append ``other``'s rows to the batch, their positions at ``at`` .. ``at + other.length`` (zeros before them;
        this cache's length must reach that far). The buffers keep room for the rows ``select`` removed and double
        when that is not enough."""
        rows, end = self.keys_values[0].shape[0], at + other.length
        if end > self.length:
            raise ValueError(f"rows up to position {end} added to a cache of length {self.length}")
        added = other.keys_values[0].shape[0]
        for i, (mine, theirs) in enumerate(zip(self.keys_values, other.keys_values, strict=True)):
            base = mine if mine._base is None else mine._base  # select keeps the first rows of the same buffer
            if base.shape[0] < rows + added or base.shape[2] != mine.shape[2]:
                base = mine.new_empty(max(rows + added, 2 * rows), *mine.shape[1:])
                base[:rows, :, :self.length] = mine[:, :, :self.length]
            grown = base[:rows + added]
            grown[rows:, :, :at] = 0
            grown[rows:, :, at:end] = theirs[:, :, :other.length]
            self.keys_values[i] = grown

    def reserve(self, total: int) -> None:
        """Room for ``total`` positions (the buffers double when they run out)."""
        if total > self.capacity:
            size = max(total, 2 * self.capacity)
            for i, old in enumerate(self.keys_values):
                grown = old.new_zeros(*old.shape[:2], size, old.shape[3])
                grown[:, :, :self.length] = old[:, :, :self.length]
                self.keys_values[i] = grown


def float_weight(linear: nn.Module) -> torch.Tensor:
    """The weight of a plain, dynamically quantized or weight-only (``dequantized``) Linear as a float tensor."""
    if hasattr(linear, "dequantized"):
        return linear.dequantized()
    weight = linear.weight() if callable(linear.weight) else linear.weight
    return weight.dequantize() if weight.is_quantized else weight


def fused_linear(*linears: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """One bias-free Linear whose output is the concatenated outputs of ``linears``."""
    weight = torch.cat([float_weight(lin).to(dtype) for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` without nn.Module's call machinery, a few microseconds a call (7% of a draft forward)."""
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight)
    packed = getattr(layer, "_packed_params", None)
    if packed is not None and packed.dtype == torch.float16:  # the op torch's dynamic fp16 Linear calls
        return torch.ops.quantized.linear_dynamic_fp16(x, packed._packed_params)
    return layer.forward(x)  # weight-only (lssp.models.weight_only) or dynamic int8


STEP_TOKENS = 16  # compiled: forwards of up to this many tokens after the prefill (decode, verification)
RECOMPILE_LIMIT = 64
COMPILED_CAPACITY = 1024  # compiled: positions each cache buffer holds (it doubles, and recompiles, if outgrown)


def _static(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` marked as an address that never changes (CUDA graphs then record the compiled step's in-place
    cache writes instead of skipping the graph, "mutated inputs") and as a shape that never changes (its guards are
    then a few equality checks, not symbolic ones)."""
    import torch._dynamo

    torch._dynamo.mark_static_address(buffer)
    torch._dynamo.mark_static(buffer)
    return buffer


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process: a rise while timing means recompiles were timed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_compiled_models = itertools.count()


def _arguments_only(entries: Sequence[Any]) -> list[bool]:
    """Guards torch.compile keeps on a model's compiled step: those on its arguments, none on the model's attributes
    (its layers, weights and settings never change once loaded, and each model compiles a code object of its own,
    ``_own_step``). Checking those took 1.1 ms of every 8 ms one-token step of the default target on a CPU (~3,000
    guards)."""
    return [not entry.name.startswith("self.") for entry in entries]


def _own_step(model: CompactLlama) -> Any:
    """``model._step`` as a method whose code object is this model's alone: torch.compile keeps its graphs per code
    object, so no other model, of whatever layers, can run them (and each has its own recompile budget)."""
    step = CompactLlama._step
    code = step.__code__.replace(co_name=f"_step_of_model_{next(_compiled_models)}")
    return types.MethodType(types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__,
                                               step.__closure__), model)


@dataclass(frozen=True)
class FusedOutput:
    """What the one-call decoder also computes after its layers: the final ``norm`` (None: none), the output layer
    (its kernel weights: packed, scales, mins) over each row's last ``keep`` positions (0: all)."""

    norm: torch.Tensor | None
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    keep: int = 0


@dataclass
class CompactOutput:
    logits: torch.Tensor
    # final hidden states (after the last norm), when asked for, after the hidden states of the model's
    # ``feature_layers`` where it has some: (batch, n, (len(feature_layers) + 1) x width)
    features: torch.Tensor | None = None


class Layered(NamedTuple):
    """What the decoder layers give: the last hidden states, logits where the output layer ran with them (else None),
    and the hidden states after each tapped layer, in layer order."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    tapped: list[torch.Tensor]


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


class FusedDecoder(nn.Module):
    """Llama decoder layers run through fused Linears over a CompactCache (batch 1, rows of equal length at equal
    positions, or rows at positions of their own under a mask). A layer whose ``input_layernorm`` is an ``nn.Identity`` skips that norm (an EAGLE head's
    first layer)."""

    def __init__(self, config: Any, layers: Sequence[nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        rotary = LlamaRotaryEmbedding(config)  # its frequencies, for any rope type transformers knows (llama3, ...)
        self.register_buffer("inv_freq", rotary.inv_freq.float().clone(), persistent=False)
        self.rope_scale = float(rotary.attention_scaling)
        self.decoder_layers = list(layers)  # the modules they were built from (their norms are read at each call)
        self.qkv = nn.ModuleList(fused_linear(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, dtype=dtype)
                                 for layer in layers)
        self.o = nn.ModuleList(fused_linear(layer.self_attn.o_proj, dtype=dtype) for layer in layers)
        self.gate_up = nn.ModuleList(fused_linear(layer.mlp.gate_proj, layer.mlp.up_proj, dtype=dtype) for layer in layers)
        self.down = nn.ModuleList(fused_linear(layer.mlp.down_proj, dtype=dtype) for layer in layers)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # Each query attends by itself, as in a one-token forward of its row (set for q4_1: its int8 activations turn
        # the rounding differences of a batched attention into different tokens).
        self.row_attention = False
        # The cache's element type where not the model's own (float16 halves what attention reads over a long cache;
        # set for the one-call decoder only, which reads and writes it).
        self.cache_dtype: torch.dtype | None = None

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == weight.dtype == torch.float32:  # one fused call
            return F.rms_norm(x, weight.shape, weight, eps=self.eps)
        return F.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype) * weight

    def _rotary(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of positions start..end-1, (1, positions, head_dim), from a table that doubles as needed.

        The sin table is negated on its first half, so rotating x is x*cos + swap_halves(x)*sin.
        """
        table = self._rope_upto(end, like)
        return table[0][:, start:end], table[1][:, start:end]

    def _rope_upto(self, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rotary``'s whole tables (1, >= end, head_dim), like ``like``'s dtype and device."""
        table = self._rope
        if table is None or table[0].shape[1] < end or table[0].device != like.device or table[0].dtype != like.dtype:
            size = max(256, 2 * end)
            freqs = torch.arange(size, device=like.device, dtype=torch.float)[:, None] * self.inv_freq.to(like.device)
            cos, sin = freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
            table = self._rope = (torch.cat((cos, cos), -1)[None].to(like.dtype), torch.cat((-sin, sin), -1)[None].to(like.dtype))
        return table

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                keys_values: list[torch.Tensor], at: slice | torch.Tensor, upto: int | None,
                output: FusedOutput | None = None, taps: Sequence[int] = (), used: torch.Tensor | None = None) -> Layered:
        """The decoder over ``hidden`` (batch, n, width) with rotary ``cos``/``sin`` of its positions (shared, or per
        row): keys and values written at ``at``, queries attending over the first ``upto`` cached positions (None: the whole buffer) under
        ``mask`` (None: all of them; bool: True where allowed; float: additive). With ``row_attention`` set each query
        attends by itself (``torch.ops.lssp.row_attention``). Returns the last hidden states (before any final
        norm) and None, or where the layers run in one call and ``output`` is given, the final hidden states after
        its norm and its logits; and the hidden states after each layer of ``taps``. ``used`` (batch, n) bool: False
        at a batch's holes, which the one-call decoder does not compute (zeros there; the eager layers compute them
        anyway, and no caller reads them)."""
        batch, n = hidden.shape[:2]
        if isinstance(at, slice) and self._one_call_over(hidden, keys_values[0]):
            return self._block_layers(hidden, cos, sin, mask, keys_values, at.start, output, taps, used)
        tapped = []
        heads, half, rotated = self.heads, self.head_dim // 2, self.heads + self.kv_heads
        # The query heads sharing a key/value head attend as one longer query over it (the mask repeated per head):
        # the same scores as SDPA's enable_gqa, up to 6x faster on a CPU in batched decoding.
        grouped = (batch, self.kv_heads, heads // self.kv_heads * n, self.head_dim)
        if mask is not None and heads != self.kv_heads:
            mask = mask.repeat(*([1] * (mask.dim() - 2)), heads // self.kv_heads, 1)
        allowed = None
        if self.row_attention and mask is not None:  # (B or 1, rows, slots): bool, or additive (B, 1, rows, slots)
            allowed = mask[None] if mask.dtype == torch.bool else (mask == 0)[:, 0]
        for i, layer in enumerate(self.decoder_layers):
            keys, values = keys_values[2 * i], keys_values[2 * i + 1]
            norm = layer.input_layernorm
            x = hidden if isinstance(norm, nn.Identity) else self._rms_norm(hidden, norm.weight)
            qkv = _linear(self.qkv[i], x).view(batch, n, -1, self.head_dim).transpose(1, 2)
            qk = qkv[:, :rotated]  # (1, heads + kv_heads, n, head_dim): rotary embedding on queries and keys at once
            qk = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)
            keys[:, :, at] = qk[:, heads:]
            values[:, :, at] = qkv[:, rotated:]
            if self.row_attention:
                out = torch.ops.lssp.row_attention(qk[:, :heads].reshape(grouped), keys[:, :, :upto], values[:, :, :upto],
                                                   allowed, self.scale)
            else:
                out = F.scaled_dot_product_attention(qk[:, :heads].reshape(grouped), keys[:, :, :upto],
                                                     values[:, :, :upto], attn_mask=mask, scale=self.scale)
            # reshape, not view: CUDA's attention kernels may return the grouped heads in another memory layout
            hidden = hidden + _linear(self.o[i], out.reshape(batch, heads, n, -1).transpose(1, 2).reshape(batch, n, -1))
            x = self._rms_norm(hidden, layer.post_attention_layernorm.weight)
            gate, up = _linear(self.gate_up[i], x).chunk(2, dim=-1)
            hidden = hidden + _linear(self.down[i], F.silu(gate) * up)
            if i in taps:
                tapped.append(hidden)
        return Layered(hidden, None, tapped)

    def _one_call_over(self, hidden: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether ``_layers`` runs ``hidden`` over a cache like ``keys`` in one call of our kernel (causal where no
        mask is given)."""
        return (self._block_stack() is not None and hidden.dtype == torch.float32
                and keys.dtype in (torch.float32, torch.float16))

    def _block_stack(self) -> list[torch.Tensor] | None:
        """Every layer's norms and block weights for ``torch.ops.lssp.decoder``, when each Linear is a q4_1 layer
        (``BlockLinear``) and queries attend by themselves; else None. Built once."""
        if "_stack" not in self.__dict__:
            from lssp.models.weight_only import BlockLinear, into_arena

            linears = [*self.qkv, *self.o, *self.gate_up, *self.down]
            ok = self.row_attention and all(type(lin) is BlockLinear for lin in linears)
            stack: list[torch.Tensor] | None = [] if ok else None
            if ok:
                output = [m for m in self.get_output_embeddings().modules() if type(m) is BlockLinear]
                into_arena([lin for i in range(len(self.qkv)) for lin in (self.qkv[i], self.o[i], self.gate_up[i],
                                                                          self.down[i])] + output)
            for i, layer in enumerate(self.decoder_layers if ok else []):
                norm = layer.input_layernorm
                first = torch.empty(0) if isinstance(norm, nn.Identity) else norm.weight.detach().float().contiguous()
                stack += [first, *self.qkv[i].weights(), *self.o[i].weights(),
                          layer.post_attention_layernorm.weight.detach().float().contiguous(),
                          *self.gate_up[i].weights(), *self.down[i].weights()]
            self.__dict__["_stack"] = stack
        return self.__dict__["_stack"]

    def _kept_stack(self) -> int:
        """A handle on ``_block_stack`` kept in our kernel (``torch.ops.lssp.keep``), let go with this model: passing
        its 14 tensors a layer to every call cost ~0.25 µs each (~0.1 ms a forward)."""
        if "_kept" not in self.__dict__:
            handle = torch.ops.lssp.keep(self._block_stack())
            weakref.finalize(self, torch.ops.lssp.release, handle)
            self.__dict__["_kept"] = handle
        return self.__dict__["_kept"]

    def _output_parts(self) -> tuple[torch.Tensor | None, nn.Module]:
        """The final norm's weight (None: none) and the output layer (its Linear) after the decoder layers."""
        raise NotImplementedError

    def _fused_output(self, keep: int) -> FusedOutput | None:
        """The final norm and output layer for the one-call decoder over the last ``keep`` positions, when the layers
        run in one call and the output layer is in our kernel's blocks."""
        outputs = self.__dict__.setdefault("_outputs", {})  # by keep, built once each
        if keep not in outputs:
            from lssp.models.weight_only import BlockLinear

            norm, linear = self._output_parts()
            fused = self.one_call and type(linear) is BlockLinear
            outputs[keep] = FusedOutput(norm, linear.weights(), keep) if fused else None
        return outputs[keep]

    @property
    def one_call(self) -> bool:
        """Whether the decoder layers run in one call of our kernel (every Linear a q4_1 layer)."""
        return self._block_stack() is not None

    @property
    def skips_holes(self) -> bool:
        """Whether a batch's padding costs nothing: ``forward`` takes ``used`` (where rows hold tokens) and, in one
        call of our kernel, computes only those positions."""
        return self.one_call

    def _block_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor | None, keys_values: list[torch.Tensor], start: int,
                      output: FusedOutput | None, taps: Sequence[int] = (), used: torch.Tensor | None = None) -> Layered:
        """``_layers`` in calls of our kernel (q4_1): causal where ``mask`` is None, else its allowed slots; one call
        for the whole stack, or one per run of layers ending at a tap."""
        batch, n = hidden.shape[:2]
        allowed = None
        if mask is not None:  # bool (rows, slots), or additive (batch, 1, rows, slots)
            allowed = mask[None] if mask.dtype == torch.bool else (mask == 0)[:, 0]
        if cos.dim() != 3:
            cos, sin = cos.reshape(-1, n, self.head_dim), sin.reshape(-1, n, self.head_dim)
        norm, weights, keep = (None, (), 0) if output is None else (output.norm, output.weights, output.keep)
        layers, tapped, logits = len(self.qkv), [], None
        ends = sorted({t + 1 for t in taps if t + 1 < layers} | {layers}) if taps else [layers]
        for first, end in zip([0, *ends[:-1]], ends):
            last = end == layers
            hidden, logits = torch.ops.lssp.decoder(
                hidden.contiguous(), cos, sin, allowed, [], keys_values[2 * first: 2 * end], start, self.heads,
                self.kv_heads, self.eps, self.scale, norm if last else None, weights if last else (), keep, used,
                stack=self._kept_stack(), stack_layer=first)
            if end - 1 in taps:
                tapped.append(hidden)
        return Layered(hidden, logits if weights else None, tapped)

    def _run(self, hidden: torch.Tensor, kv: CompactCache, mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, output: FusedOutput | None = None,
             taps: Sequence[int] = (), used: torch.Tensor | None = None) -> Layered:
        """The eager decoder over ``hidden`` (batch, n, width) after what ``kv`` holds, extending it. By default
        every row is at the cache's slots and attends causally; rows of their own (batched SSp) pass ``positions``
        (batch, n) for the rotary embedding and an additive ``mask`` (batch, 1, n, slots) over the cache's slots.
        Returns what ``_layers`` does."""
        start, n = kv.length, hidden.shape[1]
        end = start + n
        kv.reserve(end)
        if positions is None:
            cos, sin = self._rotary(start, end, hidden)
            # Queries see every cached position and the new ones up to their own (the one-call decoder's default).
            causal = n == 1 or self._one_call_over(hidden, kv.keys_values[0])
            mask = None if causal else torch.ones(n, end, dtype=torch.bool, device=hidden.device).tril(diagonal=start)
        else:
            cos, sin = self._rotary(0, int(positions.max()) + 1, hidden)
            cos, sin = cos[0][positions].unsqueeze(1), sin[0][positions].unsqueeze(1)  # (batch, 1, n, head_dim)
        out = self._layers(hidden, cos, sin, mask, kv.keys_values, slice(start, end), end, output, taps, used)
        kv.length = end
        return out


class CompactLlama(FusedDecoder):
    """Forward of a LlamaForCausalLM over a CompactCache, batch 1 (or rows of equal length at equal positions, or
    rows at positions of their own under a mask);
    ``hf`` is the model it wraps. With ``features=True`` it also returns the final hidden states (after the last
    norm) of every position it ran, after the hidden states of its ``feature_layers``: what feature heads read."""

    def __init__(self, model: PreTrainedModel) -> None:
        reason = supports_compact(model)
        if reason:
            raise ValueError(f"'forward: compact' does not support {reason}")
        super().__init__(model.config, model.model.layers, model.get_input_embeddings().weight.dtype)
        self.hf = model
        # Held here: transformers' lookup of it tries several attributes, each miss an exception (~25 us a forward).
        self._embedding = model.get_input_embeddings()
        self._compiled_step = None  # set by compile_decode()
        self._filled_only = False  # compiled on a CPU: attend over the filled slots only (dynamic shapes)
        self.compile_mode: str | None = None
        self._free_buffers: list[list[torch.Tensor]] = []  # compiled: caches reuse their buffers (stable addresses)
        # Layers whose hidden states lead the features (the feature heads bound to this target read them), in order.
        self.feature_layers: tuple[int, ...] = ()
        self.to(self.get_input_embeddings().weight.device)

    @property
    def generation_config(self) -> Any:  # transformers' GenerationConfig
        return self.hf.generation_config

    def get_input_embeddings(self) -> nn.Module:
        return self._embedding

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids``: a plain table's rows by one aten call (what its module computes,
        without the module's Python, which a forward right after the weights streamed through pays ~50 us for)."""
        table = self._embedding
        if type(table) is nn.Embedding and table.max_norm is None:
            return torch.embedding(table.weight, input_ids)
        return table(input_ids)

    def get_output_embeddings(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def new_cache(self, batch: int = 1) -> CompactCache:
        weight = self.get_input_embeddings().weight
        args = (self.config.num_hidden_layers, self.kv_heads, self.head_dim, self.cache_dtype or weight.dtype,
                weight.device)
        if self._compiled_step is None or batch > 1:  # the compiled step runs batch 1
            return CompactCache(*args, batch=batch)
        # Compiled: a zeroed buffer of fixed capacity (positions past the text are masked, never NaN), reused by the
        # next cache once this one is dropped, so CUDA graphs see the same addresses and no new shape.
        buffers = self._free_buffers.pop() if self._free_buffers else [
            _static(torch.zeros(1, args[1], COMPILED_CAPACITY, args[2], dtype=args[3], device=weight.device))
            for _ in range(2 * args[0])]
        cache = CompactCache(*args, buffers=buffers)
        weakref.finalize(cache, self._free_buffers.append, buffers)
        return cache

    def compile_decode(self, mode: str = "default") -> None:
        """Run forwards of up to STEP_TOKENS tokens after the prefill (decode, verification) through torch.compile.

        On a GPU the compiled step attends over the cache's whole buffer with a mask built from the positions, which
        it takes as a tensor: the shapes stay the same from one step to the next (CUDA graphs), so nothing recompiles
        as the text grows. On a CPU it attends over the positions filled so far, with dynamic shapes: attending over
        the whole buffer would cost more than compiling saves. Prefills stay eager.
        """
        import torch._dynamo

        if self.one_call:  # no Python between layers: nothing for torch.compile to take away
            return
        # A model's step gets a graph per token count until the count turns dynamic, per position count until that
        # does, in and out of inference mode: at times more than dynamo's default of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._filled_only = self.get_input_embeddings().weight.device.type == "cpu"
        # torch.compile takes a mode or options: the default mode's options, with fewer guards.
        how = {"options": {"guard_filter_fn": _arguments_only}} if mode == "default" else {"mode": mode}
        self._compiled_step = torch.compile(_own_step(self), fullgraph=True, **how)
        self.compile_mode = mode

    def _rope_table(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for every position of the cache's buffer (built once, outside the compiled step)."""
        self._rotary(0, self.config.max_position_embeddings, like)
        return self._rope

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(hidden, self.hf.model.norm.weight)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, keys_values: list[torch.Tensor],
              cos_table: torch.Tensor, sin_table: torch.Tensor, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and final hidden states of every position of ``input_ids`` (n,) at ``positions`` (n,), attending
        over the first ``upto`` slots (None: the whole buffer, the same shapes at every step) under a causal mask
        built from the positions (the compiled path)."""
        slots = keys_values[0].shape[2] if upto is None else upto
        mask = torch.arange(slots, device=positions.device)[None, :] <= positions[:, None]
        hidden = self._layers(self._embed(input_ids[None]), cos_table[:, positions],
                              sin_table[:, positions], mask, keys_values, positions, upto).hidden
        final = self._final(hidden)
        return self.hf.lm_head(final), final

    def forward(self, input_ids: torch.Tensor, past_key_values: CompactCache, use_cache: bool = True,
                logits_to_keep: int = 0, features: bool = False, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, used: torch.Tensor | None = None) -> CompactOutput:
        """Logits (and with ``features`` the final hidden states) of ``input_ids`` (batch, n) after what
        ``past_key_values`` holds. ``attention_mask`` (batch, 1, n, slots, additive) and ``position_ids`` (batch, n)
        let each row attend to slots and sit at positions of its own (``lssp.decoding.batched``); they run eager.
        ``used`` (batch, n) bool marks the positions that hold tokens: the one-call decoder skips the others."""
        kv = past_key_values
        if input_ids.shape[0] != kv.keys_values[0].shape[0]:
            raise ValueError(f"a batch of {input_ids.shape[0]} over a cache of {kv.keys_values[0].shape[0]} rows")
        start, n = kv.length, input_ids.shape[1]
        end = start + n
        kv.reserve(end)
        taps = self.feature_layers if features else ()
        if (self._compiled_step is not None and 0 < start and n <= STEP_TOKENS and input_ids.shape[0] == 1
                and position_ids is None and not taps):  # prefills (start 0) stay eager
            positions = torch.arange(start, end, device=input_ids.device)
            graphs = self.compile_mode in ("reduce-overhead", "max-autotune")
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are no longer read
            # A fresh 1-D copy of the ids: a slice of the growing sequence has a stride that changes every step,
            # and ids made outside inference mode are another kind of tensor; each would get a graph of its own.
            logits, final = self._compiled_step(input_ids.reshape(-1).clone(), positions, kv.keys_values,
                                                *self._rope_table(kv.keys_values[0]), end if self._filled_only else None)
            if graphs:  # a CUDA graph's outputs are overwritten by its next replay
                logits, final = logits.clone(), final.clone()
            kv.length = end
            return CompactOutput(logits[:, -logits_to_keep:] if logits_to_keep else logits, final if features else None)
        plain = attention_mask is None and position_ids is None and used is None and not taps
        called = self._plain_call(input_ids, kv, logits_to_keep) if plain else None
        if called is not None:
            kv.length = end
            return CompactOutput(called[1], called[0] if features else None)
        final, logits, tapped = self._run(self._embed(input_ids), kv, attention_mask, position_ids,
                                          self._fused_output(logits_to_keep), taps, used)
        if logits is None:
            final = self._final(final)
            logits = self.hf.lm_head(final[:, -logits_to_keep:] if logits_to_keep else final)
        return CompactOutput(logits, (torch.cat([*tapped, final], dim=-1) if tapped else final) if features else None)

    def _plain_call(self, input_ids: torch.Tensor, kv: CompactCache, keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The final hidden states and logits of a plain forward (causal, every layer, the output layer fused) in one
        call of our kernel that also looks up the tokens' rows and rotary rows, no op around it (each costs ~40 us
        right after the weights streamed through); None where that call does not apply."""
        table, output = self._embedding, self._fused_output(keep)
        if (output is None or type(table) is not nn.Embedding or table.max_norm is not None
                or not self._one_call_over(table.weight, kv.keys_values[0])):
            return None
        cos, sin = self._rope_upto(kv.length + input_ids.shape[1], table.weight)
        return torch.ops.lssp.decoder(table.weight, cos, sin, None, [], kv.keys_values, kv.length, self.heads,
                                      self.kv_heads, self.eps, self.scale, output.norm, output.weights, keep,
                                      stack=self._kept_stack(), ids=input_ids, rope_start=kv.length)

    def _output_parts(self) -> tuple[torch.Tensor | None, nn.Module]:
        return self.hf.model.norm.weight.detach().float().contiguous(), self.hf.lm_head
