"""How fast `distill` trains: seconds per step of the plain draft and of a feature head, in fp32 and in bf16
(autocast, ``--precision``), on the same batch of real ShareGPT sequences the target answered, in one run.

A small collection (BATCH of ShareGPT's held-out contexts, answered by the default target with its features, through
``distill``'s own ``collect``) goes to a temporary folder; then each of draft and head takes WARM_UP steps
and then --steps steps in each precision on the same batch, fp32 and bf16 steps in turn (medians), with ``distill``'s own loss and optimizer settings. The draft
starts from the shipped one (``--init-draft``); the head is fresh, over the target's 8192 most frequent tokens of
the batch. Every row: kind, precision, tokens per step, seconds per step, trained tokens/s, and the machine.

Usage: python benchmarks/training_speed.py [--batch 16] [--steps 5] [--out benchmarks/results/training_speed.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lssp.distill import DistillConfig, collect, collection_model  # noqa: E402
from lssp.distill.head_training import HeadTrainer, feature_examples  # noqa: E402
from lssp.distill.training import _examples, _loss, load_initial_draft  # noqa: E402
from lssp.models.draft_head import most_frequent  # noqa: E402
from lssp.models.eagle import FeatureHead, head_config  # noqa: E402
from lssp.models.loading import load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.results import RunInfo  # noqa: E402

TARGET = "smollm2-135m-compact"
DRAFT = REPO / "drafts" / "smollm2-135m-draft"
MAX_SEQ_LEN = 384
WARM_UP = 1


def seconds_per_step(model: torch.nn.Module, loss_of, steps: int) -> dict[str, float]:
    """Median seconds of an optimizer step in each precision, over ``steps`` steps of each taken in turn (fp32, bf16,
    fp32, ...) after WARM_UP of each, so that both see the machine alike."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.98))
    model.train()

    def step(precision: str) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for at in range(WARM_UP + steps):
        for precision, taken in times.items():
            seconds = step(precision)
            if at >= WARM_UP:
                taken.append(seconds)
    return {precision: statistics.median(taken) for precision, taken in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (distill's batch size)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "training_speed.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(load_registry(str(REPO / "models.yaml")).get(TARGET))
    info = RunInfo.here("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DistillConfig(kind="eagle", source="sharegpt", batch_prompts=args.batch, new_tokens=192, data_tokens=1,
                            max_seq_len=MAX_SEQ_LEN, init_from=str(DRAFT))
        collect(collection_model(target.model), target.tokenizer, Path(tmp), cfg)
        # Shard 0 answers held-out contexts (of mixed lengths; the training ones come bucketed by length, shortest
        # first): the batch is shard 0's.
        draft_batch = [e for e in _examples(Path(tmp), cfg) if e["held_out"]][:args.batch]
        head_batch = [e for e in feature_examples(Path(tmp), cfg) if e["held_out"]][:args.batch]
    hf = target.hf_model
    draft = load_initial_draft(hf, cfg)
    width = hf.get_output_embeddings().out_features
    counts = sum(torch.bincount(e["ids"][1:], minlength=width) for e in head_batch)
    head = FeatureHead(head_config(hf.config, 1, most_frequent(counts, 8192)))
    trainer = HeadTrainer(head, hf)
    for kind, model, batch, loss_of in [("draft", draft, draft_batch, lambda: _loss(draft, draft_batch, cfg)),
                                        ("feature head", head, head_batch, lambda: trainer.loss(head_batch))]:
        for precision, seconds in seconds_per_step(model, loss_of, args.steps).items():
            trained = sum(e["n"] for e in batch)
            row = {"kind": kind, "precision": precision, "sequences": len(batch),
                   "tokens": sum(len(e["ids"]) for e in batch), "trained_tokens": trained,
                   "s_per_step": round(seconds, 3), "trained_tokens_per_s": round(trained / seconds)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {**info.head(), "env": info.env, "target": TARGET, "draft": str(DRAFT.relative_to(REPO)),
              "max_seq_len": MAX_SEQ_LEN, "steps": args.steps, "warm_up": WARM_UP, "statistic": "median s per step, fp32 and bf16 steps in turn",
              "sequences": "ShareGPT held-out contexts (distill --source sharegpt) answered by the target, greedy",
              "command": "python benchmarks/training_speed.py " + " ".join(sys.argv[1:]), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
