"""A draft output layer over the target's most frequent tokens only.

A small draft with a 49k-token vocabulary reads most of its bytes in the output layer. A
head over the N tokens the target emits most often costs a fraction of that, and misses
only the rare tokens (distill records the share of the training tokens it covers). Its
logits come out full width, -inf elsewhere, so a token outside the head is simply never
proposed: speculative sampling stays exact, the residual max(0, p - q) gives those tokens
their full probability.

The chosen ids are kept in the draft's config.json as ``head_token_ids``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, LlamaForCausalLM, PreTrainedModel

HEAD_KEY = "head_token_ids"


class SubsetHead(nn.Module):
    """Logits for ``token_ids`` from ``linear``; every other of the ``vocab_size`` logits is -inf."""

    def __init__(self, hidden_size: int, token_ids: list[int], vocab_size: int) -> None:
        super().__init__()
        if any(a >= b for a, b in zip(token_ids, token_ids[1:])):  # drafting samples them in the vocabulary's order
            raise ValueError(f"{HEAD_KEY} must be increasing")
        self.linear = nn.Linear(hidden_size, len(token_ids), bias=False)
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        position = torch.full((vocab_size,), -1, dtype=torch.long)
        position[self.token_ids] = torch.arange(len(token_ids))
        self.register_buffer("position", position, persistent=False)  # vocabulary id -> row, -1 if absent
        self.in_features, self.out_features = hidden_size, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.widen(self.linear(hidden))

    def widen(self, subset: torch.Tensor) -> torch.Tensor:
        """Full-width logits from the ``token_ids``' own (-inf elsewhere)."""
        out = subset.new_full((*subset.shape[:-1], self.out_features), float("-inf"))
        out[..., self.token_ids] = subset
        return out


def most_frequent(token_counts: torch.Tensor, n: int) -> list[int]:
    """The ``n`` most frequent ids, in increasing id order."""
    return sorted(token_counts.topk(min(n, len(token_counts))).indices.tolist())


def attach_subset_head(model: LlamaForCausalLM, token_ids: list[int]) -> LlamaForCausalLM:
    """Replace ``model``'s output layer by a SubsetHead initialised from its rows for ``token_ids``."""
    old = model.get_output_embeddings()
    head = SubsetHead(model.config.hidden_size, token_ids, model.config.vocab_size).to(old.weight.device)
    with torch.no_grad():
        head.linear.weight.copy_(old.weight[head.token_ids].to(head.linear.weight.dtype))
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = {}  # the input embedding stays full width and no longer shares the head
    model.lm_head = head
    setattr(model.config, HEAD_KEY, list(token_ids))
    return model


def subset_head(model: PreTrainedModel) -> SubsetHead | None:
    head = model.get_output_embeddings()
    return head if isinstance(head, SubsetHead) else None


def has_subset_head(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    return config.exists() and HEAD_KEY in json.loads(config.read_text())


def load_subset_head_model(folder: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A draft saved with a SubsetHead (transformers' from_pretrained does not know that layer)."""
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(folder)
    ids = getattr(config, HEAD_KEY)
    model = LlamaForCausalLM(config)
    attach_subset_head(model, ids)
    state = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(shard))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype)
