"""`bench`: ours vs transformers — RSp vs generate(), SSp vs assisted generation — and vs rival engines that run
their own RSp and SSp (vLLM, llama.cpp), in one run."""
from __future__ import annotations

import math
from typing import Annotated, Optional

import typer
from rich.measure import Measurement
from rich.table import Table

from lssp.cli.app import app, settings
from lssp.cli.loaders import check_ready, heads_run, load_pair, start_engine
from lssp.cli.options import (
    ConfidenceOpt,
    DraftAlsoOpt,
    DraftArg,
    JsonOpt,
    KOpt,
    MaxNewOpt,
    NbPromptsOpt,
    PromptsOpt,
    TargetArg,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_k_within_budget,
    check_positive,
    one_draft,
    parse_engines,
    parse_fractions,
    read_prompt_list,
    sampling_params,
)
from lssp.cli.output import console, exit_interrupted, exit_with, fmt, save, say_busy, table
from lssp.cli.progress import progress
from lssp.engines import engine_class
from lssp.errors import UserError
from lssp.report.results import plural


@app.command()
def bench(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    draft_option: DraftAlsoOpt = None,
    k: KOpt = None,
    max_new_tokens: MaxNewOpt = 64,
    prompts: PromptsOpt = None,
    nb_prompts: NbPromptsOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    alpha: Annotated[Optional[str], typer.Option(help="Acceptance rates to predict the speedup for: 0.6,0.7,0.8.")] = None,
    draft_confidence: ConfidenceOpt = "0",
    engine: Annotated[str, typer.Option("--engine", help="Rivals of ours: hf (transformers), vllm, llamacpp, or a "
                                        "comma list such as hf,vllm,llamacpp.")] = "hf",
    json_out: JsonOpt = None,
) -> None:
    """Ours vs transformers (RSp vs generate(), SSp vs assisted generation), vLLM or llama.cpp: same prompts, one run."""
    draft = one_draft(draft, draft_option)
    from lssp.engines import Mode
    from lssp.measure.bench import RIVALS, engines_for, run_bench
    from lssp.workloads.prompts import WARMUP_PROMPT

    s = settings(ctx)
    rivals = parse_engines(engine, ("hf", *RIVALS))
    draft = s.registry.draft_name(draft, heads_run(rivals))  # ours and its rivals draft with the same model
    k = s.registry.draft_k(draft) if k is None else k
    check_positive("--k", k)
    check_k_within_budget(k, max_new_tokens)
    alphas = parse_fractions("--alpha", alpha) if alpha else []
    confidences = parse_fractions("--draft-confidence", draft_confidence)
    if len(confidences) != 1:
        raise UserError(f"bench takes one --draft-confidence, got {draft_confidence!r}")
    engines = engines_for(rivals)
    check_ready(rivals, confidences)  # not installed or built, or an option one lacks: said first
    prompt_list = read_prompt_list(prompts, nb_prompts)
    params = sampling_params(temperature, top_k, top_p)
    results = s.writable_results_dir(json_out)
    t, d, vocab = load_pair(s, target, draft)
    keys = [(0, 0), (k, 0)]  # RSp, and SSp with the draft at K: every rival's engines started before anything is timed
    for name in rivals:  # a rival that runs the models loaded here: refused in one line if it cannot run the draft
        if engine_class(name).runs_our_weights:
            why = start_engine(s, name, keys, target, draft, loaded=(t, [d], [vocab]))[2].supports(
                Mode("ssp", k, engine=name))
            if why:
                raise UserError(f"--engine {name} with {d.name!r}: {why}; use --engine vllm or llamacpp as its rival")
    started = {name: start_engine(s, name, keys, target, draft)[2] for name in rivals
               if not engine_class(name).runs_our_weights}  # servers stop when the command ends, however it ends
    with progress(None, "bench") as tick:
        run = run_bench(t, d, prompt_list, WARMUP_PROMPT, k, params, max_new_tokens, s.seed, vocab, engines=engines,
                        progress=tick, confidence=confidences[0], measure_bandwidth=True, rivals=started)
    render(run, alphas, t.spec.is_random or d.spec.is_random)
    rows = run.rows()
    code = save(results, run.info.run_id, "bench", rows, run.markdown(), json_out, rows,
                f"{run.info.env['device']} · run {run.info.run_id}")
    if run.failure:
        raise UserError(f"{run.failure}; the table and files cover the {plural(run.setup.prompts, 'prompt')} "
                        "every engine completed before")
    if run.interrupted:
        exit_interrupted(f"interrupted after {plural(run.setup.prompts, 'prompt')}: the table and files cover them")
    exit_with(code)


# Per rival engine (lssp.measure.bench.RIVALS): its name in words, its SSp method, where its ms/token comes from.
RIVAL_WORDS = {"vllm": ("vLLM", "draft_model", "its request timestamps"),
               "llamacpp": ("llama.cpp", "draft-simple, one llama-server per mode", "llama-server's timings")}


def render(run, alphas: list[float], random_weights: bool) -> None:
    from lssp.measure.latency import NOISY_SPREAD
    from lssp.report.stats import predicted_speedup

    rivals = run.compared()
    out = bench_table(run, rivals, ranged=True)
    ranged = bool(rivals) and Measurement.get(console, console.options.update_width(1000), out).maximum <= console.width
    if not ranged:  # ours ÷ a rival's [min–max] only where it fits (80 columns)
        out = bench_table(run, rivals, ranged=False)
    console.print(out)
    console.print(("  ours÷it: our time ÷ this engine's in the same mode (RSp, SSp), per prompt: geometric mean"
                   + (" \\[its 95% t interval]" if ranged else "") + "; " if rivals else "  ")
                  + "= ours-rsp: share of prompts whose tokens equal our RSp's")
    for name, figures in run.rivals.items():
        words, method, timing = RIVAL_WORDS[name]
        console.print(f"  {words} {figures.version} SSp ({method}): α = {fmt(figures.alpha, 2)} (accepted/drafted "
                      f"{fmt(figures.acceptance_rate, 1, pct=True)}); its tokens equal its RSp's on "
                      f"{fmt(figures.agreement, 0, pct=True)} of prompts; its ms/token from {timing}, first token to last")
    rsp_ms = next(x.ms_per_token for x in run.summaries if x.engine == "ours-rsp")
    console.print(f"  our SSp: {run.ssp_overhead_share:.1%} of decode time outside the two models' forwards; α = "
                  f"{run.alpha:.2f} (accepted/drafted {run.acceptance_rate:.1%}); c = {run.cost_ratio:.3f}; speedup over "
                  f"our RSp {run.measured_speedup:.2f}× measured (per prompt {_ratio_text(run.ssp_speedup)}), "
                  f"{run.predicted_speedup:.2f}× predicted by "
                  f"(1−α^(K+1))/((1−α)(Kc+1)), {run.predicted_speedup_v:.2f}× with the measured cost of a (K+1)-token "
                  f"verification, v = {run.verify_ratio:.2f} 1-token forwards: (1−α^(K+1))/((1−α)(Kc+v))")
    console.print(f"  {run.floor_words()} ÷ copy bandwidth {run.bandwidth / 1e9:.1f} "
                  f"GB/s = floor {run.floor_ms:.2f} ms/token; ours-rsp is {rsp_ms / run.floor_ms:.2f}× the floor")
    if run.timing_fallbacks:
        console.print(f"[yellow]  ms/token of {plural(run.timing_fallbacks, 'completion')} is whole completion ÷ "
                      "tokens (timing_basis)[/yellow]")
    say_busy(run.others_cpu_share)
    if run.noise_spread > NOISY_SPREAD:
        console.print(f"[bold yellow]  busy machine: a completion took {run.noise_spread:.1f}× its engine's and its "
                      f"prompt's typical time per iteration (a quiet machine stays under {NOISY_SPREAD}×): these ratios are "
                      "unreliable[/bold yellow]")
    if alphas:
        ks = [1, 2, 3, 4, 6, 8]
        predicted = table(f"Predicted SSp speedup for c = {run.cost_ratio:.3f}, v = 1",
                          [("α", "left"), *((f"K={kk}", "right") for kk in ks)])
        for a in alphas:
            predicted.add_row(f"{a:g}", *[f"{predicted_speedup(a, kk, run.cost_ratio):.2f}×" for kk in ks])
        console.print(predicted)
    if random_weights:
        console.print("[yellow]  Random weights: timings and c are real; acceptance and measured speedup mean nothing."
                      "[/yellow]")


def bench_table(run, rivals: list[str], ranged: bool) -> Table:
    """One row per engine: ms/token, ours ÷ it on rivals' rows (with its 95% interval if ``ranged``), = ours-rsp."""
    setup = run.setup
    spread = " \\[min–max]"  # escaped: rich would read "[min–max]" as a style tag and drop it
    out = table(f"{setup.target} + {setup.draft}, K={run.k}, {plural(setup.prompts, 'prompt')} × {setup.max_new_tokens} tokens, "
                f"T={setup.params.temperature:g}",
                [("engine", "left"), *((c, "right") for c in ("ms/token", "median" + spread,
                                                           *(["ours÷it" + (" \\[95%]" if ranged else "")] if rivals else []),
                                                           "= ours-rsp"))],
                keep_whole=("engine",))
    for x in run.summaries:
        agree = run.greedy_agreement.get(x.engine)
        out.add_row(x.engine, f"{x.ms_per_token:.1f}",
                    f"{x.ms_per_token_median:.1f} [{x.ms_per_token_min:.1f}–{x.ms_per_token_max:.1f}]",
                    *([ours_over(run, x.engine, ranged)] if rivals else []), "–" if agree is None else f"{agree:.0%}")
    return out


def ours_over(run, engine: str, ranged: bool) -> str:
    """On a rival's row: ours ÷ it in the same mode, per prompt (geometric mean, [its 95% interval] if ``ranged``);
    "–" elsewhere."""
    from lssp.measure.bench import LABELS

    owner, mode = LABELS[engine]
    ratio = next((x for x in run.summaries if x.engine == f"ours-{mode}"), None)
    ratio = ratio.rival_ratio(owner) if ratio is not None else None
    if ratio is None or math.isnan(ratio.mean):
        return "–"
    return _ratio_text(ratio) if ranged else f"{ratio.mean:.2f}"


def _ratio_text(ratio) -> str:
    """A per-prompt ratio as "1.23× [1.10–1.38]" (geometric mean, 95% t interval; no bounds under two prompts)."""
    bounds = f" [{ratio.low:.2f}–{ratio.high:.2f}]" if ratio.low == ratio.low else ""
    return f"{ratio.mean:.2f}×{bounds}"
