"""Where the default target's forward spends its time, phase by phase, in our CPU kernel.

Builds ``lssp/kernels/blocks.cpp`` as it is with ``-DLSSP_PHASES`` under another op namespace (the decoder then sums
the time of each phase of each layer: norm, qkv, rope and cache, attention, o, residual and norm, gate_up, silu, down,
residual; and the output layer), swaps its ``decoder`` in, and times forwards of 1 and 3 tokens after 128 and 512
cached tokens (``--contexts``). Each matmul's phase also gives GB/s of its weights (as stored). Writes µs per forward by phase with
the machine to a JSON file.
Usage: .venv/bin/python benchmarks/forward_phases.py OUT.json [--forwards 500] [--contexts 128,512]   (~1 minute)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_target  # noqa: E402

from lssp.kernels import block_kernel, load_as, with_kept_stack  # noqa: E402
from lssp.measure.cost import stored_bytes  # noqa: E402
from lssp.models.sources import cache_root  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402

NAMESPACE = "lssp_phases"
PHASES = ("norm", "qkv", "rope_and_cache", "attention", "o", "residual_and_norm", "gate_up", "silu", "down", "residual",
          "output_layer")


def weight_mb(model: torch.nn.Module) -> dict[str, float]:
    """MB of each matmul phase's weights over all layers, as stored (the compact forward's fused layers)."""
    sizes = {"qkv": model.qkv, "o": model.o, "gate_up": model.gate_up, "down": model.down}
    out = {phase: sum(stored_bytes(layer)[0] for layer in layers) / 1e6 for phase, layers in sizes.items()}
    out["output_layer"] = stored_bytes(model.hf.lm_head)[0] / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--forwards", type=int, default=500)
    parser.add_argument("--contexts", default="128,512", help="cached tokens before the timed forwards (comma list)")
    args = parser.parse_args()
    block_kernel(cache_root() / "kernels")
    target = load_default_target()
    model = target.model
    sizes = weight_mb(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = torch.randint(100, 20000, (1, max(contexts) + 8), generator=torch.Generator().manual_seed(0))
    result: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "unit": "µs per forward",
                    "weights_mb": {k: round(v, 2) for k, v in sizes.items()}, "runs": {}}
    with tempfile.TemporaryDirectory() as where, torch.inference_mode():
        load_as((REPO / "lssp" / "kernels" / "blocks.cpp").read_text(), NAMESPACE, Path(where), ("-DLSSP_PHASES",))
        torch.ops.lssp.decoder = with_kept_stack(NAMESPACE)
        for context in contexts:
            cache = model.new_cache()
            model(ids[:, :context], past_key_values=cache)
            for n in (1, 3):
                for _ in range(20):  # warm
                    model(ids[:, context:context + n], past_key_values=cache)
                    cache.crop(-n)
                getattr(torch.ops, NAMESPACE).phase_times()
                for _ in range(args.forwards):
                    model(ids[:, context:context + n], past_key_values=cache)
                    cache.crop(-n)
                sums = getattr(torch.ops, NAMESPACE).phase_times().tolist()
                calls = sums[-1]
                us = {phase: round(1e6 * s / calls, 1) for phase, s in zip(PHASES, sums)}
                gbs = {phase: round(sizes[phase] * 1e3 / us[phase], 1) for phase in sizes if us[phase] > 0}
                result["runs"][f"{context}+{n}"] = {"us": us, "total_us": round(sum(us.values()), 1),
                                                     "matmul_gbs": gbs}
                print(f"{context}+{n}", json.dumps(result["runs"][f"{context}+{n}"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
