"""A collection's token ids in one small file, and its shards written again from them.

A collection with the target's features is gigabytes of cache outside the repository. Its token ids (each
shard's prompts and kept continuations) fit in a few MB that can be committed: ``rebuild_shards`` writes the
shards again from them by teacher forcing (the target's features and top-k at every position, no generation: about
half the time of collecting them, benchmarks/results/more/rebuild-speed.json), and the target's text stays the one it
wrote whatever the machine's arithmetic.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from lssp.distill.collection import add_shard, read_meta, same_feature_layers, score_batch
from lssp.distill.config import Progress
from lssp.errors import UserError
from lssp.models.compact import CompactLlama

TOKENS_FILE = "tokens.npz"  # in a collection's data/ folder


def save_tokens(data: Path, path: Path | None = None) -> Path:
    """Write the token ids of the collection in ``data`` (default: ``data/tokens.npz``): per shard, its prompts and
    kept continuations, its split and source."""
    meta = read_meta(data)
    arrays: dict[str, np.ndarray] = {}
    for entry in meta["files"]:
        rec = torch.load(data / entry["name"], mmap=True)
        lengths = rec["lengths"].long()
        kept = [row[:n] for row, n in zip(rec["tokens"], lengths.tolist())]
        name = entry["name"].removesuffix(".pt")
        arrays[f"{name}/prompt_lengths"] = np.array([len(p) for p in rec["prompts"]], dtype=np.int32)
        arrays[f"{name}/prompts"] = _ids(torch.cat(list(rec["prompts"])))
        arrays[f"{name}/lengths"] = lengths.int().numpy()
        arrays[f"{name}/tokens"] = _ids(torch.cat(kept))
        arrays[f"{name}/split"] = np.array(rec.get("split", "train"))
        arrays[f"{name}/source"] = np.array(rec.get("source", "target"))
        arrays[f"{name}/top_k"] = np.array(rec["top_ids"].shape[-1])
        arrays[f"{name}/new_tokens"] = np.array(rec["tokens"].shape[1])
    path = path or data / TOKENS_FILE
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)
    return path


def _ids(ids: torch.Tensor) -> np.ndarray:
    """Token ids in the smallest type that holds them."""
    ids = ids.numpy()
    return ids.astype(np.uint16 if ids.size == 0 or (ids.min() >= 0 and ids.max() < 2 ** 16) else np.int32)


def rebuild_shards(target: PreTrainedModel, tokens_path: Path, data: Path, progress: Progress | None = None,
                   tokens: int | None = None, source: str | None = None) -> int:
    """Write the shards of ``tokens_path`` that ``data`` lacks, in order, by teacher forcing ``target`` (a compact
    forward) over each prompt and its continuation, until the collection holds ``tokens`` (None: all of them);
    returns how many were written. ``source``: the collection's prompts (``--source``), recorded from its first
    shard, so a rebuild stopped early still says what it holds."""
    if not isinstance(target, CompactLlama):
        raise UserError("writing a collection again from its token ids needs a Llama target the compact forward runs")
    meta = read_meta(data)
    same_feature_layers(data, meta, target)
    if source is not None:
        meta.setdefault("source", source)
    try:
        stored = np.load(tokens_path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the token ids in {tokens_path}: {exc}") from None
    with stored:
        names = sorted({key.split("/")[0] for key in stored.files})
        if [f["name"].removesuffix(".pt") for f in meta["files"]] != names[: len(meta["files"])]:
            raise UserError(f"{data} holds shards that are not the first ones of {tokens_path}: rebuild into "
                            "another --data-dir")
        todo = names[len(meta["files"]):]
        written = 0
        for name in todo:
            if tokens is not None and meta["tokens"] >= tokens:
                break
            start = time.perf_counter()
            record = _scored(target, {key: stored[f"{name}/{key}"] for key in (
                "prompt_lengths", "prompts", "lengths", "tokens", "split", "source", "top_k", "new_tokens")})
            add_shard(data, meta, record, time.perf_counter() - start, rebuilt=True)
            written += 1
            if progress:
                progress("rebuild", written / len(todo), f"{name} ({meta['tokens']} tokens) from {tokens_path.name}")
    return written


def _scored(target: PreTrainedModel, shard: dict[str, np.ndarray]) -> dict:
    """One shard's record from its token ids: the target's top-k and features, teacher-forced."""
    cuts = np.cumsum(shard["prompt_lengths"])[:-1]
    prompts = [p.astype(np.int64).tolist() for p in np.split(shard["prompts"], cuts)]
    lengths = shard["lengths"].astype(np.int64)
    tokens = torch.zeros(len(prompts), int(shard["new_tokens"]), dtype=torch.int32)
    for r, row in enumerate(np.split(shard["tokens"], np.cumsum(lengths)[:-1])):
        tokens[r, : len(row)] = torch.from_numpy(row.astype(np.int32))
    record = score_batch(target, prompts, tokens, int(shard["top_k"]), lengths=lengths.tolist())
    record["lengths"] = torch.from_numpy(lengths)
    record["split"] = str(shard["split"])
    if str(shard["source"]) != "target":
        record["source"] = str(shard["source"])
    return record
