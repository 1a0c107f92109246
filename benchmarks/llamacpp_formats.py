"""Is the shipped GGUF llama.cpp's fastest format here? The default target's Q4_1 file against copies of it with its
Q4_1 blocks requantized to llama.cpp's other CPU block formats (``requantized``: dequantized, quantized again), each
timed by llama-bench (a decode token after 64 cached, tg64; a 512-token prompt, pp512) on as many threads as our
engine, passes interleaved format by format, beside ours' one-token forward on the Q4_1 file (cost's timing). Each
copy's quality beside its speed: its greedy tokens on the story openings (32 each, llama-server) against the Q4_1
file's, the share of prompts equal and of tokens before the first difference.
Writes OUT.json and OUT.md with the CPU.
Usage: .venv/bin/python benchmarks/llamacpp_formats.py OUT [--formats q4_0,q8_0] [--passes 3]   (~4 minutes)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from default_pair import target_beside_llamacpp  # noqa: E402

from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.engines.llamacpp import LlamaServer, request_body  # noqa: E402
from lssp.engines.llamacpp_build import raw_decode, raw_prefill, requantized  # noqa: E402
from lssp.measure.cost import time_forwards  # noqa: E402
from lssp.report.results import RunInfo, cpu_features, cpu_name, markdown_table  # noqa: E402
from lssp.workloads.prompts import LATENCY_PROMPTS  # noqa: E402

GREEDY_TOKENS = 32


def greedy_tokens(build, gguf: Path, prompts: list[list[int]], n_threads: int) -> list[list[int]]:
    """Each prompt's greedy continuation (GREEDY_TOKENS tokens, past the end token) by a llama-server on ``gguf``."""
    with tempfile.TemporaryDirectory() as folder:
        server = LlamaServer(build, gguf.name, ["-m", str(gguf), "--threads", str(n_threads), "--parallel", "1",
                                                "--no-cont-batching"], Path(folder) / "server.log")
        server.start()
        try:
            return [list(server.complete(request_body(ids, GREEDY_TOKENS, SamplingParams(0.0), 0))[0]["tokens"])
                    for ids in prompts]
        finally:
            server.close()


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of prompts whose tokens equal the reference's, mean share of tokens before the first difference)."""
    same = [a == b for a, b in zip(tokens, reference)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b) for a, b in zip(tokens, reference)]
    return sum(same) / len(same), sum(prefix) / len(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="OUT.json and OUT.md are written")
    parser.add_argument("--formats", default="q4_0,q8_0", help="formats to requantize the Q4_1 blocks to")
    parser.add_argument("--passes", type=int, default=3, help="times each test runs; medians")
    args = parser.parse_args()
    build, target, shipped, n_threads = target_beside_llamacpp()
    files = {"Q4_1 (shipped)": shipped, **{f.upper(): requantized(shipped, f) for f in args.formats.split(",")}}
    prompts = [target.tokenizer(text).input_ids for text in LATENCY_PROMPTS]
    reference = greedy_tokens(build, shipped, prompts, n_threads)
    quality = {name: agreement(greedy_tokens(build, path, prompts, n_threads), reference) for name, path in files.items()}
    passes = []
    for number in range(args.passes):  # every format in every pass, ours beside, in the same minute
        times = {name: (raw_decode(build, path, n_threads, tokens=64, depth=64, repeats=3).ms_per_token,
                        raw_prefill(build, path, n_threads, 512)[0]) for name, path in files.items()}
        times["ours"] = (time_forwards(target.model, [1], context=64)[1], float("nan"))
        passes.append(times)
        print(f"pass {number + 1}:", {name: round(t[0], 3) for name, t in times.items()}, flush=True)
    decode = {name: median(p[name][0] for p in passes) for name in files}
    ours = median(p["ours"][0] for p in passes)
    fastest = min(decode, key=decode.get)
    rows = [{"format": name, "file_mb": round(path.stat().st_size / 1e6, 1),
             "tg64_at_d64_ms_per_token": round(decode[name], 3),
             "pp512_ms_per_token": round(median(p[name][1] for p in passes), 3),
             "ours_q4_1_over_it": round(ours / decode[name], 3),
             "greedy_prompts_equal_to_q4_1": round(quality[name][0], 3),
             "greedy_tokens_before_first_difference": round(quality[name][1], 3)} for name, path in files.items()]
    info = RunInfo.for_models(target)
    head = {**info.head(), **info.env, "cpu": f"{cpu_name()} ({cpu_features()})", "threads": n_threads,
            "target": target.name, "gguf": shipped.name, "llamacpp_version": build.version, "passes": args.passes,
            "ours_ms_per_token": round(ours, 3), "fastest": fastest, "rows": rows,
            "ours": "a one-token forward of the target as the registry loads it (the Q4_1 file), after 64 cached",
            "llamacpp": "llama-bench, flash attention on: tg64 at depth 64, pp512; the copies requantized from the "
                        "Q4_1 blocks (lossy: their greedy tokens against the Q4_1 file's beside)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(head, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# llama.cpp's decode by block format, the default target\n\n{info.describe()}; {n_threads} threads; "
        f"llama.cpp {build.version}. Ours: {head['ours']}, {ours:.3g} ms. llama.cpp: {head['llamacpp']}.\n\n"
        + markdown_table(rows, list(rows[0]))
        + f"\nMedians over {args.passes} passes. llama.cpp's fastest decode here: {fastest} "
        f"({decode[fastest]:.3g} ms/token); ours on the Q4_1 file {ours / decode[fastest]:.2f}x it. Greedy agreement: "
        f"{len(prompts)} story openings x {GREEDY_TOKENS} tokens, each copy against the Q4_1 file.\n")


if __name__ == "__main__":
    main()
