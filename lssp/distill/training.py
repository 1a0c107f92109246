"""Train the draft on the collected shards: initialisation, loss, the resumable loop, top-1 agreement."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from lssp.distill.config import DistillConfig, DistillReport, Progress
from lssp.errors import UserError
from lssp.models.draft_head import (
    attach_subset_head,
    has_subset_head,
    load_subset_head_model,
    most_frequent,
    subset_head,
)
from lssp.models.modules import logit_width

Examples = list[dict[str, torch.Tensor]]  # training sequences, as _examples or head_training.feature_examples give


def _examples(out: Path, cfg: DistillConfig) -> Examples:
    """Training sequences of the collection in ``out``: prompt + kept continuation, with the target's top-k at each
    continuation position."""
    examples = []
    for path in sorted((out / "data").glob("shard_*.pt")):
        rec = torch.load(path)
        for i, prompt in enumerate(rec["prompts"]):
            n = int(rec["lengths"][i])
            room = max(1, cfg.max_seq_len - n)
            prompt = prompt[-room:]
            examples.append({"ids": torch.cat([prompt, rec["tokens"][i, :n]]).long(), "start": len(prompt) - 1,
                             "top_ids": rec["top_ids"][i, :n].long(), "top_lp": rec["top_lp"][i, :n].float(), "n": n,
                             "held_out": rec.get("split") == "held_out"})
    return examples


def draft_config(target: PreTrainedModel, cfg: DistillConfig) -> LlamaConfig:
    tc = target.config
    return LlamaConfig(
        vocab_size=logit_width(target), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rope_theta=getattr(tc, "rope_theta", 10000.0), rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )


def init_draft(target: PreTrainedModel, cfg: DistillConfig) -> LlamaForCausalLM:
    """A fresh draft whose tied embedding is the target's, projected on its top principal directions."""
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(draft_config(target, cfg))
    emb = target.get_input_embeddings().weight.detach().float().cpu()
    centered = emb - emb.mean(0)
    _, _, v = torch.linalg.svd(centered[:: max(1, len(emb) // 16384)], full_matrices=False)
    projected = emb @ v[: cfg.hidden_size].T
    projected *= emb.std() / projected.std()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(projected[: draft.config.vocab_size])
    return draft


def load_initial_draft(target: PreTrainedModel, cfg: DistillConfig) -> LlamaForCausalLM:
    """An earlier draft to go on training, in float32; it must cover the target's vocabulary."""
    try:
        if has_subset_head(cfg.init_from):
            draft = load_subset_head_model(cfg.init_from, torch.float32)
        else:
            draft = LlamaForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load --init-draft {cfg.init_from}: {str(exc).splitlines()[0]}") from None
    if logit_width(draft) != logit_width(target):
        raise UserError(f"--init-draft {cfg.init_from} has {logit_width(draft)} logits, the target {logit_width(target)}")
    return draft


def _loss(draft: LlamaForCausalLM, batch: Examples, cfg: DistillConfig) -> torch.Tensor:
    width = max(len(e["ids"]) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for r, e in enumerate(batch):
        ids[r, : len(e["ids"])] = e["ids"]
        mask[r, : len(e["ids"])] = 1
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    # Positions whose next token the target produced: start .. start+n-1.
    rows, cols, top_ids, top_lp, hard = [], [], [], [], []
    for r, e in enumerate(batch):
        n = len(e["top_ids"])
        rows.append(torch.full((n,), r))
        cols.append(torch.arange(e["start"], e["start"] + n))
        top_ids.append(e["top_ids"])
        top_lp.append(e["top_lp"])
        hard.append(e["top_ids"][:, 0])  # the target's own argmax: what greedy acceptance needs
    h = hidden[torch.cat(rows), torch.cat(cols)]
    top_ids_t, p, hard_t = torch.cat(top_ids), torch.cat(top_lp).exp(), torch.cat(hard)
    head = subset_head(draft)
    if head is None:
        logq = draft.lm_head(h).float().log_softmax(-1)
    else:  # train the head's own rows; target tokens outside it are out of the draft's reach
        logq = head.linear(h).float().log_softmax(-1)
        top_ids_t, hard_t = head.position[top_ids_t], head.position[hard_t]
        p = p * (top_ids_t >= 0)
        top_ids_t, hard_t = top_ids_t.clamp(min=0), hard_t.masked_fill(hard_t < 0, -100)
    soft = -(p * logq.gather(-1, top_ids_t)).sum(-1).mean()
    hard_loss = F.nll_loss(logq, hard_t) if (hard_t >= 0).any() else logq.sum() * 0
    return (1 - cfg.hard_weight) * soft + cfg.hard_weight * hard_loss


@torch.no_grad()
def top1_agreement(draft: LlamaForCausalLM, examples: Examples, batch_size: int = 16) -> float:
    """Share of positions where the draft's argmax is the target's (teacher-forced): a cheap proxy for greedy α."""
    was_training = draft.training
    draft.eval()
    hits = total = 0
    for i in range(0, len(examples), batch_size):
        batch = examples[i: i + batch_size]
        width = max(len(e["ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for r, e in enumerate(batch):
            ids[r, : len(e["ids"])] = e["ids"]
        logits = draft(input_ids=ids).logits
        for r, e in enumerate(batch):
            n = len(e["top_ids"])
            guess = logits[r, e["start"]: e["start"] + n].argmax(-1)
            hits += int((guess == e["top_ids"][:, 0]).sum())
            total += n
    draft.train(was_training)
    return hits / total if total else float("nan")


def checkpoint_path(out: Path, cfg: DistillConfig) -> Path:
    """Where training of ``cfg.kind`` checkpoints in ``out``: one file per kind, so a draft and a head can be
    trained on the same collection."""
    return out / f"checkpoint-{cfg.kind}.pt"


def held_out_split(examples: Examples, out: Path) -> tuple[Examples, Examples]:
    """The training examples and those held out to measure agreement as training goes: the answers to held-out
    prompts where the collection has them (``split: held_out``), else ~2% of the sequences (at most 64)."""
    if not examples:
        raise UserError(f"no training data in {out / 'data'}")
    if any(e["held_out"] for e in examples):
        return [e for e in examples if not e["held_out"]], [e for e in examples if e["held_out"]]
    held = min(64, len(examples) // 50)
    return (examples[:-held], examples[-held:]) if held else (examples, [])


def training_examples(read: Callable[[Path, DistillConfig], Examples], out: Path,
                      cfg: DistillConfig) -> tuple[Examples, Examples, dict[str, Examples]]:
    """What ``read`` gives of the collection in ``out`` and of those in ``cfg.also_data``: the examples trained on
    (all of them but the held-out ones), ``out``'s held-out examples (the agreement curve's), and each other
    collection's held-out examples, by folder (measured once trained)."""
    examples, held_out = held_out_split(read(out, cfg), out)
    others = {}
    for folder in map(Path, cfg.also_data):
        trained, held = held_out_split(read(folder, cfg), folder)
        examples += trained
        if held:
            others[str(folder)] = held
    return examples, held_out, others


def train(target: PreTrainedModel, out: Path, cfg: DistillConfig, report: DistillReport,
          progress: Progress | None = None) -> LlamaForCausalLM:
    """Train (or resume training) the draft on the collected shards (``out``'s and ``cfg.also_data``'s)."""
    examples, held_out, others = training_examples(_examples, out, cfg)
    draft = load_initial_draft(target, cfg) if cfg.init_from else init_draft(target, cfg)
    if cfg.head_tokens or subset_head(draft) is not None:
        counts = torch.zeros(logit_width(draft), dtype=torch.long)
        for e in examples:
            counts += torch.bincount(e["ids"][e["start"] + 1:], minlength=len(counts))
        if subset_head(draft) is None:
            attach_subset_head(draft, most_frequent(counts, cfg.head_tokens))
        report.head_coverage = float(counts[subset_head(draft).token_ids].sum() / counts.sum())
    draft = optimize(draft, examples, held_out, lambda batch: _loss(draft, batch, cfg),
                     lambda held: top1_agreement(draft, held), checkpoint_path(out, cfg), cfg, report, progress, others)
    draft.eval()
    return draft


Loss = Callable[[Examples], torch.Tensor]
Agreement = Callable[[Examples], float]


def training_precision(model: nn.Module, precision: str) -> str:
    """bf16 (forwards and backwards under autocast; the weights and optimizer stay fp32) or fp32: ``precision``, or
    for auto bf16 on a GPU or CPU that computes it natively (on an AVX512-BF16 EPYC a feature head's training step
    takes 0.4x its fp32 time, a draft's 0.75x)."""
    from lssp.report.results import native_bf16

    if precision != "auto":
        return precision
    device = next(model.parameters()).device
    return "bf16" if (torch.cuda.is_bf16_supported() if device.type == "cuda" else native_bf16()) else "fp32"


def optimize(model: nn.Module, examples: Examples, held_out: Examples, loss_of: Loss, agreement_of: Agreement,
             ckpt_path: Path, cfg: DistillConfig, report: DistillReport, progress: Progress | None = None,
             other_held_out: dict[str, Examples] | None = None) -> nn.Module:
    """AdamW with warm-up and cosine decay over random batches of ``examples`` until ``cfg``'s step or time budget,
    resuming from and saving to ``ckpt_path``; records the loss and held-out agreement curves in ``report``, and
    the final agreement on each of ``other_held_out`` in its acceptance table."""
    tokens_per_epoch = sum(e["n"] for e in examples)  # each example: "n" positions trained on
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps_per_epoch = max(1, len(examples) // cfg.batch_size)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    step, seconds, seen = 0, 0.0, 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path)
        mine, theirs = model.state_dict(), state["model"]
        if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
            raise UserError(f"the checkpoint {ckpt_path} is of a draft of another shape (layers, width, feature "
                            f"layers): go on with its own options, or give another --data-dir")
        model.load_state_dict(theirs)
        opt.load_state_dict(state["optimizer"])
        step, seconds, seen = state["step"], state["seconds"], state["seen"]
        report.loss_curve = [tuple(x) for x in state["loss_curve"]]
        report.agreement_curve = [tuple(x) for x in state.get("agreement_curve", [])]
        report.started_from = state.get("started_from", report.started_from)  # read before OUT was overwritten
    report.precision = training_precision(model, cfg.precision)
    precision = torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16,
                               enabled=report.precision == "bf16")
    agreement_of = _under(precision, agreement_of)
    if step == 0 and held_out:
        report.agreement_curve.append((0, 0, agreement_of(held_out)))  # the starting point
    generator = torch.Generator().manual_seed(cfg.seed)
    model.train()
    recent: list[float] = []
    last_save = time.perf_counter()
    while step < total_steps and seconds < cfg.train_minutes * 60:
        start = time.perf_counter()
        generator.manual_seed(cfg.seed * 7919 + step)
        pick = torch.randint(len(examples), (cfg.batch_size,), generator=generator).tolist()
        batch = [examples[i] for i in pick]
        warmup = min(1.0, (step + 1) / 50)
        done = max(step / total_steps, seconds / (cfg.train_minutes * 60))  # whichever budget ends first
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * warmup * (0.1 + 0.9 * decay)
        with precision:
            loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += sum(e["n"] for e in batch)
        seconds += time.perf_counter() - start
        recent.append(float(loss.detach()))
        if step % 25 == 0 or step == total_steps:
            report.loss_curve.append((step, seen, sum(recent) / len(recent)))
            recent.clear()
            if held_out and (step % 200 == 0 or step == total_steps):
                report.agreement_curve.append((step, seen, agreement_of(held_out)))
            if progress:
                agree = f", held-out top-1 {report.agreement_curve[-1][2]:.3f}" if report.agreement_curve else ""
                progress("train", min(1.0, max(step / total_steps, seconds / (cfg.train_minutes * 60))),
                         f"step {step}, loss {report.loss_curve[-1][2]:.3f}, {seen / tokens_per_epoch:.2f} epochs{agree}")
        if time.perf_counter() - last_save > 120 or step == total_steps:
            _save_checkpoint(ckpt_path, model, opt, step, seconds, seen, report)
            last_save = time.perf_counter()
    _save_checkpoint(ckpt_path, model, opt, step, seconds, seen, report)
    report.steps, report.train_seconds = step, seconds
    report.final_loss = report.loss_curve[-1][2] if report.loss_curve else float("nan")
    if held_out:
        report.agreement_curve.append((step, seen, agreement_of(held_out)))
    for folder, held in (other_held_out or {}).items():
        report.acceptance[f"held-out top-1 agreement on {folder}"] = agreement_of(held)
    return model


def _under(context: contextlib.AbstractContextManager, agreement_of: Agreement) -> Agreement:
    """``agreement_of`` measured under ``context`` (the precision training runs in)."""
    def measured(examples: Examples) -> float:
        with context:
            return agreement_of(examples)
    return measured


def _save_checkpoint(path: Path, draft: nn.Module, opt: torch.optim.Optimizer, step: int, seconds: float,
                     seen: int, report: DistillReport) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "seconds": seconds,
                "seen": seen, "loss_curve": report.loss_curve, "agreement_curve": report.agreement_curve,
                "started_from": report.started_from}, tmp)
    tmp.replace(path)
