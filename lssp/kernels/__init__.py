"""Our own CPU kernels, compiled on first use for this machine and cached.

``blocks.cpp``: ``torch.ops.lssp.block_mm``, a matmul by weights in groups of 32 (4-bit Q4_1 or 8-bit Q8_0) with int8
activations on AVX512-VNNI, or on AVX2 (with FMA and F16C) where the CPU has no AVX-512 (``kernel_isa`` says which;
``lssp.models.weight_only.BlockLinear``), and ``torch.ops.lssp.row_attention``, causal
attention of each query by itself (the compact forward of a q4_1 model: a verification forward, or a batch of rows,
then computes each position as a one-token forward of its row does, which int8 activations need to keep SSp exact), and
``torch.ops.lssp.decoder``, a q4_1 model's whole stack of decoder layers in one call (no Python, no compilation), with
its final norm and output layer where asked (its weights kept in the kernel by handle, ``torch.ops.lssp.keep``, and its
layers run in one team of threads with a barrier between steps). It is built with ``-march=native -fopenmp`` (``-march=x86-64-v3`` with
``$LLAMASSP_KERNEL_AVX2=1``: the AVX2 path on any CPU, to test or time it; its matmuls and attention
split between torch's threads) by torch's extension builder (g++ and ninja) into ``$LLAMASSP_CACHE/kernels/`` (the
caller's choice), one build per source, torch version and CPU model (~10-20 s, once).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lssp.errors import UserError
from lssp.notices import notice

SOURCE = Path(__file__).with_name("blocks.cpp")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")  # the kernel's first choice
NEEDED_FLAGS = ("avx2", "fma", "f16c")  # what it needs at least
# -fopenmp: at::parallel_for is inlined into this source and splits work between threads only where compiled with
# OpenMP (else every matmul runs on one thread). The library it links by name, libgomp.so.1, resolves at load time
# to the copy torch has already loaded, so torch.set_num_threads governs both.
# $LLAMASSP_KERNEL_AVX2=1 builds the AVX2 path on any CPU that runs it, AVX-512 ones too (x86-64-v3: AVX2, FMA,
# F16C), so that a machine with AVX-512 tests it and times it; the build, its cache and calibrations are its own.
FORCE_AVX2 = os.environ.get("LLAMASSP_KERNEL_AVX2", "") not in ("", "0")
CFLAGS = ("-O3", "-march=x86-64-v3" if FORCE_AVX2 else "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
WEIGHTS_PER_LAYER = 14  # tensors per layer in the one-call decoder's stack (kPerLayer in blocks.cpp)


def missing_flags() -> list[str]:
    """The CPU features ``block_mm`` needs that this CPU lacks (all of them off Linux/x86)."""
    from lssp.report.results import cpu_flags

    flags = cpu_flags()
    return [f for f in NEEDED_FLAGS if f not in flags]


def kernel_isa() -> str:
    """Which vectors the kernel is built with on this CPU: "avx512-vnni", "avx2", or "" (none: it cannot run)."""
    from lssp.report.results import cpu_flags

    flags = cpu_flags()
    if all(f in flags for f in AVX512_FLAGS) and not FORCE_AVX2:
        return "avx512-vnni"
    return "" if missing_flags() else "avx2"


def build_dir(root: Path) -> Path:
    """Where under ``root`` this source is built for this torch and CPU model."""
    from lssp.report.results import cpu_name

    key = hashlib.sha256(b"|".join(s.encode() for s in (SOURCE.read_text(), torch.__version__, cpu_name(),
                                                           platform.machine(), *CFLAGS, *LDFLAGS))).hexdigest()[:12]
    return root / f"blocks-{key}"


def block_kernel(root: Path) -> None:
    """Make ``torch.ops.lssp.block_mm`` available (building it under ``root`` the first time on this machine), or
    raise a UserError saying why it cannot be. A process loads it once, from wherever it was first built."""
    if not _loaded:
        _load_block_kernel(root)


def kernel_unavailable(root: Path) -> str | None:
    """``block_kernel(root)``, returning why it cannot be (one line) instead of raising; None once it is loaded."""
    try:
        block_kernel(root)
    except UserError as exc:
        return str(exc)
    return None


_loaded: list[Path] = []  # where this process loaded it from


def _load_block_kernel(root: Path) -> None:
    missing = missing_flags()
    if missing:
        raise UserError(f"quantization q4_1 needs a CPU with AVX2, FMA and F16C (or AVX512-VNNI); this one lacks "
                        f"{', '.join(missing)} (quantization: int4 runs anywhere)")
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # pip's ninja sits beside this interpreter, which need not be on PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    where = build_dir(root)
    where.mkdir(parents=True, exist_ok=True)
    if not any(where.glob("*.so")):
        notice("building our CPU kernel (q4_1 matmuls, attention, sampling) for this CPU (once, ~10-20 s) in %s",
                    where)
    try:
        load(name=f"lssp_{where.name.replace('-', '_')}", sources=[str(SOURCE)], build_directory=str(where),
             extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot build the q4_1 kernel (g++ and ninja are needed): {first}") from None

    @torch.library.register_fake("lssp::block_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0], dtype=torch.float32)

    @torch.library.register_fake("lssp::softmax_rows")
    def _(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return logits.new_empty(logits.shape, dtype=torch.float32)

    @torch.library.register_fake("lssp::row_attention")
    def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None,
          scale: float) -> torch.Tensor:
        return q.new_empty(q.shape, dtype=torch.float32)  # the kernel: contiguous float32, whatever q's layout

    @torch.library.register_fake("lssp::decoder")
    def _(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None,
          weights: list[torch.Tensor], cache: list[torch.Tensor], start: int, heads: int, kv_heads: int, eps: float,
          scale: float, final_norm: torch.Tensor | None, output: list[torch.Tensor],
          keep: int, used: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
          embed_norm: torch.Tensor | None = None, stack: int = -1, stack_layer: int = 0,
          ids: torch.Tensor | None = None, rope_start: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        if ids is not None:  # hidden is the embedding table
            hidden = hidden.new_empty(*ids.shape, hidden.shape[1])
        batch, n = hidden.shape[:2]
        kept = min(keep, n) if keep > 0 else n
        logits = hidden.new_empty(batch, kept, output[0].shape[0]) if output else hidden.new_empty(0)
        return torch.empty_like(hidden, memory_format=torch.contiguous_format), logits

    # Inductor's on-disk graph cache keys a graph by its code, not by these ops' fake kernels: a tag of their source
    # and this module's keeps a graph compiled against other fakes (other output strides) from being reused.
    tag = "lssp-" + hashlib.sha256(SOURCE.read_bytes() + Path(__file__).read_bytes()).hexdigest()[:12]
    current = torch.compiler.config.cache_key_tag
    torch.compiler.config.cache_key_tag = f"{current}+{tag}" if current and tag not in current else current or tag
    _loaded.append(where)


def load_as(source: str, namespace: str, where: Path, extra_cflags: tuple[str, ...] = ()) -> None:
    """Build and load another copy of the kernel's ``source`` whose ops live under ``torch.ops.<namespace>`` (the
    benchmarks' A/B and instrumented builds, beside the one ``block_kernel`` loads)."""
    from torch.utils.cpp_extension import load

    source = source.replace("TORCH_LIBRARY(lssp,", f"TORCH_LIBRARY({namespace},")
    source = source.replace("TORCH_LIBRARY_IMPL(lssp,", f"TORCH_LIBRARY_IMPL({namespace},")
    (where / "blocks.cpp").write_text(source)
    load(name=namespace, sources=[str(where / "blocks.cpp")], build_directory=str(where),
         extra_cflags=[*CFLAGS, *extra_cflags], extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)


def with_kept_stack(namespace: str) -> Callable[..., Any]:
    """The ``decoder`` op of another build (``load_as``) called as ours is: a stack named by handle in this build
    (``stack``, from layer ``stack_layer``) is kept in that build too, or passed as tensors where its source keeps
    none (an older one)."""
    ops = getattr(torch.ops, namespace)
    keeps = hasattr(ops, "keep")
    takes_ids = "ids" in {a.name for a in ops.decoder.default._schema.arguments}
    theirs: dict[int, int] = {}  # our handle -> theirs, for the same tensors

    def call(*args: Any, stack: int = -1, stack_layer: int = 0, ids: torch.Tensor | None = None, rope_start: int = -1,
             **kwargs: Any) -> Any:
        if takes_ids:
            kwargs.update(ids=ids, rope_start=rope_start)
        elif ids is not None or rope_start >= 0:  # an older build: the rows and rotary rows looked up here
            n = ids.shape[1] if ids is not None else args[0].shape[1]
            rows = (lambda t: t[:, rope_start:rope_start + n]) if rope_start >= 0 else (lambda t: t)  # noqa: E731
            args = (torch.embedding(args[0], ids) if ids is not None else args[0], rows(args[1]), rows(args[2]),
                    *args[3:])
        if stack < 0:
            return ops.decoder(*args, **kwargs)
        if keeps:
            if stack not in theirs:
                theirs[stack] = ops.keep(torch.ops.lssp.kept(stack))
            return ops.decoder(*args, stack=theirs[stack], stack_layer=stack_layer, **kwargs)
        layers = len(args[5]) // 2  # the cache's tensors: keys and values per layer
        first, end = stack_layer * WEIGHTS_PER_LAYER, (stack_layer + layers) * WEIGHTS_PER_LAYER
        return ops.decoder(*args[:4], torch.ops.lssp.kept(stack)[first:end], *args[5:], **kwargs)
    return call


def huge_page_share(spans: list[tuple[int, int]]) -> float | None:
    """The share of the memory ``spans`` ((address, bytes) each) that Linux backs with huge pages: the
    ``AnonHugePages`` of the mappings holding them (``/proc/self/smaps``, read once, each mapping counted once and in
    full); None off Linux or where no mapping holds them."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    huge = total = 0
    overlaps = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            overlaps = any(start < address + nbytes and address < end for address, nbytes in spans)
            if overlaps:
                total += end - start
        elif overlaps and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return min(1.0, huge / total) if total else None
