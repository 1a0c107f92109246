"""Ours against llama.cpp on the default target's GGUF with nothing around either, as the context grows: a decode
token after D cached tokens (ours: a one-token forward of the target as the registry loads it, `cost`'s timing, the
median of 15; llama.cpp: llama-bench's generation test at depth D, 32 tokens) and a 512-token prompt into an empty
cache (ours: one forward of 512 tokens; llama.cpp: pp512), interleaved depth by depth, both on as many threads as
the engines use. Beside each of ours, its floor (weights and the cached keys and values at the faster of two
copy-bandwidth probes, before and after it: the host's bandwidth flaps). Each test runs in every pass (--passes), ours and llama.cpp's back to back; medians and the per-pass ratios.
Writes OUT.json and OUT.md with the CPU.
Usage: .venv/bin/python benchmarks/depth.py OUT [--depths 0,512,1024,2048] [--passes 3]   (~2 minutes on 2 cores)
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
from default_pair import target_beside_llamacpp  # noqa: E402

from lssp.decoding.kv import forward_logits, new_cache  # noqa: E402
from lssp.engines.llamacpp_build import raw_decode, raw_prefill  # noqa: E402
from lssp.measure.cost import bandwidth_probe, model_floor, time_forwards  # noqa: E402
from lssp.report.results import RunInfo, cpu_features, cpu_name, markdown_table  # noqa: E402

PREFILL = 512


def our_prefill_ms(model: torch.nn.Module, tokens: int, repeats: int = 3) -> float:
    """ms per token of one forward of ``tokens`` tokens into an empty cache (the median of ``repeats``)."""
    ids = torch.randint(2000, 20000, (1, tokens), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first warms
            cache = new_cache(model)
            start = time.perf_counter()
            forward_logits(model, ids, cache, 1)
            times.append(time.perf_counter() - start)
    return 1000 * median(times[1:]) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="OUT.json and OUT.md are written")
    parser.add_argument("--depths", default="0,512,1024,2048", help="cached tokens before the decode (comma list)")
    parser.add_argument("--passes", type=int, default=3, help="times each test runs; medians and per-pass ratios")
    args = parser.parse_args()
    build, target, gguf, n_threads = target_beside_llamacpp()
    floor, precision = model_floor(target)
    depths = [int(d) for d in args.depths.split(",")]
    passes: list[dict[str, dict[str, float]]] = []
    for number in range(args.passes):  # each pass times every test, ours then llama.cpp's, in the same minute
        times: dict[str, dict[str, float]] = {}
        for depth in depths:
            before = bandwidth_probe()
            ours = time_forwards(target.model, [1], context=max(depth, 1))[1]
            ours_floor = floor.at(max(before, bandwidth_probe())).ms(1, max(depth, 1))[0]
            theirs = raw_decode(build, gguf, n_threads, tokens=32, depth=depth, repeats=3).ms_per_token
            times[f"decode @ d{depth}"] = {"ours": ours, "llamacpp": theirs, "floor": ours_floor}
        times[f"prefill {PREFILL}"] = {"ours": our_prefill_ms(target.model, PREFILL),
                                       "llamacpp": raw_prefill(build, gguf, n_threads, PREFILL)[0]}
        passes.append(times)
        print(f"pass {number + 1}:", {test: round(t["ours"] / t["llamacpp"], 3) for test, t in times.items()}, flush=True)
    rows = []
    for test in passes[0]:
        got = [p[test] for p in passes]
        row = {"test": test, "ours_ms_per_token": round(median(t["ours"] for t in got), 4),
               "llamacpp_ms_per_token": round(median(t["llamacpp"] for t in got), 4),
               "ours_over_llamacpp": round(median(t["ours"] / t["llamacpp"] for t in got), 3),
               "ratio_min": round(min(t["ours"] / t["llamacpp"] for t in got), 3),
               "ratio_max": round(max(t["ours"] / t["llamacpp"] for t in got), 3)}
        if "floor" in got[0]:
            row["ours_over_floor"] = round(median(t["ours"] / t["floor"] for t in got), 3)
        rows.append(row)
    info = RunInfo.for_models(target)
    head = {**info.head(), **info.env, "cpu": f"{cpu_name()} ({cpu_features()})", "threads": n_threads, "target": target.name, "precision": precision,
            "gguf": gguf.name, "llamacpp_version": build.version, "passes": args.passes,
            "ours": "a bare forward (cost's timing): decode = one token after D cached, prefill = one forward of all",
            "llamacpp": "llama-bench, flash attention on: tg32 at depth D, pp512", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(head, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# Ours against llama.cpp as the context grows\n\n{info.describe()}; {n_threads} threads; target "
        f"`{target.name}` ({precision}), llama.cpp {build.version} on `{gguf.name}`. Ours: {head['ours']}; "
        f"llama.cpp: {head['llamacpp']}. ms per token.\n\n"
        + markdown_table(rows, ["test", "ours_ms_per_token", "llamacpp_ms_per_token", "ours_over_llamacpp",
                                "ratio_min", "ratio_max", "ours_over_floor"])
        + f"\nMedians over {args.passes} passes; ratio_min–max: ours ÷ llama.cpp's within each pass, the lowest and "
        "highest; ours_over_floor: ours ÷ its floor (the weights and the cached keys and values at the faster of two "
        "copy-bandwidth probes around it), the median over the passes; below 1, part of what the forward reads stayed in "
        "the CPU's caches from one timed forward to the next.\n")


if __name__ == "__main__":
    main()
