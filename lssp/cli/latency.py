"""`latency`: ms/token of RSp and SSp on a prompt list, side by side in one run."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Annotated, Optional

import typer
from rich.text import Text

from lssp.cli.app import app, settings
from lssp.cli.loaders import check_ready, heads_run, load_draft_for, load_pair, start_engine
from lssp.cli.options import (
    ChatOpt,
    ConfidenceOpt,
    DraftAlsoArg,
    EndpointOpt,
    EngineOpt,
    IgnoreEosOpt,
    JsonOpt,
    MaxNewOpt,
    NbPromptsOpt,
    PlotOpt,
    PromptsOpt,
    TargetArg,
    TaskOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    WideOpt,
    check_k_within_budget,
    check_positive,
    flag,
    one_draft,
    parse_engines,
    parse_fractions,
    parse_ints,
    read_task_prompts,
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
from lssp.engines import engine_class
from lssp.engines.base import Mode
from lssp.errors import UserError
from lssp.models.registry import Registry
from lssp.report.results import mode_name, plural

DraftListOpt = Annotated[Optional[str], typer.Option(
    help="Draft model (or feature head), or a comma list timed side by side; times SSp (and RSp unless "
         "--no-baseline).")]
LookupOpt = Annotated[str, typer.Option(
    "--lookup", help="Context lookup n-gram length for SSp, or a comma list to sweep: 0,4 (0: off). Ours: "
    "the draft with our context lookup; vLLM and llama.cpp: their n-gram drafter alone.")]
SplitOpt = Annotated[str, typer.Option(
    help="Where the draft/target time split is measured: auto (a separate pass when a model is on a GPU), "
         "same (sync around every forward in the timed passes), separate.")]
# --endpoint: the servers' own settings, refused beside it (parameter: how the user writes it)
SERVER_SETTINGS = {"draft_name": "DRAFT", "draft": "--draft", "default_pair": "--default-pair", "k": "--k",
                   "lookup": "--lookup", "draft_confidence": "--draft-confidence", "split": "--split",
                   "engine": "--engine", "no_baseline": "--no-baseline"}


@app.command()
def latency(
    ctx: typer.Context,
    target: TargetArg = None,
    draft_name: DraftAlsoArg = None,
    draft: DraftListOpt = None,
    default_pair: Annotated[bool, flag("--default-pair", help="Use the registry's default draft too.")] = False,
    k: Annotated[Optional[str], typer.Option("--k", help="Draft length, or a list to sweep: 2,4,8 (default: the draft's k).")] = None,
    max_new_tokens: MaxNewOpt = 64,
    task: TaskOpt = None,
    prompts: PromptsOpt = None,
    nb_prompts: NbPromptsOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    no_baseline: Annotated[bool, flag("--no-baseline", help="Skip timing RSp.")] = False,
    draft_confidence: ConfidenceOpt = "0",
    lookup: LookupOpt = "0",
    repeats: Annotated[int, typer.Option(help="Passes over the prompts (interleaved); the speedup's sd is over them.")] = 1,
    split: SplitOpt = "auto",
    chat: ChatOpt = False,
    engine: EngineOpt = "ours",
    endpoint: EndpointOpt = None,
    wide: WideOpt = False,
    json_out: JsonOpt = None,
    plot: PlotOpt = False,
) -> None:
    """ms/token of RSp and SSp on a prompt list or task categories, measured side by side in one run."""
    draft = one_draft(draft_name, draft)
    from lssp.measure.latency import SPLIT_CHOICES, latency_modes, ngram_left_out, run_latency
    from lssp.workloads.prompts import WARMUP_PROMPT

    s = settings(ctx)
    if endpoint:
        refuse_beside_endpoints(ctx, SERVER_SETTINGS)
    engines_wanted = parse_engines(engine, ("ours", "hf", "vllm", "llamacpp"))
    use_draft = not endpoint and (draft is not None or default_pair or target is None)
    if draft is None and use_draft:  # where one engine cannot run a feature head, every engine drafts with a model
        draft = s.registry.draft_name(None, heads_run(engines_wanted))
    draft_names = [name.strip() for name in (draft or "").split(",") if name.strip()] or [None]
    ks = parse_ints("--k", k) if k is not None else sorted({s.registry.draft_k(name) for name in draft_names})
    confidences = parse_fractions("--draft-confidence", draft_confidence)
    lookups = parse_ints("--lookup", lookup, minimum=0)
    check_k_within_budget([1] if endpoint else ks, max_new_tokens)  # a server sets its own K
    check_positive("--repeats", repeats)
    if split not in SPLIT_CHOICES:
        raise UserError(f"--split {split!r}: expected one of {', '.join(SPLIT_CHOICES)}")
    prompt_list = read_task_prompts(task, prompts, nb_prompts, chat)
    params = sampling_params(temperature, top_k, top_p)
    if endpoint:
        return _latency_endpoints(ctx, endpoint, target, prompt_list, params, max_new_tokens, repeats, ignore_eos,
                                  chat, json_out, wide, plot)
    check_ready(engines_wanted, confidences)  # not installed or built, or an option one lacks: said first
    results = s.writable_results_dir(json_out)
    if len(draft_names) > 1 and (one := next((e for e in engines_wanted if not engine_class(e).runs_our_weights), None)):
        raise UserError(f"--engine {one} times one draft: give --draft a single name")
    if len(set(draft_names)) < len(draft_names):
        raise UserError(f"--draft {draft!r} names a draft twice")
    draft = draft_names[0]
    s.registry.target_name(target)  # the target resolved (a folder not in the registry said) before its drafts
    names = [s.registry.draft_name(name) for name in draft_names] if use_draft else []
    modes = [entry_confidence(m, s.registry, names) for m in latency_modes(engines_wanted, names, ks, confidences,
                                                                           lookups, not no_baseline)]
    left_out = ngram_left_out(engines_wanted, ks, lookups)
    for line in left_out:
        err_console.print(f"[dim]latency: {line}[/dim]", soft_wrap=True)
    loaded = None
    if any(engine_class(e).runs_our_weights for e in engines_wanted):  # ours, hf: the models loaded here, once
        t, d, vocab = load_pair(s, target, draft, need_draft=use_draft)
        more = [load_draft_for(s, t, name) for name in draft_names[1:]]
        loaded = (t, [x for x in (d, *(m for m, _ in more)) if x is not None], [vocab, *(v for _, v in more)])
    started = {name: start_engine(s, name, [engine_class(name).key(m) for m in modes if m.engine == name], target,
                                  draft, need_draft=use_draft, loaded=loaded) for name in engines_wanted}
    engines = {name: engine for name, (_, _, engine) in started.items()}
    first = next(iter(started.values()))
    t, drafts = (loaded[0], loaded[1]) if loaded else (first[0], [first[1]] if first[1] else [])
    d = drafts[0] if drafts else None
    with progress(None, "latency") as tick:
        run = run_latency(t, engines, modes, prompt_list, WARMUP_PROMPT, params, max_new_tokens, s.seed, drafts,
                          progress=tick, chat=chat, repeats=repeats, split=split, ignore_eos=ignore_eos,
                          left_out=left_out)
    render(run, t, d, wide, drafts[1:])
    _save(s, run, results, json_out, plot)


def _save(s, run, results, json_out, plot: bool) -> None:
    """The run's files (and charts), then the exit: 130 where Ctrl-C cut it short, 2 (one line) where a server
    failed mid-run."""
    code = save(results, run.info.run_id, "latency", run.rows(), run.markdown(), json_out, run.summary_json(),
                f"{run.info.env['device']} · run {run.info.run_id}", {"latency_prompts.csv": run.prompt_rows()})
    if plot and not run.interrupted:
        plot_charts(s.results_dir, run_id=run.info.run_id, kinds=("latency",))
    if run.failure:
        raise UserError(f"{run.failure}; the table and files cover the {plural(run.prompts_done, 'prompt')} "
                        "completed before in every mode")
    if run.interrupted:
        exit_interrupted(f"interrupted after {plural(run.prompts_done, 'prompt')}: the table and files cover them")
    exit_with(code)


def _latency_endpoints(ctx: typer.Context, values: list[str], target: str | None, prompt_list: list,
                       params, max_new_tokens: int, repeats: int, ignore_eos: bool, chat: bool,
                       json_out, wide: bool, plot: bool) -> None:
    """``latency --endpoint``: servers already running, one request at a time, interleaved prompt by prompt;
    nothing loads here but the target's tokenizer (TARGET)."""
    from lssp.cli.loaders import endpoints_and_tokenizer
    from lssp.engines.endpoint import EndpointEngine, parse_endpoints
    from lssp.measure.latency import run_latency
    from lssp.workloads.prompts import WARMUP_PROMPT

    s = settings(ctx)
    parse_endpoints(values)  # a malformed --endpoint: one line before anything is read
    results = s.writable_results_dir(json_out)
    t, endpoints = endpoints_and_tokenizer(s, target, values)
    engine = EndpointEngine(endpoints, t.tokenizer)
    modes = sorted((e.mode for e in endpoints), key=lambda m: m.mode != "rsp")  # RSp first, then as given
    with progress(None, "latency") as tick:
        run = run_latency(t, {engine.name: engine}, modes, prompt_list, WARMUP_PROMPT, params, max_new_tokens,
                          s.seed, progress=tick, chat=chat, repeats=repeats, ignore_eos=ignore_eos)
    render(run, t, None, wide)
    for caution in engine.cautions():
        console.print(f"[yellow]  {caution}[/yellow]", highlight=False)
    _save(s, run, results, json_out, plot)


def _floor_line(run) -> None:
    """``--wide``: each mode's ms/token as a multiple of the target's one-token floor on this CPU (``cost``'s: its
    Linear weights and the keys and values cached before the token read once at the copy bandwidth probed beside
    each prompt, or the weights' arithmetic, whichever is slower)."""
    setup = run.setup
    if not setup.floor_precision:
        return
    rsp = next((m for m in run.overall if m.mode == "rsp"), run.overall[0])
    console.print(f"  floor of a {setup.target} token ({setup.floor_precision}, {setup.floor_weight_mb:.3g} MB "
                  f"+ {setup.floor_cache_kb:.3g} kB per cached token, {setup.floor_bound}-bound at "
                  f"{setup.bandwidth_gbs:.1f} GB/s, the median of {plural(setup.bandwidth_probes, 'probe')}): "
                  f"{rsp.floor_ms:.3g} ms; ms/token ÷ floor: " + ", ".join(
                      f"{_engine(m)}{'RSp' if m.mode == 'rsp' else _which(m)} {m.over_floor:.3g}×"
                      + (f" [{m.over_floor_low:.3g}–{m.over_floor_high:.3g}]" if m.over_floor_low == m.over_floor_low
                         else "") for m in run.overall))


def engine_label(name: str) -> str:
    return engine_class(name).label or name


def render(run, t, d, wide: bool = False, more: list | None = None) -> None:
    from lssp.measure.latency import SEPARATE_PASS

    setup = run.setup
    params = setup.params
    overall = run.overall
    several = len([x for x in overall if x.mode == "ssp"]) > 1
    tasks = f" from {len(setup.tasks)} tasks" if run.by_task else f" ({setup.tasks[0]})" if setup.tasks else ""
    drafts = [x.name for x in [d, *(more or [])] if x is not None]
    title = (f"{t.name}" + (f" with draft{'s' if len(drafts) > 1 else ''} {', '.join(drafts)}" if drafts else "") + f" — {plural(run.prompts_done // setup.repeats, 'prompt')}"
             + tasks + (" (chat template)" if setup.chat else "") + f", ≤{setup.max_new_tokens} tokens"
             + (" (end token ignored)" if setup.ignore_eos else "")
             + (f" × {setup.repeats} passes" if setup.repeats > 1 else "") + f", T={params.temperature:g}"
             + (f", top-k {params.top_k}" if params.top_k else "") + (f", top-p {params.top_p:g}" if params.top_p < 1 else ""))
    repeated = setup.repeats > 1
    out = table(title, [("mode", "left"), ("K", "left"), ("ms/token", "right"), ("min–max", "right"), ("α", "right"),
                        ("tok/fwd", "right"), ("speedup", "right"), *([("±sd", "right")] if repeated else [])],
                # an engine's name and the mode on one line, K wrapping instead; a draft's name beside the mode
                # wraps (kept whole, it would squeeze the other columns out of 80)
                keep_whole=() if len(setup.draft_kinds) > 1 else ("mode",))
    details = table("Details: median ms/token, time to first token, accepted/drafted, shares of decode time in the "
                    "draft's and the target's forwards, the spread of the target's forward time (slowest ÷ median "
                    "prompt), and the speedup's 95% interval (CI) over the prompts",
                    [("mode", "left"), ("median", "right"), ("TTFT ms", "right"), ("accepted", "right"),
                     ("draft", "right"), ("target", "right"), ("spread", "right"), ("95% CI", "right")])
    both = len(run.engines) > 1
    star = fastest(overall) if several else None
    for m in overall:
        mode = (engine_label(m.engine) + " " if both else "") + mode_name(m.mode) \
            + (f" {setup.draft_label(m)}" if len(setup.draft_kinds) > 1 and m.mode == "ssp" else "") \
            + (" ★" if m is star else "")
        k = _k(m) if m.mode == "ssp" else "–"
        style = "bold" if m is star else None
        out.add_row(mode, k, f"{m.ms_per_token:.1f}", f"{m.ms_per_token_min:.1f}–{m.ms_per_token_max:.1f}",
                    fmt(m.alpha, 2), fmt(m.mean_accepted, 2), _speedup(m.speedup),
                    *([fmt(m.speedup_sd, 2)] if repeated else []), style=style)
        details.add_row(mode + ("" if m.mode == "rsp" else f" {_which(m)}"), f"{m.ms_per_token_median:.1f}", f"{m.ttft_ms:.0f}",
                        fmt(m.acceptance_rate, 0, pct=True), fmt(m.draft_share, 0, pct=True),
                        fmt(m.target_share, 0, pct=True), fmt(m.forward_spread, 2, suffix="×"),
                        f"{m.speedup_low:.2f}–{m.speedup_high:.2f}" if m.speedup_low == m.speedup_low else "–",
                        style=style)
    if run.by_task:
        render_tasks(run)
    console.print(out)
    if wide:
        console.print(details)
        _floor_line(run)
    budget = overall[0].at_budget_share
    console.print(f"  {fmt(budget, 0, pct=True)} of completions ran to the {setup.max_new_tokens}-token budget"
                  + (" (--ignore-eos)" if setup.ignore_eos else "; the others ended at the end token" if budget < 1
                     else ": none ended at the end token"))
    _same_line(run)
    specbench = [m for m in overall if m.specbench_speedup == m.specbench_speedup]
    if specbench:
        console.print("  Spec-Bench's speedup (mean per-prompt tokens/s, prefill included, ÷ RSp's): "
                      + ", ".join(f"{_engine(m)}{_named(run, m)}{_which(m)} {m.specbench_speedup:.2f}×" for m in specbench))
    for m in overall:
        if m.mode == "ssp" and m.acceptance_rate == m.acceptance_rate:  # engines that count acceptance
            shares = [f"{i + 1}:{fmt(x, 0, pct=True)}" for i, x in enumerate(m.acceptance_by_position)]
            console.print(f"  share of iterations accepting draft i ({_engine(m)}{_named(run, m)}{_which(m)}): "
                          + " ".join(shares[:m.k or None])
                          + (f"; of copied chains past K, accepting i: {' '.join(shares[m.k:])}" if m.k and shares[m.k:]
                             else ""))
            if m.lookup:
                console.print(f"    the lookup proposed {fmt(m.lookup_share, 0, pct=True)} of drafts, "
                              f"{fmt(m.lookup_acceptance, 0, pct=True)} of them accepted")
    render_engines(run)
    if setup.recompiles:
        console.print(f"[bold yellow]  torch.compile built {plural(setup.recompiles, 'graph')} while timing: "
                      "its compile time is in the figures[/bold yellow]")
    if run.timing_fallbacks:
        console.print(f"[yellow]  ms/token of {plural(run.timing_fallbacks, 'completion')} is whole completion ÷ "
                      "tokens (timing_basis)[/yellow]")
    if setup.split_timing == SEPARATE_PASS:
        console.print("  ms/token: completions synchronized only at their boundaries; draft/target shares and c: "
                      "a separate pass synchronized around every forward")
    ratios = run.cost_ratios
    if len(ratios) > 1:
        console.print("  draft/target cost ratio c (draft ms per forward ÷ target ms per 1-token forward): "
                      + ", ".join(f"{name} {c:.3f}" for name, c in ratios.items()))
    elif not math.isnan(run.cost_ratio):
        console.print(f"  draft/target cost ratio c = {run.cost_ratio:.3f} (draft ms per forward ÷ target ms per "
                      "1-token forward)")
    if t.spec.is_random or (d is not None and d.spec.is_random):
        console.print("[yellow]  Random weights: timings are real, acceptance figures mean nothing.[/yellow]")
    render_verdict(run)


def _same_line(run) -> None:
    """Greedy: each SSp mode's share of completions whose text is its engine's RSp one's (yellow where not all)."""
    same = [m for m in run.overall if m.same_as_rsp == m.same_as_rsp]
    if same:
        console.print("  greedy SSp's text equal to RSp's: " + ", ".join(
            f"{_engine(m)}{_named(run, m)}{_which(m)} {m.same_as_rsp:.0%}" for m in same),
            style=None if all(m.same_as_rsp == 1 for m in same) else "yellow")


def fastest(modes: list) -> object | None:
    """The SSp row a table stars: the highest speedup over its own RSp, if any beats RSp at all."""
    paying = [m for m in modes if m.mode == "ssp" and m.speedup == m.speedup and m.speedup > 1]
    return max(paying, key=lambda m: m.speedup) if paying else None


def render_verdict(run) -> None:
    """The lines a user acts on: a busy machine said first, then per engine the K to use (or that SSp does not pay, or
    no clear gain), its speedup with a 95% interval from prompts its choice did not see, α, and on what prompts."""
    from lssp.measure.latency import GAIN, LOSS, NO_CLEAR_GAIN, NOISY_SPREAD

    setup = run.setup
    say_busy(setup.others_cpu_share)
    if any(m.noisy for m in run.overall):
        worst = max((m for m in run.overall if m.noisy), key=lambda m: max(_finite(m.noise_spread), _finite(m.forward_spread)))
        console.print(f"[bold yellow]  busy machine: a {_engine(worst)}{mode_name(worst.mode)} completion took "
                      f"{max(_finite(worst.noise_spread), _finite(worst.forward_spread)):.1f}× its typical time per "
                      f"iteration (a quiet machine stays under {NOISY_SPREAD}×): the speedup is unreliable[/bold yellow]")
    workload = (f"{len(setup.tasks)} tasks" if run.by_task else setup.tasks[0]) if setup.tasks else "the prompts given"
    prompts = f"{plural(run.prompts_done // setup.repeats, 'prompt')} ({workload})"
    several = len(run.verdicts) > 1
    for v in run.verdicts:
        m, s = v.mode, v.speedup
        what = f"{'' if several else _engine(m)}{_named(run, m)}{_which(m)}"
        alpha = f", α {m.alpha:.2f}" if m.alpha == m.alpha else ""
        ranged = s.low == s.low
        speedup = f"{s.estimate:.2f}× [{s.low:.2f}–{s.high:.2f}]" if ranged else f"{s.estimate:.2f}×"
        if v.outcome == GAIN:
            text, style = f"use {what}: {speedup}{alpha}, on {prompts}", "bold green"
        elif v.outcome == LOSS:
            text, style = f"SSp does not pay here: the best, {what}, runs at {speedup} RSp's speed{alpha}, on {prompts}", "bold red"
        else:
            text, style = f"no clear gain: the best, {what}, runs at {speedup} RSp's speed{alpha}, on {prompts}", "bold yellow"
        advice = ("; the machine was busy: rerun with --repeats 3 on a quiet machine" if run.noisy
                  else "; more prompts (--nb-prompts) or passes (--repeats) narrow it" if v.outcome == NO_CLEAR_GAIN
                  else "")
        head = f"verdict ({engine_label(m.engine)}): " if several else "verdict: "
        console.print(Text(head + text + advice, style=style))
        if m.same_as_rsp < 1:  # greedy, and not RSp's text everywhere: the speedup is not of the same answers
            console.print(f"  its greedy text differed from RSp's on {1 - m.same_as_rsp:.0%} of completions: is it "
                          "the same target, verified exactly?", style="bold yellow")
        how = (f"95% interval of the geometric mean of {plural(v.pairs, 'per-prompt speedup')} (paired with RSp)"
               if ranged else f"no interval from {plural(v.pairs, 'prompt')}: two or more give one")
        console.print(f"  {how}; {v.basis}", style="dim")


def _finite(x: float) -> float:
    return x if x == x else 0.0


def _engine(m) -> str:
    """"hf " or "vLLM " before a K label (nothing for the reference engine, ours)."""
    return "" if engine_class(m.engine).reference else engine_label(m.engine) + " "


def _named(run, m) -> str:
    """"eagle " or "draft " (or the draft's name) before a K label where a run times several drafts."""
    return f"{run.setup.draft_label(m)} " if len(run.setup.draft_kinds) > 1 and engine_class(m.engine).runs_each_draft \
        else ""


def _k(m) -> str:
    """The K column: ours' label, an engine's n-gram drafter with its lookup length, or the name of a server's own
    configuration (``--endpoint``) with the K its counters showed, where they did."""
    if engine_class(m.engine).names_modes:
        return m.draft + (f" K={m.k_seen}" if m.k_seen else "")
    return k_label(m.k, m.confidence, m.lookup, m.ngram)


def _which(m) -> str:
    """An SSp mode in a sentence: "K=3", or a server's name (``--endpoint``)."""
    return m.draft if engine_class(m.engine).names_modes else f"K={_k(m)}"


def _speedup(value: float) -> Text | str:
    return "–" if math.isnan(value) else Text(f"{value:.2f}×", style="bold green" if value > 1 else "bold red")


def render_tasks(run) -> None:
    """One row per task and mode: where the speedup comes from."""
    out = table("By task: decode ms/token, α, tokens per target forward, speedup over RSp on the same prompts, and the "
                "share of completions that ran to the token budget", [
                    ("task", "left"), ("mode", "left"), ("ms/token", "right"), ("α", "right"), ("tok/fwd", "right"),
                    ("speedup", "right"), ("budget", "right")])
    previous, star = None, fastest(run.by_task)
    for m in run.by_task:
        first = m.task != previous
        if first and previous is not None:
            out.add_section()
        previous = m.task
        mode = "RSp" if m.mode == "rsp" else _named(run, m) + _which(m)
        label = f"{m.task} ({run.prompt_format(m.task)}, {m.prompts})" if first else ""
        out.add_row(label, mode + (" ★" if m is star else ""), f"{m.ms_per_token:.1f}", fmt(m.alpha, 2),
                    fmt(m.mean_accepted, 2), _speedup(m.speedup), fmt(m.at_budget_share, 0, pct=True),
                    style="bold" if m is star else None)
    console.print(out)


def render_engines(run) -> None:
    """Each other engine's note (how its figures are timed), and ours ÷ it where both ran a mode."""
    reference = {(m.mode, m.k, m.lookup, m.ngram): m for m in run.overall if engine_class(m.engine).reference}
    for name in run.engines:
        if engine_class(name).reference:
            continue
        ngram = any(m.engine == name and m.ngram for m in run.overall)
        note = run.setup.own(name).note
        if note:
            console.print(f"  {note}" + ("; \"ngram N\": its n-gram drafts alone, no draft model" if ngram else ""))
        pairs = [(m, reference[(m.mode, m.k, m.lookup, m.ngram)]) for m in run.overall
                 if m.engine == name and (m.mode, m.k, m.lookup, m.ngram) in reference]
        if pairs:
            console.print(f"  ours ÷ {engine_label(name)} ms/token: " + ", ".join(
                ("RSp" if v.mode == "rsp" else _which(v)) + f" {o.ms_per_token / v.ms_per_token:.2f}×"
                for v, o in pairs))


def entry_confidence(mode: Mode, registry: Registry, drafts: list[str]) -> Mode:
    """``mode`` with its draft entry's confidence stop where no --draft-confidence was given, so that its rows and
    label say the stop it drafts with."""
    if mode.mode != "ssp" or mode.confidence or mode.ngram or not drafts:
        return mode
    confidence = registry.get(mode.draft or drafts[0]).confidence
    return replace(mode, confidence=confidence) if confidence else mode
