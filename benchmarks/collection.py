"""How fast `distill` collects the target's own answers: tokens/s of batched generation at batch 1, 32 and 128,
the collection as it is against the collection of an earlier commit, on the same ShareGPT contexts, in one run.
At the largest batch the current code also runs the target as the registry loads it (dynamically quantized on a
CPU), against the plain-weight form distill collects with.

Each measurement runs in a process of its own, one after another (never two at once): the current code's
``generate_rows`` under the compact forward (with and without the features a head learns from), and the earlier
commit's collection (``--baseline``, checked out into a temporary git worktree; its ``_generate_batch`` ran the
transformers forward over left-padded batches). Every row: the contexts' prompt tokens, the new tokens kept (up to
each row's end token), seconds, tokens/s, and the machine.

Usage: python benchmarks/collection.py [--baseline c45f4de] [--batches 1,32,128] [--new-tokens 64]
                                       [--out benchmarks/results/collection_speed.json]
"""
from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-compact"
TEMPERATURE = 0.7
TOP_K = 32


def measure(code: str, batch: int, new_tokens: int, prompts_file: str, features: bool, as_loaded: bool = False) -> dict:
    """One batch of ``batch`` contexts through the collection of the code at ``code`` (a checkout's root); with
    ``as_loaded``, the current code runs the target as the registry loads it (not the form distill collects with)."""
    sys.path.insert(0, code)
    import torch

    import lssp

    assert lssp.__file__.startswith(code), f"{lssp.__file__} is not the code under {code}"

    from lssp.models.loading import load_model
    from lssp.models.registry import load_registry

    spec = load_registry(str(Path(code) / "models.yaml")).get(TARGET)  # the checkout's own registry
    form = "as loaded"
    if code == str(REPO) and not as_loaded:  # the form distill collects with (plain weights where that is faster)
        from lssp.distill import collection_spec

        faster = collection_spec(spec, torch.device("cpu"))
        spec, form = (faster, f"{faster.dtype}, plain weights") if faster else (spec, form)
    target = load_model(spec)
    eos = set(target.tokenizer.all_special_ids)
    prompts = pickle.loads(Path(prompts_file).read_bytes())[:batch]
    start = time.perf_counter()
    if code == str(REPO):
        from lssp.decoding.sampling import SamplingParams
        from lssp.distill import collection_model, generate_rows

        generators = [torch.Generator().manual_seed(r) for r in range(batch)]
        record = generate_rows(collection_model(target.model), prompts, new_tokens, SamplingParams(TEMPERATURE),
                               generators, TOP_K, eos, features=features)
    else:  # the earlier collection: the transformers model, left-padded batches, one generator
        from lssp.distill.collection import _generate_batch

        record = _generate_batch(target.hf_model, prompts, new_tokens, TEMPERATURE, TOP_K, 0,
                                 torch.Generator().manual_seed(0), features=features)
    seconds = time.perf_counter() - start
    kept = sum(next((i + 1 for i, t in enumerate(row) if t in eos), new_tokens) for row in record["tokens"].tolist())
    return {"batch": batch, "features": features, "target_form": form, "prompt_tokens": sum(map(len, prompts)), "new_tokens": kept,
            "seconds": round(seconds, 2), "tokens_per_s": round(kept / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="c45f4de", help="earlier commit to compare with ('' for none)")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "collection_speed.json")
    parser.add_argument("--worker", nargs=4, metavar=("CODE", "BATCH", "PROMPTS", "FEATURES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        code, batch, prompts, features = args.worker
        print(json.dumps(measure(code, int(batch), args.new_tokens, prompts, features == "1", features == "loaded")))
        return

    sys.path.insert(0, str(REPO))
    from lssp.distill import DistillConfig
    from lssp.distill.collection import source_prompts
    from lssp.models.loading import load_model
    from lssp.models.registry import load_registry
    from lssp.report.results import RunInfo

    batches = [int(b) for b in args.batches.split(",")]
    target = load_model(load_registry(str(REPO / "models.yaml")).get(TARGET))
    contexts = source_prompts(target.tokenizer, DistillConfig(source="sharegpt", batch_prompts=max(batches)))[0]
    info = RunInfo.here("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.pkl"
        prompts.write_bytes(pickle.dumps(contexts[:max(batches)]))  # the first bucket: contexts of about one length
        codes = [("current", str(REPO))]
        if args.baseline:
            old = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(old), args.baseline], check=True)
            codes.insert(0, (f"commit {args.baseline}", str(old)))
        try:
            for label, code in codes:
                for batch in batches:
                    top = label == "current" and batch == max(batches)
                    for features in ("0", "1", "loaded") if top else ("0",):
                        out = subprocess.run([sys.executable, __file__, "--new-tokens", str(args.new_tokens), "--worker",
                                              code, str(batch), str(prompts), features],
                                             capture_output=True, text=True, check=True, cwd=tmp)
                        row = {"code": label, **json.loads(out.stdout.strip().splitlines()[-1])}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    report = {**info.head(), "env": info.env, "target": TARGET, "temperature": TEMPERATURE, "top_k_saved": TOP_K,
              "new_tokens_per_context": args.new_tokens, "contexts": "ShareGPT training contexts (distill --source "
              "sharegpt), the first bucket", "command": "python benchmarks/collection.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
