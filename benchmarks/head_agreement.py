"""Held-out top-1 agreement of feature heads at each drafting step, on one collection's held-out answers.

Teacher-forced up to where a draft begins, then the head on its own guesses (``HeadTrainer.agreement``): step 0 is
the first drafted token, step s the (s+1)-th. Every head is measured on the same sequences, in bf16 autocast where
training runs in it, so the numbers compare across heads (and with a card's curve, measured the same way).

Usage: python benchmarks/head_agreement.py DATA_DIR HEAD [HEAD ...] [--steps 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lssp.distill import DistillConfig  # noqa: E402
from lssp.distill.head_training import HeadTrainer, feature_examples  # noqa: E402
from lssp.distill.training import held_out_split, training_precision  # noqa: E402
from lssp.models.eagle import load_feature_head  # noqa: E402
from lssp.models.loading import load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.results import RunInfo  # noqa: E402

TARGET = "smollm2-135m-compact"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("heads", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=384)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target = load_model(load_registry(REPO / "models.yaml").get(TARGET)).hf_model
    rows, held = [], []
    for folder in args.heads:
        head = load_feature_head(folder).float()
        # The held-out answers with the features this head reads (a head with feature_layers: those layers' too).
        cfg = DistillConfig(max_seq_len=args.max_seq_len, feature_layers=head.feature_layers)
        _, held = held_out_split(feature_examples(args.data_dir, cfg), args.data_dir)
        trainer = HeadTrainer(head, target)
        precision = training_precision(head, "auto")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            agreement = [trainer.agreement(held, step) for step in range(args.steps)]
        rows.append({"head": str(folder), "agreement_by_step": agreement, "precision": precision})
        print(folder, " ".join(f"{a:.3f}" for a in agreement))
    info = RunInfo.here("cpu")
    result = {"run_id": info.run_id, "env": info.env, "data_dir": str(args.data_dir), "held_out_sequences": len(held),
              "held_out_positions": sum(e["n"] for e in held), "command": "python " + " ".join(sys.argv), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
