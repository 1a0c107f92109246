"""The llamassp command line: parse, call the library, render. No measurement logic here."""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from lssp import report
from lssp.errors import UserError
from lssp.registry import Registry, load_registry
from lssp.sampling import SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure speculative sampling (SSp) against regular sampling (RSp).")
console = Console(highlight=False, width=None if sys.stdout.isatty() else 130)
log = logging.getLogger("lssp")


@dataclass
class Settings:
    config: Path
    results_dir: Path
    seed: int
    verbose: bool
    device: str | None
    _registry: Registry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = load_registry(self.config)
        return self._registry


def settings(ctx: typer.Context) -> Settings:
    return ctx.find_root().obj


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(help="Model registry.")] = Path("models.yaml"),
    results_dir: Annotated[Path, typer.Option(help="Where CSV, Markdown and JSON results go.")] = Path("results"),
    seed: Annotated[int, typer.Option(help="Seed for sampling and prompt draws.")] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress; show tracebacks.")] = False,
    device: Annotated[Optional[str], typer.Option(help="Override placement: cpu, cuda, cuda:1, auto.")] = None,
) -> None:
    """Global options come before the subcommand: llamassp.py --seed 1 latency ..."""
    ctx.obj = Settings(config, results_dir, seed, verbose, device)
    _configure_logging(verbose)


def _configure_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_path=False)], force=True)
    import transformers

    transformers.logging.set_verbosity_info() if verbose else transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- shared option types -------------------------------------------------------------------
KOpt = Annotated[int, typer.Option("--k", help="Draft tokens per iteration.")]
ConfidenceOpt = Annotated[str, typer.Option(
    "--draft-confidence", help="Stop drafting once the draft's own probability of its token falls below this "
    "(K becomes a maximum; a comma list sweeps; 0: always K).")]
LookupOpt = Annotated[int, typer.Option(
    "--lookup", help="Context lookup: where the text's last N tokens occurred before and the draft is unsure, "
    "propose what followed them (0: off).")]
MaxNewOpt = Annotated[int, typer.Option(help="Tokens to generate per prompt.")]
TopKOpt = Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass (1: off).")]
TemperatureOpt = Annotated[float, typer.Option(help="0 is greedy.")]
TargetArg = Annotated[Optional[str], typer.Argument(help="Target model (default: the registry's default_target).")]
DraftArg = Annotated[Optional[str], typer.Argument(help="Draft model (default: the registry's default_draft).")]
PromptsOpt = Annotated[Optional[Path], typer.Option(help="File with one prompt per line.")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the run's summary as JSON here.")]
PlotOpt = Annotated[bool, typer.Option(help="Draw this run's charts into the results directory.")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="Feed each prompt as a user turn in the target's chat template.")]


def _params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}")


def _parse_ints(name: str, text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{name} takes whole numbers separated by commas, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise UserError(f"{name} values must be at least {minimum}, got {text!r}")
    return values



def _load(s: Settings, name: str):
    from lssp.loading import load_model

    spec = s.registry.get(name)
    with console.status(f"Loading {name} ({spec.path or 'random init'})…"):
        loaded = load_model(spec, s.device)
    log.info("%s: %s on %s, %.1f MB", name, loaded.precision, loaded.device, loaded.weight_bytes / 1e6)
    return loaded


def _load_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    from lssp.loading import check_compatible

    t_name = s.registry.target_name(target_name)
    d_name = s.registry.draft_name(draft_name) if (draft_name or need_draft) else None
    target = _load(s, t_name)
    if d_name is None:
        return target, None, None
    draft = _load(s, d_name)
    return target, draft, check_compatible(target, draft)


def _read_prompt_list(prompts_file: Path | None, nb_prompts: int | None) -> list[str]:
    from lssp.prompts import LATENCY_PROMPTS, read_prompts

    prompts = read_prompts(prompts_file) if prompts_file else list(LATENCY_PROMPTS)
    if nb_prompts is not None:
        _check_positive("--nb-prompts", nb_prompts)
        prompts = prompts[:nb_prompts]
    return prompts


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _fmt(value: float, digits: int = 1, pct: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{100 * value:.{digits}f}%" if pct else f"{value:.{digits}f}"


# --- models ----------------------------------------------------------------------------------
@app.command("models")
def models_cmd(ctx: typer.Context) -> None:
    """List the registry: name, source, precision, placement, and whether it is on disk."""
    reg = settings(ctx).registry
    table = Table(title=f"Models in {reg.source}")
    for col in ("name", "path", "dtype", "quant", "placement", "local"):
        table.add_column(col)
    for spec in reg.models.values():
        tag = " (default target)" if spec.name == reg.default_target else " (default draft)" if spec.name == reg.default_draft else ""
        placement = spec.device_map or "auto"
        if spec.gpus:
            placement += f", {spec.gpus} GPUs"
        if spec.max_memory:
            placement += f", max_memory {spec.max_memory}"
        source = f"random init: {spec.config if isinstance(spec.config, str) else 'custom config'}" if spec.is_random else spec.path
        local = spec.available_locally()
        table.add_row(spec.name + tag, source, spec.dtype, spec.quantization, placement,
                      Text("yes", style="green") if local else Text("no", style="dim"))
    console.print(table)


# --- latency ---------------------------------------------------------------------------------
@app.command()
def latency(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft model; times SSp (and RSp unless --no-baseline).")] = None,
    default_pair: Annotated[bool, typer.Option("--default-pair", help="Use the registry's default draft too.")] = False,
    k: Annotated[str, typer.Option("--k", help="Draft length, or a comma list to sweep: 2,4,8.")] = "4",
    max_new_tokens: MaxNewOpt = 64,
    prompts: PromptsOpt = None,
    nb_prompts: Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")] = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip timing RSp.")] = False,
    draft_confidence: ConfidenceOpt = "0",
    lookup: Annotated[str, typer.Option(
        "--lookup", help="Context lookup n-gram length for SSp, or a comma list to sweep: 0,4 (0: off).")] = "0",
    chat: ChatOpt = False,
    json_out: JsonOpt = None,
    plot: PlotOpt = False,
) -> None:
    """ms/token of RSp and SSp on a fixed prompt list, measured side by side in one run."""
    from lssp.latency import run_latency
    from lssp.prompts import WARMUP_PROMPT

    s = settings(ctx)
    ks = _parse_ints("--k", k)
    confidences = _parse_floats("--draft-confidence", draft_confidence)
    lookups = _parse_ints("--lookup", lookup, minimum=0)
    _check_positive("--max-new-tokens", max_new_tokens)
    prompt_list = _read_prompt_list(prompts, nb_prompts)
    params = _params(temperature, top_k, top_p)
    use_draft = draft is not None or default_pair or target is None
    t, d, vocab = _load_pair(s, target, draft, need_draft=use_draft)
    modes = (0 if no_baseline and d is not None else 1) + (len(ks) * len(confidences) * len(lookups) if d else 0)
    with _progress() as bar:
        task = bar.add_task("timing", total=modes * (len(prompt_list) + 1))
        run = run_latency(t, d, prompt_list, WARMUP_PROMPT, ks, params, max_new_tokens, s.seed,
                          baseline=not no_baseline, vocab_size=vocab,
                          progress=lambda msg: bar.update(task, advance=1, description=msg), confidences=confidences,
                          chat=chat, lookups=lookups)
    run_id = report.new_run_id()
    env = report.environment(t.device)
    rows = []
    for m in run.summaries:
        row = {"timestamp": report.timestamp(), "run_id": run_id, "mode": m.mode, "target": t.name,
               "draft": d.name if d and m.mode == "ssp" else "", "k": m.k, **params.as_dict(),
               "max_new_tokens": max_new_tokens, "prompt_format": "chat" if chat else "raw",
               **{k_: v for k_, v in asdict(m).items() if k_ not in ("mode", "k")},
               "acceptance_by_position": ";".join(f"{x:.4f}" for x in m.acceptance_by_position),
               "target_precision": t.precision, "draft_precision": d.precision if d else "", **env}
        rows.append(row)
    report.append_csv(s.results_dir / "latency.csv", rows)
    report.append_csv(s.results_dir / "latency_prompts.csv", [
        {"run_id": run_id, "mode": p.mode, "k": p.k, "confidence": p.confidence, "lookup": p.lookup,
         "prompt_index": p.prompt_index,
         "new_tokens": p.stats.new_tokens,
         "ms_per_token": p.stats.ms_per_token, "ttft_ms": 1000 * p.stats.ttft_s,
         "acceptance_rate": p.stats.acceptance_rate, "target": t.name, "draft": d.name if d else ""}
        for p in run.timings])
    md_cols = ["mode", "k", *(["confidence"] if any(confidences) else []), *(["lookup"] if any(lookups) else []), "ms_per_token", "ms_per_token_median",
               "ms_per_token_min", "ms_per_token_max", "ttft_ms", "acceptance_rate", "alpha", "mean_accepted", "speedup"]
    md = (f"# latency run {run_id}\n\ntarget `{t.name}` ({t.precision}), draft `{d.name if d else '-'}`, "
          f"{len(prompt_list)} prompts{' in the chat template' if chat else ''} x {max_new_tokens} new tokens, "
          f"{params}\n\n{env['device']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, commit {env['git_commit']}\n\n" + report.markdown_table(rows, md_cols))
    (s.results_dir / f"latency-{run_id}.md").write_text(md)
    if json_out:
        report.write_json(json_out, [{
            "mode": m.mode, "target": t.name, "draft": r["draft"] or None, "k": m.k, "confidence": m.confidence,
            "lookup": m.lookup, "lookup_acceptance": m.lookup_acceptance, "ms_per_token": m.ms_per_token,
            "ttft_ms": m.ttft_ms, "acceptance_rate": m.acceptance_rate, "alpha": m.alpha, "mean_accepted": m.mean_accepted,
            "speedup": m.speedup, "ms_per_token_median": m.ms_per_token_median,
            "acceptance_by_position": [round(x, 4) for x in m.acceptance_by_position], "run_id": run_id,
            "device": env["device"]} for m, r in zip(run.summaries, rows)])
    _render_latency(run, t, d, params, len(prompt_list), max_new_tokens, env, run_id, s.results_dir, chat)
    if plot:
        _plot(s, run_id=run_id, kinds=("latency",))


def _k_label(k: int, confidence: float, lookup: int = 0) -> str:
    """K, or "≤K p≥0.4" where drafting stops early below a draft probability; "+lookup N" with the context lookup."""
    return (f"≤{k} p≥{confidence:g}" if confidence else str(k)) + (f" +lookup {lookup}" if lookup else "")


def _render_latency(run, t, d, params, n_prompts, max_new_tokens, env, run_id, results_dir, chat=False) -> None:
    table = Table(title=f"{t.name}" + (f" with draft {d.name}" if d else "") +
                  f" — {n_prompts} prompts{' (chat template)' if chat else ''} × {max_new_tokens} tokens, "
                  f"T={params.temperature:g}"
                  + (f", top-k {params.top_k}" if params.top_k else "") + (f", top-p {params.top_p:g}" if params.top_p < 1 else ""))
    for col, justify in [("mode", "left"), ("K", "right"), ("ms/token", "right"), ("median \\[min–max]", "right"),
                         ("TTFT ms", "right"), ("accepted/drafted", "right"), ("α", "right"), ("tokens/fwd", "right"),
                         ("draft/target/other", "right"), ("speedup", "right")]:
        table.add_column(col, justify=justify)
    for m in run.summaries:
        split = f"{m.draft_share:.0%}/{m.target_share:.0%}/{m.other_share:.0%}"
        table.add_row(
            m.mode.upper() + (" ★" if m.best and len([x for x in run.summaries if x.mode == "ssp"]) > 1 else ""),
            _k_label(m.k, m.confidence, m.lookup) if m.mode == "ssp" else "–", f"{m.ms_per_token:.1f}",
            f"{m.ms_per_token_median:.1f} [{m.ms_per_token_min:.1f}–{m.ms_per_token_max:.1f}]", f"{m.ttft_ms:.0f}",
            _fmt(m.acceptance_rate, 0, pct=True), _fmt(m.alpha, 2), _fmt(m.mean_accepted, 2), split,
            Text(f"{m.speedup:.2f}×", style="bold green" if m.speedup > 1 else "bold red") if not math.isnan(m.speedup) else "–",
            style="bold" if m.best else None)
    console.print(table)
    for m in run.summaries:
        if m.mode == "ssp":
            console.print(f"  share of iterations accepting draft i (K={_k_label(m.k, m.confidence, m.lookup)}): " +
                          " ".join(f"{i + 1}:{_fmt(x, 0, pct=True)}" for i, x in enumerate(m.acceptance_by_position)))
            if m.lookup:
                console.print(f"    the lookup proposed {_fmt(m.lookup_share, 0, pct=True)} of drafts, "
                              f"{_fmt(m.lookup_acceptance, 0, pct=True)} of them accepted")
    c = run.cost_ratio
    if not math.isnan(c):
        console.print(f"  draft/target cost ratio c = {c:.3f} (draft ms per forward ÷ target ms per 1-token forward)")
    if t.spec.is_random or (d is not None and d.spec.is_random):
        console.print("[yellow]  Random weights: timings are real, acceptance figures mean nothing.[/yellow]")
    console.print(f"[dim]{env['device']} · torch {env['torch']} · transformers {env['transformers']} · "
                  f"commit {env['git_commit']} · run {run_id} → {results_dir}/latency.csv[/dim]")


# --- eval ------------------------------------------------------------------------------------
@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: Annotated[Optional[str], typer.Option(help="Draft model: evaluate SSp.")] = None,
    both: Annotated[bool, typer.Option("--both", help="Evaluate RSp and SSp on the same prompts and compare.")] = False,
    nb_prompts: Annotated[int, typer.Option(help="Number of multiplication problems.")] = 1000,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = 8,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the newest interrupted run with the same settings.")] = False,
    lookup: LookupOpt = 0,
    json_out: JsonOpt = None,
    plot: PlotOpt = False,
) -> None:
    """Multiplication accuracy ("a * b = ", a and b uniform in 1..99) with 95% intervals."""
    from lssp.evals import run_eval

    s = settings(ctx)
    _check_positive("--nb-prompts", nb_prompts)
    _check_positive("--k", k)
    _check_positive("--max-new-tokens", max_new_tokens)
    _check_positive("--lookup", lookup, minimum=0)
    params = _params(temperature, top_k, top_p)
    if target is None and draft is None:  # the default pair
        draft = s.registry.draft_name(None)
    if both and draft is None:
        draft = s.registry.draft_name(None)
    modes = ["rsp", "ssp"] if both else ["ssp"] if draft else ["rsp"]
    t, d, vocab = _load_pair(s, target, draft, need_draft=draft is not None)
    config = {"target": t.name, "draft": d.name if d else None, "modes": modes, "nb_prompts": nb_prompts, "seed": s.seed,
              "k": k, "max_new_tokens": max_new_tokens, **params.as_dict(), **({"lookup": lookup} if lookup else {})}
    run_id = report.new_run_id()
    with _progress() as bar:
        task = bar.add_task("eval", total=nb_prompts * len(modes))
        correct = {m: 0 for m in modes}

        def on_record(r) -> None:
            correct[r.mode] += r.correct
            bar.update(task, advance=1, description="eval " + " ".join(f"{m.upper()} {c}✓" for m, c in correct.items()))

        run = run_eval(t, d, modes, nb_prompts, s.seed, params, max_new_tokens, k, s.results_dir / "eval_records",
                       run_id, config, resume=resume, vocab_size=vocab, on_record=on_record, lookup=lookup)
    env = report.environment(t.device)
    cmp = run.comparison
    rows = [{"timestamp": report.timestamp(), "run_id": run.run_id, "mode": m.mode, "target": t.name,
             "draft": d.name if d and m.mode == "ssp" else "", "k": k if m.mode == "ssp" else 0,
             "lookup": lookup if m.mode == "ssp" else 0, **params.as_dict(), "max_new_tokens": max_new_tokens, "seed": s.seed, "trials": m.trials, "successes": m.successes,
             "success_rate": m.success_rate, "wald_low": m.wald.low, "wald_high": m.wald.high,
             "wilson_low": m.wilson.low, "wilson_high": m.wilson.high,
             "diff_rsp_minus_ssp": cmp.difference.estimate if cmp else float("nan"),
             "diff_low": cmp.difference.low if cmp else float("nan"), "diff_high": cmp.difference.high if cmp else float("nan"),
             "mcnemar_p": cmp.mcnemar_p if cmp else float("nan"), "records": str(run.records_path),
             "target_precision": t.precision, "draft_precision": d.precision if d else "", **env} for m in run.summaries]
    report.append_csv(s.results_dir / "eval.csv", rows)
    md = (f"# eval run {run.run_id}\n\ntarget `{t.name}`, draft `{d.name if d else '-'}`, {nb_prompts} problems, "
          f"{params}, {env['device']}, commit {env['git_commit']}\n\n" +
          report.markdown_table(rows, ["mode", "trials", "successes", "success_rate", "wald_low", "wald_high",
                                       "wilson_low", "wilson_high", "diff_low", "diff_high", "mcnemar_p"]))
    (s.results_dir / f"eval-{run.run_id}.md").write_text(md)
    if json_out:
        report.write_json(json_out, [{k_: r[k_] for k_ in (
            "mode", "target", "draft", "trials", "successes", "success_rate", "wald_low", "wald_high", "wilson_low",
            "wilson_high", "diff_rsp_minus_ssp", "diff_low", "diff_high", "mcnemar_p", "run_id")} for r in rows])
    table = Table(title=f"Multiplication eval: {t.name}" + (f" (draft {d.name}, K={_k_label(k, 0, lookup)})" if d else "") +
                  f", {nb_prompts} problems, T={params.temperature:g}")
    for col in ("mode", "successes / trials", "success rate", "95% Wald", "95% Wilson"):
        table.add_column(col, justify="right")
    for m in run.summaries:
        table.add_row(m.mode.upper(), f"{m.successes} / {m.trials}", f"{100 * m.success_rate:.1f}%",
                      f"± {50 * (m.wald.high - m.wald.low):.1f} [{100 * m.wald.low:.1f}, {100 * m.wald.high:.1f}]",
                      f"[{100 * m.wilson.low:.1f}, {100 * m.wilson.high:.1f}]")
    console.print(table)
    if cmp:
        verdict = ("[green]contains 0: no evidence that SSp changes quality[/green]" if cmp.difference.contains(0)
                   else "[red]excludes 0: SSp and RSp differ[/red]")
        console.print(f"  RSp − SSp = {100 * cmp.difference.estimate:+.1f} points, 95% CI "
                      f"[{100 * cmp.difference.low:+.1f}, {100 * cmp.difference.high:+.1f}] {verdict}; "
                      f"McNemar p = {cmp.mcnemar_p:.3f} ({cmp.only_rsp} only-RSp vs {cmp.only_ssp} only-SSp correct)")
    if run.resumed:
        console.print(f"  resumed: {run.resumed} records reused from {run.records_path}")
    console.print(f"[dim]{env['device']} · run {run.run_id} → {s.results_dir}/eval.csv, records {run.records_path}[/dim]")
    if plot:
        _plot(s, run_id=run.run_id, kinds=("eval",))


# --- compare ---------------------------------------------------------------------------------
@app.command()
def compare(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt(s); otherwise read from stdin or a > prompt.")] = None,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = 64,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    chat: ChatOpt = False,
    lookup: LookupOpt = 0,
) -> None:
    """Stream RSp then SSp completions of each prompt, with wall times and the speedup."""
    from lssp.generation import generate_regular, generate_speculative
    from lssp.prompts import WARMUP_PROMPT

    s = settings(ctx)
    _check_positive("--k", k)
    _check_positive("--max-new-tokens", max_new_tokens)
    _check_positive("--lookup", lookup, minimum=0)
    params = _params(temperature, top_k, top_p)
    t, d, vocab = _load_pair(s, target, draft)
    import torch

    def run_one(text: str, index: int) -> None:
        ids = t.encode(text, chat=chat)
        console.print(Text(f"\n=> Regular sampling with {t.name}", style="bold"))
        stream = _TokenStream(t.tokenizer, text)
        rsp = generate_regular(t.model, ids, max_new_tokens, params, torch.Generator(t.device).manual_seed(s.seed + index),
                               on_tokens=stream.show)
        rsp_ms = rsp.stats.total_time_s * 1000 / max(1, rsp.stats.new_tokens)
        console.print(Text(f"\n   {rsp.stats.total_time_s:.2f}s, {rsp_ms:.1f} ms/token", style="bold red"))
        console.print(Text(f"=> Speculative sampling with {t.name} helped by {d.name} (K={_k_label(k, 0, lookup)}); ", style="bold")
                      + Text("draft tokens accepted", style="green") + Text(" / ") + Text("made by the target", style="bold blue"))
        stream = _TokenStream(t.tokenizer, text)
        ssp = generate_speculative(t.model, d.model, ids, max_new_tokens, k, params,
                                   torch.Generator(t.device).manual_seed(s.seed + index), vocab_size=vocab, on_tokens=stream.show,
                                   lookup=lookup)
        ssp_ms = ssp.stats.total_time_s * 1000 / max(1, ssp.stats.new_tokens)
        console.print(Text(f"\n   {ssp.stats.total_time_s:.2f}s, {ssp_ms:.1f} ms/token, acceptance "
                           f"{_fmt(ssp.stats.acceptance_rate, 0, pct=True)}, {ssp.stats.tokens_per_target_forward:.2f} tokens "
                           f"per target forward", style="bold green"))
        speedup = rsp_ms / ssp_ms
        console.print(Text(f"   speedup {speedup:.2f}×", style="bold green" if speedup > 1 else "bold red"))

    with console.status("Warming up…"):
        generate_speculative(t.model, d.model, t.encode(WARMUP_PROMPT), 8, k, params, vocab_size=vocab, lookup=lookup)
        generate_regular(t.model, t.encode(WARMUP_PROMPT), 8, params)
    console.print(f"Comparing {t.name} RSp with SSp helped by {d.name}. Ctrl-C or EOF (Ctrl-D) ends.")
    try:
        for index, text in enumerate(_prompt_source(prompt)):
            run_one(text, index)
    except KeyboardInterrupt:
        console.print("\n[dim]interrupted[/dim]")


def _prompt_source(prompts: list[str] | None):
    if prompts:
        yield from prompts
        return
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


class _TokenStream:
    """Prints each new token's text as it arrives, coloured by who produced it."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""
        console.print(Text(prompt, style="dim"), end="")

    def show(self, tokens: list[int], drafted: list[bool]) -> None:
        for token, from_draft in zip(tokens, drafted):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            piece, self.shown = text[len(self.shown):], text
            console.print(Text(piece, style="green" if from_draft else "bold blue"), end="")
        console.file.flush()


# --- distill ---------------------------------------------------------------------------------
@app.command()
def distill(
    ctx: typer.Context,
    target: TargetArg = None,
    out: Annotated[Path, typer.Option(help="Output folder for the draft (and its checkpoints).")] = Path("drafts/draft"),
    hidden_size: Annotated[int, typer.Option(help="Draft width.")] = 256,
    layers: Annotated[int, typer.Option(help="Draft depth.")] = 4,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 768,
    data_tokens: Annotated[int, typer.Option(help="Target tokens to collect.")] = 100_000,
    batch_prompts: Annotated[int, typer.Option(help="Prompts generated together.")] = 16,
    new_tokens: Annotated[int, typer.Option(help="Tokens the target generates per prompt.")] = 96,
    train_minutes: Annotated[float, typer.Option(help="Training time budget.")] = 10.0,
    max_steps: Annotated[int, typer.Option(help="Stop after this many steps (0: time budget only).")] = 0,
    epochs: Annotated[float, typer.Option(help="Passes over the data at most.")] = 4.0,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-3,
    hard_weight: Annotated[float, typer.Option(help="Weight of cross-entropy on the target's argmax (rest: soft top-k).")] = 0.3,
    data_dir: Annotated[Optional[Path], typer.Option(help="Where collected data and checkpoints go (default: OUT/work).")] = None,
    init_draft: Annotated[Optional[Path], typer.Option(help="Go on training this draft (its shape wins over the size options).")] = None,
    head_tokens: Annotated[int, typer.Option(help="Output layer over the target's N most frequent tokens only (0: all).")] = 0,
    on_policy: Annotated[float, typer.Option(help="Share of newly collected shards written by --init-draft and scored by "
                                             "the target in one teacher-forced forward (on-policy data).")] = 0.0,
    repeat_share: Annotated[float, typer.Option(help="Share of newly collected shards the target continues from "
                                                "contexts that repeat a cue of earlier text (teaches the draft to copy).")] = 0.0,
) -> None:
    """Make a small Llama draft for TARGET from its own continuations (resumable)."""
    from lssp import distill as dst
    from lssp.generation import model_device
    from lssp.latency import run_latency
    from lssp.loading import check_compatible, load_model
    from lssp.prompts import LATENCY_PROMPTS, WARMUP_PROMPT
    from lssp.registry import ModelSpec

    s = settings(ctx)
    for name, value in [("--hidden-size", hidden_size), ("--layers", layers), ("--data-tokens", data_tokens),
                        ("--batch-prompts", batch_prompts), ("--new-tokens", new_tokens)]:
        _check_positive(name, value)
    if hidden_size % heads:
        raise UserError(f"--hidden-size {hidden_size} must be a multiple of --heads {heads}")
    if head_tokens < 0:
        raise UserError(f"--head-tokens must be >= 0, got {head_tokens}")
    for name, share in [("--on-policy", on_policy), ("--repeat-share", repeat_share)]:
        if not 0.0 <= share <= 1.0:
            raise UserError(f"{name} must be in [0, 1], got {share}")
    if on_policy and not init_draft:
        raise UserError("--on-policy needs --init-draft: the draft that writes the on-policy data")
    t = _load(s, s.registry.target_name(target))
    if t.tokenizer is None:
        raise UserError(f"model {t.name!r} has no tokenizer to share with a draft")
    cfg = dst.DistillConfig(hidden_size=hidden_size, layers=layers, heads=heads, intermediate_size=intermediate_size,
                            data_tokens=data_tokens, batch_prompts=batch_prompts, new_tokens=new_tokens,
                            train_minutes=train_minutes, max_steps=max_steps, epochs=epochs, lr=lr,
                            hard_weight=hard_weight, seed=s.seed, init_from=str(init_draft) if init_draft else None,
                            head_tokens=head_tokens, on_policy=on_policy, repeat_share=repeat_share)
    work = data_dir or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    rep = dst.DistillReport(target=t.name, config=asdict(cfg))
    if init_draft:
        rep.started_from = dst.earlier_training(init_draft)
    with _progress() as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, fraction: float, message: str) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=1000)
            bar.update(tasks[phase], completed=int(1000 * fraction), description=f"{phase}: {message}")

        # Batched collection and training need the transformers model (a compact forward runs batch 1).
        writer = dst.load_initial_draft(t.hf_model, cfg).to(model_device(t.hf_model)).eval() if on_policy else None
        got = dst.collect(t.hf_model, t.tokenizer, work, cfg, progress, draft=writer)
        rep.data_tokens, rep.collect_seconds = got.tokens, got.seconds
        rep.draft_written_tokens, rep.repeat_tokens = got.draft_tokens, got.repeat_tokens
        model = dst.train(t.hf_model, work, cfg, rep, progress)
    rep.parameters = sum(p.numel() for p in model.parameters())
    command = "python llamassp.py " + " ".join(sys.argv[1:]) if sys.argv and "llamassp" in sys.argv[0] else "llamassp distill …"
    dst.write_draft(model, t.tokenizer, out, rep, command)
    # Measure what the card promises: greedy acceptance on held-out prompts, through the real loader.
    drafted = load_model(ModelSpec(name=out.name, path=str(out.resolve()), dtype="bfloat16"), s.device)
    vocab = check_compatible(t, drafted)
    with console.status("Measuring acceptance on held-out prompts…"):
        run = run_latency(t, drafted, LATENCY_PROMPTS[:4], WARMUP_PROMPT, [4], SamplingParams(0), 32, s.seed,
                          baseline=False, vocab_size=vocab)
    rep.acceptance = {"latency prompts 1-4, greedy, K=4, 32 tokens": run.summaries[0].acceptance_rate}
    dst.write_draft(model, t.tokenizer, out, rep, command)
    console.print(f"Draft written to {out}: {rep.parameters / 1e6:.1f}M parameters, {rep.data_tokens} data tokens, "
                  f"{rep.steps} steps, final loss {rep.final_loss:.3f}, greedy acceptance {run.summaries[0].acceptance_rate:.1%}")


# --- bench -----------------------------------------------------------------------------------
@app.command()
def bench(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = 64,
    prompts: PromptsOpt = None,
    nb_prompts: Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")] = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    alpha: Annotated[Optional[str], typer.Option(help="Acceptance rates to predict the speedup for: 0.6,0.7,0.8.")] = None,
    draft_confidence: ConfidenceOpt = "0",
    json_out: JsonOpt = None,
) -> None:
    """Ours vs transformers: RSp vs generate(), SSp vs assisted generation, same prompts, one run."""
    from lssp.bench import copy_bandwidth, run_bench
    from lssp.prompts import WARMUP_PROMPT
    from lssp.stats import predicted_speedup

    s = settings(ctx)
    _check_positive("--k", k)
    _check_positive("--max-new-tokens", max_new_tokens)
    alphas = _parse_floats("--alpha", alpha) if alpha else []
    confidences = _parse_floats("--draft-confidence", draft_confidence)
    if len(confidences) != 1:
        raise UserError(f"bench takes one --draft-confidence, got {draft_confidence!r}")
    prompt_list = _read_prompt_list(prompts, nb_prompts)
    params = _params(temperature, top_k, top_p)
    t, d, vocab = _load_pair(s, target, draft)
    with _progress() as bar:
        task = bar.add_task("bench", total=4 * (len(prompt_list) + 1))
        run = run_bench(t, d, prompt_list, WARMUP_PROMPT, k, params, max_new_tokens, s.seed, vocab,
                        progress=lambda msg: bar.update(task, advance=1, description=msg), confidence=confidences[0])
    with console.status("Measuring copy bandwidth…"):
        bandwidth = copy_bandwidth(t.device)
    floor_ms = 1000 * t.weight_bytes / bandwidth
    run_id = report.new_run_id()
    env = report.environment(t.device)
    by = {x.engine: x for x in run.summaries}
    measured_speedup = by["ours-rsp"].ms_per_token / by["ours-ssp"].ms_per_token
    predicted = predicted_speedup(run.alpha, k, run.cost_ratio)
    predicted_v = predicted_speedup(run.alpha, k, run.cost_ratio, run.verify_ratio)
    rows = [{"timestamp": report.timestamp(), "run_id": run_id, "engine": x.engine, "target": t.name, "draft": d.name, "k": k,
             "draft_confidence": confidences[0],
             **params.as_dict(), "max_new_tokens": max_new_tokens, "prompts": len(prompt_list),
             "ms_per_token": x.ms_per_token, "ms_per_token_median": x.ms_per_token_median, "ms_per_token_min": x.ms_per_token_min,
             "ms_per_token_max": x.ms_per_token_max, "ours_over_hf_median": x.ratio_median, "ours_over_hf_min": x.ratio_min,
             "ours_over_hf_max": x.ratio_max, "greedy_agreement": run.greedy_agreement.get(x.engine, float("nan")),
             "ssp_overhead_share": run.ssp_overhead_share, "acceptance_rate": run.acceptance_rate, "alpha": run.alpha,
             "cost_ratio": run.cost_ratio,
             "verify_ratio": run.verify_ratio, "ssp_speedup_measured": measured_speedup, "ssp_speedup_predicted": predicted,
             "ssp_speedup_predicted_v": predicted_v,
             "target_weight_bytes": t.weight_bytes, "copy_bandwidth_gbs": bandwidth / 1e9, "bandwidth_floor_ms": floor_ms,
             "target_precision": t.precision, "draft_precision": d.precision, **env} for x in run.summaries]
    report.append_csv(s.results_dir / "bench.csv", rows)
    md_cols = ["engine", "ms_per_token", "ms_per_token_median", "ms_per_token_min", "ms_per_token_max",
               "ours_over_hf_median", "ours_over_hf_min", "ours_over_hf_max", "greedy_agreement"]
    (s.results_dir / f"bench-{run_id}.md").write_text(
        f"# bench run {run_id}\n\ntarget `{t.name}` ({t.precision}), draft `{d.name}`, K={k}, {len(prompt_list)} prompts x "
        f"{max_new_tokens} tokens, {params}\n\n{env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"commit {env['git_commit']}\n\n" + report.markdown_table(rows, md_cols) +
        f"\nour SSp overhead outside forwards: {run.ssp_overhead_share:.1%} of decode time; α {run.alpha:.3f}; "
        f"c = {run.cost_ratio:.3f}; v = {run.verify_ratio:.3f}; SSp speedup measured {measured_speedup:.2f}x, predicted "
        f"{predicted:.2f}x (v = 1), {predicted_v:.2f}x (measured v)\n\n"
        f"target weights {t.weight_bytes / 1e6:.0f} MB, copy bandwidth {bandwidth / 1e9:.1f} GB/s, floor {floor_ms:.2f} ms/token, "
        f"ours-rsp {by['ours-rsp'].ms_per_token / floor_ms:.2f}x the floor\n")
    if json_out:
        report.write_json(json_out, rows)
    table = Table(title=f"{t.name} + {d.name}, K={k}, {len(prompt_list)} prompts × {max_new_tokens} tokens, T={params.temperature:g}")
    for col in ("engine", "ms/token", "median \\[min–max]", "ours ÷ hf (median \\[min–max])", "same tokens as ours-rsp"):
        table.add_column(col, justify="right")
    for x in run.summaries:
        ratio = "–" if math.isnan(x.ratio_median) else f"{x.ratio_median:.2f} [{x.ratio_min:.2f}–{x.ratio_max:.2f}]"
        agree = run.greedy_agreement.get(x.engine)
        table.add_row(x.engine, f"{x.ms_per_token:.1f}", f"{x.ms_per_token_median:.1f} [{x.ms_per_token_min:.1f}–{x.ms_per_token_max:.1f}]",
                      ratio, "–" if agree is None else f"{agree:.0%}")
    console.print(table)
    console.print(f"  our SSp: {run.ssp_overhead_share:.1%} of decode time outside the two models' forwards; α = "
                  f"{run.alpha:.2f} (accepted/drafted {run.acceptance_rate:.1%}); c = {run.cost_ratio:.3f}; speedup over our RSp {measured_speedup:.2f}× measured, "
                  f"{predicted:.2f}× predicted by (1−α^(K+1))/((1−α)(Kc+1)), {predicted_v:.2f}× with the measured cost "
                  f"of a (K+1)-token verification, v = {run.verify_ratio:.2f} 1-token forwards: (1−α^(K+1))/((1−α)(Kc+v))")
    console.print(f"  target weights {t.weight_bytes / 1e6:.0f} MB ÷ copy bandwidth {bandwidth / 1e9:.1f} GB/s = floor "
                  f"{floor_ms:.2f} ms/token; ours-rsp is {by['ours-rsp'].ms_per_token / floor_ms:.2f}× the floor")
    if alphas:
        pt = Table(title=f"Predicted SSp speedup for c = {run.cost_ratio:.3f}, v = 1")
        pt.add_column("α")
        ks = [1, 2, 3, 4, 6, 8]
        for kk in ks:
            pt.add_column(f"K={kk}", justify="right")
        for a in alphas:
            pt.add_row(f"{a:g}", *[f"{predicted_speedup(a, kk, run.cost_ratio):.2f}×" for kk in ks])
        console.print(pt)
    if t.spec.is_random or d.spec.is_random:
        console.print("[yellow]  Random weights: timings and c are real; acceptance and measured speedup mean nothing.[/yellow]")
    console.print(f"[dim]{env['device']} · run {run_id} → {s.results_dir}/bench.csv[/dim]")


def _parse_floats(name: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{name} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not 0 <= v < 1 for v in values):
        raise UserError(f"{name} values must be in [0, 1), got {text!r}")
    return values


# --- cost ------------------------------------------------------------------------------------
@app.command()
def cost(
    ctx: typer.Context,
    models: Annotated[Optional[list[str]], typer.Argument(help="Models to time (default: the default target and draft).")] = None,
    precisions: Annotated[str, typer.Option(help="Float dtypes and CPU dynamic quantizations to compare.")] =
        "bfloat16,float32,dynamic-fp16,dynamic-int8",
    tokens: Annotated[str, typer.Option(help="Tokens fed in one forward (K+1 for a verification).")] = "1,2,3,5",
    forwards: Annotated[Optional[str], typer.Option(help="Time these forwards: transformers,compact (default: each entry's).")] = None,
    context: Annotated[int, typer.Option(help="Tokens already in the KV cache.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed forwards per point (median taken).")] = 15,
    json_out: JsonOpt = None,
) -> None:
    """Forward ms by precision and by tokens per forward: does verifying K drafts cost about one forward here?"""
    from dataclasses import replace

    from lssp.cost import forward_costs
    from lssp.loading import load_model
    from lssp.registry import DTYPES, FORWARDS, QUANTIZATIONS

    s = settings(ctx)
    counts = _parse_ints("--tokens", tokens)
    forward_list = [f.strip() for f in (forwards or "").split(",") if f.strip()]
    if forwards is not None and (not forward_list or any(f not in FORWARDS for f in forward_list)):
        raise UserError(f"--forwards takes some of {','.join(FORWARDS)}, got {forwards!r}")
    _check_positive("--context", context)
    _check_positive("--repeats", repeats)
    chosen = [p.strip() for p in precisions.split(",") if p.strip()]
    allowed = [d for d in DTYPES if d != "auto"] + [q for q in QUANTIZATIONS if q.startswith("dynamic")]
    if not chosen or any(p not in allowed for p in chosen):
        raise UserError(f"--precisions takes some of {','.join(allowed)}, got {precisions!r}")
    names = models or [s.registry.target_name(None), s.registry.draft_name(None)]
    loaded = []
    for name in names:
        spec = replace(s.registry.get(name), quantization="none")  # each precision is made from the plain weights
        for forward in forward_list or [spec.forward]:
            with console.status(f"Loading {name} ({forward} forward)…"):
                loaded.append(load_model(replace(spec, forward=forward), s.device))
    with console.status("Timing forwards…") as status:
        costs = forward_costs(loaded, chosen, counts, context, repeats, progress=lambda m: status.update(f"Timing {m}…"))
    run_id = report.new_run_id()
    env = report.environment(loaded[0].device)
    rows = [{"timestamp": report.timestamp(), "run_id": run_id, **asdict(c), "context": context, "repeats": repeats, **env}
            for c in costs]
    report.append_csv(s.results_dir / "cost.csv", rows)
    (s.results_dir / f"cost-{run_id}.md").write_text(
        f"# cost run {run_id}\n\n{env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"commit {env['git_commit']}; forwards of N tokens after {context} cached, median of {repeats}\n\n"
        + report.markdown_table(rows, ["model", "forward", "precision", "tokens", "ms", "relative"]))
    if json_out:
        report.write_json(json_out, rows)
    all_counts = sorted({c.tokens for c in costs})
    table = Table(title=f"Forward ms after {context} cached tokens (× a 1-token forward) — {env['device']}")
    for col in ["model", "forward", "precision", *(f"{n} token{'s' * (n > 1)}" for n in all_counts)]:
        table.add_column(col, justify="right")
    by_key: dict[tuple[str, str, str], dict[int, tuple[float, float]]] = {}
    for c in costs:
        by_key.setdefault((c.model, c.forward, c.precision), {})[c.tokens] = (c.ms, c.relative)
    for (model, forward, precision), cells in by_key.items():
        table.add_row(model, forward, precision, *(f"{cells[n][0]:.1f} (×{cells[n][1]:.2f})" for n in all_counts))
    console.print(table)
    names_timed = list(dict.fromkeys(x.name for x in loaded))
    if len(names_timed) >= 2:
        target_name, draft_name = names_timed[:2]
        target_forward = s.registry.get(target_name).forward
        ratios = [f"{p} ({f}): {by_key[(draft_name, f, p)][1][0] / by_key[(target_name, target_forward, p)][1][0]:.3f}"
                  for (m, f, p) in by_key if m == draft_name and (target_name, target_forward, p) in by_key]
        console.print(f"  c = {draft_name} ÷ {target_name} ({target_forward} forward) per 1-token forward — " + ", ".join(ratios))


# --- verify ----------------------------------------------------------------------------------
@app.command()
def verify(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    prompts: PromptsOpt = None,
    nb_prompts: Annotated[int, typer.Option(help="Use the first N prompts.")] = 3,
    samples: Annotated[int, typer.Option(help="SSp runs per prompt (sampled mode).")] = 1000,
    depth: Annotated[int, typer.Option(help="Emitted positions checked per prompt (2+ exercises cache rollback).")] = 3,
    k: KOpt = 4,
    temperature: Annotated[float, typer.Option(help="0 checks greedy equality instead.")] = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    significance: Annotated[float, typer.Option(help="Family-wise significance level.")] = 0.01,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy mode: tokens compared per prompt.")] = 64,
    tie_tolerance: Annotated[float, typer.Option(help="Greedy mode: a top-2 logit gap up to this (or 2 ulp of the logits' dtype) is a near-tie.")] = 0.1,
    lookup: LookupOpt = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON here.")] = None,
) -> None:
    """Check that SSp samples exactly from the target (exit 1 when it does not)."""
    from lssp import verify as vf
    from lssp.prompts import LATENCY_PROMPTS

    s = settings(ctx)
    for name, value in [("--nb-prompts", nb_prompts), ("--samples", samples), ("--depth", depth), ("--k", k),
                        ("--max-new-tokens", max_new_tokens)]:
        _check_positive(name, value)
    if not 0 < significance < 1:
        raise UserError(f"--significance must be in (0, 1), got {significance}")
    _check_positive("--lookup", lookup, minimum=0)
    params = _params(temperature, top_k, top_p)
    prompt_list = (_read_prompt_list(prompts, None) if prompts else list(LATENCY_PROMPTS))[:nb_prompts]
    t, d, vocab = _load_pair(s, target, draft)
    with _progress() as bar:
        task = bar.add_task("verify", total=len(prompt_list) * (1 if params.greedy else samples // 50))
        tick = lambda msg: bar.update(task, advance=1, description=msg)  # noqa: E731
        if params.greedy:
            rep = vf.verify_greedy(t, d, prompt_list, k, max_new_tokens, vocab, tie_tolerance, tick, lookup)
        else:
            rep = vf.verify_sampled(t, d, prompt_list, params, k, samples, depth, s.seed, vocab, significance, tick, lookup)
    run_id = report.new_run_id()
    env = report.environment(t.device)
    base = {"timestamp": report.timestamp(), "run_id": run_id, "target": t.name, "draft": d.name, "k": k,
            "lookup": lookup, "looked_up": rep.looked_up, **params.as_dict(), "verdict": "lossless" if rep.lossless else "not lossless",
            "acceptance_rate": rep.acceptance_rate, "target_precision": t.precision, "draft_precision": d.precision, **env}
    rows = [{**base, **asdict(c), "prefix": " ".join(map(str, c.prefix))} for c in rep.positions] + \
           [{**base, **asdict(g)} for g in rep.greedy]
    report.append_csv(s.results_dir / "verify.csv", rows)
    if json_out:
        report.write_json(json_out, {"mode": rep.mode, "lossless": rep.lossless, "significance": rep.significance,
                                                      "correction": rep.correction, "acceptance_rate": rep.acceptance_rate,
                                                      "lookup": lookup, "looked_up": rep.looked_up,
                                                      "checks": [asdict(c) for c in rep.positions] + [asdict(g) for g in rep.greedy],
                                                      "run_id": run_id, "device": env["device"]})
    _render_verify(rep, t, d, params, k)
    if not rep.lossless:
        raise typer.Exit(1)


def _render_verify(rep, t, d, params, k) -> None:
    title = f"verify {t.name} with draft {d.name}, K={_k_label(k, 0, rep.lookup)}, {params}"
    table = Table(title=title)
    if rep.mode == "greedy":
        for col in ("prompt", "identical", "first difference", "top-2 logit gap", "near-tie"):
            table.add_column(col, justify="right")
        for g in rep.greedy:
            table.add_row(str(g.prompt_index + 1), "yes" if g.identical else "no", "–" if g.identical else str(g.first_difference),
                          "–" if g.top2_gap is None else f"{g.top2_gap:.4f}", "yes" if g.near_tie else "–")
        console.print(table)
        console.print(f"  identical continuations: {rep.identical_share:.0%} of prompts; a difference at a top-2 gap ≤ "
                      f"{rep.tie_tolerance}, or within two units in the last place of the logits' dtype, is a numerical "
                      "near-tie (a 1-token and a K+1-token forward round differently), not a bug")
    else:
        for col in ("prompt", "pos", "samples", "χ² p-value", "cells", "TV", "TV noise (mean±sd)", "exact α", "ok"):
            table.add_column(col, justify="right")
        for c in rep.positions:
            table.add_row(str(c.prompt_index + 1), str(c.position), str(c.samples), f"{c.chi2_p_value:.3g}", str(c.chi2_cells),
                          f"{c.tv:.3f}", f"{c.tv_null_mean:.3f}±{c.tv_null_sd:.3f}", f"{c.exact_alpha:.2f}",
                          Text("✓", style="green") if c.passed else Text("✗", style="bold red"))
        console.print(table)
        for note in rep.skipped:
            console.print(f"  [dim]skipped {note} (fewer than 20; raise --samples)[/dim]")
        console.print(f"  measured acceptance {_fmt(rep.acceptance_rate, 1, pct=True)}; each test rejects at p < "
                      f"{rep.threshold:.2g} ({rep.significance} family-wise, {rep.correction})")
    if rep.lookup:
        console.print(f"  the context lookup proposed {rep.looked_up} drafts")
    verdict = Text("LOSSLESS", style="bold green") if rep.lossless else Text("NOT LOSSLESS", style="bold red")
    console.print(Text("  verdict: ") + verdict)


# --- plot ------------------------------------------------------------------------------------
@app.command("plot")
def plot_cmd(
    ctx: typer.Context,
    run_id: Annotated[Optional[str], typer.Option(help="Only this run.")] = None,
    target: Annotated[Optional[str], typer.Option(help="Only runs of this target.")] = None,
    draft: Annotated[Optional[str], typer.Option(help="Only runs with this draft.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder for the PNGs (default: RESULTS_DIR/plots).")] = None,
) -> None:
    """Draw PNG charts from the CSVs in the results directory."""
    _plot(settings(ctx), run_id=run_id, target=target, draft=draft, out=out)


# --- plotting ------------------------------------------------------------------------------
def _plot(s: Settings, run_id: str | None = None, kinds: tuple[str, ...] = (), target: str | None = None,
          draft: str | None = None, out: Path | None = None) -> None:
    try:
        from lssp import plot as plotting
    except ImportError:
        raise UserError("plotting needs matplotlib (run ./setup.sh)") from None
    for path in plotting.plot_results(s.results_dir, out, run_id=run_id, target=target, draft=draft, kinds=kinds):
        console.print(f"  chart: {path}")


# --- entry point -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the app; user mistakes become one red line and exit code 2 (tracebacks with -v)."""
    verbose = any(a in ("-v", "--verbose") for a in (argv if argv is not None else sys.argv[1:]))
    try:
        app(args=argv, standalone_mode=False)
    except UserError as exc:
        return _fail(str(exc), verbose)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        console.print("[dim]aborted[/dim]")
        return 130
    except KeyboardInterrupt:
        console.print("\n[dim]interrupted[/dim]")
        return 130
    except Exception as exc:  # noqa: BLE001 - classify, then one line
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # a usage error (typer vendors click's)
            exc.show()
            return exc.exit_code
        if type(exc).__name__ == "OutOfMemoryError":
            return _fail("CUDA out of memory: try an 8bit/4bit entry, more GPUs (gpus: N), or fewer --max-new-tokens", verbose)
        if verbose:
            raise
        return _fail(f"{type(exc).__name__}: {exc} (run with -v for the traceback)", False)
    return 0


def _fail(message: str, verbose: bool) -> int:
    if verbose and sys.exc_info()[0] is not None:
        console.print_exception()
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {message}", soft_wrap=True)
    return 2
