"""`load`: RSp and SSp serving the same requests at rising concurrency, and where SSp stops paying."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from lssp.cli.app import Settings, app, settings
from lssp.cli.loaders import STARTERS, check_ready, check_ssp, heads_run
from lssp.cli.options import (
    ChatOpt,
    DraftAlsoArg,
    EndpointOpt,
    IgnoreEosOpt,
    JsonOpt,
    KOpt,
    MaxNewOpt,
    NbPromptsOpt,
    PromptsOpt,
    TargetArg,
    TaskOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_k_within_budget,
    check_positive,
    given_options,
    one_draft,
    parse_ints,
    read_task_prompts,
    refuse_beside_endpoints,
    sampling_params,
)
from lssp.cli.output import console, err_console, exit_interrupted, exit_with, finish, fmt, say_busy, table
from lssp.cli.progress import progress
from lssp.engines import engine_class
from lssp.errors import UserError
from lssp.report.results import ResultWriter, plural

ENGINES = tuple(name for name, starter in STARTERS.items() if starter.serve is not None)
EngineOpt = Annotated[str, typer.Option(
    "--engine", help="vllm: one vLLM server per mode, loaded by vLLM's benchmark client (./setup.sh --vllm); "
    "ours: our engine, continuous batching under a closed loop of C = concurrency clients; llamacpp: one "
    "llama-server per mode with a slot per request in flight, continuous batching (./setup.sh --llamacpp); "
    "endpoint: servers already running, --endpoint.")]
ConcurrencyOpt = Annotated[str, typer.Option(help="Concurrency levels, comma-separated: requests in flight at once "
                                             "(ours: the batch size).")]
RequestsOpt = Annotated[int, typer.Option("--requests", help="Requests per level and mode (the same set each "
                                          "time); at least the highest concurrency.")]
RepeatsOpt = Annotated[int, typer.Option(
    help="Passes over each level, every mode once a pass in rotating order: the throughput ratio gets a 95% "
         "interval over the passes (from 2), the latency ratio's bootstrap takes every pass's requests.")]
RequestRateOpt = Annotated[Optional[float], typer.Option(
    help="Open loop: Poisson arrivals at this many requests per second, still at most --concurrency in flight "
         "(vllm, llamacpp, endpoint, and ours under the compact forward; default: closed loop, all sent at once).")]
BatchingOpt = Annotated[str, typer.Option(
    help="ours: continuous (requests join the running batch, under the compact forward) or static (the next "
         "--concurrency requests start when the whole batch is done).")]
MaxRowsOpt = Annotated[Optional[str], typer.Option(
    "--max-rows", metavar="N|auto", help="ours: also SSp under a row budget: a step verifies at most this many "
    "positions, rows x (drafts + 1), each row drafting fewer as the batch grows, down to none (at least K + 1); "
    "auto: the most a forward of the target takes here for at most 25% more than one token.")]


@app.command()
def load(
    ctx: typer.Context,
    target: TargetArg = None,
    draft_name: DraftAlsoArg = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft model (default: the registry's default_draft).")] = None,
    engine: EngineOpt = "vllm",
    concurrency: ConcurrencyOpt = "1,2,4,8",
    requests: RequestsOpt = 16,
    repeats: RepeatsOpt = 1,
    k: KOpt = None,
    lookup: Annotated[int, typer.Option(
        "--lookup", help="Also SSp with n-gram lookup of this length: vLLM's and llama.cpp's n-gram drafter alone; "
        "ours: the draft with our context lookup (0: off).")] = 0,
    max_new_tokens: MaxNewOpt = 64,
    task: TaskOpt = None,
    prompts: PromptsOpt = None,
    nb_prompts: NbPromptsOpt = None,
    chat: ChatOpt = False,
    ignore_eos: IgnoreEosOpt = False,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    request_rate: RequestRateOpt = None,
    batching: BatchingOpt = "continuous",
    max_rows: MaxRowsOpt = None,
    endpoint: EndpointOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Speculative decoding under load: per-user latency and throughput of RSp and SSp at each concurrency,
    SSp's ratio to RSp, and the break-even concurrency for each."""
    draft = one_draft(draft_name, draft)
    s = settings(ctx)
    if engine not in (*ENGINES, ENDPOINT):
        raise UserError(f"load --engine {engine!r}: load takes {', '.join(ENGINES)} or {ENDPOINT}")
    levels = sorted(set(parse_ints("--concurrency", concurrency)))
    check_positive("--requests", requests)
    check_positive("--repeats", repeats)
    if levels[-1] > requests:
        raise UserError(f"--concurrency {levels[-1]} is more than --requests {requests}: no more than {requests} "
                        f"requests could be in flight; give --requests {levels[-1]} or more")
    if endpoint or engine == ENDPOINT:
        _check_endpoint_options(ctx, endpoint)
        return _load_endpoints(s, target, endpoint or [], levels, (requests, repeats), max_new_tokens,
                               (task, prompts, nb_prompts, chat), sampling_params(temperature, top_k, top_p),
                               ignore_eos, request_rate, json_out)
    k = s.registry.draft_k(draft, heads_run([engine])) if k is None else k  # llama.cpp: the default draft model's
    check_positive("--k", k)
    check_k_within_budget(k, max_new_tokens)
    if lookup < 0:
        raise UserError(f"--lookup must be 0 (off) or more, got {lookup}")
    if batching not in ("continuous", "static"):
        raise UserError(f"--batching {batching!r}: expected continuous or static")
    if batching == "static" and not engine_class(engine).runs_our_weights:
        raise UserError(f"--batching static: only --engine ours serves static batches ({engine} batches "
                        "continuously)")
    budget = _check_max_rows(max_rows, k, engine)
    _check_rate(request_rate)
    from lssp.measure.latency import latency_modes
    from lssp.measure.load import LoadSetup, build_requests

    check_ready([engine])  # not installed or built: one line naming ./setup.sh's option, before anything loads
    workload, prompt_list = _workload(task, prompts, nb_prompts, requests, chat)
    params = sampling_params(temperature, top_k, top_p)
    results = s.writable_results_dir(json_out)
    kind = engine_class(engine)
    need_draft = draft is not None or target is None or not lookup or kind.takes_lookup
    check_ssp("load", engine, [k], lookup, has_draft=need_draft)
    starter = STARTERS[engine]
    t, d, vocab = starter.models(s, target, draft, need_draft)
    modes = latency_modes([engine], [d.name] if d else [], [k], (0.0,), [0, lookup] if lookup else [0])
    modes, row_budget = _with_row_budget(modes, budget, t, k)
    if len(modes) < 2:
        raise UserError(f"load compares SSp with RSp: give --draft D (or --lookup N for {kind.label}'s n-gram "
                        "drafts)")
    request_set = build_requests(t, prompt_list, requests, s.seed, chat)
    setup = LoadSetup(engine, t.name, d.name if d else None, modes, levels, params, max_new_tokens, requests,
                      workload, len(prompt_list), chat, ignore_eos, request_rate, s.seed, batching=batching,
                      row_budget=row_budget, repeats=repeats)
    backend = starter.serve(t, d, vocab, setup, request_set)  # servers or engine started before anything is timed
    try:
        setup.engine_version = backend.version
        _measure(s, backend, t, d, results, json_out, request_set)
    finally:
        backend.close()  # servers and engines started for the run


AUTO = -1  # --max-rows auto, chosen once the target is loaded
ENDPOINT = "endpoint"  # --engine endpoint: servers already running (--endpoint), lssp.measure.load_endpoint


def _check_rate(request_rate: float | None) -> None:
    if request_rate is not None and not request_rate > 0:
        raise UserError(f"--request-rate must be a positive number of requests per second, got {request_rate:g}")


def _check_endpoint_options(ctx: typer.Context, endpoints: list[str] | None) -> None:
    """One line for what servers already running take from their own settings, not from this command."""
    if not endpoints:
        raise UserError("--engine endpoint: name the servers with --endpoint LABEL=URL (one labelled rsp)")
    if "--engine" in given_options(ctx, {"engine": "--engine"}) and ctx.params.get("engine") != ENDPOINT:
        raise UserError(f"--endpoint runs servers already running: --engine {ctx.params.get('engine')} does not go "
                        "with it")
    refuse_beside_endpoints(ctx, {"draft_name": "DRAFT", "draft": "--draft", "k": "--k", "lookup": "--lookup",
                                  "batching": "--batching", "max_rows": "--max-rows"})


def _load_endpoints(s: Settings, target: str | None, values: list[str], levels: list[int],
                    requests_repeats: tuple[int, int], max_new_tokens: int, workload_args: tuple, params,
                    ignore_eos: bool, request_rate: float | None, json_out: Path | None) -> None:
    """``load --endpoint``: servers already running; nothing loads here but the target's tokenizer (TARGET), which
    turns the prompts into the token ids every server gets."""
    from lssp.cli.loaders import endpoints_and_tokenizer
    from lssp.engines.endpoint import parse_endpoints
    from lssp.measure.load import LoadSetup, build_requests
    from lssp.measure.load_endpoint import EndpointLoadBackend

    parse_endpoints(values)  # a malformed --endpoint: one line before the workload is read
    requests, repeats = requests_repeats
    task, prompts, nb_prompts, chat = workload_args
    workload, prompt_list = _workload(task, prompts, nb_prompts, requests, chat)
    results = s.writable_results_dir(json_out)
    t, endpoints = endpoints_and_tokenizer(s, target, values)
    setup = LoadSetup(ENDPOINT, t.name, None, [e.mode for e in endpoints], levels, params, max_new_tokens, requests,
                      workload, len(prompt_list), chat, ignore_eos, request_rate, s.seed, draft_method="remote",
                      repeats=repeats)
    backend = EndpointLoadBackend(endpoints, setup)
    setup.engine_version = backend.version
    _measure(s, backend, t, None, results, json_out, build_requests(t, prompt_list, requests, s.seed, chat))


def _check_max_rows(max_rows: str | None, k: int, engine: str) -> int | None:
    """--max-rows: a number of positions, at least K + 1 (room for one request's drafts), or auto (``AUTO``), for an
    engine that takes a row budget."""
    if max_rows is None:
        return None
    from lssp.engines import Mode

    budget = AUTO if max_rows.strip().lower() == "auto" else None
    if budget is None:
        try:
            budget = int(max_rows)
        except ValueError:
            raise UserError(f"--max-rows {max_rows!r}: a whole number of positions, or auto") from None
    why = engine_class(engine).refuses(Mode("ssp", k, engine=engine, max_rows=max(budget, k + 1)))
    if why or budget != AUTO and budget < k + 1:
        raise UserError(f"--max-rows {max_rows}: {why or f'at least K + 1 = {k + 1} (one request drafts K)'}")
    return budget


def _with_row_budget(modes: list, budget: int | None, target, k: int) -> tuple[list, str]:
    """``modes`` and, with a row budget, each draft's SSp under it beside them; how an ``AUTO`` budget was chosen
    (timed on the loaded ``target`` here and said in one line), else ""."""
    how = ""
    if budget == AUTO:
        from lssp.measure.cost import row_budget
        from lssp.notices import notice

        with err_console.status("Timing the target's forward by positions for --max-rows auto…"):
            chosen = row_budget(target.model, k + 1)
        budget, how = chosen.rows, chosen.describe()
        notice(how)
    if budget is None:
        return modes, how
    return modes + [replace(m, max_rows=budget) for m in modes if m.mode == "ssp" and not m.ngram], how


def _workload(task: str | None, prompts: Path | None, nb_prompts: int | None, requests: int, chat: bool):
    """(its name, the TaskPrompts): ShareGPT by default where installed (one drawn prompt per request unless
    --nb-prompts says), else the built-in story openings."""
    from lssp.workloads.sharegpt import TASK, sharegpt_file

    if task is None and prompts is None:
        task = TASK if sharegpt_file() is not None else "stories"
    if task is not None and TASK in [name.strip() for name in task.split(",")] and nb_prompts is None:
        nb_prompts = requests
    return (task or str(prompts)), read_task_prompts(task, prompts, nb_prompts, chat)


def _measure(s: Settings, backend, t, d, results: Path, json_out: Path | None, request_set: list) -> None:
    """Run every level (saving each), render, and end as the run ended."""
    from lssp.measure.load import run_load
    from lssp.report.results import RunInfo

    setup = backend.setup
    info = RunInfo.for_models(t, d)
    info.env = backend.environment(info.env)
    writer = ResultWriter(results, info.run_id)

    def save_level(run) -> None:
        writer.csv("load.csv", run.level_rows(len(run.levels) - 1))
        writer.json(results / f"load-{run.info.run_id}.json", run.summary_json())

    with progress(None, "load") as tick:
        run = run_load(backend, setup, info, request_set, save_level, tick)
    render(run)
    if run.levels:
        _finish_files(run, writer, results, json_out)
    code = finish(writer, f"{run.info.env['device']} · run {run.info.run_id}")
    if run.failure:
        raise UserError(run.failure + (f" — the {plural(len(run.levels), 'level')} completed before it are saved"
                                       if run.levels else ""))
    if run.interrupted:
        exit_interrupted(f"interrupted after {plural(len(run.levels), 'concurrency level')}: the table and files "
                         "cover them")
    exit_with(code)


def _finish_files(run, writer: ResultWriter, results: Path, json_out: Path | None) -> None:
    """The run's Markdown, its --json copy and its chart (the CSV and JSON rows are saved level by level)."""
    from lssp.report.load_chart import load_chart

    writer.text(f"load-{run.info.run_id}.md", run.markdown())
    if json_out:
        writer.json(json_out, run.summary_json())
    setup = run.setup
    try:
        chart = load_chart(run.rows(), results / f"load-{run.info.run_id}.png",
                           f"SSp ÷ RSp under load: {setup.engine}, {setup.target} with {setup.draft or 'n-gram'}, "
                           f"{setup.workload}" + (f" × {setup.repeats} passes" if setup.repeats > 1 else "")
                           + f", ≤{setup.max_new_tokens} tokens, {setup.params}",
                           f"{run.info.env.get('device', '')} — run {run.info.run_id}")
    except OSError as exc:
        err_console.print(f"[yellow]warning:[/yellow] could not draw the chart: {exc.strerror or exc}")
        return
    if chart is not None:
        writer.written.append(chart)


def render(run) -> None:
    """The table (80 columns), the break-even lines and the notes."""
    setup = run.setup
    arrivals = f"Poisson {setup.request_rate:g}/s" if setup.request_rate else "closed loop"
    title = (f"{setup.engine} under load: {setup.target}" + (f" with {setup.draft}" if setup.draft else "")
             + f" — {plural(setup.requests, 'request')} ({setup.workload}) per level"
             + (f" × {setup.repeats} passes" if setup.repeats > 1 else "") + f", ≤{setup.max_new_tokens} "
             f"tokens, {setup.params}, {arrivals}")
    out = table(title, [("c", "right"), ("mode", "left"), ("TPOT ms", "right"), ("TTFT ms", "right"),
                        ("tok/s", "right"), ("acc/len", "right"), ("lat×", "right"), ("thr×", "right")])
    previous = None
    for row in run.summaries:
        if previous is not None and row.concurrency != previous:
            out.add_section()
        first = row.concurrency != previous
        previous = row.concurrency
        out.add_row(str(row.concurrency) if first else "", row.label + ("" if row.batched else " †"),
                    f"{_num(row.tpot_median_ms)}/{_num(row.tpot_p90_ms)}",
                    f"{_num(row.ttft_median_ms, 0)}/{_num(row.ttft_p90_ms, 0)}", _num(row.throughput_tok_s),
                    "–" if row.mode == "rsp" else f"{fmt(row.acceptance_rate, 0, pct=True)}/"
                    f"{fmt(row.mean_acceptance_length, 2)}",
                    _ratio(row.latency_ratio), _ratio(row.throughput_ratio))
    console.print(out)
    from lssp.measure.load import TTFT_VLLM_CLIENT

    start = "its send by vLLM's client" if run.ttft_definition == TTFT_VLLM_CLIENT else "its arrival"
    console.print("  TPOT: per-user decode ms/token (last token − first) ÷ (tokens − 1), median/p90; TTFT ms "
                  f"median/p90, each request's from {start} (p99s in the rows); acc/len: accepted ÷ drafted / mean "
                  "acceptance length; lat× and thr×: SSp's per-user speed and throughput ÷ RSp's (> 1: SSp pays); lat×'s "
                  "95% intervals: a bootstrap over the requests" + (
                      " of every pass; thr×: the geometric mean of the passes' ratios, its interval over them"
                      if setup.repeats > 1 else " (the spread over them, not from run to run); thr× is one "
                      "measurement per level (--repeats 2 or more gives it an interval)"))
    _interval_lines(run.summaries)
    if any(not row.batched for row in run.summaries):
        console.print("[yellow]  † not batched: served one request at a time (see below)[/yellow]")
    unbatched = {row.label for row in run.summaries if not row.batched}
    for label, latency, throughput in run.break_evens():
        for what, rule in (("per-user latency", latency), ("throughput", throughput)):
            style = "bold green" if rule.pays_everywhere else "bold red" if rule.level is not None else "bold"
            text = rule.describe()
            if label in unbatched:
                text = ("not measured: † SSp ran one request at a time, so its TPOT is a lone request's (the wait is "
                        "in its TTFT)") if what == "per-user latency" else text + " († SSp not batched)"
            console.print(Text(f"break-even ({what}, {label}): {text}", style=style))
    for note in run.notes:
        console.print(f"  {note}")
    for concurrency, share in run.busy_levels.items():
        say_busy(share, f"concurrency {concurrency}: ")
    cut = sum(row.prompt_tokens_cut for row in run.summaries if row.mode == "rsp")
    if cut:
        console.print(f"  prompt tokens cut to batch: {cut} over the levels (equal lengths per static batch)")


def _interval_lines(summaries) -> None:
    """Each SSp mode's lat× and thr× with their 95% intervals by level, where they have them; greedy, the share of
    its outputs equal to RSp's."""
    for label in dict.fromkeys(s.label for s in summaries if s.mode == "ssp"):
        for name, key in (("lat×", "latency_ratio"), ("thr×", "throughput_ratio")):
            known = [s for s in summaries if s.label == label and getattr(s, key + "_low") == getattr(s, key + "_low")]
            if known:
                console.print(f"  {name} 95% intervals, {label}: " + " · ".join(
                    f"c={s.concurrency} {getattr(s, key):.2f} [{getattr(s, key + '_low'):.2f}–"
                    f"{getattr(s, key + '_high'):.2f}]" for s in known))
        same = [s for s in summaries if s.label == label and s.same_as_rsp == s.same_as_rsp]
        if same:
            console.print(f"  greedy outputs equal to RSp's, {label}: " + " · ".join(
                f"c={s.concurrency} {s.same_as_rsp:.0%}" for s in same))


def _num(value: float, digits: int = 1) -> str:
    if value != value or math.isinf(value):
        return "–"
    return f"{value:.{digits if value < 100 else 0}f}"


def _ratio(value: float) -> Text | str:
    if value != value:
        return "–"
    return Text(f"{value:.2f}", style="green" if value > 1 else "red")
