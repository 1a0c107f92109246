"""Teacher-forced first-draft agreement of drafts on the story openings' own text: the target's greedy completions.

Where a head's held-out agreement on a collection rises, this says whether it rises on the text `latency` times
(the reference's story openings): at each position of the target's greedy completion, does the draft's argmax after
the true prefix equal the target's token? By spans of 16 generated tokens (the first spans follow short prompts),
and by how sure the target itself was of its token (its probability: where it hesitates, a draft cannot be sure).

Usage: python benchmarks/story_agreement.py DRAFT [DRAFT ...] [--config models.yaml] [--prompts 16] [--tokens 64]
       [--out FILE.json]
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
from lssp.workloads.prompts import LATENCY_PROMPTS  # noqa: E402

SPAN = 16
SURE = (0.0, 0.5, 0.8, 0.95)  # lower bounds of the buckets of the target's probability of its own token


def agreement(target, draft, completions: list[tuple[int, torch.Tensor]]) -> dict:
    """Share of positions where the draft's argmax after the true prefix is the target's greedy token, overall, by
    span of SPAN generated tokens, and by the target's probability of that token (buckets from SURE)."""
    hits: dict[int, list[int]] = {}
    by_sure: dict[float, list[int]] = {bound: [] for bound in SURE}
    for prompt_len, seq in completions:
        sure = forward_logits(target, seq, new_cache(target), seq.shape[1]).float().softmax(-1)
        for end in range(prompt_len + 1, seq.shape[1]):
            logits = draft_logits(target, draft, seq[:, :end]).reshape(-1)
            hit = int(int(logits.argmax()) == int(seq[0, end]))
            hits.setdefault((end - prompt_len) // SPAN, []).append(hit)
            by_sure[max(b for b in SURE if b <= float(sure[end - 1, seq[0, end]]))].append(hit)
    every = [h for span in hits.values() for h in span]
    return {"agreement": sum(every) / len(every), "positions": len(every),
            "by_span": {f"{SPAN * s}-{SPAN * (s + 1) - 1}": round(sum(h) / len(h), 4) for s, h in sorted(hits.items())},
            "by_target_probability": {f">={b}": {"share": round(len(h) / len(every), 4),
                                                 "agreement": round(sum(h) / len(h), 4) if h else None}
                                      for b, h in by_sure.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+")
    ap.add_argument("--config", type=Path, default=REPO / "models.yaml")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    registry = load_registry(args.config)
    target = load_model(registry.get(registry.target_name(None)))
    greedy = SamplingParams(temperature=0.0)
    completions = []
    with torch.inference_mode():
        for text in LATENCY_PROMPTS[:args.prompts]:
            ids = torch.tensor([encode_prompt(target.tokenizer, text, False)])
            out = generate_regular(target.model, ids, args.tokens, greedy, time_forwards=False).tokens
            completions.append((ids.shape[1], torch.cat([ids[0], out])[None]))
        rows = []
        for name in args.drafts:
            draft = load_model(registry.get(name), draft=True, target=target).model
            rows.append({"draft": name, **agreement(target.model, draft, completions)})
            print(name, f"{rows[-1]['agreement']:.3f}", rows[-1]["by_span"], rows[-1]["by_target_probability"])
    info = RunInfo.here("cpu")
    result = {"run_id": info.run_id, "env": info.env, "target": target.spec.name, "precision": target.precision,
              "prompts": args.prompts, "tokens": args.tokens, "command": "python " + " ".join(sys.argv), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
