"""Make a small Llama draft for a target: collect the target's own continuations and
distributions, then train the draft to match them (soft cross-entropy to the target's
top-k probabilities plus cross-entropy on the sampled tokens).

Both phases checkpoint into the output folder, so an interrupted run resumes.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from lssp.distill_data import training_prompts
from lssp.draft_head import attach_subset_head, has_subset_head, load_subset_head_model, most_frequent, subset_head
from lssp.errors import UserError
from lssp.generation import logit_width, model_device
from lssp.loading import encode_prompt

Progress = Callable[[str, float, str], None]  # phase, fraction done, message


@dataclass
class DistillConfig:
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


@dataclass
class Collected:
    tokens: int
    seconds: float
    draft_tokens: int
    repeat_tokens: int


def _last_logits(model: PreTrainedModel, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits at each row's last position; for a draft with a frequent-token head, only the head's
    rows and their vocabulary ids (a full-width -inf scatter costs more than the batch's forward)."""
    head = subset_head(model)
    if head is None:
        return model(**inputs, logits_to_keep=1).logits[:, -1], None
    return head.linear(model.model(**inputs).last_hidden_state[:, -1]), head.token_ids


def _left_padded(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """ids, attention mask and position ids of ``sequences`` padded on the left to one width."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.as_tensor(seq)
        mask[row, width - len(seq):] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def _generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, temperature: float, top_k: int, pad_id: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Left-padded batched sampling that records ``model``'s top-k log-probs at each new position."""
    from transformers import DynamicCache

    ids, mask, positions = _left_padded(prompts, pad_id, model_device(model))
    kv = DynamicCache(config=model.config)
    logits, vocab_ids = _last_logits(model, input_ids=ids, attention_mask=mask, position_ids=positions,
                                     past_key_values=kv, use_cache=True)
    top_ids, top_lp, tokens = [], [], []
    for _ in range(new_tokens):
        logprobs = logits.float().log_softmax(-1)
        lp, ix = logprobs.topk(top_k, dim=-1)
        if temperature == 0:
            nxt = logprobs.argmax(-1)
        else:
            nxt = torch.multinomial((logprobs / temperature).softmax(-1), 1, generator=generator)[:, 0]
        if vocab_ids is not None:
            ix, nxt = vocab_ids[ix], vocab_ids[nxt]
        top_ids.append(ix.int().cpu())
        top_lp.append(lp.half().cpu())
        tokens.append(nxt.cpu())
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits, _ = _last_logits(model, input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                                 past_key_values=kv, use_cache=True)
    return {"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "tokens": torch.stack(tokens, 1).int(),
            "top_ids": torch.stack(top_ids, 1), "top_lp": torch.stack(top_lp, 1)}


@torch.inference_mode()
def _score_batch(
    target: PreTrainedModel, prompts: list[list[int]], tokens: torch.Tensor, top_k: int, pad_id: int, rows: int = 16,
) -> dict[str, torch.Tensor]:
    """The target's top-k log-probs at every position of given continuations: one teacher-forced
    forward per ``rows`` sequences (~2x the tokens/s of generating them on a 2-core CPU)."""
    new_tokens = tokens.shape[1]
    top_ids, top_lp = [], []
    for at in range(0, len(prompts), rows):
        # Left-padded, so every continuation ends at the last column.
        chunk = [p + row.tolist() for p, row in zip(prompts[at: at + rows], tokens[at: at + rows])]
        ids, mask, positions = _left_padded(chunk, pad_id, model_device(target))
        logits = target(input_ids=ids, attention_mask=mask, position_ids=positions,
                        logits_to_keep=new_tokens + 1).logits[:, :-1]  # the position before each continuation token
        lp, ix = logits.float().log_softmax(-1).topk(top_k, dim=-1)
        top_ids.append(ix.int().cpu())
        top_lp.append(lp.half().cpu())
    return {"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "tokens": tokens.int(),
            "top_ids": torch.cat(top_ids), "top_lp": torch.cat(top_lp)}


def chosen_shard(shard: int, share: float) -> bool:
    """Whether shard number ``shard`` is among ``share`` of all shards, spread evenly."""
    return math.floor((shard + 1) * share) > math.floor(shard * share)


REPEAT_WINDOW, REPEAT_CUE = 48, 4  # tokens of earlier text; tokens of it repeated at the end


def repeat_prompts(source: dict[str, torch.Tensor], specials: set[int], generator: torch.Generator) -> list[list[int]]:
    """Contexts that end by repeating the start of a span of earlier text.

    Each row of an earlier shard gives a window (the end of its prompt and the start of its
    continuation, REPEAT_WINDOW tokens) followed by REPEAT_CUE tokens copied from a random place
    in it. The target's continuation then shows how it copies: greedy text repeats itself often,
    and a small draft trained on plain continuations need not learn to copy.
    """
    contexts = []
    for prompt, row, n in zip(source["prompts"], source["tokens"], source["lengths"].tolist()):
        text = prompt.tolist() + row[:n].tolist()
        if text[-1] in specials:
            text = text[:-1]
        window = text[: len(prompt) + REPEAT_WINDOW - 8][-REPEAT_WINDOW:]  # at least 8 prompt tokens if there are
        last = max(0, len(window) - REPEAT_CUE - 8)  # the cue's span goes on for 8 tokens or more in the window
        at = int(torch.randint(last + 1, (1,), generator=generator))
        contexts.append(window + window[at: at + REPEAT_CUE])
    return contexts


def _repeat_source(shard: int, repeat_shards: list[int], share: float) -> int | None:
    """The earlier shard whose text repeat shard ``shard`` repeats (never a repeat shard), or None
    when ``shard`` is not one of the ``share`` or nothing earlier can be repeated."""
    if not chosen_shard(shard, share):
        return None
    sources = sorted(set(range(shard)) - set(repeat_shards))
    return sources[shard * 7919 % len(sources)] if sources else None


def _batches(prompts: list[tuple[str, bool]], cfg: DistillConfig) -> Iterator[tuple[list[tuple[str, bool]], float]]:
    """The prompts and temperature of each shard, in order (deterministic, so a resumed run continues it).

    Greedy continuations of a prompt are all the same, so a greedy batch skips prompts already run
    greedily (until every distinct prompt has been).
    """
    done_greedy: set[tuple[str, bool]] = set()
    distinct = len(set(prompts))
    at = 0
    for shard in itertools.count():
        temperature = cfg.temperatures[shard % len(cfg.temperatures)]
        batch: list[tuple[str, bool]] = []
        while len(batch) < cfg.batch_prompts:
            prompt = prompts[at % len(prompts)]
            at += 1
            if temperature == 0:
                if prompt in done_greedy and len(done_greedy) < distinct:
                    continue
                done_greedy.add(prompt)
            batch.append(prompt)
        yield batch, temperature


def collect(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, cfg: DistillConfig,
            progress: Progress | None = None, draft: PreTrainedModel | None = None) -> Collected:
    """Write shards of continuations to ``out/data`` until ``cfg.data_tokens``; resumes.

    The target writes them, except the ``cfg.on_policy`` share that ``draft`` writes (on-policy
    data: the contexts the draft itself gets into); every position carries the target's top-k.
    A ``cfg.repeat_share`` of shards replaces the prompts by repeat_prompts of an earlier shard.
    """
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    eos = set(tokenizer.all_special_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = training_prompts(2_000_000 // cfg.new_tokens + 1000, cfg.seed)
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"shards": 0, "tokens": 0, "seconds": 0.0}
    meta.setdefault("draft_tokens", 0)
    meta.setdefault("repeat_tokens", 0)
    meta.setdefault("repeat_shards", [])
    generator = torch.Generator(device=model_device(target)).manual_seed(cfg.seed)
    for shard, (batch, temperature) in enumerate(_batches(prompts, cfg)):
        if meta["tokens"] >= cfg.data_tokens:
            break
        if shard < meta["shards"]:
            continue
        start = time.perf_counter()
        shard_seed = cfg.seed * 100_003 + shard
        generator.manual_seed(shard_seed)
        repeat_from = _repeat_source(shard, meta["repeat_shards"], cfg.repeat_share)
        repeat = repeat_from is not None
        by_draft = not repeat and draft is not None and chosen_shard(shard, cfg.on_policy)
        if repeat:
            source = torch.load(data / f"shard_{repeat_from:05d}.pt")
            encoded = repeat_prompts(source, eos, torch.Generator().manual_seed(shard_seed))
        else:
            encoded = [encode_prompt(tokenizer, p, chat) for p, chat in batch]
        if by_draft:
            written = _generate_batch(draft, encoded, cfg.new_tokens, temperature, 1, pad_id, generator)["tokens"]
            record = _score_batch(target, encoded, written, cfg.top_k_saved, pad_id)
            record["source"] = "draft"
        else:
            record = _generate_batch(target, encoded, cfg.new_tokens, temperature, cfg.top_k_saved, pad_id, generator)
        # Keep each row up to and including its first special token.
        lengths = []
        for row in record["tokens"].tolist():
            stop = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
            lengths.append(stop + 1)
        record["lengths"] = torch.tensor(lengths)
        if repeat:
            record["source"] = "repeat"
        torch.save(record, data / f"shard_{shard:05d}.pt")
        meta["shards"] += 1
        meta["tokens"] += int(sum(lengths))
        meta["draft_tokens"] += int(sum(lengths)) if by_draft else 0
        meta["repeat_tokens"] += int(sum(lengths)) if repeat else 0
        meta["repeat_shards"] += [shard] if repeat else []
        meta["seconds"] += time.perf_counter() - start
        meta_path.write_text(json.dumps(meta))
        if progress:
            progress("collect", min(1.0, meta["tokens"] / cfg.data_tokens),
                     f"{meta['tokens']} tokens ({meta['draft_tokens']} draft-written, {meta['repeat_tokens']} after a repeat), "
                     f"{meta['tokens'] / max(meta['seconds'], 1e-9):.0f} tokens/s")
    return Collected(meta["tokens"], meta["seconds"], meta["draft_tokens"], meta["repeat_tokens"])


def _examples(out: Path, cfg: DistillConfig) -> list[dict[str, torch.Tensor]]:
    """Training sequences: prompt + kept continuation, with the target's top-k at each continuation position."""
    examples = []
    for path in sorted((out / "data").glob("shard_*.pt")):
        rec = torch.load(path)
        for i, prompt in enumerate(rec["prompts"]):
            n = int(rec["lengths"][i])
            room = max(1, cfg.max_seq_len - n)
            prompt = prompt[-room:]
            examples.append({"ids": torch.cat([prompt, rec["tokens"][i, :n]]).long(), "start": len(prompt) - 1,
                             "top_ids": rec["top_ids"][i, :n].long(), "top_lp": rec["top_lp"][i, :n].float()})
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


def earlier_training(folder: str | Path) -> dict:
    """What a draft folder's own card says of how it was made: its report and command, where present."""
    folder = Path(folder)
    found: dict = {"path": str(folder)}
    try:  # a draft kept in git: the last commit that changed it names these exact weights
        log = subprocess.run(["git", "log", "-1", "--format=%h", "--", "."], cwd=folder, capture_output=True, text=True, timeout=5)
        if log.returncode == 0 and log.stdout.strip():
            found["commit"] = log.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    report = folder / "distill_report.json"
    if report.exists():
        earlier = json.loads(report.read_text())
        found.update({key: earlier.get(key) for key in ("data_tokens", "collect_seconds", "steps", "train_seconds")})
        found["started_from"] = earlier.get("started_from") or {}
    card = folder / "README.md"
    if card.exists():
        made_with = [line for line in card.read_text().splitlines() if line.startswith("Made with:")]
        if made_with:
            found["command"] = made_with[0].removeprefix("Made with:").strip().strip("`")
    return found


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


def _loss(draft: LlamaForCausalLM, batch: list[dict[str, torch.Tensor]], cfg: DistillConfig) -> torch.Tensor:
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
def top1_agreement(draft: LlamaForCausalLM, examples: list[dict[str, torch.Tensor]], batch_size: int = 16) -> float:
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


def train(target: PreTrainedModel, out: Path, cfg: DistillConfig, report: DistillReport,
          progress: Progress | None = None) -> LlamaForCausalLM:
    """Train (or resume training) the draft on the collected shards."""
    examples = _examples(out, cfg)
    if not examples:
        raise UserError(f"no training data in {out / 'data'}")
    # Hold out ~2% of the sequences (at most 64) to measure top-1 agreement as training goes.
    held = min(64, len(examples) // 50)
    examples, held_out = (examples[:-held], examples[-held:]) if held else (examples, [])
    ckpt_path = out / "checkpoint.pt"
    draft = load_initial_draft(target, cfg) if cfg.init_from else init_draft(target, cfg)
    if cfg.head_tokens or subset_head(draft) is not None:
        counts = torch.zeros(logit_width(draft), dtype=torch.long)
        for e in examples:
            counts += torch.bincount(e["ids"][e["start"] + 1:], minlength=len(counts))
        if subset_head(draft) is None:
            attach_subset_head(draft, most_frequent(counts, cfg.head_tokens))
        report.head_coverage = float(counts[subset_head(draft).token_ids].sum() / counts.sum())
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    tokens_per_epoch = sum(len(e["top_ids"]) for e in examples)
    steps_per_epoch = max(1, len(examples) // cfg.batch_size)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    step, seconds, seen = 0, 0.0, 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, seconds, seen = state["step"], state["seconds"], state["seen"]
        report.loss_curve = [tuple(x) for x in state["loss_curve"]]
        report.agreement_curve = [tuple(x) for x in state.get("agreement_curve", [])]
        report.started_from = state.get("started_from", report.started_from)  # read before OUT was overwritten
    if step == 0 and held_out:
        report.agreement_curve.append((0, 0, top1_agreement(draft, held_out)))  # the starting point
    generator = torch.Generator().manual_seed(cfg.seed)
    draft.train()
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
        loss = _loss(draft, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        seen += sum(len(e["top_ids"]) for e in batch)
        seconds += time.perf_counter() - start
        recent.append(float(loss.detach()))
        if step % 25 == 0 or step == total_steps:
            report.loss_curve.append((step, seen, sum(recent) / len(recent)))
            recent.clear()
            if held_out and (step % 200 == 0 or step == total_steps):
                report.agreement_curve.append((step, seen, top1_agreement(draft, held_out)))
            if progress:
                agree = f", held-out top-1 {report.agreement_curve[-1][2]:.3f}" if report.agreement_curve else ""
                progress("train", min(step / total_steps, seconds / (cfg.train_minutes * 60)),
                         f"step {step}, loss {report.loss_curve[-1][2]:.3f}, {seen / tokens_per_epoch:.2f} epochs{agree}")
        if time.perf_counter() - last_save > 120 or step == total_steps:
            _save_checkpoint(ckpt_path, draft, opt, step, seconds, seen, report)
            last_save = time.perf_counter()
    _save_checkpoint(ckpt_path, draft, opt, step, seconds, seen, report)
    report.steps, report.train_seconds = step, seconds
    report.final_loss = report.loss_curve[-1][2] if report.loss_curve else float("nan")
    if held_out:
        report.agreement_curve.append((step, seen, top1_agreement(draft, held_out)))
    draft.eval()
    return draft


def _save_checkpoint(path: Path, draft: LlamaForCausalLM, opt: torch.optim.Optimizer, step: int, seconds: float,
                     seen: int, report: DistillReport) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "seconds": seconds,
                "seen": seen, "loss_curve": report.loss_curve, "agreement_curve": report.agreement_curve,
                "started_from": report.started_from}, tmp)
    tmp.replace(path)


def write_draft(draft: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, report: DistillReport,
                command: str) -> None:
    """safetensors weights in bf16, the tokenizer, and a model card with how it was made."""
    draft.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "distill_report.json").write_text(json.dumps(asdict(report), indent=1))
    curve = "\n".join(f"| {s} | {t} | {loss:.3f} |" for s, t, loss in report.loss_curve[:: max(1, len(report.loss_curve) // 12)])
    accept = "\n".join(f"| {k} | {v:.3f} |" for k, v in report.acceptance.items())
    head = subset_head(draft)
    output_layer = (f"an output layer over the target's {len(head.token_ids)} most frequent tokens, "
                    f"{report.head_coverage:.1%} of the target tokens it was trained on (the others are never proposed), "
                    f"and a {draft.config.vocab_size}-token input embedding" if head else
                    f"tied {draft.config.vocab_size}-token embedding")
    lineage, earlier = "", report.started_from
    while earlier:
        at_commit = f" as of commit {earlier['commit']}" if earlier.get("commit") else ""
        lineage += (f"- started from the weights of `{earlier['path']}`{at_commit}, which had been trained {earlier.get('steps')} steps "
                    f"({(earlier.get('train_seconds') or 0) / 60:.1f} min) on {earlier.get('data_tokens')} target tokens"
                    f" ({(earlier.get('collect_seconds') or 0) / 60:.1f} min of collection)"
                    + (f" by `{earlier['command']}`" if earlier.get("command") else "") + "\n")
        earlier = earlier.get("started_from") or {}
    agreement = "\n".join(f"| {s} | {t} | {a:.3f} |" for s, t, a in report.agreement_curve)
    written_by = (f"{report.data_tokens - report.draft_written_tokens} written by the target and {report.draft_written_tokens} "
                 f"by the starting draft (on-policy, scored by the target in one forward per batch)," if report.draft_written_tokens
                 else "all written by the target,")
    if report.repeat_tokens:
        written_by += (f" {report.repeat_tokens} of them the target's continuations of contexts that end by repeating"
                      f" {REPEAT_CUE} tokens of the {REPEAT_WINDOW} before (to teach the draft to copy),")
    (out / "README.md").write_text(f"""# Draft for {report.target}, made by `llamassp distill`

A {draft.config.num_hidden_layers}-layer Llama (hidden {draft.config.hidden_size}, {report.parameters / 1e6:.1f}M parameters,
{output_layer}) sharing {report.target}'s tokenizer. Weights in bfloat16.

Made with: `{command}`

- data: {report.data_tokens} tokens of continuations (collected in {report.collect_seconds / 60:.1f} min), {written_by}
  with the target's top-{report.config['top_k_saved']} log-probabilities at every position
- training: {report.steps} steps in {report.train_seconds / 60:.1f} min; loss = soft cross-entropy to the target's
  top-k distribution + {report.config['hard_weight']} x cross-entropy on the target's argmax; final loss {report.final_loss:.3f}
- prompts: written by `lssp/distill_data.py`; none of the `latency`, `compare` or `eval` prompts
{lineage}
## Measured acceptance (greedy, held-out prompts)
| prompts | acceptance rate |
|---|---|
{accept}

## Loss curve
| step | target tokens seen | loss |
|---|---|---|
{curve}

## Held-out top-1 agreement (teacher-forced, a proxy for greedy acceptance)
| step | target tokens seen | agreement |
|---|---|---|
{agreement}
""")
