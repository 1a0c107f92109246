"""A standard Llama copy of a draft saved with a frequent-token head, for engines that load plain checkpoints (vLLM)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lssp.errors import UserError
from lssp.models.sources import cache_root, content_key
from lssp.workloads.arithmetic import few_shot
from lssp.workloads.prompts import LATENCY_PROMPTS
from lssp.workloads.tasks import all_task_texts

log = logging.getLogger(__name__)


def exported_dir(folder: Path) -> Path:
    """Where the vLLM copy of a frequent-token-head draft lives: in the cache, named by its weights' content."""
    weights = sorted(folder.glob("*.safetensors"))
    key = "|".join(content_key(w) for w in weights) + "|" + (folder / "config.json").read_text()
    return cache_root() / "vllm" / f"{folder.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


EXCLUDED_MARGIN = 30.0  # at every probe position, excluded logits sit at least this far below the head's top


def probe_texts() -> list[str]:
    """Ordinary text of every kind the tool runs (stories, tasks, few-shot arithmetic), for export_draft."""
    return [*LATENCY_PROMPTS, few_shot("mul"), few_shot("add"), *sorted(all_task_texts())]


def positive_direction(h: torch.Tensor, steps: int = 2000) -> torch.Tensor:
    """A w with h·w > 0 for every row of ``h`` where one exists: least squares towards h·w = 1, then a hinge
    loss on the rows below 1 (a linear separation of the rows from the origin)."""
    w = torch.linalg.lstsq(h, torch.ones(h.shape[0], 1)).solution.flatten()
    with torch.enable_grad():
        w = w.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([w], lr=1e-2)
        for _ in range(steps):
            margin = h @ w
            if margin.min() >= 0.5:
                break
            loss = torch.relu(1 - margin).mean() + 1e-4 * w.square().sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w.detach()


@dataclass
class ExportReport:
    """What ``export_draft`` did: where it wrote, how far below the head the excluded tokens sit."""

    out: Path
    head_tokens: int
    vocab_size: int
    positions: int  # probe positions the direction was fitted and checked on
    min_projection: float  # smallest h·w over them (> 0: excluded tokens held down everywhere)
    excluded_mass: float  # largest probability the excluded tokens together get at a probe position (T=1)


def export_draft(folder: str | Path, out: str | Path) -> ExportReport:
    """Write a standard Llama copy of a draft saved with a frequent-token head (``lssp.models.draft_head``).

    A standard Llama output layer has no bias, so "never propose these tokens" cannot be written as -inf. Every
    excluded row is set to -w, where w is the least-squares direction with h·w ≈ s on the draft's final (normed)
    hidden states h over the probe texts, scaled so that the excluded logit -h·w sits at least EXCLUDED_MARGIN
    below the head's top logit at every probe position. Where h·w > 0 (the export checks it on every probe position) an
    excluded token is in practice never proposed; whatever small mass remains is part of the draft's q, so SSp
    stays exact either way.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from lssp.models.draft_head import HEAD_KEY, load_subset_head_model

    folder, out = Path(folder), Path(out)
    model = load_subset_head_model(folder, torch.float32)
    head = model.lm_head
    ids = head.token_ids
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        h = torch.cat([model.model(**tokenizer(text[:4000], return_tensors="pt")).last_hidden_state[0]
                       for text in probe_texts()])
        w = positive_direction(h)
        projection = h @ w
        if projection.min() <= 0:
            raise UserError(f"{folder}: no direction keeps the draft's excluded tokens below its head on every probe "
                            "position; it cannot be exported for vLLM")
        head_logits = head.linear(h)
        top = head_logits.max(-1).values
        scale = float(((EXCLUDED_MARGIN + top.clamp(min=0)) / projection).max())  # the margin at every position
        full = (-scale * w).expand(model.config.vocab_size, -1).clone()
        full[ids] = head.linear.weight
        excluded = -scale * projection  # every excluded token's logit, position by position
        log_out = excluded + torch.log(torch.tensor(float(model.config.vocab_size - len(ids))))
        mass = torch.sigmoid(log_out - torch.logsumexp(head_logits, -1)).max().item()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    state["lm_head.weight"] = full
    config = json.loads((folder / "config.json").read_text())
    config.pop(HEAD_KEY, None)
    config["tie_word_embeddings"] = False
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.get("dtype"), torch.float32)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.to(dtype) for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if (folder / "generation_config.json").exists():
        (tmp / "generation_config.json").write_text((folder / "generation_config.json").read_text())
    report = ExportReport(out, len(ids), model.config.vocab_size, h.shape[0], float(projection.min()), mass)
    (tmp / "export.json").write_text(json.dumps({
        "source": str(folder), "head_tokens": report.head_tokens, "vocab_size": report.vocab_size,
        "excluded_rows": f"-w: h.w > 0 on the probe texts' final hidden states h (least squares, then a hinge loss), "
                         f"scaled {EXCLUDED_MARGIN:g} logits below the head's top at every probe position",
        "probe_positions": report.positions, "min_projection": report.min_projection,
        "max_excluded_mass": mass}, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return report
