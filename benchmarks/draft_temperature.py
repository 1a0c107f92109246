"""Which temperature should a draft sample at? The expected acceptance of one sampled draft, sum_x min(p(x), q(x)),
where p is the target's law at temperature T and q the draft's logits at temperature tau (any q keeps SSp exact:
verification divides by the q the draft drew from), on the target's own sampled completions of the task categories,
teacher-forced (each position after the true prefix). tau = 0 means drafting the argmax (q one-hot: acceptance p(x*)).

Usage: python benchmarks/draft_temperature.py DRAFT [--temperature 0.7] [--taus 0,0.35,0.5,0.7,0.85,1]
       [--per-task 3] [--tokens 48] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lssp.decoding.generation import generate_regular  # noqa: E402
from lssp.decoding.kv import forward_logits, new_cache  # noqa: E402
from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.drafters.model import draft_logits  # noqa: E402
from lssp.models.loading import encode_prompt, load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.results import RunInfo  # noqa: E402
from lssp.workloads.tasks import TASKS, load_tasks  # noqa: E402


def acceptance(p: torch.Tensor, draft: torch.Tensor, tau: float) -> float:
    """sum_x min(p(x), q(x)) for q the draft's logits at temperature tau (0: its argmax, one-hot)."""
    if tau == 0:
        return float(p[int(draft.argmax())])
    return float(torch.minimum(p, torch.softmax(draft / tau, -1)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft")
    ap.add_argument("--config", type=Path, default=REPO / "models.yaml")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--taus", default="0,0.35,0.5,0.7,0.85,1")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    taus = [float(t) for t in args.taus.split(",")]
    registry = load_registry(args.config)
    target = load_model(registry.get(registry.target_name(None)))
    draft = load_model(registry.get(args.draft), draft=True, target=target).model
    params = SamplingParams(temperature=args.temperature)
    torch.manual_seed(0)
    per_task: dict[str, list[list[float]]] = {}
    with torch.inference_mode():
        for prompt in load_tasks(list(TASKS), args.per_task):
            ids = torch.tensor([encode_prompt(target.tokenizer, prompt.text, prompt.chat)])
            out = generate_regular(target.model, ids, args.tokens, params, time_forwards=False).tokens
            seq = torch.cat([ids[0], out])[None]
            laws = torch.softmax(forward_logits(target.model, seq, new_cache(target.model), seq.shape[1]).float()
                                 / args.temperature, -1)
            for end in range(ids.shape[1] + 1, seq.shape[1]):
                logits = draft_logits(target.model, draft, seq[:, :end]).reshape(-1).float()
                per_task.setdefault(prompt.task, []).append([acceptance(laws[end - 1], logits, t) for t in taus])
    rows = [{"task": task, "positions": len(v), **{f"tau={t}": round(sum(r[i] for r in v) / len(v), 4)
                                                   for i, t in enumerate(taus)}} for task, v in per_task.items()]
    every = [r for v in per_task.values() for r in v]
    rows.append({"task": "all", "positions": len(every),
                 **{f"tau={t}": round(sum(r[i] for r in every) / len(every), 4) for i, t in enumerate(taus)}})
    for row in rows:
        print(row)
    info = RunInfo.for_models(target)
    result = {"run_id": info.run_id, "env": info.env, "draft": args.draft, "temperature": args.temperature,
              "command": "python " + " ".join(sys.argv), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
