"""Settings of a distillation run and what it reports."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Progress = Callable[[str, float, str], None]  # phase, fraction done, message
SOURCES = ("built-in", "sharegpt", "documents")  # --source: the prompts the target answers


@dataclass
class DistillConfig:
    kind: str = "draft"  # "draft": a small Llama; "eagle": a feature-level head over the target's hidden states
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 768
    data_tokens: int = 100_000  # target-generated tokens to collect
    batch_prompts: int = 16
    new_tokens: int = 96  # tokens generated per prompt
    temperatures: tuple[float, ...] = (0.0, 0.7, 0.0, 1.0)  # cycled per batch: half greedy
    top_k_saved: int = 32
    train_minutes: float = 10.0
    max_steps: int = 0  # 0: until train_minutes run out
    epochs: float = 4.0
    batch_size: int = 16
    lr: float = 3e-3
    hard_weight: float = 0.3
    seed: int = 0
    max_seq_len: int = 160
    init_from: str | None = None  # a draft folder whose weights (and shape) training starts from
    head_tokens: int = 0  # >0: the output layer covers only the target's most frequent tokens (see draft_head)
    on_policy: float = 0.0  # share of new shards the init_from draft writes and the target scores (teacher-forced)
    repeat_share: float = 0.0  # share of new shards the target continues from a cue repeated out of earlier text
    source: str = "built-in"  # the prompts: "built-in" (lssp.distill.data), "sharegpt" (lssp.distill.conversations)
    #   or "documents" (lssp.distill.documents)
    max_prompt_tokens: int = 384  # sharegpt, documents: longer contexts are left out (prefill and memory grow with them)
    precision: str = "auto"  # of training's forward: "bf16" (autocast, fp32 weights), "fp32", "auto" (bf16 where native)
    also_data: tuple[str, ...] = ()  # other collections' folders (their data/ is read, never written) trained on too
    unroll: int = 2  # a head's training-time test: drafting steps unrolled over its own guesses (EAGLE-3)
    feature_layers: tuple[int, ...] = ()  # a head also reads the target's hidden states after these layers (EAGLE-3)


@dataclass
class DistillReport:
    target: str
    config: dict
    data_tokens: int = 0
    collect_seconds: float = 0.0
    steps: int = 0
    train_seconds: float = 0.0
    final_loss: float = float("nan")
    loss_curve: list[tuple[int, int, float]] = field(default_factory=list)  # (step, tokens seen, loss)
    agreement_curve: list[tuple[int, int, float]] = field(default_factory=list)  # (step, tokens seen, held-out top-1)
    acceptance: dict[str, float] = field(default_factory=dict)
    parameters: int = 0
    started_from: dict = field(default_factory=dict)  # the --init-draft's own report and command, if any
    head_coverage: float = float("nan")  # share of the training tokens a frequent-token head covers
    draft_written_tokens: int = 0  # of data_tokens, those the starting draft wrote (on-policy) and the target scored
    repeat_tokens: int = 0  # of data_tokens, the target's continuations of a repeated cue (see repeat_prompts)
    precision: str = ""  # what training ran in: bf16 (autocast) or fp32
    also_data: list[dict] = field(default_factory=list)  # the other collections trained on: path, source, tokens, seconds
    rebuilt_tokens: int = 0  # of data_tokens, those written again from token ids (--tokens-from): text seen before


@dataclass
class Collected:
    tokens: int
    seconds: float
    draft_tokens: int
    repeat_tokens: int
    held_out_tokens: int = 0  # answers to the held-out prompts (not counted in tokens)
    rebuilt_tokens: int = 0  # of tokens, those written again from token ids (``--tokens-from``): text seen before
