"""Our CPU kernel against its source at another git revision, in one process, alternating call by call.

Builds ``lssp/kernels/blocks.cpp`` as it was at REV under another op namespace, then times both builds:
the body's matmuls of the default target's shape (30 layers' gate/up and down projections, random weights, streamed
from memory as in a forward) at 1 to 8 activation rows, and the default pair decoding the story openings (RSp, and
SSp with the default drafter at its K), each build's ``decoder`` op swapped in per completion, and the target's
forward of 1, 3 and 7 tokens after 64 to 1536 cached tokens, call by call. Both over a float32 KV cache (what every
build reads; ``--cache float16`` where both builds read that too). Says whether the outputs were equal. Writes the
medians with the machine to a JSON file.
Usage: .venv/bin/python benchmarks/kernel_ab.py REV OUT.json [--repeats 3] [--prompts 8] [--cache float16]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from default_pair import load_default_pair  # noqa: E402

from lssp.decoding.generation import generate_regular  # noqa: E402
from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.decoding.speculative import speculative_decode  # noqa: E402
from lssp.drafters import entry_drafter  # noqa: E402
from lssp.kernels import block_kernel, load_as, with_kept_stack  # noqa: E402
from lssp.models.loading import encode_prompt, load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.models.sources import cache_root  # noqa: E402
from lssp.models.weight_only import BlockLinear  # noqa: E402
from lssp.report.results import cpu_name  # noqa: E402
from lssp.workloads.prompts import LATENCY_PROMPTS  # noqa: E402

BASE = "lssp_base"  # the op namespace of REV's build


def build_base(rev: str, where: Path) -> None:
    """``torch.ops.lssp_base``: the kernel's source at ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:lssp/kernels/blocks.cpp"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    load_as(source, BASE, where)


def matmuls(ops: dict, repeats: int) -> dict:
    """Median ms of the body's matmuls per build at 1..8 rows, and whether the builds' outputs were equal."""
    torch.manual_seed(0)
    layers = [BlockLinear(torch.randn(n, k) * 0.05) for _ in range(30) for n, k in ((3072, 576), (576, 1536))]
    out = {}
    for rows in range(1, 9):
        xs = [torch.randn(rows, layer.in_features) for layer in layers]
        times: dict[str, list[float]] = {name: [] for name in ops}
        for i in range(repeats):
            for name in (list(ops) if i % 2 else list(ops)[::-1]):
                start = time.perf_counter()
                for layer, x in zip(layers, xs):
                    ops[name](x, *layer.weights())
                times[name].append(time.perf_counter() - start)
        equal = all(torch.equal(*(op(x, *layer.weights()) for op in ops.values())) for layer, x in zip(layers[:6], xs))
        out[str(rows)] = {**{name: round(1000 * median(t), 3) for name, t in times.items()}, "equal": equal}
    return out


def decoding(ops: dict, repeats: int, prompts: int, cache: torch.dtype | None) -> dict:
    """ms/token per build for RSp and SSp (the default pair, story openings, greedy, 64 tokens), per completion
    after its first emission, and whether every completion's tokens were equal."""
    target, spec, head = load_default_pair()
    target.model.cache_dtype = cache
    greedy = SamplingParams(temperature=0.0)
    ids = [torch.tensor([encode_prompt(target.tokenizer, text, False)]) for text in LATENCY_PROMPTS[:prompts]]
    spent = {name: {"rsp": [0.0, 0], "ssp": [0.0, 0]} for name in ops}
    tokens: dict[str, list] = {name: [] for name in ops}
    for i in range(repeats):
        for prompt in ids:
            for name in (list(ops) if i % 2 else list(ops)[::-1]):
                torch.ops.lssp.decoder = ops[name]
                drafter = entry_drafter(head)
                for mode, out in (("rsp", generate_regular(target.model, prompt, 64, greedy, time_forwards=False)),
                                  ("ssp", speculative_decode(target.model, drafter, prompt, 64, spec.k or 2, greedy,
                                                             time_forwards=False))):
                    spent[name][mode][0] += out.stats.total_time_s - out.stats.ttft_s
                    spent[name][mode][1] += out.stats.new_tokens - out.stats.first_emission_tokens
                    tokens[name].append(out.tokens.tolist())
    first = next(iter(tokens.values()))
    return {name: {mode: round(1000 * s / n, 3) for mode, (s, n) in per.items()} for name, per in spent.items()} | {
        "equal": all(t == first for t in tokens.values()), "draft": spec.name, "k": spec.k or 2}


def forwards(ops: dict, repeats: int, cache: torch.dtype | None) -> dict:
    """Median ms per build of the default target's forward of 1, 3 and 7 tokens after 64..1536 cached tokens
    (random ids), the builds alternating call by call, and whether their logits were equal."""
    registry = load_registry(REPO / "models.yaml")
    model = load_model(registry.get(registry.target_name(None))).model
    model.cache_dtype = cache
    ids = torch.randint(100, 20000, (1, 1536 + 7), generator=torch.Generator().manual_seed(0))
    out = {}
    for context in (64, 256, 512, 1536):
        kv = model.new_cache()
        model(ids[:, :context], past_key_values=kv)
        for n in (1, 3, 7):
            times: dict[str, list[float]] = {name: [] for name in ops}
            logits = {}
            for i in range(repeats):
                for name in (list(ops) if i % 2 else list(ops)[::-1]):
                    torch.ops.lssp.decoder = ops[name]
                    start = time.perf_counter()
                    logits[name] = model(ids[:, context:context + n], past_key_values=kv).logits
                    times[name].append(time.perf_counter() - start)
                    kv.crop(-n)
            first = next(iter(logits.values()))
            out[f"{context}+{n}"] = {**{name: round(1000 * median(t), 3) for name, t in times.items()},
                                     "equal": all(torch.equal(first, x) for x in logits.values())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--cache", choices=["float32", "float16"], default="float32")
    args = parser.parse_args()
    cache = torch.float16 if args.cache == "float16" else None
    block_kernel(cache_root() / "kernels")
    with tempfile.TemporaryDirectory() as where, torch.inference_mode():
        build_base(args.rev, Path(where))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
        changed = subprocess.run(["git", "status", "--porcelain", "lssp"], cwd=REPO, capture_output=True, text=True).stdout
        head = head.strip() + (" with the working tree's changes" if changed.strip() else "")
        base = getattr(torch.ops, BASE)
        # Both taken before any swap: forwards() leaves torch.ops.lssp.decoder set to the build it timed last (until
        # 2026-11-29 decoding() then read it as the head's, and timed the base build against itself).
        decoders = {"head": torch.ops.lssp.decoder, "base": with_kept_stack(BASE)}
        result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "base": args.rev, "head": head,
                  "kv_cache": args.cache,
                  "matmul_ms": matmuls({"head": torch.ops.lssp.block_mm, "base": base.block_mm}, 40),
                  "forward_ms": forwards(decoders, 20, cache),
                  "decoding_ms_per_token": decoding(decoders, args.repeats, args.prompts, cache)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
