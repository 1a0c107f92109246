"""EAGLE-3 heads (Li et al. 2025, arXiv 2503.01840) in their published layout, drafting for their target.

The files are those SafeAILab's EAGLE, SpecForge and vLLM read: a config.json (``LlamaForCausalLMEagle3``,
``draft_vocab_size``, optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` and ``t2d`` (``embed_tokens`` where the head keeps its own).

At position t the head reads the target's hidden states entering three of its layers (by default 2, L/2 and
L-3 of L, as vLLM takes them), fused by ``fc``, and the embedding of the token at t+1. Its one decoder layer
attends over cat(input_layernorm(embedding), hidden_norm(fused)), twice the width, the fused state being the
residual. Its output before the final ``norm`` stands in for the fused state while drafting (the head feeds
itself); after ``norm``, ``lm_head`` gives logits over the draft vocabulary, draft token i being the target's
i + d2t[i]. Verification is the engine's: the head only proposes, q being its softmax widened with -inf.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from lssp.errors import UserError
from lssp.models.compact import CompactOutput
from lssp.models.draft_head import SubsetHead
from lssp.models.eagle import ChainParts, FeatureCache, FeatureDrafting, feature_layers, read_weights, unrolled_mask
from lssp.models.weight_only import BlockLinear, stacked_blocks

AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # in config.json's eagle_config: the target layers the head reads


def is_eagle3_head(folder: str | Path) -> bool:
    """Whether ``folder``'s config.json is an EAGLE-3 head's: its architecture says so, or it has a draft vocabulary
    (as the heads EAGLE's authors published first, under a plain Llama architecture)."""
    config = Path(folder) / "config.json"
    if not config.exists():
        return False
    raw = json.loads(config.read_text())
    return "Eagle3" in "".join(raw.get("architectures") or []) or "draft_vocab_size" in raw


def aux_layer_ids(config: LlamaConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads: ``eagle_config``'s (vLLM reads them there) or the
    top level's (llama.cpp's converter reads them there), else vLLM's default for Llama: 2, L/2, L-3."""
    given = (getattr(config, "eagle_config", None) or {}).get(AUX_KEY) or getattr(config, AUX_KEY, None)
    return tuple(given) if given else default_aux_ids(target_layers)


def default_aux_ids(target_layers: int) -> tuple[int, ...]:
    """vLLM's (and llama.cpp's converter's) EAGLE-3 layers for a Llama of ``target_layers``: 2, L/2, L-3."""
    return (2, target_layers // 2, target_layers - 3)


class Eagle3Attention(nn.Module):
    """Attention whose queries, keys and values read twice the head's width (embedding and fused state)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        width, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(2 * width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)


class Eagle3Layer(nn.Module):
    """The head's decoder layer (``midlayer``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(width, eps=eps)
        self.hidden_norm = LlamaRMSNorm(width, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """EAGLE-3 weights under their published names; ``step`` runs the layer over a cache."""

    def __init__(self, config: LlamaConfig, aux_ids: tuple[int, ...], own_embeddings: bool = False) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"
        self.config, self.aux_ids = config, aux_ids
        width = config.hidden_size
        target_width = getattr(config, "target_hidden_size", None) or width
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(len(aux_ids) * target_width, width, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(width, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(config.vocab_size, width) if own_embeddings else None
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def token_ids(self) -> torch.Tensor:
        """The target's id of each draft token (i + d2t[i])."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, kv: FeatureCache, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output before ``norm`` (batch, n, d) for n new positions after the cache's, each reading its
        token's embedding and the state beside it (fused or fed back), its keys and values added to ``kv``. Rows at
        positions of their own pass ``positions`` (batch, n) and an additive ``mask`` (batch, 1, n, slots); else
        each row is at the cache's next slots and attends causally."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        start, (batch, n) = kv.length, embeds.shape[:2]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        shape = (batch, n, -1, attn.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if positions is None:
            positions = torch.arange(start, start + n, device=embeds.device)[None]
            mask = torch.arange(start + n, device=embeds.device)[None] <= positions[0, :, None]
        q, k = apply_rotary_pos_emb(q, k, *self.rotary(x, positions))
        kv.reserve(start + n)
        keys, values = kv.keys_values
        keys[:, :, start:start + n], values[:, :, start:start + n] = k, v
        kv.length = start + n
        out = F.scaled_dot_product_attention(q, keys[:, :, :start + n], values[:, :, :start + n], attn_mask=mask,
                                             enable_gqa=True)
        state = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, n, -1))
        return state + layer.mlp(layer.post_attention_layernorm(state))

    def unrolled(self, embeds: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: the layer's outputs before ``norm`` (batch, T, d) at each of ``steps`` drafting
        steps over embeddings of tokens 1..T and fused states 0..T-1. Step 0 reads the fused states; at step s,
        position j reads step s-1's output at j-1 and attends as a draft of s+1 tokens begun at j-s would
        (``unrolled_mask``), as ``FeatureHead.unrolled`` does."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        length = embeds.shape[1]
        positions = torch.arange(length, device=embeds.device)[None]
        rope = self.rotary(embeds, positions)
        shape = (*embeds.shape[:2], -1, attn.head_dim)
        normed = layer.input_layernorm(embeds)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        states, given = [], fused
        for step in range(steps):
            x = torch.cat([normed, layer.hidden_norm(given)], dim=-1)
            q, k = apply_rotary_pos_emb(attn.q_proj(x).view(shape).transpose(1, 2),
                                        attn.k_proj(x).view(shape).transpose(1, 2), *rope)
            keys.append(k)
            values.append(attn.v_proj(x).view(shape).transpose(1, 2))
            out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                 attn_mask=unrolled_mask(length, step, embeds.device), enable_gqa=True)
            state = given + attn.o_proj(out.transpose(1, 2).reshape(*embeds.shape[:2], -1))
            state = state + layer.mlp(layer.post_attention_layernorm(state))
            states.append(state)
            given = torch.cat([fused[:, :1], state[:, :-1]], dim=1)
        return states


def load_eagle3_head(folder: str | Path, target: PreTrainedModel, name: str = "") -> Eagle3Head:
    """The head in ``folder`` for ``target``, every weight checked by name and shape (one line naming what is wrong)."""
    folder, label = Path(folder), name or str(folder)
    raw = json.loads((folder / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version",
                                                                       "architectures")})
    state = read_weights(folder)
    layers = target.config.num_hidden_layers
    aux = aux_layer_ids(config, layers)
    if any(not 1 <= i < layers for i in aux):
        raise UserError(f"EAGLE-3 head {label!r} reads the hidden states entering layers {list(aux)}; its target has "
                        f"layers 0..{layers - 1}, and llamassp gives those entering 1..{layers - 1}")
    if config.vocab_size != target.config.vocab_size:
        raise UserError(f"EAGLE-3 head {label!r} has a vocabulary of {config.vocab_size}, its target "
                        f"{target.config.vocab_size}")
    own = "embed_tokens.weight" in state
    width, meant = target.config.hidden_size, getattr(config, "target_hidden_size", None) or config.hidden_size
    if meant != width or (not own and config.hidden_size != width):
        raise UserError(f"EAGLE-3 head {label!r} is for a target {meant} wide (and reads its embeddings unless it has "
                        f"its own), its target {width}")
    head = Eagle3Head(config, aux, own_embeddings=own)
    if len(head.d2t) == config.vocab_size:  # a full draft vocabulary: d2t and t2d may be left out (vLLM wants them out)
        state.setdefault("d2t", head.d2t)
        state.setdefault("t2d", torch.ones_like(head.t2d))
    expected = {k: v.shape for k, v in head.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(v.shape)} (expected {tuple(expected[k])})" for k, v in state.items()
             if k in expected and v.shape != expected[k]]
    if missing or extra or wrong:
        what = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                       f"unexpected {', '.join(extra)}" if extra else "",
                                       f"shapes {', '.join(wrong)}" if wrong else ""]))
        raise UserError(f"EAGLE-3 head {label!r}: weights do not match its config: {what}")
    head.load_state_dict(state)
    ids = head.token_ids
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or len(set(ids.tolist())) != len(ids):
        raise UserError(f"EAGLE-3 head {label!r}: d2t maps its draft tokens outside the target's vocabulary or twice")
    return head


def save_eagle3_head(head: Eagle3Head, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json and model.safetensors in the published layout (vLLM's ``eagle3`` method and llama.cpp's converter
    read it; the layers are said where each looks)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_diff_dict()
    config.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                   "draft_vocab_size": len(head.d2t), "dtype": str(dtype).removeprefix("torch."),
                   "eagle_config": {**(getattr(head.config, "eagle_config", None) or {}), AUX_KEY: list(head.aux_ids)},
                   AUX_KEY: list(head.aux_ids)})  # where llama.cpp's converter reads them
    for key in ("_attn_implementation_autoset", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    full = len(head.d2t) == head.config.vocab_size and not head.d2t.any()  # vLLM refuses d2t where nothing maps
    state = {k: (v if k in ("d2t", "t2d") else v.to(dtype)).detach().cpu().contiguous()
             for k, v in head.state_dict().items() if not k.startswith("rotary.") and not (full and k in ("d2t", "t2d"))}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


class Eagle3Draft(nn.Module, FeatureDrafting):
    """``head`` drafting for ``target``: the target's embeddings unless the head has its own, its draft vocabulary
    as a SubsetHead (in the target's id order), for one completion or batched rows. With its Linear layers in our
    kernel's blocks (q4_1) the layer runs in one kernel call and K drafts chain in one; else in torch."""

    def __init__(self, head: Eagle3Head, target: PreTrainedModel, dtype: torch.dtype) -> None:
        super().__init__()
        self.head, self.config = head.to(dtype), head.config
        attn = head.midlayer.self_attn
        self.heads, self.kv_heads, self.eps, self.scale = (attn.heads, attn.kv_heads, head.config.rms_norm_eps,
                                                           attn.head_dim ** -0.5)
        self._target = (target,)  # not a submodule: moving the draft leaves the target alone
        self.taps = tuple(i - 1 for i in head.aux_ids)  # the state entering layer i leaves layer i - 1
        target.feature_layers = tuple(sorted(set(feature_layers(target)) | set(self.taps)))
        ids, order = head.token_ids.sort()
        self.output = SubsetHead(head.config.hidden_size, ids.tolist(), target.config.vocab_size).to(dtype)
        with torch.no_grad():
            self.output.linear.weight.copy_(head.lm_head.weight[order])
        self.to(target.get_input_embeddings().weight.device)

    def get_input_embeddings(self) -> nn.Module:
        return self.head.embed_tokens if self.head.embed_tokens is not None else self._target[0].get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.output

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the norms' (the Linear layers may hold our kernel's blocks instead of weights)."""
        return self.head.norm.weight.dtype

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.output.token_ids

    def new_cache(self, batch: int = 1) -> FeatureCache:
        attn = self.head.midlayer.self_attn
        return FeatureCache(1, attn.kv_heads, attn.head_dim, self.compute_dtype, self.head.norm.weight.device,
                            batch=batch, fuse=self.fused)

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` over the target's hidden states at the head's layers, taken from its features (those of its
        ``feature_layers``, then the final one)."""
        given = feature_layers(self._target[0])
        chunks = features.split(features.shape[-1] // (len(given) + 1), dim=-1)
        return self.head.fc(torch.cat([chunks[given.index(t)] for t in self.taps], dim=-1).to(self.compute_dtype))

    def forward(self, input_ids: torch.Tensor, past_key_values: FeatureCache, use_cache: bool = True,
                logits_to_keep: int = 0, input_features: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                used: torch.Tensor | None = None, widen: bool = True) -> CompactOutput:
        """Logits after ``input_ids`` (batch, n), each token paired with the state of the token before it: the
        cache's queued fused states or its last output, or ``input_features`` (fused, batch, n, d) where the caller
        keeps them (batched rows, with ``attention_mask``, ``position_ids`` and ``used`` as in
        ``CompactLlama.forward``). The last position's output becomes the cache's ``guess``."""
        kv = past_key_values
        embeds = self.get_input_embeddings()(input_ids).to(self.compute_dtype)
        hidden = kv.take(input_ids.shape[1]) if input_features is None else input_features.to(self.compute_dtype)
        parts = self._chain_parts()
        if parts is not None:  # the layer, its norm and output rows in one call, as draft_chain runs them
            start, end = kv.length, kv.length + input_ids.shape[1]
            kv.reserve(end)
            cos, sin = self._rope(position_ids if position_ids is not None
                                  else torch.arange(start, end, device=embeds.device)[None])
            allowed = None if attention_mask is None else (attention_mask == 0)[:, 0]
            state, logits = torch.ops.lssp.decoder(
                hidden.contiguous(), cos, sin, allowed, parts.layers, kv.keys_values, start, self.heads,
                self.kv_heads, self.eps, self.scale, parts.final_norm, parts.output, logits_to_keep, used,
                embeds.contiguous(), parts.embed_norm)
            kv.length = end
        else:
            state = self.head.step(embeds, hidden, kv, position_ids, attention_mask)
            last = state[:, -logits_to_keep:] if logits_to_keep else state
            logits = self.output.linear(self.head.norm(last))
        kv.guess = state[:, -1:]
        return CompactOutput(self.output.widen(logits) if widen else logits)

    @property
    def skips_holes(self) -> bool:
        """Whether a batch's padding costs nothing (``forward`` takes ``used``): in one call of our kernel."""
        return self.can_chain

    def draft_logits(self, input_ids: torch.Tensor, kv: FeatureCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last position's logits over the draft vocabulary and their target ids."""
        return self(input_ids, kv, logits_to_keep=1, widen=False).logits[0, -1], self.draft_ids

    def _chain_parts(self) -> ChainParts | None:
        """What our kernel reads to run the layer (``decoder``) and chain drafts (``draft_chain``): where every Linear
        of the layer and the output rows are in its blocks (q4_1) and activations float32; else None. Built once."""
        if "_chain_parts_" not in self.__dict__:
            layer, table = self.head.midlayer, self.get_input_embeddings().weight
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                       self.output.linear)
            able = (all(type(m) is BlockLinear for m in linears) and self.compute_dtype == torch.float32
                    and table.dtype == torch.float32 and table.is_contiguous())
            norm = lambda m: m.weight.detach().float().contiguous()  # noqa: E731
            self.__dict__["_chain_parts_"] = ChainParts(
                table, (), [norm(layer.hidden_norm), *stacked_blocks(attn.q_proj, attn.k_proj, attn.v_proj),
                            *attn.o_proj.weights(), norm(layer.post_attention_layernorm),
                            *stacked_blocks(mlp.gate_proj, mlp.up_proj), *mlp.down_proj.weights()],
                self.output.linear.weights(), self.draft_ids, norm(layer.input_layernorm), norm(self.head.norm)) \
                if able else None
        return self.__dict__["_chain_parts_"]

    def _rotary(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rope(torch.arange(start, end, device=like.device)[None])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (sin negated on its first half) at ``positions`` (batch, n), float32 as the kernel
        takes them."""
        cos, sin = self.head.rotary(self.head.norm.weight.float(), positions)  # the tensor only gives dtype, device
        half = sin.shape[-1] // 2
        return cos.contiguous(), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
