"""Train an EAGLE-3 head (``lssp.models.eagle3``) on the target's own text and hidden states, in its published layout.

Each collected sequence x_0..x_{T-1} comes with the target's hidden states after three of its layers (the states
entering layers L+1 that the head's ``eagle_aux_hidden_state_layer_ids`` name) and its final feature. The head reads
pairs (fc(states at j), x_{j+1}) and is trained, through its own ``norm`` and ``lm_head``, towards the target's
distribution at j+1 over the draft vocabulary (cross-entropy to the softmax of the target's logits over those
tokens): no feature regression, as EAGLE-3 has none. The training-time test unrolls the head over its own outputs
for ``cfg.unroll`` steps (``Eagle3Head.unrolled``), step s weighted 0.8^s (``STEP_DECAY``).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

from lssp.distill.config import DistillConfig, DistillReport, Progress
from lssp.distill.head_training import STEP_DECAY, HeadTrainer, feature_examples, fit, token_counts
from lssp.distill.training import checkpoint_path, training_examples
from lssp.errors import UserError
from lssp.models.compact import float_weight
from lssp.models.draft_head import most_frequent
from lssp.models.eagle import check_feature_layers, head_config
from lssp.models.eagle3 import AUX_KEY, Eagle3Head, default_aux_ids, is_eagle3_head, load_eagle3_head


def default_taps(target: PreTrainedModel) -> tuple[int, ...]:
    """Our feature layers for vLLM's default EAGLE-3 layers (the states entering 2, L/2 and L-3 leave 1, L/2-1, L-4)."""
    return tuple(i - 1 for i in default_aux_ids(target.config.num_hidden_layers))


class Eagle3Trainer(HeadTrainer):
    """The loss and held-out agreement of an EAGLE-3 head against ``target``'s features over its draft vocabulary,
    the head unrolled over ``steps`` drafting steps."""

    def __init__(self, head: Eagle3Head, target: PreTrainedModel, taps: tuple[int, ...], steps: int = 2) -> None:
        self.head, self.steps = head, steps
        self.embed = target.get_input_embeddings()
        self.rows = float_weight(target.get_output_embeddings()).detach().float()[head.token_ids]
        width = target.config.hidden_size
        stored = sorted(set(taps))  # the columns ``feature_examples`` keeps: these layers', then the final
        self.columns = torch.cat([torch.arange(stored.index(t) * width, (stored.index(t) + 1) * width) for t in taps])

    def _guesses(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        fused = self.head.fc(features[:, :-1, self.columns])
        return [self.head.lm_head(self.head.norm(s)) for s in self.head.unrolled(embeds, fused, steps)]

    def _wanted(self, features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary at the valid positions (from its final feature)."""
        return features[:, 1:, -self.rows.shape[1]:][valid] @ self.rows.T

    def loss(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        embeds, features, mask = self._batch(batch)
        total = embeds.new_zeros(())
        for step, logits in enumerate(self._guesses(embeds, features, self.steps)):
            valid = mask.clone()
            valid[:, :step] = False  # no draft of step+1 tokens begins before position 0
            with torch.no_grad():
                p = self._wanted(features, valid).softmax(-1)
            total = total - STEP_DECAY ** step * (p * logits[valid].log_softmax(-1)).sum(-1).mean()
        return total

    def _logits(self, embeds: torch.Tensor, features: torch.Tensor, mask: torch.Tensor,
                step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's logits at drafting step ``step`` and the target's, over the draft vocabulary, where ``mask``
        (``agreement``: their argmaxes agree)."""
        return self._guesses(embeds, features, step + 1)[step][mask], self._wanted(features, mask)


def new_eagle3_head(target: PreTrainedModel, taps: tuple[int, ...], token_ids: list[int]) -> Eagle3Head:
    """A fresh head of the target's width, heads and MLP reading ``taps``, over the draft vocabulary ``token_ids``
    (increasing): ``lm_head`` and ``norm`` start as the target's output rows and final norm, ``fc`` as the identity on
    the highest layer's state (zero on the others)."""
    config = head_config(target.config)
    config.draft_vocab_size = len(token_ids)
    config.eagle_config = {AUX_KEY: [t + 1 for t in taps]}
    head = Eagle3Head(config, tuple(t + 1 for t in taps))
    width = config.hidden_size
    with torch.no_grad():
        head.d2t.copy_(torch.tensor(token_ids) - torch.arange(len(token_ids)))
        head.t2d.zero_()
        head.t2d[token_ids] = True
        head.lm_head.weight.copy_(float_weight(target.get_output_embeddings()).float()[token_ids])
        norm = getattr(getattr(target, "model", target), "norm", None)
        if norm is not None:
            head.norm.weight.copy_(norm.weight.float())
        head.fc.weight.zero_()
        high = max(range(len(taps)), key=lambda i: taps[i])
        head.fc.weight[:, high * width:(high + 1) * width] = torch.eye(width)
    return head


def train_eagle3_head(target: PreTrainedModel, out: Path, cfg: DistillConfig, report: DistillReport,
                      progress: Progress | None = None) -> Eagle3Head:
    """Train (or resume training) an EAGLE-3 head for ``target`` on the collected shards, from ``cfg.init_from``'s
    weights where given; the draft vocabulary: ``cfg.head_tokens`` most frequent tokens of the data (0: all)."""
    taps = cfg.feature_layers or default_taps(target)
    check_feature_layers(target, taps)
    examples, held_out, others = training_examples(feature_examples, out, replace_taps(cfg, taps))
    if cfg.init_from:
        if not is_eagle3_head(cfg.init_from):
            raise UserError(f"--init-draft {cfg.init_from} holds no EAGLE-3 head (config.json naming "
                            "LlamaForCausalLMEagle3)")
        head = load_eagle3_head(cfg.init_from, target).float()
        if tuple(i - 1 for i in head.aux_ids) != tuple(taps):
            raise UserError(f"--init-draft {cfg.init_from} reads the states entering layers {list(head.aux_ids)}: "
                            f"--feature-layers must be {','.join(str(i - 1) for i in head.aux_ids)}")
    else:
        vocab = target.get_output_embeddings().out_features
        counts = token_counts(examples, vocab)
        token_ids = checkpoint_vocabulary(checkpoint_path(out, cfg)) or \
            (most_frequent(counts, cfg.head_tokens) if cfg.head_tokens else list(range(vocab)))
        report.head_coverage = float(counts[token_ids].sum() / counts.sum())
        torch.manual_seed(cfg.seed)
        head = new_eagle3_head(target, taps, token_ids)
    return fit(head, Eagle3Trainer(head, target, taps, cfg.unroll), examples, held_out, others, out, cfg, report,
               progress)


def checkpoint_vocabulary(path: Path) -> list[int] | None:
    """The draft vocabulary of the head checkpointed at ``path`` (None: no checkpoint): resumed on more data, the head
    keeps the tokens its ``lm_head`` rows were trained on, whatever the new data's most frequent ones."""
    if not path.exists():
        return None
    d2t = torch.load(path, map_location="cpu")["model"]["d2t"]
    return (torch.arange(len(d2t)) + d2t).tolist()


def replace_taps(cfg: DistillConfig, taps: tuple[int, ...]) -> DistillConfig:
    """``cfg`` reading the features of ``taps`` (what ``feature_examples`` keeps)."""
    other = copy.copy(cfg)
    other.feature_layers = tuple(sorted(set(taps)))
    return other
