"""`eval`: multiplication accuracy with 95% intervals, RSp and SSp on the same problems."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.loaders import heads_run, start_engine
from lssp.cli.options import (
    DraftAlsoArg,
    JsonOpt,
    LookupOpt,
    MaxNewOpt,
    PlotOpt,
    TargetArg,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_k_within_budget,
    check_positive,
    flag,
    one_draft,
    parse_engines,
    refuse_beside_endpoints,
    sampling_params,
)
from lssp.cli.output import (
    console,
    err_console,
    exit_interrupted,
    exit_with,
    fmt,
    k_label,
    plot_charts,
    save,
    say_busy,
    table,
)
from lssp.cli.progress import progress
from lssp.errors import UserError
from lssp.report.results import mode_name, plural

EvalEndpointOpt = Annotated[Optional[list[str]], typer.Option(
    "--endpoint", metavar="LABEL=URL", help="Two servers already running (OpenAI /v1/completions): rsp=URL without "
    "speculation and NAME=URL with it, scored on the same problems (--both implied); see docs/endpoints.md; TARGET names the tokenizer.")]
# --endpoint: the servers' own settings, refused beside it (parameter: how the user writes it)
SERVER_SETTINGS = {"draft_name": "DRAFT", "draft": "--draft", "k": "--k", "lookup": "--lookup", "engine": "--engine",
                   "rsp_batch": "--rsp-batch", "ssp_batch": "--ssp-batch", "prefix_cache": "--prefix-cache"}


@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    target: TargetArg = None,
    draft_name: DraftAlsoArg = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft model: evaluate SSp.")] = None,
    both: Annotated[bool, flag("--both", help="Evaluate RSp and SSp on the same prompts and compare.")] = False,
    nb_prompts: Annotated[int, typer.Option(help="Number of problems.")] = 1000,
    op: Annotated[str, typer.Option("--op", help="mul (a * b, the reference's) or add (a + b).")] = "mul",
    max_operand: Annotated[int, typer.Option(help="Operands are drawn from 1..N; a smaller N makes the task easier "
                                             "(aim for a success rate between 20% and 80%).")] = 99,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", help="Compute the few-shot prefix's keys and values once per model.")] = True,
    rsp_batch: Annotated[int, typer.Option(help="RSp problems whose prompts have the same token count run in "
                                           "batches of up to N (the same tokens as one by one; 1: off).")] = 64,
    ssp_batch: Annotated[int, typer.Option(help="SSp problems in batches of up to N (as one by one; 1: off).")] = 16,
    k: Annotated[int, typer.Option("--k", help="Draft tokens per iteration (2: the fastest that still drafts "
                                   "after an accepted draft; quality does not depend on K).")] = 2,
    max_new_tokens: MaxNewOpt = 8,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    resume: Annotated[bool, flag("--resume", help="Continue the newest interrupted run with the same settings.")] = False,
    lookup: LookupOpt = 0,
    engine: Annotated[str, typer.Option("--engine", help="ours, hf (transformers), or vllm (./setup.sh --vllm installs it).")] = "ours",
    endpoint: EvalEndpointOpt = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = False,
) -> None:
    """Arithmetic accuracy ("a * b = " after the reference's few-shot lines, a and b uniform in 1..99) with 95%
    intervals."""
    draft = one_draft(draft_name, draft)
    from lssp.measure.evals import LOW, OPERATIONS, EvalInterrupted, eval_config, resume_point, run_eval

    s = settings(ctx)
    check_positive("--nb-prompts", nb_prompts)
    check_positive("--k", k)
    check_positive("--max-new-tokens", max_new_tokens)
    check_positive("--lookup", lookup, minimum=0)
    check_positive("--max-operand", max_operand, minimum=LOW)
    check_positive("--rsp-batch", rsp_batch)
    check_positive("--ssp-batch", ssp_batch)
    if op not in OPERATIONS:
        raise UserError(f"--op {op!r}: expected one of {', '.join(OPERATIONS)}")
    params = sampling_params(temperature, top_k, top_p)
    if "," in engine:
        raise UserError(f"--engine {engine!r}: eval runs one engine at a time (ours, hf, vllm or llamacpp)")
    (engine,) = parse_engines(engine, ("ours", "hf", "vllm", "llamacpp"))
    if endpoint:  # servers already running: RSp and SSp, nothing of ours loaded but the tokenizer
        engine = _check_endpoints(ctx, endpoint)
    elif (target is None and draft is None) or (both and draft is None):  # the default pair
        draft = s.registry.draft_name(None, heads_run([engine]))
    modes = ["rsp", "ssp"] if both or endpoint else ["ssp"] if draft else ["rsp"]
    if "ssp" in modes:
        check_k_within_budget(k, max_new_tokens)
    hint = ("" if both or endpoint else " (--both compares it with RSp)" if modes == ["ssp"]
            else " (a target alone: --draft D for SSp, --both for RSp and SSp)")
    err_console.print(f"[dim]eval: {' and '.join(mode_name(m) for m in modes)}{hint}[/dim]", soft_wrap=True)
    results = s.writable_results_dir(json_out)
    done_before = 0
    if resume:  # say "nothing to resume" before loading anything
        done_before = len(resume_point(results / "eval_records", eval_config(
            s.registry.target_name(target), s.registry.draft_name(draft) if draft else None, modes, nb_prompts, s.seed,
            k, max_new_tokens, params, lookup, op, max_operand, engine))[1])
    t, d, runner = (_endpoint_engine(s, target, endpoint) if endpoint else
                    start_engine(s, engine, [(0, 0) if m == "rsp" else (k, lookup) for m in modes], target, draft,
                                 need_draft=draft is not None))
    correct = {m: 0 for m in modes}
    try:
        with progress(nb_prompts * len(modes), "eval", done_before) as tick:
            def on_record(r) -> None:
                correct[r.mode] += r.correct
                tick(" ".join(f"{mode_name(m)} {c}✓" for m, c in correct.items()))

            run = run_eval(t, d, runner, modes, nb_prompts, s.seed, params, max_new_tokens, k, results / "eval_records",
                           resume=resume, on_record=on_record, lookup=lookup, op=op, max_operand=max_operand,
                           prefix_cache=prefix_cache, rsp_batch=rsp_batch, ssp_batch=ssp_batch)
    except EvalInterrupted as stop:
        exit_interrupted(f"interrupted: {plural(stop.records, 'record')} kept in {stop.records_path}; "
                         "the same command with --resume continues it")  # soft-wrapped: the path stays whole
    render(run, t, d)
    code = save(results, run.run_id, "eval", run.rows(), run.markdown(), json_out, run.summary_json(),
                f"{run.info.env['device']} · run {run.run_id} · records {run.records_path}")
    if plot:
        plot_charts(s.results_dir, run_id=run.run_id, kinds=("eval",))
    exit_with(code)


def _check_endpoints(ctx: typer.Context, values: list[str]) -> str:
    """``eval --endpoint``: one line for the servers' own settings or other than two servers (one labelled rsp);
    the engine's name."""
    from lssp.engines.endpoint import EndpointEngine, parse_endpoints

    refuse_beside_endpoints(ctx, SERVER_SETTINGS)
    if len(parse_endpoints(values)) != 2:
        raise UserError("eval --endpoint compares two servers: one labelled rsp and one with speculation")
    return EndpointEngine.name  # for --resume's settings


def _endpoint_engine(s, target: str | None, values: list[str]):
    """(the target as a tokenizer, no draft, the engine over the servers) for ``eval --endpoint``."""
    from lssp.cli.loaders import endpoints_and_tokenizer
    from lssp.engines.endpoint import EndpointEngine

    t, endpoints = endpoints_and_tokenizer(s, target, values)
    return t, None, EndpointEngine(endpoints, t.tokenizer)


def _where(engine: str) -> str:
    """Where the title says the problems ran: nothing for the models loaded here, else the engine or servers."""
    from lssp.engines import engine_class

    kind = engine_class(engine)
    if kind.reference or kind.runs_our_weights:
        return ""
    return " on servers already running" if kind.names_modes else f" in {kind.label}"


def render(run, t, d) -> None:
    from lssp.measure.evals import LOW, OPERATIONS

    setup = run.setup
    symbol = OPERATIONS[setup.op][0]
    out = table(f"Eval \"a {symbol} b = \", a and b in {LOW}..{setup.max_operand}: {t.name}"
                + (f" (draft {d.name}, K={k_label(setup.k, 0, setup.lookup)})" if d else "")
                + _where(setup.engine)
                + f", {plural(setup.nb_prompts, 'problem')}, T={setup.params.temperature:g}",
                [("mode", "left"), *((c, "right") for c in ("correct", "rate ±95%", "95% Wald", "95% Wilson", "s/problem"))])
    for m in run.summaries:
        half = max(m.wald.high - m.success_rate, m.success_rate - m.wald.low)
        out.add_row(mode_name(m.mode), f"{m.successes}/{m.trials}", f"{100 * m.success_rate:.1f}% ±{100 * half:.1f}",
                    f"[{100 * m.wald.low:.1f}, {100 * m.wald.high:.1f}]", f"[{100 * m.wilson.low:.1f}, {100 * m.wilson.high:.1f}]",
                    fmt(m.seconds_per_problem, 3) + ("*" if run.timing_basis(m.mode) != "per problem" else ""))
    console.print(out)
    batched = [m.mode for m in run.summaries if run.timing_basis(m.mode) != "per problem"]
    if batched:
        bases = "; ".join(f"{mode_name(m)} {run.timing_basis(m)} (--{m}-batch)" for m in batched)
        console.print(f"  * {bases}: not comparable with a one-at-a-time s/problem")
    cmp = run.comparison
    if cmp:
        score, wald = cmp.score_difference, cmp.difference
        verdict = ("[green]contains 0: no evidence that SSp changes quality[/green]" if score.contains(0)
                   else "[red]excludes 0: SSp and RSp differ[/red]")
        console.print(f"  RSp − SSp = {100 * score.estimate:+.1f} points, 95% CI [{100 * score.low:+.1f}, "
                      f"{100 * score.high:+.1f}] (Tango's score; Wald [{100 * wald.low:+.1f}, {100 * wald.high:+.1f}]) "
                      f"{verdict}; McNemar p = {cmp.mcnemar_p:.3f} ({cmp.only_rsp} only-RSp vs {cmp.only_ssp} only-SSp "
                      "correct)")
        console.print("  " + (f"McNemar's test at 5% would find a difference of ±{100 * cmp.detectable:.1f} points with "
                              f"80% power at this share of discordant problems"
                              if cmp.detectable == cmp.detectable else
                              f"RSp and SSp were right or wrong alike on all {plural(cmp.pairs, 'problem')}: no discordant pair"),
                      style="dim")
    if run.resumed:
        console.print(f"  resumed: {run.resumed} records reused from {run.records_path}")
    say_busy(run.others_cpu_share)
