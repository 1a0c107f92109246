"""What the Python around our kernel's call costs per forward of the default target, with caches as a real forward
leaves them.

A forward streams ~100 MB of weights through the caches, so the Python and torch code that runs between two kernel
calls runs cold: an op that takes ~5 us in a loop takes ~40 us there. This times, in one process, alternating, each
after a 100 MB stream: the default target's one-token forward as ``forward_logits`` calls it with the kernel's
``decoder`` stubbed (its output returned at once), by the plain call (``CompactLlama._plain_call``: the rows and
rotary rows looked up in the kernel) and by the general path (embedding, rotary rows and arguments built in Python:
the path a masked, batched or tapped forward takes); and RSp's step from logits to the next token's ids, greedy, by
tensors on the device (``sample_logits``, the token stored, viewed as the next ids: a GPU's) and on the host
(``pick``, the ids' buffer written by NumPy: a CPU's). Writes the medians in us with the machine to a JSON file.
Usage: .venv/bin/python benchmarks/forward_overhead.py OUT.json [--rounds 300]   (~1 minute)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_target  # noqa: E402

from lssp.decoding.kv import forward_logits  # noqa: E402
from lssp.decoding.sampling import SamplingParams, pick, sample_logits  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    target = load_default_target()
    model = target.model
    ids = torch.randint(100, 20000, (1, 129), generator=torch.Generator().manual_seed(0))
    stream = torch.empty(100 * 2**20 // 4)
    real, plain = torch.ops.lssp.decoder, model._plain_call
    times: dict[str, list[float]] = {"plain call": [], "general path": [], "next token by tensors": [],
                                     "next token on the host": []}
    greedy, out, fed = SamplingParams(0.0), torch.empty(1, dtype=torch.long), torch.empty(1, 1, dtype=torch.long)
    with torch.inference_mode():
        cache = model.new_cache()
        model(ids[:, :128], past_key_values=cache)
        logits = forward_logits(model, ids[:, 128:], cache, 1)
        cache.crop(-1)
        outputs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for general in (False, True):  # each path's own output, for its stub to return
            model._plain_call = (lambda *a: None) if general else plain
            torch.ops.lssp.decoder = lambda *a, general=general, **k: outputs.setdefault(general, real(*a, **k))
            forward_logits(model, ids[:, 128:], cache, 1)
            cache.crop(-1)
        try:
            for _ in range(args.rounds):
                for general, name in ((False, "plain call"), (True, "general path")):
                    model._plain_call = (lambda *a: None) if general else plain
                    torch.ops.lssp.decoder = lambda *a, general=general, **k: outputs[general]
                    stream.fill_(1.0)
                    start = time.perf_counter()
                    forward_logits(model, ids[:, 128:], cache, 1)
                    times[name].append(time.perf_counter() - start)
                    cache.crop(-1)
                stream.fill_(1.0)
                start = time.perf_counter()
                token = sample_logits(logits, greedy, None)
                out[0] = token[0]
                token.view(1, 1)
                times["next token by tensors"].append(time.perf_counter() - start)
                stream.fill_(1.0)
                start = time.perf_counter()
                fed.numpy()[0, 0] = pick(logits, greedy, None)
                times["next token on the host"].append(time.perf_counter() - start)
        finally:
            torch.ops.lssp.decoder, model._plain_call = real, plain
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "target": target.spec.name,
              "rounds": args.rounds, "unit": "us, median, each after a 100 MB stream",
              "us": {name: round(1e6 * median(spent), 1) for name, spent in times.items()}}
    print(json.dumps(result["us"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
