"""What every command shares: the app, global settings, option types, loading, progress and saving."""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lssp.errors import UserError
from lssp.models.registry import Registry, load_registry
from lssp.report.results import ResultWriter, check_writable_dir, plural
from lssp.decoding.sampling import SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure speculative sampling (SSp) against regular sampling (RSp).")


def _width() -> int | None:
    """The terminal's width; 80 columns (or $COLUMNS) when output goes to a file or a pipe."""
    if sys.stdout.isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else 80


console = Console(highlight=False, width=_width())
err_console = Console(stderr=True, highlight=False)
log = logging.getLogger("lssp")

# Options every command accepts before or after its name (main() moves them in front).
GLOBAL_OPTIONS_WITH_VALUE = ("--config", "--results-dir", "--seed", "--device")
GLOBAL_FLAGS = ("-v", "--verbose", "--compile", "--compile-fallback")


def flag(*decls: str, help: str) -> Any:
    """A boolean option shown without typer's "<bool>" in --help."""
    return typer.Option(*decls, help=help, metavar="")


@dataclass
class Settings:
    config: Path
    results_dir: Path
    seed: int
    verbose: bool
    device: str | None
    compile: bool = False
    compile_fallback: bool = False
    _registry: Registry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = load_registry(self.config)
        return self._registry

    def writable_results_dir(self) -> Path:
        """The results directory, made if needed and proven writable, before any model loads."""
        check_writable_dir(self.results_dir)
        return self.results_dir


def settings(ctx: typer.Context) -> Settings:
    return ctx.find_root().obj


def _print_version(value: bool) -> None:
    if value:
        from lssp import __version__

        console.print(f"llamassp {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(help="Model registry.")] = Path("models.yaml"),
    results_dir: Annotated[Path, typer.Option(help="Where CSV, Markdown and JSON results go.")] = Path("results"),
    seed: Annotated[int, typer.Option(help="Seed for sampling and prompt draws.")] = 0,
    verbose: Annotated[bool, flag("--verbose", "-v", help="Log progress; show tracebacks.")] = False,
    device: Annotated[Optional[str], typer.Option(help="Override placement: cpu, cuda, cuda:1, auto.")] = None,
    compile: Annotated[bool, flag("--compile", help="Run every model's decode steps compiled (torch.compile on the "
                                  "compact forward; CUDA graphs on a GPU).")] = False,
    compile_fallback: Annotated[bool, flag("--compile-fallback", help="Where compiling is impossible, run "
                                           "uncompiled with a warning instead of stopping.")] = False,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=_print_version, metavar="")] = False,
) -> None:
    """Global options go before or after the subcommand: llamassp.py latency --seed 1 ..."""
    ctx.obj = Settings(config, results_dir, seed, verbose, device, compile, compile_fallback)
    _configure_logging(verbose)


def _configure_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err_console, show_path=False)], force=True)
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
EngineOpt = Annotated[str, typer.Option(
    "--engine", help="ours, vllm (./setup.sh --vllm installs it), or ours,vllm: both in one interleaved run.")]
DraftArg = Annotated[Optional[str], typer.Argument(help="Draft model (default: the registry's default_draft).")]
PromptsOpt = Annotated[Optional[Path], typer.Option(
    help="File with one prompt per line, or JSONL in Spec-Bench's question.jsonl shape (category, turns).")]
TaskOpt = Annotated[Optional[str], typer.Option(
    "--task", help="Built-in task categories, comma-separated, or all: chat, translation, summarization, qa, math, rag, "
    "code, stories (the default).")]
IgnoreEosOpt = Annotated[bool, flag("--ignore-eos", help="Run every completion to --max-new-tokens, past the end token "
                                    "(fixed-length runs for hardware timing).")]
NbPromptsOpt = Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the run's summary as JSON here.")]
PlotOpt = Annotated[bool, flag(help="Draw this run's charts into the results directory.")]
ChatOpt = Annotated[bool, flag("--chat", help="Feed each prompt as a user turn in the target's chat template.")]
WideOpt = Annotated[bool, flag("--wide", help="Also show a second table: median, TTFT, accepted/drafted, where the "
                               "time went, and the spread of forward times.")]


def sampling_params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def check_positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}")


def _comma_list(name: str, text: str, kind: str) -> list[str]:
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise UserError(f"{name} takes {kind} separated by commas, got {text!r}")
    return parts


def parse_ints(name: str, text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(part) for part in _comma_list(name, text, "whole numbers")]
    except ValueError:
        raise UserError(f"{name} takes whole numbers separated by commas, got {text!r}") from None
    if any(v < minimum for v in values):
        raise UserError(f"{name} values must be at least {minimum}, got {text!r}")
    return values


def parse_fractions(name: str, text: str) -> list[float]:
    """Numbers in [0, 1), comma-separated."""
    try:
        values = [float(part) for part in _comma_list(name, text, "numbers")]
    except ValueError:
        raise UserError(f"{name} takes numbers separated by commas, got {text!r}") from None
    if any(not 0 <= v < 1 for v in values):
        raise UserError(f"{name} values must be in [0, 1), got {text!r}")
    return values


def load(s: Settings, name: str, draft: bool = False, target=None):
    from lssp.models.loading import feature_head_folder, load_model

    spec = s.registry.get(name)
    if s.compile and not spec.compile and not (draft and feature_head_folder(spec)):
        spec = replace(spec, compile=True, forward="compact")
    with err_console.status(f"Loading {name} ({spec.path or 'random init'})…"):
        loaded = load_model(spec, s.device, draft, s.compile_fallback, target)
    log.info("%s: %s on %s, %.1f MB", name, loaded.precision, loaded.placement, loaded.weight_bytes / 1e6)
    return loaded


def load_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    t_name = s.registry.target_name(target_name)
    d_name = s.registry.draft_name(draft_name) if (draft_name or need_draft) else None
    target = load(s, t_name)
    if d_name is None:
        return target, None, None
    return (target, *load_draft_for(s, target, d_name))  # after the target: on the GPU it left emptiest


def load_draft_for(s: Settings, target, name: str):
    """One more draft for a loaded target, and the logit width they share."""
    from lssp.models.loading import check_compatible

    draft = load(s, s.registry.draft_name(name), draft=True, target=target)
    return draft, check_compatible(target, draft)


def parse_engines(value: str, allowed: tuple[str, ...] = ("ours", "vllm")) -> list[str]:
    """--engine: a comma list of known engines, each once."""
    engines = [e.strip() for e in value.split(",") if e.strip()]
    unknown = [e for e in engines if e not in allowed]
    if unknown or not engines or len(set(engines)) < len(engines):
        raise UserError(f"--engine {value!r}: expected one or more of {', '.join(allowed)}, comma-separated, each once")
    return engines


def load_engine_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    """The pair as vLLM will run it: tokenizers and configs only on our side (no weights loaded here)."""
    from lssp.models.loading import check_compatible
    from lssp.engines.vllm import EngineModel, require_vllm

    require_vllm()
    t_spec = s.registry.get(s.registry.target_name(target_name))
    d_name = s.registry.draft_name(draft_name) if (draft_name or need_draft) else None
    with err_console.status(f"Reading {t_spec.name} for vLLM…"):
        target = EngineModel(t_spec)
        draft = EngineModel(s.registry.get(d_name), target) if d_name else None
    if draft is not None:
        check_compatible(target, draft)
    return target, draft


def start_vllm(target, draft, keys: list[tuple[int, int]]):
    """vLLM engines for (k, lookup) modes (k = 0: RSp), all started before anything is timed."""
    from lssp.engines.vllm import VllmEngines

    with err_console.status(f"Starting {plural(len(keys), 'vLLM engine')}…") as status:
        return VllmEngines(target, draft, keys, lambda key: status.update(f"Started vLLM for K={key[0]}…"))


def read_prompt_list(prompts_file: Path | None, nb_prompts: int | None) -> list[str]:
    """Prompts as text: the file's lines (the first turn of each JSONL prompt) or the built-in list."""
    from lssp.workloads.prompts import LATENCY_PROMPTS, read_prompts
    from lssp.workloads.tasks import is_jsonl, read_jsonl

    if prompts_file and is_jsonl(prompts_file):
        prompts = [p.text for p in read_jsonl(prompts_file)]
    else:
        prompts = read_prompts(prompts_file) if prompts_file else list(LATENCY_PROMPTS)
    return _first(prompts, nb_prompts, prompts_file)


def _first(prompts: list, nb_prompts: int | None, source: Path | str | None) -> list:
    """The first ``nb_prompts`` of ``prompts`` (all of them for None); more than there are is a mistake."""
    if nb_prompts is None:
        return prompts
    check_positive("--nb-prompts", nb_prompts)
    if nb_prompts > len(prompts):
        raise UserError(f"--nb-prompts {nb_prompts}: {source or 'the built-in list'} has only "
                        f"{plural(len(prompts), 'prompt')}" + ("" if source else " (give more with --prompts FILE)"))
    return prompts[:nb_prompts]


def read_task_prompts(tasks: str | None, prompts_file: Path | None, nb_prompts: int | None, chat: bool) -> list:
    """The TaskPrompts a latency run times: built-in tasks (``--nb-prompts`` of each), a file (lines or
    Spec-Bench JSONL), or by default the reference's story openings."""
    from lssp.measure.latency import as_task_prompts
    from lssp.workloads.tasks import is_jsonl, load_tasks, parse_tasks, read_jsonl, task_prompts

    if tasks is not None and prompts_file is not None:
        raise UserError("--task and --prompts: give one of them")
    if tasks is not None:
        if nb_prompts is not None:
            check_positive("--nb-prompts", nb_prompts)
        return load_tasks(parse_tasks(tasks), nb_prompts)
    if prompts_file is not None and is_jsonl(prompts_file):
        return _first(read_jsonl(prompts_file), nb_prompts, prompts_file)
    if prompts_file is not None:
        return as_task_prompts(read_prompt_list(prompts_file, nb_prompts), chat)
    return _first(list(task_prompts("stories")), nb_prompts, None)


Tick = Callable[..., None]  # (description) or (description, done, total)
# Without a terminal, at most one progress line per this many seconds ($LLAMASSP_LOG_EVERY; 0: every step).
LOG_EVERY_S = float(os.environ.get("LLAMASSP_LOG_EVERY", "5"))


class ProgressLog:
    """Progress as lines on stderr (for logs and pipes): at most one per LOG_EVERY_S, with the
    elapsed time and, from the fraction done, an estimate of the rest."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.perf_counter()
        self.last = -math.inf

    def show(self, fraction: float, message: str, count: str = "") -> None:
        now = time.perf_counter()
        if now - self.last < LOG_EVERY_S and fraction < 1:
            return
        self.last = now
        elapsed = now - self.start
        rest = f", ~{_duration(elapsed / fraction * (1 - fraction))} left" if fraction > 0 else ""
        err_console.print(f"{count}{self.label}: {message} · {_duration(elapsed)} elapsed{rest}", soft_wrap=True)


def _bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


@contextmanager
def progress(total: int | None, label: str) -> Iterator[Tick]:
    """A bar on a terminal, ProgressLog lines elsewhere. Yields ``tick(description, done=None, total=None)``,
    called after each step: without ``done`` and ``total`` a step of the ``total`` given here, with them (the run
    loop's) where the run stands."""
    if err_console.is_terminal:
        with _bar() as bar:
            task = bar.add_task(label, total=total)

            def advance(message: str, done: int | None = None, of: int | None = None) -> None:
                if of is not None:
                    bar.update(task, total=of, completed=done, description=message)
                else:
                    bar.update(task, advance=1, description=message)

            yield advance
        return
    lines, count = ProgressLog(label), 0

    def tick(message: str, done: int | None = None, of: int | None = None) -> None:
        nonlocal count, total
        count = done if done is not None else count + 1
        total = of if of is not None else total
        lines.show(count / max(1, total or 1), message, f"[{count}/{total}] ")

    yield tick


@contextmanager
def phase_progress() -> Iterator[Callable[[str, float, str], None]]:
    """Like ``progress`` for work in phases that report the fraction done: yields ``update(phase, fraction, message)``."""
    if err_console.is_terminal:
        with _bar() as bar:
            tasks: dict[str, int] = {}

            def update(phase: str, fraction: float, message: str) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=1000)
                bar.update(tasks[phase], completed=int(1000 * fraction), description=f"{phase}: {message}")

            yield update
        return
    logs: dict[str, ProgressLog] = {}

    def update(phase: str, fraction: float, message: str) -> None:
        logs.setdefault(phase, ProgressLog(phase)).show(fraction, message, f"[{fraction:.0%}] ")

    yield update


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def fmt(value: float | None, digits: int = 1, pct: bool = False, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{100 * value:.{digits}f}%" if pct else f"{value:.{digits}f}{suffix}"


def k_label(k: int, confidence: float, lookup: int = 0) -> str:
    """K, or "≤K p≥0.4" where drafting stops early below a draft probability; "+lookup N" with the context lookup."""
    return (f"≤{k} p≥{confidence:g}" if confidence else str(k)) + (f" +lookup {lookup}" if lookup else "")


def table(title: str, columns: list[tuple[str, str]], keep_whole: tuple[str, ...] = ()) -> Table:
    """A table for 80 columns: right-justified columns (numbers, under headers no wider than them)
    and ``keep_whole`` ones never wrap; the others wrap at spaces, or fold, rather than being cut."""
    out = Table(title=title)
    for name, justify in columns:
        out.add_column(name, justify=justify, overflow="fold", no_wrap=justify == "right" or name in keep_whole)
    return out


def save(results: Path, run_id: str, name: str, rows: list[dict[str, Any]], markdown: str | None,
         json_out: Path | None, json_payload: Any, run_line: str, more_csv: dict[str, list[dict[str, Any]]] | None = None,
         ) -> int:
    """Write a run's files — NAME.csv (and ``more_csv``), NAME-RUNID.md, the --json file — then say where
    they went; 1 if a write failed (its content went to a fallback file), else 0."""
    writer = ResultWriter(results, run_id)
    for csv_name, csv_rows in {f"{name}.csv": rows, **(more_csv or {})}.items():
        writer.csv(csv_name, csv_rows)
    if markdown is not None:
        writer.text(f"{name}-{run_id}.md", markdown)
    if json_out:
        writer.json(json_out, json_payload)
    return finish(writer, run_line)


def finish(writer: ResultWriter, run_line: str) -> int:
    """Print where the run's files went (and any write that failed); 1 if one failed, else 0."""
    written = ", ".join(str(p) for p in dict.fromkeys(writer.written))
    console.print(f"[dim]{run_line} → {written or 'nothing written'}[/dim]", soft_wrap=False)
    for note in writer.notes:
        err_console.print(f"[yellow]warning:[/yellow] {note}", soft_wrap=True)
    return 1 if writer.failed else 0


def exit_with(code: int) -> None:
    if code:
        raise typer.Exit(code)


def plot_charts(s: Settings, **filters: Any) -> None:
    try:
        from lssp.report.results import plot as plotting
    except ImportError:
        raise UserError("plotting needs matplotlib (run ./setup.sh)") from None
    for path in plotting.plot_results(s.results_dir, **filters):
        console.print(f"  chart: {path}")
