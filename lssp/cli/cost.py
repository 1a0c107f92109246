"""`cost`: forward ms by precision and by tokens per forward."""
from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.options import JsonOpt, check_positive, parse_ints
from lssp.cli.output import console, err_console, exit_with, save, say_busy, table
from lssp.engines import check_engines
from lssp.errors import UserError


@app.command()
def cost(
    ctx: typer.Context,
    models: Annotated[Optional[list[str]], typer.Argument(help="Models to time (default: the default target and draft).")] = None,
    precisions: Annotated[str, typer.Option(help="Float dtypes and CPU quantizations (q4_1: the GGUF's blocks, as the "
                                            "default pair runs on a CPU; dynamic-*; weight-only int4 and int8) to "
                                            "compare.")] =
        "q4_1,bfloat16,float32,dynamic-fp16,dynamic-int8,int4,int8",
    tokens: Annotated[str, typer.Option(help="Tokens fed in one forward (K+1 for a verification).")] = "1,2,3,5",
    forwards: Annotated[Optional[str], typer.Option(help="Time these forwards: transformers,compact (default: each entry's).")] = None,
    context: Annotated[int, typer.Option(help="Tokens already in the KV cache.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed forwards per point (median taken).")] = 15,
    engine: Annotated[str, typer.Option("--engine", help="The engine to time: ours (the only one cost takes so far).")] = "ours",
    json_out: JsonOpt = None,
) -> None:
    """Forward ms by precision and by tokens per forward: does verifying K drafts cost about one forward here?"""
    from lssp.measure.cost import run_costs
    from lssp.models.loading import load_model
    from lssp.models.registry import CPU_QUANTIZATIONS, DTYPES, FORWARDS

    s = settings(ctx)
    check_engines("cost", [e.strip() for e in engine.split(",") if e.strip()], ("ours",))
    counts = parse_ints("--tokens", tokens)
    forward_list = [f.strip() for f in (forwards or "").split(",") if f.strip()]
    if forwards is not None and (not forward_list or any(f not in FORWARDS for f in forward_list)):
        raise UserError(f"--forwards takes some of {','.join(FORWARDS)}, got {forwards!r}")
    check_positive("--context", context)
    check_positive("--repeats", repeats)
    chosen = [p.strip() for p in precisions.split(",") if p.strip()]
    allowed = [d for d in DTYPES if d != "auto"] + list(CPU_QUANTIZATIONS)
    if not chosen or any(p not in allowed for p in chosen):
        raise UserError(f"--precisions takes some of {','.join(allowed)}, got {precisions!r}")
    names = models or [s.registry.target_name(None), s.registry.draft_name(None, heads=False)]  # models alone
    results = s.writable_results_dir(json_out)
    loaded = []
    compiled = [n for n in names if s.registry.get(n).compile]
    for name in names:  # each precision is made from the plain weights, and timed uncompiled
        spec = replace(s.registry.get(name), quantization="none", compile=False)
        for forward in forward_list or [spec.forward]:
            with err_console.status(f"Loading {name} ({forward} forward)…"):
                loaded.append(load_model(replace(spec, forward=forward), s.device))
    with err_console.status("Timing forwards…") as status:
        run = run_costs(loaded, chosen, counts, context, repeats, progress=lambda m: status.update(f"Timing {m}…"))
    counts_timed = sorted({c.tokens for c in run.costs})
    out = table(f"Forward ms after {context} cached tokens (× a 1-token forward) — {run.info.env['device']}",
                [("model (forward, precision)", "left")] + [(f"{n} tok", "right") for n in counts_timed])
    for (model, forward, precision), cells in run.cells().items():  # two lines a row: fits 80 columns
        out.add_row(f"{model}\n({forward}, {precision})",
                    *(f"{cells[n].ms:.1f}\n×{cells[n].relative:.2f}" for n in counts_timed))
    console.print(out)
    if compiled:
        console.print(f"  timed uncompiled: {', '.join(compiled)} asks torch.compile, which cost leaves out (each "
                      "precision's eager forward; latency times the entry as it runs)")
    if run.limits is not None:
        console.print(f"  floor: the Linear layers' weights and the {context} cached tokens' keys and values read "
                      f"once at {run.limits.bandwidth / 1e9:.1f} GB/s (this machine's copy bandwidth, past its caches), "
                      "or the weights' arithmetic at each precision's own large-matmul speed, whichever is slower; "
                      "ms ÷ floor, 1 token:")
        for (model, forward, precision), cells in run.cells().items():
            one = cells[1]
            console.print(f"    {model} ({forward}, {precision}):\n      {one.ms:.1f} ms ÷ {one.floor_ms:.2f} = "
                          f"{one.over_floor:.1f}× ({one.weight_bytes / 1e6:.0f} MB + {one.cache_bytes / 1e6:.2g} MB "
                          f"cached, {one.bound}-bound)")
        if any(c.over_floor < 1 for c in run.costs):
            console.print("  below 1×: what the forward reads stays in the CPU's own caches from one timed forward "
                          "to the next (a small model, or a short cache); the floor takes every byte from memory")
    names_timed = list(dict.fromkeys(x.name for x in loaded))
    if len(names_timed) >= 2:
        target_name, draft_name = names_timed[:2]
        target_forward = s.registry.get(target_name).forward
        ratios = run.cost_ratios(target_name, target_forward, draft_name)
        console.print(f"  c = {draft_name} ÷ {target_name} ({target_forward} forward) per 1-token forward — "
                      + ", ".join(f"{p} ({f}): {c:.3f}" for (p, f), c in ratios.items()))
    say_busy(run.others_cpu_share)
    rows = run.rows()
    exit_with(save(results, run.info.run_id, "cost", rows, run.markdown(), json_out, rows, f"run {run.info.run_id}"))
