"""Make a small Llama draft for a target: collect the target's own continuations and
distributions, then train the draft to match them (soft cross-entropy to the target's
top-k probabilities plus cross-entropy on the sampled tokens).

Both phases checkpoint into the output folder, so an interrupted run resumes.

- config: DistillConfig, DistillReport, Collected
- data: the built-in training prompts
- conversations: training and held-out contexts from ShareGPT's conversations (--source sharegpt)
- collection: batched generation (rows at positions of their own) and scoring of the target, repeat prompts,
  resumable shards
- training: draft initialisation or loading, loss, training loop, checkpoints
- card: the draft's files and model card; earlier_training reads one back
- acceptance: held_out_acceptance of a written draft
- head_training: a feature head (EAGLE, --kind eagle) trained on the target's features
- eagle3_training: an EAGLE-3 head (--kind eagle3) in its published layout
"""
from __future__ import annotations

from lssp.distill.acceptance import HELD_OUT_ACCEPTANCE, held_out_acceptance
from lssp.distill.card import earlier_training, write_draft, write_eagle3_head, write_head
from lssp.distill.collection import (
    REPEAT_CUE,
    REPEAT_WINDOW,
    chosen_shard,
    collect,
    collection_model,
    collection_spec,
    collection_summary,
    generate_rows,
    repeat_prompts,
)
from lssp.distill.config import Collected, DistillConfig, DistillReport, Progress
from lssp.distill.data import training_prompts
from lssp.distill.eagle3_training import default_taps, train_eagle3_head
from lssp.distill.head_training import train_head
from lssp.distill.training import draft_config, init_draft, load_initial_draft, top1_agreement, train

__all__ = [
    "HELD_OUT_ACCEPTANCE", "REPEAT_CUE", "REPEAT_WINDOW", "Collected", "DistillConfig", "DistillReport", "Progress",
    "chosen_shard", "collect", "collection_summary", "collection_model", "collection_spec", "generate_rows", "draft_config", "earlier_training", "held_out_acceptance", "init_draft",
    "load_initial_draft", "repeat_prompts", "top1_agreement", "train", "train_head", "training_prompts", "write_draft",
    "write_eagle3_head", "train_eagle3_head", "default_taps",
    "write_head",
]
