"""What the default target's forward gets of this machine's memory bandwidth, minute by minute, in one process.

Every few seconds, in turn: a 256 MB copy (``copy_bandwidth``, the probe ``latency`` takes), a 256 MB read
(``torch.sum``), our q4_1 kernel over 110 MB of weights as one matmul and as 100 matmuls of the model's gate/up shape
(each a call from Python), and the default target's one-token forward after 128 cached tokens (fastest of 20): each
as GB/s of what it reads. Shared hosts drift between bandwidth states; this shows which of them the forward follows.
Writes the samples with the machine to a JSON file.
Usage: .venv/bin/python benchmarks/bandwidth_track.py OUT.json [--samples 25]   (~1 minute)
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

from lssp.decoding.timing import copy_bandwidth  # noqa: E402
from lssp.measure.cost import Floor  # noqa: E402
from lssp.models.weight_only import BlockLinear  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402

MATMULS = 100  # of the gate/up shape (3072 x 576): 110 MB of q4_1, well past the L3


def fastest(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=25)
    args = parser.parse_args()
    target = load_default_target()
    model = target.model
    weight_bytes = Floor.of(model, 1.0, 1.0).weight_bytes
    torch.manual_seed(0)
    small = [BlockLinear(torch.randn(3072, 576) * 0.05) for _ in range(MATMULS)]
    big = BlockLinear(torch.randn(3072 * MATMULS, 576) * 0.05)
    stream_bytes = sum(t.numel() * t.element_size() for t in big.weights())
    x, read = torch.randn(1, 576), torch.ones(256 * 2**20 // 4)
    ids = torch.randint(100, 20000, (1, 130), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    samples = []
    with torch.inference_mode():
        model(ids[:, :128], past_key_values=cache)

        def forward() -> None:
            model(ids[:, 128:129], past_key_values=cache)
            cache.crop(-1)

        for _ in range(args.samples):
            sample = {"copy": copy_bandwidth("cpu", 256, 3),
                      "read": read.numel() * 4 / fastest(read.sum, 4),
                      "one_matmul": stream_bytes / fastest(lambda: torch.ops.lssp.block_mm(x, *big.weights()), 3),
                      "matmuls": stream_bytes / fastest(lambda: [torch.ops.lssp.block_mm(x, *m.weights())
                                                                 for m in small], 3),
                      "forward": weight_bytes / fastest(forward, 20)}
            samples.append({key: round(value / 1e9, 2) for key, value in sample.items()})
            print(json.dumps(samples[-1]), flush=True)
            time.sleep(1)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "unit": "GB/s of what each reads",
              "forward_weight_mb": round(weight_bytes / 1e6, 1), "samples": samples,
              "median": {key: median(s[key] for s in samples) for key in samples[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
