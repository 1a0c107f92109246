"""Feature-level drafts: an EAGLE head (Li et al. 2024, arXiv 2401.15077) drafting for its target.

The head reads what the target has already computed. At position t it takes the target's final
hidden state f_t (after the last norm: the "feature") and the embedding of the token at t+1,
mixes them through ``fc`` (2d -> d), runs one or more Llama decoder layers (the first without
its input norm) and returns its guess of f_{t+1}; the target's own output layer (or its rows for
the head's ``head_token_ids``) turns that guess into logits for the token at t+2. While drafting,
the head feeds its guesses back in place of the features it does not have yet; after each
verification the target's real features of the accepted tokens replace them, and the head's
cache rolls back to the last position it saw with real features.

``FeatureHead`` holds the weights in the layout EAGLE's authors publish (``fc``, ``layers.{i}``;
the target's embeddings and output layer are reused, not stored) and is what training runs;
``FeatureDraft`` binds a head to a loaded target and runs it through the fused decoder of
``lssp/models/compact.py`` over a ``FeatureCache``. q is the head's distribution after the same warping
as the target's, so the acceptance rule keeps speculative sampling exact.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding, apply_rotary_pos_emb

from lssp.errors import UserError
from lssp.models.compact import CompactCache, CompactOutput, FusedDecoder, FusedOutput, float_weight
from lssp.models.draft_head import HEAD_KEY, SubsetHead
from lssp.models.weight_only import BlockLinear

HEAD_MARK = "feature_head"  # config.json key of heads written by llamassp (the format is EAGLE's either way)
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight")  # copies of the target's that published heads may carry
EAGLE3_SIGNS = ("d2t", "t2d", "midlayer.")
LAYERS_KEY = "feature_layers"  # config.json key: the target layers a head reads besides the final feature


class FeatureHead(nn.Module):
    """EAGLE-1/2 head weights: ``fc`` over cat(embedding of token t+1, feature at t), then Llama decoder
    layers, the first without input norm; no final norm. ``forward`` is the (causal, batched) training path.

    A head with ``feature_layers`` (EAGLE-3's fused features) reads, as its feature at t, ``fuse`` over the target's
    hidden states after those layers (each RMS-normalized, no weight) and its final feature, concatenated; its own
    guesses stand in for that fused feature while drafting, as a plain head's stand in for the final feature."""

    def __init__(self, config: LlamaConfig, bias: bool = False) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"
        self.config = config
        width = config.hidden_size
        self.fc = nn.Linear(2 * width, width, bias=bias)
        taps = self.feature_layers
        self.fuse = nn.Linear((len(taps) + 1) * width, width, bias=False) if taps else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def token_ids(self) -> list[int] | None:
        """The tokens the head proposes (its output rows of the target's layer), None for all."""
        return getattr(self.config, HEAD_KEY, None)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's layers whose hidden states the head reads besides its final feature (none: EAGLE-1/2)."""
        return tuple(getattr(self.config, LAYERS_KEY, None) or ())

    def fused(self, features: torch.Tensor, given: Sequence[int] = (), dtype: torch.dtype | None = None) -> torch.Tensor:
        """The feature the head reads (..., d) from the target's (..., (len(given) + 1) x d): the hidden states after
        the layers ``given``, then the final feature (``CompactOutput.features``); ``fuse`` runs in ``dtype`` (by
        default its weight's)."""
        width = self.config.hidden_size
        chunks = features.split(width, dim=-1)
        if len(chunks) != len(given) + 1 or chunks[-1].shape[-1] != width:
            raise ValueError(f"features {features.shape[-1]} wide for layers {tuple(given)} and the final, {width} each")
        if not self.feature_layers:
            return chunks[-1]
        if not set(self.feature_layers) <= set(given):
            raise ValueError(f"the head reads layers {self.feature_layers}, the target gives {tuple(given)}")
        taps = [F.rms_norm(chunks[list(given).index(t)].float(), (width,), eps=self.config.rms_norm_eps)
                for t in self.feature_layers]
        return self.fuse(torch.cat([*taps, chunks[-1].float()], dim=-1).to(dtype or self.fuse.weight.dtype))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predicted features (batch, T, d) from embeddings of tokens 1..T and features 0..T-1, causally."""
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rope = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return hidden

    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test (EAGLE-3): the head's guesses at each of ``steps`` drafting steps, (batch, T, d)
        each. Step 0 is ``forward``; at step s, position j reads the guess step s-1 made at j-1 and attends as a
        draft of s+1 tokens begun at j-s would: to the keys of the real features up to j-s and to that draft's own
        keys at steps 1..s (positions j < s have no such draft; their outputs are not meant to be trained on)."""
        length = embeds.shape[1]
        positions = torch.arange(length, device=embeds.device)[None]
        rope = self.rotary(embeds, positions)
        kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self.layers]
        guesses, given = [], features
        for step in range(steps):
            mask = unrolled_mask(length, step, embeds.device)
            hidden = self.fc(torch.cat([embeds, given], dim=-1))
            for layer, (keys, values) in zip(self.layers, kept):
                hidden = _layer_step(layer, hidden, rope, keys, values, mask)
            guesses.append(hidden)
            given = torch.cat([features[:, :1], hidden[:, :-1]], dim=1)
        return guesses


def unrolled_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """Which keys (steps 0..``step``, ``length`` positions each) a query at ``step`` attends to: (length,
    (step+1) x length), True where it does (see ``FeatureHead.unrolled``)."""
    j = torch.arange(length, device=device)[:, None]
    i = torch.arange(length, device=device)[None]
    blocks = [i <= j - step] + [i == j - step + s for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def _layer_step(layer: LlamaDecoderLayer, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``layer`` over ``hidden`` whose keys and values join those of the earlier steps (``keys``, ``values``,
    extended here) under ``mask``."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:2], -1, attn.head_dim)
    q, k = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj))
    q, k = apply_rotary_pos_emb(q, k, *rope)
    keys.append(k)
    values.append(attn.v_proj(x).view(shape).transpose(1, 2))
    out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                         scale=attn.scaling, enable_gqa=True)
    hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _reshaped(head: FeatureHead, config: LlamaConfig) -> FeatureHead:
    """A head of ``config``'s shape holding ``head``'s weights where they fit (the rest freshly initialized)."""
    other = FeatureHead(config, bias=head.fc.bias is not None).to(head.fc.weight.dtype)
    other.load_state_dict(head.state_dict(), strict=False)
    return other


def with_feature_layers(head: FeatureHead, layers: Sequence[int]) -> FeatureHead:
    """``head`` reading the target's hidden states after ``layers`` too, drafting as it did: its ``fuse`` starts
    as the identity on the final feature (zero on the others), which training then learns to use."""
    config = copy.deepcopy(head.config)
    setattr(config, LAYERS_KEY, sorted(set(layers)))
    wider = _reshaped(head, config)
    width = config.hidden_size
    with torch.no_grad():
        wider.fuse.weight.zero_()
        wider.fuse.weight[:, -width:] = torch.eye(width)
    return wider


def with_more_layers(head: FeatureHead, layers: int) -> FeatureHead:
    """``head`` with ``layers`` decoder layers, drafting as it did: each new layer starts as the identity (its
    attention's and MLP's output projections zero, so the residual passes through), which training then grows."""
    config = copy.deepcopy(head.config)
    config.num_hidden_layers = layers
    deeper = _reshaped(head, config)
    with torch.no_grad():
        for layer in deeper.layers[len(head.layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper


def check_feature_layers(target: nn.Module, layers: Sequence[int]) -> None:
    """Refuse feature layers ``target`` does not have below its last (whose state the final feature is)."""
    count = target.config.num_hidden_layers
    wrong = [t for t in layers if not 0 <= t < count - 1]
    if wrong:
        raise UserError(f"feature layers {', '.join(map(str, wrong))}: the target's layers are 0..{count - 1}, and "
                        f"the last gives the final feature already (choose from 0..{count - 2})")


def head_feature_layers(folder: str | Path) -> tuple[int, ...]:
    """The target layers the head in ``folder`` reads besides the final feature (from its config.json)."""
    return tuple(json.loads((Path(folder) / "config.json").read_text()).get(LAYERS_KEY) or ())


def head_config(target_config: LlamaConfig, layers: int = 1, token_ids: list[int] | None = None,
                feature_layers: Sequence[int] = ()) -> LlamaConfig:
    """A head's config: the target's width, heads and MLP, ``layers`` decoder layers, reading the target's
    ``feature_layers`` besides its final feature."""
    tc = target_config
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps, rope_parameters=rope,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    if token_ids is not None:
        setattr(config, HEAD_KEY, list(token_ids))
    if feature_layers:
        setattr(config, LAYERS_KEY, sorted(set(feature_layers)))
    return config


def is_feature_head(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EAGLE head (ours, or one in its authors' published layout)."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.exists():
        return False
    if HEAD_MARK in json.loads(config.read_text()):
        return True
    return any(k == "fc.weight" for k in _weight_names(folder))


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def _weight_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in _weight_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                names.extend(f.keys())
        else:
            names.extend(torch.load(path, map_location="meta", weights_only=True))
    return names


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state.update(load_file(path) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu", weights_only=True))
    return state


def load_feature_head(folder: str | Path, name: str = "") -> FeatureHead:
    """A head from ``folder``: its config.json and weights (safetensors or pytorch_model.bin), mapped key by key.

    A missing or unexpected weight is an error that names it; the copies of the target's embeddings or
    output layer that published heads carry are skipped (the target's own are used). EAGLE-3 heads load through
    ``lssp.models.eagle3``.
    """
    folder = Path(folder)
    label = name or str(folder)
    raw = json.loads((folder / "config.json").read_text())
    state = read_weights(folder)
    if not state:
        raise UserError(f"feature head {label!r}: no weights (*.safetensors or pytorch_model.bin) in {folder}")
    if any(k.startswith(EAGLE3_SIGNS) for k in state) or "Eagle3" in "".join(raw.get("architectures") or []):
        raise UserError(f"feature head {label!r} is in EAGLE-3's layout: it drafts (as a registry entry), but "
                        "distill trains EAGLE-1/2 heads only")
    raw.pop("architectures", None)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")})
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[1] != 2 * config.hidden_size:
        raise UserError(f"feature head {label!r}: fc takes {fc.shape[1]} inputs, expected 2 x {config.hidden_size}")
    head = FeatureHead(config, bias="fc.bias" in state)
    kept = {k: v for k, v in state.items() if k not in IGNORED_KEYS and not k.endswith("rotary_emb.inv_freq")}
    expected = set(head.state_dict()) - {k for k in head.state_dict() if k.startswith("rotary.")}
    missing, extra = sorted(expected - set(kept)), sorted(set(kept) - expected)
    if missing or extra:
        what = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                       f"unexpected {', '.join(extra)}" if extra else ""]))
        raise UserError(f"feature head {label!r}: weights do not match an EAGLE head with "
                        f"{config.num_hidden_layers} layer(s): {what}")
    for key, value in kept.items():
        if value.shape != head.state_dict()[key].shape:
            raise UserError(f"feature head {label!r}: {key} has shape {tuple(value.shape)}, "
                            f"expected {tuple(head.state_dict()[key].shape)}")
    head.load_state_dict(kept, strict=False)
    return head


def save_feature_head(head: FeatureHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json and model.safetensors in EAGLE's layout (vLLM's ``eagle`` method reads it as it is)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_diff_dict()
    config.update({HEAD_MARK: True, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "dtype": str(dtype).removeprefix("torch.")})
    for key in ("_attn_implementation_autoset", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    state = {k: v.detach().to(dtype).cpu().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def check_head_fits(head: FeatureHead, target: PreTrainedModel, name: str) -> None:
    """Refuse a head whose width or vocabulary does not match ``target``'s."""
    width = target.get_input_embeddings().weight.shape[1]
    if head.config.hidden_size != width:
        raise UserError(f"feature head {name!r} is {head.config.hidden_size} wide, its target {width}")
    vocab = target.get_output_embeddings().out_features
    ids = head.token_ids or []
    if ids and max(ids) >= vocab:
        raise UserError(f"feature head {name!r} proposes token {max(ids)}, beyond the target's {vocab} logits")


class FeatureCache(CompactCache):
    """The head's keys and values plus the features waiting for their tokens.

    ``get_seq_length`` counts the text tokens the head has read: one per cached position plus the first
    token of the text, which no position takes as its "next token". ``queue`` adds the target's real
    features; a forward over n tokens takes n queued features, or, with none queued, the head's own
    guess from its previous forward (one token: drafting).
    """

    def __init__(self, *args: Any, fuse: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 **kwargs: Any) -> None:  # CompactCache's
        super().__init__(*args, **kwargs)
        self.queued: torch.Tensor | None = None  # (1, m, d) real features not yet paired with their tokens
        self.guess: torch.Tensor | None = None  # (1, 1, d) the head's last predicted feature
        self.fuse = fuse  # the target's features as the head reads them (``FeatureDraft.fused``)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length + 1

    def queue(self, features: torch.Tensor) -> None:
        """Add the target's features (1, m, its feature width) of the next m tokens."""
        features = self.fuse(features) if self.fuse is not None else features
        self.guess = None
        self.queued = features if self.queued is None else torch.cat([self.queued, features], dim=1)

    def take(self, n: int) -> torch.Tensor:
        if self.queued is not None:
            if self.queued.shape[1] != n:
                raise ValueError(f"{n} tokens for {self.queued.shape[1]} queued features")
            features, self.queued = self.queued, None
            return features
        if self.guess is None or n != 1:
            raise ValueError(f"{n} tokens and no feature to pair them with")
        return self.guess

    @property
    def ready(self) -> bool:
        """Whether the head can draft now (it has a feature for its next token)."""
        return self.queued is not None or self.guess is not None


@dataclass(frozen=True)
class ChainParts:
    """What ``torch.ops.lssp.draft_chain`` reads besides the cache: the embedding table (float32), ``fc``'s blocks
    (none: the cache holds the head's own states already, EAGLE-3), the layer stack as ``torch.ops.lssp.decoder``
    takes it, the output rows' blocks and their vocabulary ids; an EAGLE-3 layer's embedding and final norms."""

    table: torch.Tensor
    fc: tuple[torch.Tensor, ...]
    layers: list[torch.Tensor]
    output: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor
    embed_norm: torch.Tensor | None = None
    final_norm: torch.Tensor | None = None


class FeatureDrafting:
    """What a head drafting from its target's features offers the drafters (``FeatureDraft``, EAGLE-1/2, and
    ``Eagle3Draft``): ``new_cache``, a forward over (tokens, cache), ``draft_logits``, ``draft_ids`` and, from here,
    ``start``, ``can_chain`` and ``draft_chain`` (over the head's ``_chain_parts``, ``_rotary`` and its ``heads``,
    ``kv_heads``, ``eps`` and ``scale``)."""

    heads: int
    kv_heads: int
    eps: float
    scale: float

    def _chain_parts(self) -> ChainParts | None:
        """What the head drafts with in one kernel call, where it can (None: it cannot)."""
        return None

    def _rotary(self, start: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (sin negated on its first half) of positions start..end-1, (1, positions, head_dim)."""
        raise NotImplementedError

    @property
    def can_chain(self) -> bool:
        """Whether the head drafts in one call of our kernel (``draft_chain``): its layers and output rows (and an
        EAGLE-1 head's ``fc``) are in the kernel's blocks."""
        return self._chain_parts() is not None

    def draft_chain(self, input_ids: torch.Tensor, kv: FeatureCache, k: int, temperature: float = 0.0,
                    uniforms: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafts after ``input_ids`` (1, n) in one call of our kernel (where ``can_chain``), each step fed the
        last draft, and the cache as those steps leave it (the last draft not fed): the argmaxes of ``k`` steps of
        ``draft_logits``, or with ``temperature`` > 0 draws from their softmax at that temperature by ``uniforms``
        (k,), as ``inverse_cdf`` draws, with those laws (k, the head's tokens: ``draft_ids``)."""
        drafts, _, q = self._chain(input_ids, kv, k, temperature, uniforms)
        return drafts.tolist(), q if temperature > 0 else None

    def _chain(self, input_ids: torch.Tensor, kv: FeatureCache, k: int, temperature: float = 0.0,
               uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``torch.ops.lssp.draft_chain``'s drafts, last logits and laws over ``kv``, extending it as k forwards
        would."""
        parts = self._chain_parts()
        if input_ids.shape[0] != 1 or parts is None:
            raise ValueError("a chain of drafts is one completion's, by a head in our kernel's blocks")
        n = input_ids.shape[1]
        features = kv.take(n)
        start, end = kv.length, kv.length + n + k - 1
        kv.reserve(end)
        cos, sin = self._rotary(start, end, features)
        drafts, kv.guess, logits, q = torch.ops.lssp.draft_chain(
            input_ids[0], parts.table, features[0], parts.fc, cos, sin, parts.layers, kv.keys_values, start,
            self.heads, self.kv_heads, self.eps, self.scale, parts.output, parts.token_ids, k, temperature, uniforms,
            parts.embed_norm, parts.final_norm)
        kv.length = end
        return drafts, logits, q

    def start(self, seq: torch.Tensor, features: torch.Tensor, kv: FeatureCache | None = None) -> FeatureCache:
        """The head's cache after the target's prefill of ``seq`` (1, T) but its last token, whose features
        ``features`` (1, T-1, d) are: every pair but the last is fed, the last waits for the first draft.
        ``kv``: a cache already holding the first pairs of ``seq`` (a shared prompt prefix's)."""
        kv = kv if kv is not None else self.new_cache()  # type: ignore[attr-defined]
        kv.queued = kv.guess = None
        done = kv.length
        if features.shape[1] - 1 > done:
            kv.queue(features[:, done:-1])
            self(seq[:, done + 1:-1], kv)  # type: ignore[operator]
        if features.shape[1]:
            kv.queue(features[:, -1:])
        return kv


class FeatureDraft(FusedDecoder, FeatureDrafting):
    """``head`` drafting for ``target`` (a loaded model: transformers, compact or dynamically quantized).

    The target's input embedding is shared, not copied; the output layer is the target's rows for the head's
    ``head_token_ids`` (a SubsetHead: the other logits are -inf, never proposed) or, without them, the
    target's own output layer."""

    def __init__(self, head: FeatureHead, target: PreTrainedModel, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or head.fc.weight.dtype
        head = head.to(dtype)
        super().__init__(head.config, head.layers, dtype)
        self.head = head
        self._target = (target,)  # not a submodule: moving or quantizing the draft leaves the target alone
        target.feature_layers = tuple(sorted(set(feature_layers(target)) | set(head.feature_layers)))
        output = target.get_output_embeddings()
        ids = head.token_ids
        if ids:
            subset = SubsetHead(head.config.hidden_size, ids, output.out_features)
            with torch.no_grad():
                subset.linear.weight.copy_(float_weight(output)[subset.token_ids].to(dtype))
            self.output = subset.to(dtype)
        else:
            self._full_output = (output,)
        self.to(target.get_input_embeddings().weight.device)

    def get_input_embeddings(self) -> nn.Module:
        return self._target[0].get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.output if hasattr(self, "output") else self._full_output[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations run in: the weights', or float32 under a dynamic quantization (read once: a
        quantized layer unpacks its weight to tell)."""
        if "_compute_dtype" not in self.__dict__:
            self.__dict__["_compute_dtype"] = float_weight(self.qkv[0]).dtype
        return self.__dict__["_compute_dtype"]

    def new_cache(self, batch: int = 1) -> FeatureCache:
        """An empty cache; with ``batch`` > 1 for rows that pass their features to ``forward`` themselves."""
        weight = self.get_input_embeddings().weight
        return FeatureCache(len(self.qkv), self.kv_heads, self.head_dim, self.compute_dtype, weight.device, batch=batch,
                            fuse=self.fused)

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features (..., its feature width) as the head reads them (..., d)."""
        return self.head.fused(features, feature_layers(self._target[0]), self.compute_dtype)

    def forward(self, input_ids: torch.Tensor, past_key_values: FeatureCache, use_cache: bool = True,
                logits_to_keep: int = 0, input_features: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                used: torch.Tensor | None = None, widen: bool = True) -> CompactOutput:
        """Logits after ``input_ids`` (batch, n), each token paired with the feature of the token before it: the
        cache's queued features or its last guess, or ``input_features`` (batch, n, d) where the caller keeps them
        (batched rows, with ``attention_mask``, ``position_ids`` and ``used`` as in ``CompactLlama.forward``). The last
        position's hidden state becomes the cache's ``guess``. ``widen=False``: a SubsetHead's logits stay its own
        tokens' (``draft_ids`` names them)."""
        kv = past_key_values
        mask = attention_mask.to(self.compute_dtype) if attention_mask is not None else None
        hidden, logits = self._step(input_ids, kv, input_features, self._fused_output(logits_to_keep), mask,
                                    position_ids, used)
        output = self.get_output_embeddings()
        subset = isinstance(output, SubsetHead)
        if logits is None:
            last = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
            if not subset:  # the target's own layer, in the target's dtype (read once)
                if "_output_dtype" not in self.__dict__:
                    self.__dict__["_output_dtype"] = float_weight(output).dtype
                last = last.to(self.__dict__["_output_dtype"])
            return CompactOutput(output(last) if widen or not subset else output.linear(last))
        return CompactOutput(output.widen(logits) if subset and widen else logits)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The vocabulary ids of the logits ``forward(widen=False)`` gives (None: all of them)."""
        output = self.get_output_embeddings()
        return output.token_ids if isinstance(output, SubsetHead) else None

    def draft_logits(self, input_ids: torch.Tensor, kv: FeatureCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s logits of the last position (vocab,) after ``input_ids`` (1, n), where the head has a
        SubsetHead and the output layer runs in the call: the head's own tokens' logits only (not widened), with their
        vocabulary ids; else the full logits and None. The same numbers, cheaper: drafting reads an argmax."""
        fused = self._draft_output()
        if fused is None:
            return self(input_ids, kv, logits_to_keep=1).logits[0, -1], None
        if self.can_chain and input_ids.shape[0] == 1:
            logits = self._chain(input_ids, kv, 1)[1]
        else:
            logits = self._step(input_ids, kv, None, fused)[1][0, -1]
        return logits, self.draft_ids

    def _chain_parts(self) -> ChainParts | None:
        """What ``draft_chain`` reads, where the head can draft in one call (its ``fc``, layers and output rows in
        our kernel's blocks, float32 activations); else None. Read once, off the drafting path."""
        if "_chain_parts_" not in self.__dict__:
            fused = self._draft_output()
            table = self.get_input_embeddings().weight
            able = (fused is not None and type(self.head.fc) is BlockLinear and table.dtype == torch.float32
                    and self.compute_dtype == torch.float32 and self._block_stack() is not None)
            self.__dict__["_chain_parts_"] = ChainParts(table, self.head.fc.weights(), self._block_stack(),
                                                        fused.weights, self.draft_ids) if able else None
        return self.__dict__["_chain_parts_"]

    def _draft_output(self) -> FusedOutput | None:
        """The head's output rows over the last position in the one call, where it has a SubsetHead there (else
        None: drafting reads the full logits)."""
        if "_draft_rows" not in self.__dict__:
            output = self.get_output_embeddings()
            self.__dict__["_draft_rows"] = self._fused_output(1) if isinstance(output, SubsetHead) else None
        return self.__dict__["_draft_rows"]

    def _step(self, input_ids: torch.Tensor, kv: FeatureCache, features: torch.Tensor | None,
              output: FusedOutput | None, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's hidden states after ``input_ids``, each paired with its feature (``features``, else the cache's
        queued ones or its guess), and the logits ``output`` computes in the call (None: none); the last hidden state
        becomes the cache's guess."""
        dtype = self.compute_dtype
        features = kv.take(input_ids.shape[1]) if features is None else features
        embeds = self.get_input_embeddings()(input_ids).to(dtype)
        hidden, logits, _ = self._run(self.head.fc(torch.cat([embeds, features.to(dtype)], dim=-1)), kv, mask,
                                      positions, output, (), used)
        kv.guess = hidden[:, -1:]
        return hidden, logits

    def _output_parts(self) -> tuple[torch.Tensor | None, nn.Module]:
        output = self.get_output_embeddings()  # no norm: the head guesses a feature after its target's norm
        return None, output.linear if isinstance(output, SubsetHead) else output


def feature_layers(model: nn.Module) -> tuple[int, ...]:
    """The layers whose hidden states lead ``model``'s features (those of the heads bound to it)."""
    return getattr(model, "feature_layers", ())


def feature_width(model: nn.Module) -> int:
    """How wide ``model``'s features are: its width for the final feature and each of its ``feature_layers``."""
    return (len(feature_layers(model)) + 1) * model.config.hidden_size


def forward_with_features(model: PreTrainedModel, ids: torch.Tensor, kv: object, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the ``last`` final positions (last, vocab) and the features (1, n, ``feature_width``) of all
    ``ids``, extending ``kv``: a compact forward returns them directly, a transformers model through its base model."""
    device = model.get_input_embeddings().weight.device
    if hasattr(model, "hf"):
        out = model(input_ids=ids, past_key_values=kv, use_cache=True, logits_to_keep=max(last, 1), features=True)
        return out.logits[0, -last:].to(device) if last else out.logits[0, :0], out.features.to(device)
    taps = feature_layers(model)
    out = model.model(input_ids=ids, past_key_values=kv, use_cache=True, output_hidden_states=bool(taps))
    hidden = out.last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, -last:])[0] if last else hidden.new_empty(0)
    features = torch.cat([*(out.hidden_states[t + 1] for t in taps), hidden], dim=-1) if taps else hidden
    return logits.to(device), features.to(device)
