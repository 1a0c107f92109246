"""``quantization: auto``: the fastest weight format for an entry on this CPU, measured once and cached.

The formats differ per machine (an AMD EPYC and an Intel Xeon with AMX do not rank them alike), so ``auto`` times
each format this CPU can run on the entry's own model: one forward of 1 token (RSp's step) and one of 4 (a
verification at K=3) after 64 cached tokens, eager, and keeps the one whose two forwards take least. The choice is
cached per model file, forward, CPU model, torch version and kernel build in ``$LLAMASSP_CACHE/calibration.json``,
said in one line at every load, and recorded in every row (the model's precision). A calibration timed while other
work took more than a quarter of the CPUs is used but not cached. On a GPU ``auto`` means no quantization.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lssp.models.registry import ModelSpec
from lssp.notices import notice

log = logging.getLogger(__name__)

# (quantization, dtype of the rest of the model): the candidates, each where this CPU runs it
CANDIDATES = (("q4_1", "float32"), ("int4", "bfloat16"), ("dynamic-fp16", "float32"))
CONTEXT, VERIFY_TOKENS, REPEATS = 64, 4, 7


@dataclass(frozen=True)
class Calibration:
    quantization: str
    dtype: str
    ms: dict[str, list[float]]  # per candidate: median ms of the 1-token and the 4-token forward
    cached: bool = False
    busy: float = 0.0  # the share of the CPUs other work took while it was measured (above BUSY_SHARE: not cached)

    def line(self, name: str) -> str:
        from lssp.report.contention import BUSY_SHARE

        timed = ", ".join(f"{q} {one:.1f}+{four:.1f} ms" for q, (one, four) in self.ms.items())
        origin = "cached" if self.cached else "measured now"
        if self.busy > BUSY_SHARE:
            origin += f" on a busy machine (other work {self.busy:.0%} of the CPUs): not cached"
        return (f"{name}: quantization auto -> {self.quantization} on this CPU ({origin}; 1-token + 4-token forward: "
                f"{timed})")


def cache_file() -> Path:
    from lssp.models.sources import cache_root

    return cache_root() / "calibration.json"


def calibration_key(spec: ModelSpec) -> str:
    """The model file, its forward, the CPU model, torch's version and our kernel's build (source and flags): a
    change to any of them measures again."""
    from lssp.kernels import build_dir
    from lssp.report.results import cpu_name

    return "|".join((spec.path, spec.forward, cpu_name(), torch.__version__, build_dir(Path()).name))


def runnable(quantization: str) -> bool:
    """Whether this CPU runs ``quantization`` (q4_1 needs our kernel: AVX512-VNNI or AVX2, and it must build)."""
    if quantization != "q4_1":
        return True
    from lssp.kernels import kernel_unavailable
    from lssp.models.sources import cache_root

    reason = kernel_unavailable(cache_root() / "kernels")
    if reason:
        log.info("quantization auto leaves out q4_1: %s", reason)
    return reason is None


def _forward_ms(model: torch.nn.Module) -> tuple[float, float]:
    """Median ms of a 1-token and a 4-token forward of ``model`` after CONTEXT cached tokens."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, CONTEXT + VERIFY_TOKENS), generator=generator)
    out = []
    with torch.inference_mode():
        kv = model.new_cache() if hasattr(model, "new_cache") else DynamicCache(config=model.config)
        model(input_ids=ids[:, :CONTEXT], past_key_values=kv, use_cache=True)
        for n in (1, VERIFY_TOKENS):
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                model(input_ids=ids[:, CONTEXT:CONTEXT + n], past_key_values=kv, use_cache=True)
                times.append(1000 * (time.perf_counter() - start))
                kv.crop(-n)
            out.append(sorted(times)[len(times) // 2])
    return out[0], out[1]


def calibrate(spec: ModelSpec, load: Callable[[ModelSpec], torch.nn.Module]) -> Calibration:
    """The cached choice for ``spec`` on this CPU, or a new measurement of the models ``load`` gives (stored)."""
    key, path = calibration_key(spec), cache_file()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if key in stored:
        return Calibration(**stored[key], cached=True)
    from lssp.report import contention

    ms: dict[str, list[float]] = {}
    dtypes = {}
    before = contention.cpu_snapshot()
    for quantization, dtype in CANDIDATES:
        if runnable(quantization):
            candidate = replace(spec, quantization=quantization, dtype=dtype, compile=False)
            ms[quantization] = list(_forward_ms(load(candidate)))
            dtypes[quantization] = dtype
    best = min(ms, key=lambda q: sum(ms[q]))
    busy = contention.others_share(before, contention.cpu_snapshot())
    found = Calibration(best, dtypes[best], ms, busy=busy)  # nan (not known) counts as quiet: nan > x is false
    if found.busy > contention.BUSY_SHARE:  # a loaded machine's timings may rank the formats wrongly
        return found
    stored[key] = {"quantization": found.quantization, "dtype": found.dtype, "ms": found.ms}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored, indent=1))
    except OSError as exc:
        log.warning("cannot cache the calibration in %s: %s", path, exc)
    return found


def resolve_auto(spec: ModelSpec, on_cpu: bool, load: Callable[[ModelSpec], torch.nn.Module]) -> ModelSpec:
    """``spec`` with ``quantization: auto`` made concrete: the calibrated format on a CPU (``load`` gives a
    candidate's model on the CPU; compiled only where the entry asks and the format can be), none on a GPU."""
    if not on_cpu:
        return replace(spec, quantization="none")
    found = calibrate(spec, load)
    notice("%s", found.line(spec.name))
    compiles = spec.compile and not found.quantization.startswith("dynamic")
    return replace(spec, quantization=found.quantization, dtype=found.dtype, compile=compiles)
