"""What the CLI shows and writes: the consoles (80 columns off a terminal), tables, number formats, result files."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from lssp.errors import UserError
from lssp.report.contention import busy_line
from lssp.report.results import ResultWriter, check_writable_dir


def _width() -> int | None:
    """The terminal's width; 80 columns (or $COLUMNS) when output goes to a file or a pipe."""
    if sys.stdout.isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else 80


console = Console(highlight=False, width=_width())
err_console = Console(stderr=True, highlight=False)


def fmt(value: float | None, digits: int = 1, pct: bool = False, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{100 * value:.{digits}f}%" if pct else f"{value:.{digits}f}{suffix}"


def k_label(k: int, confidence: float, lookup: int = 0, ngram: int = 0) -> str:
    """K, or "≤K p≥0.4" where drafting stops early below a draft probability; "+lookup N" with the context lookup,
    "ngram N" for an n-gram drafter alone."""
    return ((f"≤{k} p≥{confidence:g}" if confidence else str(k)) + (f" +lookup {lookup}" if lookup else "")
            + (f" ngram {ngram}" if ngram else ""))


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


_interrupt_said: list[str] = []  # what the command said it kept when interrupted (see exit_interrupted)


def exit_interrupted(message: str) -> NoReturn:
    """Exit 130 after Ctrl-C or SIGTERM, saying what was kept; without this the runner says nothing was."""
    err_console.print(message, soft_wrap=True)
    _interrupt_said.append(message)
    raise typer.Exit(130)


def interrupt_said(reset: bool = False) -> bool:
    """Whether the command has said what an interruption kept (``reset``: forget it, for the next command)."""
    said = bool(_interrupt_said)
    if reset:
        _interrupt_said.clear()
    return said


def say_busy(share: float, where: str = "") -> None:
    """One line where other work took too much of the CPUs while timing (``where``: e.g. a load level)."""
    line = busy_line(share)
    if line:
        console.print(f"[bold yellow]  {where}{line}[/bold yellow]")


def plot_charts(results_dir: Path, **filters: Any) -> None:
    """Draw the charts ``filters`` select from ``results_dir``, warning in one line per malformed part skipped."""
    try:
        from lssp.report import plot as plotting
    except ImportError:
        raise UserError("plotting needs matplotlib (run ./setup.sh)") from None
    if results_dir.is_dir():  # where the charts go must take them, said before drawing (a read-only folder)
        check_writable_dir(filters.get("out_dir") or results_dir / "plots")
    charts = plotting.draw_charts(results_dir, **filters)
    for warning in charts.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    for path in charts.require():
        console.print(f"  chart: {path}", soft_wrap=True)
