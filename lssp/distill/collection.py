"""Collect what the draft learns from: batched continuations with the target's top-k log-probs,
written as resumable shards (target-written, draft-written and scored, or continuing a repeated cue)."""
from __future__ import annotations

import functools
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lssp.decoding.batched import empty_rows, feed_rows, keep_rows
from lssp.decoding.kv import accepts_logits_to_keep
from lssp.decoding.sampling import SamplingParams, sample_logits
from lssp.distill.config import SOURCES, Collected, DistillConfig, Progress
from lssp.distill.conversations import split_contexts
from lssp.distill.data import training_prompts
from lssp.distill.documents import document_prompts
from lssp.errors import UserError
from lssp.models.compact import CompactLlama, supports_compact
from lssp.models.eagle import feature_layers
from lssp.models.loading import encode_conversation, encode_prompt
from lssp.models.modules import model_device
from lssp.models.registry import DYNAMIC_QUANTIZATIONS, ModelSpec
from lssp.workloads.prompts import HELD_OUT
from lssp.workloads.tasks import all_task_texts


def collection_model(model: PreTrainedModel) -> PreTrainedModel:
    """The forward collection runs: ``model`` if it is a compact forward, else a compact forward over it where it
    can run one, else ``model`` itself (it then gives no features: ``--kind eagle`` needs the compact forward)."""
    already_or_cannot = isinstance(model, CompactLlama) or supports_compact(model) is not None
    return model if already_or_cannot else CompactLlama(model)


def collection_spec(spec: ModelSpec, device: torch.device) -> ModelSpec | None:
    """The target's entry as collection runs it faster, or None to run it as loaded: an entry dynamically quantized
    on a CPU (prepacked weights with float32 arithmetic, tuned for forwards of a few tokens) becomes plain weights
    under the compact forward, in bfloat16 where the CPU computes it natively (else float32): the same weights, ~1.6x
    the tokens/s at 128 rows (benchmarks/results/collection_speed.json)."""
    from lssp.report.results import native_bf16

    if spec.quantization not in DYNAMIC_QUANTIZATIONS or device.type != "cpu":
        return None
    dtype = "bfloat16" if spec.dtype in ("bfloat16", "auto") and native_bf16() else "float32"
    return replace(spec, quantization="none", dtype=dtype, forward="compact", compile=False)


def _logits_kwargs(model: PreTrainedModel, keep: int) -> dict[str, Any]:
    return {"logits_to_keep": keep} if accepts_logits_to_keep(type(model)) else {}


DROP_SHARE = 0.25  # finished rows leave the batch once they are this share of it (each leaving copies the cache)


@torch.inference_mode()
def generate_rows(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, params: SamplingParams,
    generators: list[torch.Generator | None], top_k: int, stop_ids: set[int], features: bool = False,
) -> dict[str, Any]:
    """RSp of prompts of any lengths in one batch, each row at positions of its own (``lssp.decoding.batched``), so
    each row gives the tokens it gives alone with its generator; a row ends at its first ``stop_ids`` token or after
    ``new_tokens``, and finished rows leave the batch. Records each row's tokens (padded with 0 after its end) and
    ``model``'s top-k log-probs at each new position; with ``features`` (a compact forward), the final hidden states of
    every prompt position and of every new token (float16)."""
    rows = len(prompts)
    kwargs = _logits_kwargs(model, 1)
    if features:
        if not isinstance(model, CompactLlama):
            raise UserError("collecting features (--kind eagle) needs a Llama target the compact forward runs")
        kwargs["features"] = True
    cache = empty_rows(model, rows)
    out = feed_rows(cache, prompts, True, **kwargs)
    logits = out.logits[:, -1]
    feats = [[out.features[r, out.features.shape[1] - len(p):].half().cpu()] if features else [] for r, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    top_ids = torch.zeros(rows, new_tokens, top_k, dtype=torch.int32)
    top_lp = torch.zeros(rows, new_tokens, top_k, dtype=torch.float16)
    finished = [new_tokens <= 0] * rows
    spent = [False] * rows  # finished, and with features its last token fed: nothing left to do
    in_cache = list(range(rows))  # the row of each cache row
    while True:
        sampling = [i for i, r in enumerate(in_cache) if not finished[r]]
        if sampling:
            lp, ix = logits[sampling].float().log_softmax(-1).topk(top_k, dim=-1)
            for j, i in enumerate(sampling):
                r = in_cache[i]
                token = int(sample_logits(logits[i:i + 1], params, generators[r])[0])
                top_ids[r, len(tokens[r])], top_lp[r, len(tokens[r])] = ix[j].int().cpu(), lp[j].half().cpu()
                tokens[r].append(token)
                finished[r] = token in stop_ids or len(tokens[r]) >= new_tokens
        # Fed next: the rows still going and, for their last token's features, the rows that just ended.
        fed = {r for r in in_cache if not spent[r] and (features or not finished[r])}
        for r in in_cache:
            spent[r] = spent[r] or r not in fed
        if not fed:
            break
        if sum(spent[r] for r in in_cache) >= DROP_SHARE * len(in_cache):
            kept = [i for i, r in enumerate(in_cache) if not spent[r]]
            keep_rows(cache, kept)
            in_cache = [in_cache[i] for i in kept]
        out = feed_rows(cache, [[tokens[r][-1]] if r in fed else [] for r in in_cache], True, **kwargs)
        logits = out.logits[:, -1]
        for i, r in enumerate(in_cache):
            if r in fed:
                if features:
                    feats[r].append(out.features[i, -1:].half().cpu())
                spent[r] = finished[r]
    written = torch.zeros(rows, new_tokens, dtype=torch.int32)
    for r, row in enumerate(tokens):
        written[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
    record: dict[str, Any] = {"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "tokens": written,
                              "top_ids": top_ids, "top_lp": top_lp}
    if features:
        record["features"] = [torch.cat(f) for f in feats]
        record["feature_layers"] = list(feature_layers(model))
    return record


@torch.inference_mode()
def score_batch(
    target: PreTrainedModel, prompts: list[list[int]], tokens: torch.Tensor, top_k: int, rows: int = 16,
    lengths: list[int] | None = None,
) -> dict[str, Any]:
    """The target's top-k log-probs at every position of given continuations: one teacher-forced
    forward per ``rows`` sequences (~2x the tokens/s of generating them on a 2-core CPU). With ``lengths`` (each
    row's kept tokens; a compact forward), also the final hidden states of each prompt and its kept tokens, as
    ``generate_rows`` records them."""
    new_tokens = tokens.shape[1]
    top_ids, top_lp, features = [], [], []
    kwargs = _logits_kwargs(target, new_tokens + 1)
    if lengths is not None:
        kwargs["features"] = True
    for at in range(0, len(prompts), rows):
        # Left-padded, so every continuation ends at the last column.
        chunk = [p + row.tolist() for p, row in zip(prompts[at: at + rows], tokens[at: at + rows])]
        out = feed_rows(empty_rows(target, len(chunk)), chunk, True, **kwargs)
        logits = out.logits[:, -new_tokens - 1:-1]  # the position before each continuation token
        lp, ix = logits.float().log_softmax(-1).topk(top_k, dim=-1)
        top_ids.append(ix.int().cpu())
        top_lp.append(lp.half().cpu())
        for r, seq in enumerate(chunk) if lengths is not None else ():
            kept = len(seq) - new_tokens + lengths[at + r]
            features.append(out.features[r, out.features.shape[1] - len(seq):][:kept].half().cpu())
    record: dict[str, Any] = {"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "tokens": tokens.int(),
                              "top_ids": torch.cat(top_ids), "top_lp": torch.cat(top_lp)}
    if lengths is not None:
        record["features"] = features
        record["feature_layers"] = list(feature_layers(target))
    return record


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


def _batches(prompts: list[list[int]], cfg: DistillConfig) -> Iterator[tuple[list[list[int]], float]]:
    """The prompts and temperature of each shard, in order (deterministic, so a resumed run continues it).

    Greedy continuations of a prompt are all the same, so a greedy batch skips prompts already run
    greedily (until every distinct prompt has been).
    """
    done_greedy: set[tuple[int, ...]] = set()
    distinct = len({tuple(p) for p in prompts})
    at = 0
    for shard in itertools.count():
        temperature = cfg.temperatures[shard % len(cfg.temperatures)]
        batch: list[list[int]] = []
        while len(batch) < cfg.batch_prompts:
            prompt = prompts[at % len(prompts)]
            at += 1
            if temperature == 0:
                if tuple(prompt) in done_greedy and len(done_greedy) < distinct:
                    continue
                done_greedy.add(tuple(prompt))
            batch.append(prompt)
        yield batch, temperature


CHARS_PER_TOKEN = 12  # more than any tokenizer's average on natural text: a longer context is left out unencoded
BUCKET_WINDOW = 8  # batches whose prompts are sorted by length together (less padding, still mixed)


def bucketed(prompts: list[list[int]], batch: int, seed: int) -> list[list[int]]:
    """``prompts`` shuffled with ``seed``, then sorted by length within windows of BUCKET_WINDOW batches, so that a
    batch of consecutive prompts holds prompts of about one length (its shorter rows wait less on padding)."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    window = batch * BUCKET_WINDOW
    return [p for at in range(0, len(order), window) for p in sorted(order[at: at + window], key=len)]


def source_prompts(tokenizer: PreTrainedTokenizerBase, cfg: DistillConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(training prompts, held-out prompts) as token ids. ``built-in``: the prompts of ``data.training_prompts``
    (no held-out prompts: training holds out some of its sequences). ``sharegpt``: the contexts of
    ``conversations.split_contexts`` in the target's chat template, at most ``cfg.max_prompt_tokens`` long,
    bucketed by length; ``documents``: ``documents.document_prompts`` over the same split, the same way."""
    if cfg.source == "built-in":  # as many prompts as the collection can use (a longer list extends a shorter one)
        count = min(2_000_000, 4 * cfg.data_tokens) // cfg.new_tokens + 1000
        return [encode_prompt(tokenizer, p, chat) for p, chat in training_prompts(count, cfg.seed)], []
    if cfg.source not in SOURCES:
        raise UserError(f"--source {cfg.source!r}: expected one of {', '.join(SOURCES)}")
    chars = CHARS_PER_TOKEN * cfg.max_prompt_tokens  # longer texts cannot fit: not worth encoding
    excluded = frozenset(HELD_OUT | all_task_texts())
    if cfg.source == "documents":
        splits: tuple = document_prompts(cfg.seed, excluded)
        length, encode = len, lambda text: encode_prompt(tokenizer, text, True)
    else:
        splits = split_contexts(cfg.seed, excluded_texts=excluded)
        length = lambda c: sum(map(len, c.turns + c.answers))  # noqa: E731
        encode = lambda c: encode_conversation(tokenizer, c.turns, c.answers, True)  # noqa: E731
    encoded = [[ids for item in split if length(item) <= chars and len(ids := encode(item)) <= cfg.max_prompt_tokens]
               for split in splits]
    return bucketed(encoded[0], cfg.batch_prompts, cfg.seed), encoded[1]


def _intact(data: Path, meta: dict) -> tuple[dict, str | None]:
    """``meta`` cut back to its shards whose files are there at the size written (a resumed collection goes on from
    the first one that is not), and what was cut, or None."""
    files = meta.get("files", [])
    for at, entry in enumerate(files):
        path = data / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            kept = files[:at]
            cut = {"shards": at, "files": kept, **{key: sum(f[key] for f in kept) for key in SHARD_COUNTS},
                   "seconds": sum(f["seconds"] for f in kept)}
            return {**meta, **cut}, f"{entry['name']} is missing or truncated: collection goes on from shard {at}"
    return meta, None


SHARD_COUNTS = ("tokens", "draft_tokens", "repeat_tokens", "held_out_tokens")


def _keeps_features(data: Path, meta: dict, cfg: DistillConfig) -> bool:
    """Whether the shards carry the target's features: for a head (``--kind eagle``, ``eagle3``), and for a draft that goes on with
    a collection begun for one, so that a head can still train on every shard. A head refuses to go on with a
    collection begun without them."""
    if "features" not in meta and meta["files"]:  # written before meta said so
        meta["features"] = "features" in torch.load(data / meta["files"][0]["name"], mmap=True)
    began_with = meta.get("features")
    head = cfg.kind in ("eagle", "eagle3")
    if head and began_with is False and meta["files"]:
        raise UserError(f"{data} holds a collection without the target's features (made for --kind draft): collect "
                        f"into another --data-dir for --kind {cfg.kind}")
    return head or bool(began_with)


def same_feature_layers(data: Path, meta: dict, target: PreTrainedModel) -> None:
    """Refuse to add shards of the features of other layers than those ``data``'s shards hold."""
    held, wanted = meta.get("feature_layers", []), list(feature_layers(target))
    if meta["files"] and held != wanted:
        names = {tuple(held): ", ".join(map(str, held)) or "none", tuple(wanted): ", ".join(map(str, wanted)) or "none"}
        raise UserError(f"{data} holds the target's features of layers {names[tuple(held)]} (and the final), not of "
                        f"{names[tuple(wanted)]}: give the same --feature-layers, or collect into another --data-dir")


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file renamed into place: a stopped or failed write leaves the old file (or none)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; what was collected before it is kept, "
                        "and the same command goes on from there") from None


def read_meta(data: Path, notice: Callable[[str], None] | None = None) -> dict:
    """The collection's meta.json in ``data`` (created empty), cut back to its intact shards (said through
    ``notice``)."""
    data.mkdir(parents=True, exist_ok=True)
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"shards": 0, "seconds": 0.0}
    for key in SHARD_COUNTS:
        meta.setdefault(key, 0)
    meta.setdefault("repeat_shards", [])
    meta.setdefault("files", [])
    meta, cut = _intact(data, meta)
    if cut and notice:
        notice(cut)
    meta["repeat_shards"] = [s for s in meta["repeat_shards"] if s < meta["shards"]]
    return meta


def add_shard(data: Path, meta: dict, record: dict[str, Any], seconds: float, rebuilt: bool = False) -> None:
    """Write ``record`` as the collection's next shard and count it in ``meta`` (both written atomically); ``rebuilt``:
    its text was written before (teacher-forced again from token ids)."""
    shard = meta["shards"]
    name = f"shard_{shard:05d}.pt"
    _write_atomically(data / name, functools.partial(torch.save, record))
    held, source = record["split"] == "held_out", record.get("source")
    tokens = int(record["lengths"].sum())
    entry = {"name": name, "bytes": (data / name).stat().st_size, "seconds": seconds,
             "tokens": 0 if held else tokens, "held_out_tokens": tokens if held else 0,
             "draft_tokens": tokens if source == "draft" else 0, "repeat_tokens": tokens if source == "repeat" else 0}
    if rebuilt:
        entry["rebuilt"] = True
    if "feature_layers" in record:
        meta["feature_layers"] = record["feature_layers"]
    meta["files"].append(entry)
    meta["shards"] += 1
    for key in (*SHARD_COUNTS, "seconds"):
        meta[key] += entry[key]
    meta["repeat_shards"] += [shard] if source == "repeat" else []
    _write_atomically(data / "meta.json", lambda path: path.write_text(json.dumps(meta)))


def collect(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, cfg: DistillConfig,
            progress: Progress | None = None, draft: PreTrainedModel | None = None,
            notice: Callable[[str], None] | None = None) -> Collected:
    """Write shards of continuations to ``out/data`` until ``cfg.data_tokens``; resumes.

    The target writes them (``generate_rows``: batched, each row as alone with its seed), except the
    ``cfg.on_policy`` share that ``draft`` writes (on-policy data: the contexts the draft itself gets into); every
    position carries the target's top-k, and for a head (``cfg.kind`` eagle or eagle3) its features. A ``cfg.repeat_share`` of
    shards replaces the prompts by repeat_prompts of an earlier shard. With held-out prompts (``source_prompts``),
    shard 0 answers them and is marked ``split: held_out``. A shard missing or cut short is collected again (said
    through ``notice``).
    """
    data = out / "data"
    eos = set(tokenizer.all_special_ids)
    meta = read_meta(data, notice)
    if meta["files"] and meta.setdefault("source", cfg.source) != cfg.source:
        raise UserError(f"{data} holds a collection of --source {meta['source']} prompts: use --source "
                        f"{meta['source']}, or collect into another --data-dir")
    meta["source"] = cfg.source
    prompts, held_out = source_prompts(tokenizer, cfg)
    meta["features"] = features = _keeps_features(data, meta, cfg)
    if features:
        same_feature_layers(data, meta, target)
    if meta["files"]:  # what the shards are, said even when none is added (shards written again from token ids)
        _write_atomically(data / "meta.json", lambda path: path.write_text(json.dumps(meta)))
    params_of = {t: SamplingParams(temperature=t) for t in (0.0, *cfg.temperatures)}  # held-out answers: greedy
    batches = _batches(prompts, cfg)
    for shard in itertools.count():
        if meta["tokens"] >= cfg.data_tokens:
            break
        held = shard == 0 and bool(held_out)
        batch, temperature = (held_out[:cfg.batch_prompts], 0.0) if held else next(batches)
        if shard < meta["shards"]:
            continue
        start = time.perf_counter()
        shard_seed = cfg.seed * 100_003 + shard
        never_repeated = meta["repeat_shards"] + ([0] if held_out else [])  # nor the held-out answers
        repeat_from = None if held else _repeat_source(shard, never_repeated, cfg.repeat_share)
        repeat = repeat_from is not None
        by_draft = not repeat and not held and draft is not None and chosen_shard(shard, cfg.on_policy)
        if repeat:
            source = torch.load(data / f"shard_{repeat_from:05d}.pt")
            batch = repeat_prompts(source, eos, torch.Generator().manual_seed(shard_seed))
        generators = [torch.Generator(device=model_device(target)).manual_seed(shard_seed * 1000 + r)
                      for r in range(len(batch))]
        if by_draft:
            written = generate_rows(draft, batch, cfg.new_tokens, params_of[temperature], generators, 1, eos)["tokens"]
            record = score_batch(target, batch, written, cfg.top_k_saved)
            record["source"] = "draft"
        else:
            record = generate_rows(target, batch, cfg.new_tokens, params_of[temperature], generators, cfg.top_k_saved,
                                   eos, features=features)
        # Keep each row up to and including its first special token.
        lengths = []
        for row in record["tokens"].tolist():
            stop = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
            lengths.append(stop + 1)
        record["lengths"] = torch.tensor(lengths)
        record["split"] = "held_out" if held else "train"
        if repeat:
            record["source"] = "repeat"
        add_shard(data, meta, record, time.perf_counter() - start)
        if progress:
            progress("collect", min(1.0, meta["tokens"] / cfg.data_tokens),
                     f"{meta['tokens']} tokens ({meta['draft_tokens']} draft-written, {meta['repeat_tokens']} after a repeat), "
                     f"{(meta['tokens'] + meta['held_out_tokens']) / max(meta['seconds'], 1e-9):.0f} tokens/s")
    return Collected(meta["tokens"], meta["seconds"], meta["draft_tokens"], meta["repeat_tokens"], meta["held_out_tokens"],
                     rebuilt_tokens(meta))


def rebuilt_tokens(meta: dict) -> int:
    """Target-written tokens (not held out) of shards written again from token ids: text trained on before."""
    return sum(f["tokens"] for f in meta.get("files", []) if f.get("rebuilt"))


def collection_summary(folder: Path) -> dict:
    """What the collection in ``folder`` holds, from its meta.json: path, source, tokens, held-out tokens and seconds
    of collection (one line if there is none)."""
    meta_path = folder / "data" / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise UserError(f"no collection in {folder} ({meta_path} is missing or unreadable)") from None
    return {"path": str(folder), "source": meta.get("source", "unknown"), "tokens": meta.get("tokens", 0),
            "held_out_tokens": meta.get("held_out_tokens", 0), "seconds": meta.get("seconds", 0.0),
            "rebuilt_tokens": rebuilt_tokens(meta)}
