"""The final norm and output layer inside our kernel's one call against after it, in one process, interleaved.

Times the default target's (q4_1) forward of 1 and 3 tokens after 64 cached, alternating the two paths call by call
(the output layer run from Python: ``torch.rms_norm`` and ``block_mm``; or inside ``torch.ops.lssp.decoder``), and
writes the medians with the machine to a JSON file.
Usage: .venv/bin/python benchmarks/fused_output_ab.py OUT.json [CALLS]
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

from lssp.decoding.kv import forward_logits, new_cache
from lssp.models.loading import load_model
from lssp.models.registry import load_registry
from lssp.report.results import cpu_name

TOKENS = (1, 3)


def main(out: Path, calls: int) -> None:
    model = load_model(load_registry(Path(__file__).parents[1] / "models.yaml").get("smollm2-135m-q4")).model
    ids = torch.randint(1000, 20000, (1, 80), generator=torch.Generator().manual_seed(0))
    kv = new_cache(model)
    assert model._fused_output(1) is not None, "the output layer is not in our kernel's blocks"
    fused = model.__dict__["_output"]  # what the model caches; None makes it run the output layer from Python
    times: dict[str, dict[int, list[float]]] = {"after the call": {n: [] for n in TOKENS},
                                               "in the call": {n: [] for n in TOKENS}}
    with torch.inference_mode():
        forward_logits(model, ids[:, :64], kv, 1)
        for i in range(calls):
            path = "in the call" if i % 2 else "after the call"
            model.__dict__["_output"] = fused if path == "in the call" else None
            n = TOKENS[(i // 2) % len(TOKENS)]
            start = time.perf_counter()
            forward_logits(model, ids[:, 64:64 + n], kv, n)
            times[path][n].append(time.perf_counter() - start)
            kv.crop(-n)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "calls": calls,
              "median_ms": {path: {str(n): round(1000 * median(v[len(v) // 10:]), 3) for n, v in per.items()}
                            for path, per in times.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4000)
