"""`verify`: a statistical check that SSp samples exactly from the target.

Exit status: 0 lossless, 1 not lossless (any engine or K), 2 a usage error or an engine that broke down,
3 inconclusive (every test passed but some lacked the power to vouch; the output says how many runs would do).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from lssp.cli.app import app, settings
from lssp.cli.loaders import check_ready, check_ssp, heads_run, load_pair
from lssp.cli.options import (
    DraftAlsoOpt,
    DraftArg,
    EndpointOpt,
    LookupOpt,
    PromptsOpt,
    TargetArg,
    TopKOpt,
    TopPOpt,
    check_k_within_budget,
    check_positive,
    one_draft,
    parse_ints,
    read_prompt_list,
    refuse_beside_endpoints,
    sampling_params,
)
from lssp.cli.output import console, err_console, exit_interrupted, exit_with, fmt, k_label, save, table
from lssp.cli.progress import progress
from lssp.engines import check_engines, engine_class
from lssp.errors import UserError
from lssp.report.results import RunInfo, plural
from lssp.report.stats import POWER

VERIFY_ENGINES = ("ours", "hf", "vllm", "llamacpp")


@app.command()
def verify(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    draft_option: DraftAlsoOpt = None,
    prompts: PromptsOpt = None,
    nb_prompts: Annotated[int, typer.Option(help="Use the first N prompts.")] = 3,
    samples: Annotated[Optional[int], typer.Option(
        help="SSp runs per prompt (sampled mode; default: as many as --time-budget allows, at most 1000, at least "
        "what the power needs).", show_default=False)] = None,
    time_budget: Annotated[float, typer.Option(
        "--time-budget", help="Sampled mode: minutes the default --samples is sized to (a pilot times this machine "
        "first; the estimate is said before the runs start).")] = 8.0,
    depth: Annotated[int, typer.Option(help="Emitted positions checked per prompt (2+ exercises cache rollback).")] = 3,
    k: Annotated[str, typer.Option("--k", help="Draft tokens per iteration; a comma list audits each (K=1 puts the "
                                   "bonus token at position 1).")] = "1,4",
    temperature: Annotated[float, typer.Option(help="0 checks greedy equality instead.")] = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    significance: Annotated[float, typer.Option(help="Family-wise significance level.")] = 0.01,
    effect: Annotated[float, typer.Option(help="Sampled mode: the smallest deviation (Cohen's w) a LOSSLESS verdict "
                                          "must have an 80% chance to see; with less power it is INCONCLUSIVE.")] = 0.5,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy mode: tokens compared per prompt.")] = 64,
    tie_tolerance: Annotated[float, typer.Option(
        help="Greedy mode: a top-2 logit gap up to this (or 2 ulp of the logits' dtype) is a near-tie.")] = 0.1,
    lookup: LookupOpt = 0,
    engine: Annotated[str, typer.Option("--engine", help="The engines to audit: ours, hf (assisted generation), vllm, llamacpp, "
                                        "or a comma list; a verdict for each.")] = "ours",
    two_sample: Annotated[Optional[bool], typer.Option(
        "--two-sample/--no-two-sample", help="Sampled mode: also test SSp's tokens against the same engine's RSp "
        "tokens (default: for engines other than ours, whose arithmetic may differ from our exact law).")] = None,
    batch: Annotated[int, typer.Option(help="Sampled mode: a prompt's runs go N at a time where the engine batches "
                                       "them (ours: SSp with a draft model, and RSp), each with its own seed: the "
                                       "same samples as one at a time.")] = 32,
    endpoint: EndpointOpt = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON here.")] = None,
) -> None:
    """Check that SSp samples exactly from the target (exit 1 when it does not, 3 when it cannot tell)."""
    draft = one_draft(draft, draft_option)
    from lssp.measure import verify as vf

    s = settings(ctx)
    if endpoint:
        return _verify_endpoints(ctx, endpoint, target, read_prompt_list(prompts, nb_prompts), samples, depth,
                                 sampling_params(temperature, top_k, top_p), significance, effect, json_out)
    engines = check_ready(check_engines("verify", [e.strip() for e in engine.split(",") if e.strip()], VERIFY_ENGINES))
    ks = parse_ints("--k", k)
    _check_numbers(nb_prompts, samples, depth, max_new_tokens, batch, time_budget, significance, effect, lookup, ks)
    params = sampling_params(temperature, top_k, top_p)
    prompt_list = read_prompt_list(prompts, nb_prompts)
    paired = {name: two_sample if two_sample is not None else not engine_class(name).reference for name in engines}
    needed = _samples_needed(engines, paired, len(prompt_list), depth, effect, significance)
    if not params.greedy and samples is not None and samples < needed:
        raise UserError(f"--samples {samples} is too few: even the first token's test would have less than an 80% "
                        f"chance to see a deviation of --effect {effect}; use --samples {needed} or more (or a "
                        "larger --effect)")
    results = s.writable_results_dir(json_out)
    draft = s.registry.draft_name(draft, heads_run(engines))  # every engine audited drafts with the same one
    t, d, vocab = load_pair(s, target, draft)  # our models give the exact laws, whichever engine is audited
    runners = _engines(s, engines, t, d, vocab, target, draft, ks, lookup)
    info = RunInfo.for_models(t, d)
    if not params.greedy:
        samples = _size_to_budget(s, runners, ks, t.encode(prompt_list[0]), params, depth, lookup, paired, batch,
                                  len(prompt_list), samples, needed, 60 * time_budget)
    reports, failed = _run_audits(s, runners, ks, t, d, prompt_list, params, vocab, samples, depth, significance,
                                  max_new_tokens, tie_tolerance, lookup, paired, effect, batch)
    interrupted = any(rep.interrupted for rep in reports)
    reports = [rep for rep in reports if rep.prompts_done]  # interrupted before its first prompt: nothing to say
    if not reports:
        if interrupted:
            exit_interrupted("interrupted before the first prompt's runs were complete: nothing was saved")
        raise UserError("; ".join(f"verify --engine {name} failed: {why}" for name, why in failed.items()))
    for rep in reports:
        render(rep, t, d, params)
    rows = [row for rep in reports for row in rep.rows(info, t, d, params)]
    summary = [rep.summary_json(info) for rep in reports]
    code = save(results, info.run_id, "verify", rows, None, json_out, summary[0] if len(summary) == 1 else summary,
                f"{info.env['device']} · run {info.run_id}")
    for name, why in failed.items():
        err_console.print(f"[bold red]error:[/bold red] verify --engine {name} failed while running ({why}); the "
                          "other reports were saved (-v for the traceback)", soft_wrap=True)
    if interrupted:
        exit_interrupted(f"interrupted: {len(reports)} report(s) saved above; a verdict covers only the prompts "
                         f"whose runs were complete ({reports[-1].prompts_done} in the last)")
    verdicts = {rep.verdict for rep in reports}
    exit_with(2 if failed else 1 if vf.NOT_LOSSLESS in verdicts else 3 if vf.INCONCLUSIVE in verdicts else code)


ENDPOINT_RUNS = 300  # --endpoint: completions per prompt and server unless --samples says


def _verify_endpoints(ctx: typer.Context, values: list[str], target: str | None, prompt_list: list[str],
                      samples: int | None, depth: int, params, significance: float, effect: float,
                      json_out: Path | None) -> None:
    """``verify --endpoint``: each SSp server's completions against the RSp server's (``verify_endpoint``)."""
    from lssp.cli.loaders import endpoints_and_tokenizer
    from lssp.engines.endpoint import parse_endpoints, remote_environment
    from lssp.measure import verify as vf
    from lssp.measure.verify_endpoint import verify_endpoints

    refuse_beside_endpoints(ctx, {"draft": "DRAFT", "draft_option": "--draft", "k": "--k", "lookup": "--lookup",
                                  "engine": "--engine", "two_sample": "--two-sample", "batch": "--batch",
                                  "time_budget": "--time-budget", "max_new_tokens": "--max-new-tokens",
                                  "tie_tolerance": "--tie-tolerance"})
    if params.greedy:
        raise UserError("verify --endpoint tests the law at a temperature above 0 (--temperature 0.7); greedy "
                        "outputs beside RSp's show in `latency --endpoint` (same_as_rsp) and `load --endpoint`")
    _check_numbers(len(prompt_list), samples, depth, 64, 1, 1.0, significance, effect, 0, [1])
    s = settings(ctx)
    parse_endpoints(values)  # a malformed --endpoint: one line before anything is read
    results = s.writable_results_dir(json_out)
    t, endpoints = endpoints_and_tokenizer(s, target, values)
    info = RunInfo.here("cpu")
    info.env = remote_environment(info.env, endpoints)
    runs = samples or ENDPOINT_RUNS
    with progress(len(prompt_list) * len(endpoints), "verify") as tick:
        audits = verify_endpoints(endpoints, [t.encode(p)[0].tolist() for p in prompt_list],
                                  lambda text: t.tokenizer(text, add_special_tokens=False).input_ids, params, runs,
                                  depth, s.seed, significance, effect, tick)
    for audit in audits:
        _render_endpoint(audit, runs)
    rows = [r for a in audits for r in a.rows({**info.head(), **info.env})]
    summary = {**info.head(), **params.as_dict(), "depth": depth, "runs": runs, "significance": significance,
               "effect": effect, "prompts": len(prompt_list), "env": info.env,
               "audits": [{"endpoint": a.label, "url": a.url, "verdict": a.verdict, "underpowered": a.underpowered,
                           "runs_needed": a.runs_needed, "failed_requests": a.failed_requests,
                           "checks": [row for row in rows if row["endpoint"] == a.label]} for a in audits]}
    code = save(results, info.run_id, "verify-endpoint", rows, None, json_out, summary,
                f"{info.env['device']} · run {info.run_id}")
    verdicts = {a.verdict for a in audits}
    exit_with(1 if vf.NOT_LOSSLESS in verdicts else 3 if vf.INCONCLUSIVE in verdicts else code)


def _render_endpoint(audit, runs: int) -> None:
    from lssp.measure import verify as vf

    out = table(f"verify --endpoint {audit.label} ({audit.url}) against rsp: {runs} runs per prompt and server, "
                f"{audit.params}", [("prompt", "right"), ("pos", "right"), ("rsp n", "right"), ("ssp n", "right"),
                                    ("cells", "right"), ("p", "right"), ("power", "right")])
    for c in audit.checks:
        out.add_row(str(c.prompt_index + 1), str(c.position), str(c.rsp_samples), str(c.ssp_samples), str(c.cells),
                    fmt(c.p_value, 3), fmt(c.power, 2))
    console.print(out)
    console.print(f"  chi-square homogeneity of the two servers' tokens (the target's tokenizer over each text), at "
                  f"each position among the runs sharing the commonest prefix; level {audit.significance:g} over "
                  f"{plural(len(audit.checks), 'test')} (each at {audit.threshold:.2g}); power against Cohen's w = "
                  f"{audit.effect:g}")
    style = {vf.LOSSLESS: "bold green", vf.NOT_LOSSLESS: "bold red"}.get(audit.verdict, "bold yellow")
    why = "; ".join(audit.underpowered) + (f": --samples {audit.runs_needed} would do" if audit.runs_needed else "")
    console.print(Text(f"{audit.label}: {audit.verdict.upper()}" + (f" ({why})" if why and audit.verdict ==
                                                                    vf.INCONCLUSIVE else ""), style=style))


def _run_audits(s, runners, ks: list[int], t, d, prompt_list: list[str], params, vocab: int, samples: int, depth: int,
                significance: float, max_new_tokens: int, tie_tolerance: float, lookup: int, paired: dict[str, bool],
                effect: float, batch: int) -> tuple[list, dict[str, str]]:
    """Each engine at each K; an engine that breaks down is named in the second result, the others go on."""
    from lssp.measure import verify as vf

    reports: list = []
    steps = len(ks) * sum(len(prompt_list) * (1 if params.greedy else samples // 50 * (1 + paired[r.name]))
                          for r in runners)
    failed: dict[str, str] = {}
    with progress(steps, "verify") as tick:
        for runner, k_now in ((r, k_now) for r in runners for k_now in ks):
            try:
                if params.greedy:
                    rep = vf.verify_greedy(t, d, prompt_list, k_now, max_new_tokens, vocab, tie_tolerance, tick,
                                           lookup, runner)
                else:
                    rep = vf.verify_sampled(t, d, prompt_list, params, k_now, samples, depth, s.seed, vocab,
                                            significance, tick, lookup, runner, paired[runner.name], effect, batch)
            except KeyboardInterrupt:  # outside the sampling loops (which keep their prompts done): stop here
                reports.append(vf.VerifyReport("sampled", significance, "", interrupted=True))
                break
            except Exception as exc:  # noqa: BLE001 - an engine's own failure, reported in one line by the caller
                if s.verbose:
                    raise
                text = str(exc).strip()
                failed[f"{runner.name} K={k_now}"] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                continue
            reports.append(rep)
            if rep.interrupted:
                break
    return reports, failed


def _check_numbers(nb_prompts: int, samples: int | None, depth: int, max_new_tokens: int, batch: int, time_budget: float,
                   significance: float, effect: float, lookup: int, ks: list[int]) -> None:
    """One line for each number a user can get wrong."""
    for name, value in [("--nb-prompts", nb_prompts), ("--samples", samples or 1), ("--depth", depth),
                        ("--max-new-tokens", max_new_tokens), ("--batch", batch)]:
        check_positive(name, value)
    if not time_budget > 0:
        raise UserError(f"--time-budget must be above 0 minutes, got {time_budget:g}")
    if not 0 < significance < 1:
        raise UserError(f"--significance must be in (0, 1), got {significance}")
    if not effect > 0:
        raise UserError(f"--effect must be above 0, got {effect}")
    check_positive("--lookup", lookup, minimum=0)
    check_k_within_budget(ks, max_new_tokens)


def _samples_needed(engines: list[str], paired: dict[str, bool], prompts: int, depth: int, effect: float,
                    significance: float) -> int:
    """The fewest --samples with which any LOSSLESS verdict is possible (checked before loading anything)."""
    from lssp.engines import ENGINES
    from lssp.measure.verify import samples_needed_upfront

    return max(samples_needed_upfront(prompts, depth, paired[name], ENGINES[name].runs_our_weights, effect,
                                      significance) for name in engines)


MAX_SAMPLES = 1000  # the default --samples where the time budget allows it


def _size_to_budget(s, runners, ks: list[int], ids, params, depth: int, lookup: int, paired: dict[str, bool],
                    batch: int, prompts: int, samples: int | None, needed: int, budget_s: float) -> int:
    """Time a pilot of each engine's SSp (and RSp where paired), then say what the audit will take; without
    --samples, as many runs as fit ``budget_s`` (at most MAX_SAMPLES, at least ``needed``)."""
    from lssp.engines import Mode
    from lssp.measure.verify import seconds_per_run

    per_sample = 0.0  # seconds per run per prompt, over every engine and K (and the paired RSp runs)
    for runner in runners:
        try:
            for k in ks:
                per_sample += seconds_per_run(runner, runner.ssp_mode(runner.name, k, lookup), ids, depth + k, params,
                                              s.seed, batch)
            if paired[runner.name]:
                per_sample += len(ks) * seconds_per_run(runner, Mode("rsp", engine=runner.name), ids, depth, params,
                                                        s.seed, batch)
        except Exception:  # noqa: BLE001 - an engine that breaks down: its audit says so, in one line
            if s.verbose:
                raise
    per_sample *= prompts
    chosen = samples if samples is not None else max(needed, min(MAX_SAMPLES, int(budget_s / max(per_sample, 1e-9) + 1e-6)))
    estimate = chosen * per_sample
    budget = f"--time-budget {budget_s / 60:g} min"
    why = ("as asked (--samples)" if samples is not None else
           f"the default, within {budget}" if chosen == MAX_SAMPLES and estimate <= budget_s else
           f"the fewest that give the tests their power, beyond {budget}" if estimate > budget_s else
           f"the most that fit {budget}")
    err_console.print(f"[dim]verify: {chosen} runs per prompt × {plural(prompts, 'prompt')}, {why}: about "
                      f"{_duration(estimate)} here (a pilot: {1000 * per_sample / prompts:.0f} ms per run over every "
                      f"engine and K)[/dim]", soft_wrap=True)
    return chosen


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _engines(s, names: list[str], t, d, vocab: int, target: str | None, draft: str | None, ks: list[int],
             lookup: int) -> list:
    """The engines to audit, in the order given, all started before anything runs."""
    from lssp.cli.loaders import start_engine

    runners = []
    for name in names:
        check_ssp("verify", name, ks, lookup)
    for name in names:
        runner = start_engine(s, name, [(0, 0)] + [(k, lookup) for k in ks], target, draft, loaded=(t, [d], [vocab]))[2]
        for k in ks:
            why = runner.supports(runner.ssp_mode(name, k, lookup))
            if why:
                raise UserError(f"verify --engine {name}: {why}")
        runners.append(runner)
    return runners


def render(rep, t, d, params) -> None:
    title = f"verify {rep.engine}: {t.name} with draft {d.name}, K={k_label(rep.k, 0, rep.lookup, rep.ngram)}, {params}"
    if rep.mode == "greedy":
        _render_greedy(rep, title)
    else:
        _render_sampled(rep, title)
        _render_impossible(rep, t)
    if rep.lookup:
        console.print(f"  the context lookup proposed {rep.looked_up} drafts")
    if rep.stopped_early:
        console.print(f"  stopped early: {rep.stopped_early}")
    style = {"lossless": "bold green", "not lossless": "bold red", "inconclusive": "bold yellow"}[rep.verdict]
    line = Text(f"  verdict ({rep.engine}, K={rep.k}): ") + Text(rep.verdict.upper(), style=style)
    if rep.verdict == "lossless" and rep.mode == "sampled":
        line += Text(f": no deviation the tests could see (they had {POWER:.0%} power against w = {rep.effect:g})")
    if rep.verdict == "inconclusive":
        line += Text(f": every test passed, but {'; '.join(rep.underpowered)}"
                     + (f"; --samples {rep.runs_needed} or more would do" if rep.runs_needed else "; raise --samples"))
    console.print(line)


def _render_impossible(rep, t) -> None:
    """Each draw the target cannot make, apart from the χ² (one such draw is a bug whatever the test says)."""
    for c in rep.impossible:
        tokens = ", ".join(f"{token} ({t.decode([token])!r})" for token in c.impossible_tokens)
        console.print(f"  [bold red]impossible draw:[/bold red] prompt {c.prompt_index + 1} position {c.position}: "
                      f"token {tokens}, {c.impossible_draws} of {c.samples} draws, has probability 0 in the target's "
                      "law after the same temperature, top-k and top-p")


def _render_greedy(rep, title: str) -> None:
    compared = any(g.same_as_ours is not None for g in rep.greedy)
    out = table(title, [(c, "right") for c in ("prompt", "identical", "first diff", "top-2 gap", "near-tie")
                        + (("RSp = ours",) if compared else ())])
    for g in rep.greedy:
        out.add_row(str(g.prompt_index + 1), "yes" if g.identical else "no",
                    "–" if g.identical else str(g.first_difference),
                    "–" if g.top2_gap is None else f"{g.top2_gap:.4f}", "yes" if g.near_tie else "–",
                    *(("yes" if g.same_as_ours else "no",) if compared else ()))
    console.print(out)
    console.print(f"  identical continuations: {rep.identical_share:.0%} of prompts; a difference at a top-2 gap ≤ "
                  f"{rep.tie_tolerance}, or within two units in the last place of the logits' dtype, is a numerical "
                  "near-tie (a 1-token and a K+1-token forward round differently), not a bug")
    if compared:
        console.print(f"  RSp = ours: {rep.engine}'s plain greedy tokens equal ours (for reference: equal only where "
                      "both compute in the same precision)")


def _render_sampled(rep, title: str) -> None:
    paired = any(c.two_sample_p == c.two_sample_p for c in rep.positions)
    out = table(title + "; χ² p: against the exact law" + ("; vs RSp: against the engine's own RSp tokens"
                                                            if paired else "")
                + "; TV noise: mean±sd of TV under sampling noise alone; α: exact Σ min(p, q); power: to see a "
                f"deviation w={rep.effect:g}",
                [(c, "right") for c in ("prompt", "pos", "n", "χ² p", "vs RSp" if paired else "cells", "TV",
                                        "TV noise", "α", "power", "ok")])
    for c in rep.positions:
        out.add_row(str(c.prompt_index + 1), str(c.position), str(c.samples), f"{c.chi2_p_value:.3g}",
                    fmt(c.two_sample_p, 3) if paired else str(c.chi2_cells), f"{c.tv:.3f}",
                    f"{c.tv_null_mean:.3f}±{c.tv_null_sd:.3f}", f"{c.exact_alpha:.2f}", fmt(c.power, 2),
                    Text("✓", style="green") if c.passed else Text("✗", style="bold red"))
    console.print(out)
    for note in rep.skipped:
        console.print(f"  [dim]skipped {note} (fewer than 20; raise --samples)[/dim]")
    if not rep.exact_law_counts:
        console.print(f"  {rep.engine} computes with its own copy of the weights: χ² p against our exact law is "
                      "shown for reference; the verdict rests on the test against its own RSp")
    console.print(f"  measured acceptance {fmt(rep.acceptance_rate, 1, pct=True)}; each test rejects at p < "
                  f"{rep.threshold:.2g} ({rep.significance} family-wise, {rep.correction})")
    tested = [c for c in rep.positions if not c.passed and (c.two_sample_p <= rep.threshold or (
        rep.exact_law_counts and c.chi2_p_value <= rep.threshold))]  # failed a test (impossible draws: below)
    worst = sorted(tested, key=lambda c: c.tv - c.tv_null_mean, reverse=True)
    for c in worst[:3]:
        console.print(f"  [red]deviates:[/red] prompt {c.prompt_index + 1} position {c.position}: total-variation "
                      f"distance {c.tv:.2f} where noise gives {c.tv_null_mean:.2f}±{c.tv_null_sd:.2f}")
