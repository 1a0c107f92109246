"""Facts about a loaded torch model that every layer asks: where it runs, how wide its logits are."""
from __future__ import annotations

import torch
from transformers import PreTrainedModel


def model_device(model: PreTrainedModel) -> torch.device:
    """Where the input embeddings live: where ids go in and sampling happens."""
    return model.get_input_embeddings().weight.device


def logit_width(model: PreTrainedModel) -> int:
    """How many logits the model's output layer gives (its vocabulary, padded or not)."""
    return model.get_output_embeddings().out_features
