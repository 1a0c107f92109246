"""Train a feature head (EAGLE) on the target's own text and final hidden states.

Each example is a collected sequence x_0..x_{T-1} with the target's features f_0..f_{T-1}. The head
reads pairs (f_j, x_{j+1}) and is trained to give f_{j+1} (smooth-L1 regression, as in EAGLE) and,
through the target's output rows, the target's distribution at j+1 (cross-entropy to softmax of the
target's logits over the head's tokens). A second, unrolled pass feeds the head its own guesses in
place of the real features, as drafting does after its first token (training-time test, EAGLE-3).
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
from lssp.models.eagle import FeatureHead, head_config

FEATURE_NOISE = 0.05  # uniform noise, relative to the features' RMS, added to the features the head reads
REGRESSION_WEIGHT = 0.2  # of the smooth-L1 feature loss, beside the cross-entropy


def feature_examples(out: Path, cfg: DistillConfig) -> list[dict[str, torch.Tensor]]:
    """Collected sequences with the target's features at every position (shards written with kind eagle)."""
    examples = []
    for path in sorted((out / "data").glob("shard_*.pt")):
        rec = torch.load(path)
        if "features" not in rec:
            raise UserError(f"{path} has no target features: collect into another --data-dir for --kind eagle")
        for i, prompt in enumerate(rec["prompts"]):
            n = int(rec["lengths"][i])
            ids = torch.cat([prompt, rec["tokens"][i, :n]]).long()[-cfg.max_seq_len:]
            features = rec["features"][i][: len(prompt) + n][-cfg.max_seq_len:].clone()  # frees the rest
            examples.append({"ids": ids, "features": features, "n": len(ids) - 1, "held_out": rec.get("split") == "held_out"})
    return examples


class HeadTrainer:
    """The loss and held-out agreement of ``head`` against ``target``'s features, over the head's tokens."""

    def __init__(self, head: FeatureHead, target: PreTrainedModel) -> None:
        self.head = head
        self.embed = target.get_input_embeddings()
        weight = float_weight(target.get_output_embeddings()).detach().float()
        ids = head.token_ids
        self.rows = weight[torch.tensor(ids)] if ids else weight  # frozen: the target's own output rows

    def _batch(self, batch: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        width = max(len(e["ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        features = torch.zeros(len(batch), width, self.rows.shape[1])
        mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for r, e in enumerate(batch):
            ids[r, : len(e["ids"])] = e["ids"]
            features[r, : len(e["ids"])] = e["features"].float()
            mask[r, : len(e["ids"]) - 1] = True
        with torch.no_grad():
            embeds = self.embed(ids[:, 1:]).float()
        return embeds, features, mask

    def _passes(self, embeds: torch.Tensor, features: torch.Tensor, noise: bool) -> list[torch.Tensor]:
        """The head's guesses of f_1..f_{T-1}: from the real features, then from its own first guesses."""
        given = features[:, :-1]
        if noise:
            scale = FEATURE_NOISE * given.pow(2).mean().sqrt()
            given = given + (torch.rand_like(given) * 2 - 1) * scale
        first = self.head(embeds, given)
        # Unrolled: position j reads the guess made at j-1 for f_j (position 0 keeps the real f_0).
        own = torch.cat([given[:, :1], first[:, :-1].detach()], dim=1)
        return [first, self.head(embeds, own)]

    def loss(self, batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        embeds, features, mask = self._batch(batch)
        wanted = features[:, 1:][mask]
        with torch.no_grad():
            p = (wanted @ self.rows.T).softmax(-1)
        total = embeds.new_zeros(())
        for weight, guess in zip((1.0, 0.5), self._passes(embeds, features, noise=True)):
            guessed = guess[mask]
            log_q = (guessed @ self.rows.T).log_softmax(-1)
            total = total + weight * (-(p * log_q).sum(-1).mean() + REGRESSION_WEIGHT * F.smooth_l1_loss(guessed, wanted))
        return total

    @torch.no_grad()
    def agreement(self, held_out: list[dict[str, torch.Tensor]], unrolled: bool = False) -> float:
        """Share of positions where the head's top token is the target's (teacher-forced; ``unrolled``: reading
        its own guess of the feature before): a proxy for greedy acceptance at the first (second) draft."""
        was = self.head.training
        self.head.eval()
        hits = total = 0
        for at in range(0, len(held_out), 16):
            embeds, features, mask = self._batch(held_out[at: at + 16])
            guess = self._passes(embeds, features, noise=False)[int(unrolled)][mask]
            hits += int(((guess @ self.rows.T).argmax(-1) == (features[:, 1:][mask] @ self.rows.T).argmax(-1)).sum())
            total += int(mask.sum())
        self.head.train(was)
        return hits / total if total else float("nan")


def train_head(target: PreTrainedModel, out: Path, cfg: DistillConfig, report: DistillReport,
               progress: Progress | None = None) -> FeatureHead:
    """Train (or resume training) a feature head for ``target`` on the collected shards (``out``'s and
    ``cfg.also_data``'s)."""
    examples, held_out, others = training_examples(feature_examples, out, cfg)
    width = target.get_output_embeddings().out_features
    token_ids = None
    if cfg.head_tokens:
        counts = torch.zeros(width, dtype=torch.long)
        for e in examples:
            counts += torch.bincount(e["ids"][1:], minlength=width)
        token_ids = most_frequent(counts, cfg.head_tokens)
        report.head_coverage = float(counts[token_ids].sum() / counts.sum())
    torch.manual_seed(cfg.seed)
    head = FeatureHead(head_config(target.config, cfg.layers, token_ids))
    trainer = HeadTrainer(head, target)
    optimize(head, examples, held_out, trainer.loss, trainer.agreement, checkpoint_path(out, cfg), cfg, report, progress,
             others)
    if held_out:
        report.acceptance["held-out top-1 agreement, second draft (unrolled)"] = trainer.agreement(held_out, unrolled=True)
    head.eval()
    return head
