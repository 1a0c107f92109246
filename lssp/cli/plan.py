"""`plan`: where a target and its draft would go on a node of GPUs, before anything is loaded."""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.options import DraftAlsoOpt, DraftArg, JsonOpt, TargetArg, one_draft
from lssp.cli.output import console, err_console, table
from lssp.errors import UserError


@contextmanager
def _quiet_accelerate() -> Iterator[None]:
    """accelerate warns once per GPU it cannot see: planning for a node that is not this machine is the point."""
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _gib(n: float) -> str:
    from lssp.models.placement import GiB

    return f"{n / GiB:.1f}"


def _device(d: int | str) -> str:
    return f"GPU {d}" if isinstance(d, int) else "no room"


def _size(text: str, option: str) -> int:
    """Bytes of a size option; a bare number is read as GiB, and said so."""
    from lssp.models.placement import parse_size

    value, assumed = parse_size(text, option)
    if assumed:
        err_console.print(f"{option} {text.strip()} has no unit: read as {text.strip()} GiB", soft_wrap=True)
    return value


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _node(gpus: int | None, gpu_memory: str | None, reserve: str) -> tuple[int, int, int]:
    """GPUs, bytes of each and bytes kept free on each: as given, else this machine's."""
    import torch

    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus} (plan lays a model out over GPUs)")
    visible = _visible_gpus()
    if gpus is None:
        if not visible:
            raise UserError("no GPU visible here: describe the node with --gpus N --gpu-memory SIZE (e.g. --gpus 8 "
                            "--gpu-memory 40GiB)")
        gpus = visible
    if gpu_memory is None and not visible:
        raise UserError("no GPU visible here: give each GPU's memory with --gpu-memory (e.g. 40GiB)")
    gpu_bytes = _size(gpu_memory, "--gpu-memory") if gpu_memory else torch.cuda.get_device_properties(0).total_memory
    return gpus, gpu_bytes, _size(reserve, "--reserve")


@app.command()
def plan(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    draft_option: DraftAlsoOpt = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Plan the target alone.", metavar="")] = False,
    gpus: Annotated[Optional[int], typer.Option(help="GPUs in the node (default: this machine's).")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(
        help="Memory of each GPU: 40GiB, 80GB; a bare number is GiB (default: this machine's first GPU).")] = None,
    reserve: Annotated[str, typer.Option(
        help="Kept free on each GPU for the CUDA context, activations and the KV cache.")] = "2GiB",
    bandwidth: Annotated[Optional[float], typer.Option(
        help="One GPU's memory bandwidth in GB/s, for the floor per token (default: measured on this machine's GPU).")] = None,
    json_out: JsonOpt = None,
) -> None:
    """Where each block of the target (and the whole draft) goes, bytes per GPU, and whether it fits in
    16-bit, 8-bit or 4-bit: worked out on the meta device, nothing loaded. The target honours its entry's
    max_memory; where the draft finds no room beside it, its room is kept first and the max_memory line that
    makes loading do the same is given; where nothing fits, the nearest option that does."""
    draft = one_draft(draft, draft_option)
    from lssp.models.placement import PRECISIONS, empty_model, kv_bytes_per_token, model_config, plan_node

    s = settings(ctx)
    registry = s.registry
    t_spec = registry.get(registry.target_name(target))
    d_spec = None if no_draft else registry.get(registry.draft_name(draft))
    gpus, gpu_bytes, reserve_bytes = _node(gpus, gpu_memory, reserve)
    if bandwidth is not None and bandwidth <= 0:
        raise UserError(f"--bandwidth must be positive, got {bandwidth:g}")
    bandwidth_source = "--bandwidth"
    if bandwidth is None and _visible_gpus():
        from lssp.decoding.timing import copy_bandwidth

        bandwidth, bandwidth_source = copy_bandwidth("cuda:0") / 1e9, "measured copy bandwidth of cuda:0"
    t_config = model_config(t_spec)
    with _quiet_accelerate():
        t_model = empty_model(t_config)
        d_model = empty_model(model_config(d_spec)) if d_spec else None
        node = plan_node(t_model, t_spec.name, d_model, d_spec.name if d_spec else None, gpus, gpu_bytes, reserve_bytes,
                         kv_bytes_per_token(t_config), bandwidth * 1e9 if bandwidth else float("nan"),
                         max_memory=t_spec.max_memory, device_map=t_spec.device_map)
    chosen = node.fitting()
    _render_table(node, t_spec, d_spec)
    if chosen:
        _render_placement(node, chosen, d_spec is not None, bandwidth, bandwidth_source)
        _render_entry_advice(node, chosen, t_spec)
    if not chosen:
        for precision in PRECISIONS:
            _render_other_entry(node, precision, t_spec.name)
    nearest = _nearest(node, chosen)
    if chosen and nearest:
        console.print(f"Nearest at more bits: {nearest}.")
    if json_out:
        _write_json(json_out, node, chosen, t_spec.name, d_spec.name if d_spec else None)
    if not chosen:
        short = node.missing_bytes("4-bit")
        raise UserError(f"{t_spec.name}" + (f" with {d_spec.name}" if d_spec else "") + f" does not fit on {gpus} × "
                        f"{_gib(gpu_bytes)} GiB at any precision: even in 4-bit, {_gib(short)} GiB find no room"
                        + (f"; nearest that fits: {nearest}" if nearest else ""))


def _render_table(node, t_spec, d_spec) -> None:
    from lssp.models.placement import PRECISIONS, precision_of

    entry_precision = precision_of(t_spec)
    title = (f"{t_spec.name}" + (f" with draft {d_spec.name}" if d_spec else "")
             + f" on {node.gpus} × {_gib(node.gpu_bytes)} GiB {'GPUs' if node.gpus > 1 else 'GPU'}, "
             f"{_gib(node.reserve_bytes)} GiB kept free on each"
             + (", the target within its entry's max_memory" if node.entry_max_memory else ""))
    out = table(title, [("precision", "left"), ("target GiB", "right"), ("max/GPU", "right"),
                        *([("draft GiB", "right"), ("draft on", "left")] if d_spec else []), ("fits", "left")])
    chosen = node.fitting()
    for precision in PRECISIONS:
        t = node.target[precision]
        d = node.draft.get(precision)
        short = node.missing_bytes(precision)
        fits = ("yes*" if node.draft_first[precision] else "yes") if not short else f"no −{_gib(short)}"
        on_gpus = [b for dev, b in t.bytes_per_device.items() if isinstance(dev, int)]
        out.add_row(precision + (" (entry)" if precision == entry_precision else ""), _gib(t.weight_bytes),
                    _gib(max(on_gpus, default=0)),
                    *([_gib(d.weight_bytes), _device(next(iter(d.device_map.values())))] if d else []), fits,
                    style="bold" if precision == chosen else None)
    console.print(out)
    if any(node.missing_bytes(p) for p in PRECISIONS):
        console.print("no −N: N GiB find no room on the GPUs.")
    if any(node.draft_first[p] and not node.missing_bytes(p) for p in PRECISIONS):
        console.print("yes*: with the draft's room kept first, the target placed unevenly in the rest.")


def _render_placement(node, chosen: str, has_draft: bool, bandwidth: float | None, bandwidth_source: str) -> None:
    """Where the target's blocks go at ``chosen``, GiB per GPU, the KV cache and the bandwidth floor."""
    from lssp.models.placement import GiB

    t = node.target[chosen]
    weights = _gib(t.weight_bytes) + (f" + {_gib(node.draft[chosen].weight_bytes)}" if has_draft else "")
    console.print(f"At {chosen}, the widest that fits ({weights} GiB in {_gib(node.gpus * node.usable_bytes)} GiB "
                  "usable), the target's blocks go:")
    for module, device in t.blocks():
        console.print(f"  {module or '(the whole model)'} → {_device(device)}")
    used = {i: t.bytes_per_device.get(i, 0) + (node.draft[chosen].bytes_per_device.get(i, 0) if has_draft else 0)
            for i in range(node.gpus)}
    console.print("GiB per GPU, draft included:\n  " + ", ".join(f"{i}: {_gib(b)}" for i, b in used.items()))
    console.print(f"KV cache: {node.kv_bytes_per_token * 1024 / GiB:.2f} GiB per 1,024 tokens (16-bit, batch 1)")
    if bandwidth:
        console.print(f"Memory-bandwidth floor per token at {bandwidth:,.0f} GB/s ({bandwidth_source}), all "
                      "weights read at one GPU's bandwidth (split layers run one GPU after another):")
        floor = f"  target {node.floor_ms(t):.1f} ms"
        if has_draft:
            d = node.draft[chosen]
            floor += f", draft {node.floor_ms(d):.2f} ms, c ≥ {d.weight_bytes / t.weight_bytes:.3f} by bytes"
        console.print(floor)
    else:
        console.print("Give --bandwidth GB/s (one GPU's) for the memory-bandwidth floor per token.")


def _render_entry_advice(node, chosen: str, t_spec) -> None:
    """What the target's entry needs for loading to place it as planned: a quantization, a max_memory line
    (in place of its gpus or max_memory), or a GPU count this node has."""
    from lssp.models.placement import PRECISIONS, precision_of

    changes = []
    if chosen != precision_of(t_spec):
        changes.append("quantization: " + {"16-bit": "none", "8-bit": "8bit", "4-bit": "4bit"}[chosen])
    line = node.max_memory_line(chosen)
    if line:
        instead = "its max_memory" if t_spec.max_memory else f"gpus: {t_spec.gpus}" if t_spec.gpus else ""
        changes.append(line + (f" (in place of {instead})" if instead else ""))
    elif t_spec.gpus and t_spec.gpus > node.gpus and not t_spec.max_memory:
        changes.append(f"gpus: {node.gpus} (it asks for {t_spec.gpus})")
    if changes:
        console.print(f"To load it so, {t_spec.name}'s entry (or a copy of it) needs:\n  " + "\n  ".join(changes),
                      soft_wrap=True)
    for precision in PRECISIONS[:PRECISIONS.index(chosen)]:
        _render_other_entry(node, precision, t_spec.name)


def _render_other_entry(node, precision: str, name: str) -> None:
    """Where the entry's max_memory stops ``precision``: the device_map or max_memory under which it fits."""
    if node.sequential_fits.get(precision):
        console.print(f"{precision} fits within {name}'s max_memory as written if its entry also says "
                      "device_map: sequential (auto evens the GPUs out, which that max_memory does not allow).")
    elif node.other_max_memory_line(precision):
        console.print(f"{precision} fits if {name}'s max_memory allows more:\n  {node.other_max_memory_line(precision)}",
                      soft_wrap=True)


def _nearest(node, chosen: str | None) -> str:
    """The options that fit for each precision wider than ``chosen``: more GPUs of this size, or other budgets."""
    from lssp.models.placement import PRECISIONS

    wider = PRECISIONS if chosen is None else PRECISIONS[:PRECISIONS.index(chosen)]
    options = []
    for precision in wider:
        n = node.gpus_needed.get(precision)
        if node.sequential_fits.get(precision) or node.other_max_memory_line(precision):
            continue  # said above: the entry changed, on this node
        if n:
            options.append(f"{precision} on {n} × {_gib(node.gpu_bytes)} GiB GPUs")
    if chosen is None:
        options.reverse()  # fewest bits first: the cheapest change
        if any(node.sequential_fits.get(p) or node.other_max_memory_line(p) for p in wider):
            options.insert(0, "this node with the entry changed as said above")
    return "; ".join(options)


def _write_json(path: Path, node, chosen: str | None, target: str, draft: str | None) -> None:
    def placement(p) -> dict:
        return {"weight_bytes": p.weight_bytes, "fits": p.fits, "missing_bytes": p.missing_bytes,
                "bytes_per_device": {str(k): v for k, v in p.bytes_per_device.items()},
                "blocks": [[module, device] for module, device in p.blocks()]}

    data = {"target": target, "draft": draft, "gpus": node.gpus, "gpu_bytes": node.gpu_bytes,
            "reserve_bytes": node.reserve_bytes, "fits_at": chosen, "kv_bytes_per_token": node.kv_bytes_per_token,
            "bandwidth_bytes_per_s": node.bandwidth if node.bandwidth == node.bandwidth else None,
            "target_by_precision": {k: placement(v) for k, v in node.target.items()},
            "draft_by_precision": {k: placement(v) for k, v in node.draft.items()},
            "target_budgets_by_precision": {k: {str(i): b for i, b in v.items()} for k, v in node.budgets.items()},
            "draft_first_by_precision": node.draft_first,
            "max_memory_line_by_precision": {k: node.max_memory_line(k) for k in node.target},
            "gpus_needed_by_precision": node.gpus_needed}
    try:
        path.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
