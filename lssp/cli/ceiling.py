"""`ceiling`: how good must the draft be? SSp with an oracle draft of set acceptance, against RSp and the draft."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape

from lssp.cli.app import app, settings
from lssp.cli.loaders import load_draft_for, load_pair
from lssp.cli.options import (
    DraftAlsoArg,
    JsonOpt,
    MaxNewOpt,
    PromptsOpt,
    TargetArg,
    TaskOpt,
    check_k_within_budget,
    check_positive,
    one_draft,
    parse_fractions,
    parse_ints,
    read_task_prompts,
)
from lssp.cli.output import console, err_console, exit_interrupted, exit_with, save, say_busy, table
from lssp.errors import UserError
from lssp.report.results import plural

if TYPE_CHECKING:
    from rich.table import Table

    from lssp.measure.ceiling import CeilingCell, CeilingRun


@app.command()
def ceiling(
    ctx: typer.Context,
    target: TargetArg = None,
    draft_name: DraftAlsoArg = None,
    draft: Annotated[Optional[str], typer.Option(help="The draft (default: the registry's default_draft), or a comma "
                                                 "list timed side by side: each as its entry drafts; the first drafts "
                                                 "alongside the oracle for its cost.")] = None,
    k: Annotated[str, typer.Option("--k", help="Draft lengths, comma-separated.")] = "2,4",
    alpha: Annotated[str, typer.Option("--alpha", help="The oracle's acceptances: each of its drafts is right with "
                                       "this probability.")] = "0.6,0.7,0.8,0.9,1.0",
    bar: Annotated[str, typer.Option("--bar", help="Speedups to find the needed acceptance for, comma-separated.")] = "1.5",
    task: TaskOpt = None,
    prompts: PromptsOpt = None,
    nb_prompts: Annotated[int, typer.Option(help="Prompts of each task (or of the file, or of the story openings).")] = 4,
    repeats: Annotated[int, typer.Option(help="Passes over the prompts (interleaved).")] = 2,
    max_new_tokens: MaxNewOpt = 64,
    json_out: JsonOpt = None,
) -> None:
    """How good must the draft be? Greedy SSp on our engine with an oracle draft that knows the target's answer and
    is right with set probabilities, against RSp and the draft, in one interleaved run."""
    from lssp.drafters import entry_drafter
    from lssp.measure.ceiling import ALL, run_ceiling

    s = settings(ctx)
    draft = one_draft(draft_name, draft)
    ks, alphas = parse_ints("--k", k), parse_fractions("--alpha", alpha, with_one=True)
    bars = [float(b) for b in parse_positive_numbers("--bar", bar)]
    check_k_within_budget(ks, max_new_tokens)
    check_positive("--repeats", repeats)
    check_positive("--nb-prompts", nb_prompts)
    prompt_list = read_task_prompts(task, prompts, nb_prompts, False)
    results = s.writable_results_dir(json_out)
    names = [name.strip() for name in (draft or "").split(",") if name.strip()] or [None]
    if len(set(names)) < len(names):
        raise UserError(f"--draft {draft!r} names a draft twice")
    t, d, _ = load_pair(s, target, names[0])
    drafts = [d, *(load_draft_for(s, t, name)[0] for name in names[1:])]
    with err_console.status("Timing…") as status:
        run = run_ceiling(t, drafts, entry_drafter, prompt_list, ks, alphas, repeats, max_new_tokens, s.seed,
                          progress=lambda m: status.update(f"Timing: {m}…"))
    out = table(f"SSp ÷ RSp ({run.rsp_ms[ALL]:.2f} ms/token): speedup, 95% interval, tokens per forward",
                [("drafting", "left")] + [(f"K={k}", "right") for k in run.ks])
    for label, alpha_value, name in run.ways():
        cells = [run.cell(ALL, k, alpha_value, name) for k in run.ks]
        out.add_row(label, *(f"{c.speedup:.2f}×\n{interval_text(c)}\n{c.tokens_per_forward:.2f}" for c in cells))
    console.print(out)
    console.print("  oracle α: proposes the target's answer, each draft right with probability α\n"
                  "  (the draft drafts alongside for its cost)")
    for name in run.drafts:
        measured = ", ".join(f"{run.cell(ALL, k, None, name).measured_alpha:.2f} at K={k}" for k in run.ks)
        console.print(f"  {'the draft' if len(run.drafts) == 1 else name}'s α (accepted ÷ tried): {measured}")
    for b in bars:
        needed = ", ".join(f"≥ {a:.2f} at K={k}" if a is not None else f"none measured at K={k}"
                           for k, a in run.alpha_needed(b).items())
        console.print(f"  {b:g}× needs the oracle's α {needed}")
    if len(run.tasks) > 1:
        console.print(by_task(run, bars[0]))
    if run.not_equal:
        console.print(f"[bold red]  {run.not_equal} completions differ from RSp's: greedy SSp is not exact here"
                      "[/bold red]")
    say_busy(run.others_cpu_share)
    summary = {"run_id": run.info.run_id, "rsp_ms": run.rsp_ms, "alpha_needed": {
        f"{b:g}": {f"K={k}": a for k, a in run.alpha_needed(b).items()} for b in bars}, "rows": run.rows()}
    code = save(results, run.info.run_id, "ceiling", run.rows(), run.markdown(), json_out, summary,
                f"{run.info.env['device']} · run {run.info.run_id}")
    if run.interrupted:
        exit_interrupted(f"interrupted after {plural(run.completions, 'completion')} of each way: the table and files "
                         "cover them")
    exit_with(code)


def by_task(run: CeilingRun, bar: float) -> Table:
    """Per task: the first draft at its fastest K, the oracle's α needed for ``bar``, and the oracle's best."""
    top = max(run.alphas)
    out = table("By task: the draft and the oracle at their fastest K",
                [("task", "left"), ("draft", "right"), (f"{bar:g}× needs", "right"), (f"α={top:g}", "right")])
    for task in run.tasks:
        draft = max((run.cell(task, k, None) for k in run.ks), key=lambda c: c.speedup)
        reached = [a for a in run.alpha_needed(bar, task).values() if a is not None]
        best = max((run.cell(task, k, top) for k in run.ks), key=lambda c: c.speedup)
        out.add_row(task, f"{draft.speedup:.2f}× (K={draft.k}, α {draft.measured_alpha:.2f})",
                    f"α ≥ {min(reached):.2f}" if reached else "not reached",
                    f"{best.speedup:.2f}× (K={best.k})")
    return out


def interval_text(c: CeilingCell) -> str:
    """The speedup's 95% interval, escaped for rich; "no interval" from a single completion per way."""
    if math.isnan(c.speedup_low):
        return "no interval"
    return escape(f"[{c.speedup_low:.2f}-{c.speedup_high:.2f}]")


def parse_positive_numbers(name: str, text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{name} takes numbers separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{name} takes positive numbers separated by commas, got {text!r}")
    return values
