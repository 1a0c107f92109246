"""Train a feature head (EAGLE) on the target's own text and final hidden states.

Each example is a collected sequence x_0..x_{T-1} with the target's features f_0..f_{T-1}. The head
reads pairs (f_j, x_{j+1}) and is trained to give f_{j+1} (smooth-L1 regression, as in EAGLE) and,
through the target's output rows, the target's distribution at j+1 (cross-entropy to softmax of the
target's logits over the head's tokens). The training-time test (EAGLE-3) unrolls the head over its own
guesses for ``cfg.unroll`` steps, each attending as a draft would (``FeatureHead.unrolled``), the loss of step s
weighted 0.8^s.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from lssp.distill.config import DistillConfig, DistillReport, Progress
from lssp.distill.training import checkpoint_path, optimize, training_examples
from lssp.errors import UserError
from lssp.models.compact import float_weight
from lssp.models.draft_head import most_frequent
from lssp.models.eagle import (
    FeatureHead,
    check_feature_layers,
    check_head_fits,
    head_config,
    is_feature_head,
    load_feature_head,
    with_feature_layers,
    with_more_layers,
)

FEATURE_NOISE = 0.05  # uniform noise, relative to the features' RMS, added to the features the head reads
REGRESSION_WEIGHT = 0.2  # of the smooth-L1 feature loss, beside the cross-entropy
STEP_DECAY = 0.8  # the loss of unrolled step s weighs STEP_DECAY**s (EAGLE-3's training script)


def feature_examples(out: Path, cfg: DistillConfig) -> list[dict[str, torch.Tensor]]:
    """Collected sequences with the target's features at every position (shards written with kind eagle): those of
    ``cfg.feature_layers`` and the final feature, in that order."""
    examples = []
    for path in sorted((out / "data").glob("shard_*.pt")):
        rec = torch.load(path)
        if "features" not in rec:
            raise UserError(f"{path} has no target features: collect into another --data-dir for --kind eagle")
        columns = _feature_columns(path, list(rec.get("feature_layers", ())), cfg.feature_layers, rec["features"][0])
        for i, prompt in enumerate(rec["prompts"]):
            n = int(rec["lengths"][i])
            ids = torch.cat([prompt, rec["tokens"][i, :n]]).long()[-cfg.max_seq_len:]
            features = rec["features"][i][: len(prompt) + n][-cfg.max_seq_len:, columns].clone()  # frees the rest
            examples.append({"ids": ids, "features": features, "n": len(ids) - 1, "held_out": rec.get("split") == "held_out"})
    return examples


def _feature_columns(path: Path, stored: list[int], wanted: tuple[int, ...], sample: torch.Tensor) -> torch.Tensor:
    """The columns of a shard's features (of layers ``stored``, then the final) that hold ``wanted``'s, then the
    final feature's."""
    missing = sorted(set(wanted) - set(stored))
    if missing:
        have = ", ".join(map(str, stored)) or "none"
        raise UserError(f"{path} holds the target's features of layers {have} (and the final), not of "
                        f"{', '.join(map(str, missing))}: collect with --feature-layers into another --data-dir")
    width = sample.shape[-1] // (len(stored) + 1)
    chunks = [stored.index(t) for t in wanted] + [len(stored)]
    return torch.cat([torch.arange(c * width, (c + 1) * width) for c in chunks])


class HeadTrainer:
    """The loss and held-out agreement of ``head`` against ``target``'s features, over the head's tokens, the head
    unrolled over ``steps`` drafting steps."""

    def __init__(self, head: FeatureHead, target: PreTrainedModel, steps: int = 2) -> None:
        self.head = head
        self.steps = steps
        self.embed = target.get_input_embeddings()
        weight = float_weight(target.get_output_embeddings()).detach().float()
        ids = head.token_ids
        self.rows = weight[torch.tensor(ids)] if ids else weight  # frozen: the target's own output rows

    def _batch(self, batch: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        width = max(len(e["ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        features = torch.zeros(len(batch), width, batch[0]["features"].shape[-1])
        mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for r, e in enumerate(batch):
            ids[r, : len(e["ids"])] = e["ids"]
            features[r, : len(e["ids"])] = e["features"].float()
            mask[r, : len(e["ids"]) - 1] = True
        with torch.no_grad():
            embeds = self.embed(ids[:, 1:]).float()
        return embeds, features, mask

    def _steps(self, embeds: torch.Tensor, features: torch.Tensor, noise: bool) -> list[torch.Tensor]:
        """The head's guesses of f_1..f_{T-1} at each drafting step (step s: from its own guesses of s steps)."""
        given = self.head.fused(features[:, :-1], self.head.feature_layers)
        if noise:
            scale = FEATURE_NOISE * given.pow(2).mean().sqrt()
            given = given + (torch.rand_like(given) * 2 - 1) * scale
        return self.head.unrolled(embeds, given, self.steps)

    def loss(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        embeds, features, mask = self._batch(batch)
        total = embeds.new_zeros(())
        for step, guess in enumerate(self._steps(embeds, features, noise=True)):
            valid = mask.clone()
            valid[:, :step] = False  # no draft of step+1 tokens begins before position 0
            wanted = features[:, 1:, -self.rows.shape[1]:][valid]  # the final feature
            with torch.no_grad():
                p = (wanted @ self.rows.T).softmax(-1)
            guessed = guess[valid]
            log_q = (guessed @ self.rows.T).log_softmax(-1)
            step_loss = -(p * log_q).sum(-1).mean() + REGRESSION_WEIGHT * F.smooth_l1_loss(guessed, wanted)
            total = total + STEP_DECAY ** step * step_loss
        return total

    @torch.no_grad()
    def agreement(self, held_out: list[dict[str, torch.Tensor]], step: int = 0) -> float:
        """Share of positions where the head's top token is the target's (teacher-forced up to the draft's start,
        then ``step`` steps on its own guesses): a proxy for greedy acceptance at the draft's (step+1)-th token."""
        was = self.head.training
        self.head.eval()
        hits = total = 0
        for at in range(0, len(held_out), 16):
            embeds, features, mask = self._batch(held_out[at: at + 16])
            mask[:, :step] = False
            guessed, wanted = self._logits(embeds, features, mask, step)
            hits += int((guessed.argmax(-1) == wanted.argmax(-1)).sum())
            total += int(mask.sum())
        self.head.train(was)
        return hits / total if total else float("nan")

    def _logits(self, embeds: torch.Tensor, features: torch.Tensor, mask: torch.Tensor,
                step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's logits at drafting step ``step`` and the target's, over the head's tokens, where ``mask``."""
        given = self.head.fused(features[:, :-1], self.head.feature_layers)
        guess = self.head.unrolled(embeds, given, step + 1)[step][mask]
        return guess @ self.rows.T, features[:, 1:, -self.rows.shape[1]:][mask] @ self.rows.T


def _initial_head(target: PreTrainedModel, folder: str, layers: tuple[int, ...], depth: int) -> FeatureHead:
    """An earlier head to go on training (its shape and tokens win over the size options), in float32, reading the
    target's ``layers`` too (a head that reads none starts reading them as it drafted: ``with_feature_layers``), with
    ``depth`` decoder layers where it has fewer (the new ones start as the identity: ``with_more_layers``)."""
    if not is_feature_head(folder):
        raise UserError(f"--init-draft {folder} holds no feature head (config.json and fc weights)")
    head = load_feature_head(folder).float()
    check_head_fits(head, target, folder)
    if head.feature_layers and head.feature_layers != layers:
        raise UserError(f"--init-draft {folder} reads the target's layers {','.join(map(str, head.feature_layers))}: "
                        f"--feature-layers must name them")
    head = with_feature_layers(head, layers) if layers and not head.feature_layers else head
    return with_more_layers(head, depth) if depth > len(head.layers) else head


def train_head(target: PreTrainedModel, out: Path, cfg: DistillConfig, report: DistillReport,
               progress: Progress | None = None) -> FeatureHead:
    """Train (or resume training) a feature head for ``target`` on the collected shards (``out``'s and
    ``cfg.also_data``'s), from ``cfg.init_from``'s weights where given."""
    examples, held_out, others = training_examples(feature_examples, out, cfg)
    width = target.get_output_embeddings().out_features
    check_feature_layers(target, cfg.feature_layers)
    start = _initial_head(target, cfg.init_from, cfg.feature_layers, cfg.layers) if cfg.init_from else None
    token_ids = start.token_ids if start is not None else None
    if cfg.head_tokens or token_ids:
        counts = token_counts(examples, width)
        token_ids = token_ids or most_frequent(counts, cfg.head_tokens)
        report.head_coverage = float(counts[token_ids].sum() / counts.sum())
    torch.manual_seed(cfg.seed)
    head = start if start is not None else FeatureHead(head_config(target.config, cfg.layers, token_ids,
                                                                   cfg.feature_layers))
    return fit(head, HeadTrainer(head, target, cfg.unroll), examples, held_out, others, out, cfg, report, progress)


def fit(head: torch.nn.Module, trainer: HeadTrainer, examples: list, held_out: list, others: dict, out: Path,
        cfg: DistillConfig, report: DistillReport, progress: Progress | None) -> torch.nn.Module:
    """``optimize`` ``head`` under ``trainer``'s loss, then its held-out agreement at each later drafting step."""
    optimize(head, examples, held_out, trainer.loss, trainer.agreement, checkpoint_path(out, cfg), cfg, report, progress,
             others)
    for step in range(1, max(cfg.unroll, 2)) if held_out else ():
        report.acceptance[f"held-out top-1 agreement, draft token {step + 1} (on its own guesses)"] = \
            trainer.agreement(held_out, step)
    head.eval()
    return head


def token_counts(examples: list[dict[str, torch.Tensor]], vocab: int) -> torch.Tensor:
    """How often each token is a position's next token in ``examples``."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e["ids"][1:], minlength=vocab)
    return counts
