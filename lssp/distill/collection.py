"""Collect what the draft learns from: batched continuations with the target's top-k log-probs,
written as resumable shards (target-written, draft-written and scored, or continuing a repeated cue)."""
from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lssp.distill.config import Collected, DistillConfig, Progress
from lssp.distill.data import training_prompts
from lssp.models.draft_head import subset_head
from lssp.models.loading import encode_prompt
from lssp.models.modules import model_device


def _last_logits(model: PreTrainedModel, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits at each row's last position; for a draft with a frequent-token head, only the head's
    rows and their vocabulary ids (a full-width -inf scatter costs more than the batch's forward)."""
    head = subset_head(model)
    if head is None:
        return model(**inputs, logits_to_keep=1).logits[:, -1], None
    return head.linear(model.model(**inputs).last_hidden_state[:, -1]), head.token_ids


def _logits_and_features(model: PreTrainedModel, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at each row's last position and the final hidden states (after the last norm) of every position:
    the features a feature-level draft reads."""
    hidden = model.model(**inputs).last_hidden_state
    return model.lm_head(hidden[:, -1]), hidden


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
    generator: torch.Generator, features: bool = False,
) -> dict[str, torch.Tensor]:
    """Left-padded batched sampling that records ``model``'s top-k log-probs at each new position; with
    ``features``, also its final hidden states at every position of each row (prompt and continuation, float16)."""
    from transformers import DynamicCache

    def forward(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not features:
            return _last_logits(model, **inputs)
        logits, hidden = _logits_and_features(model, **inputs)
        steps.append(hidden.half().cpu())
        return logits, None

    steps: list[torch.Tensor] = []
    ids, mask, positions = _left_padded(prompts, pad_id, model_device(model))
    kv = DynamicCache(config=model.config)
    logits, vocab_ids = forward(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=kv,
                                use_cache=True)
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
        logits, _ = forward(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions, past_key_values=kv,
                            use_cache=True)
    record = {"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "tokens": torch.stack(tokens, 1).int(),
              "top_ids": torch.stack(top_ids, 1), "top_lp": torch.stack(top_lp, 1)}
    if features:  # row r: its prompt's positions (the end of the left-padded prefill), then one per new token
        continuation = torch.cat(steps[1:], dim=1)
        record["features"] = [torch.cat([steps[0][r, steps[0].shape[1] - len(p):], continuation[r]])
                              for r, p in enumerate(prompts)]
    return record


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
            record = _generate_batch(target, encoded, cfg.new_tokens, temperature, cfg.top_k_saved, pad_id, generator,
                                     features=cfg.kind == "eagle")
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
