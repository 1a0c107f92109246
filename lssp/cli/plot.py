"""`plot`: PNG charts from the CSVs in the results directory."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.output import plot_charts


@app.command("plot")
def plot_cmd(
    ctx: typer.Context,
    run_id: Annotated[Optional[str], typer.Option(help="Only this run.")] = None,
    target: Annotated[Optional[str], typer.Option(help="Only runs of this target.")] = None,
    draft: Annotated[Optional[str], typer.Option(help="Only runs with this draft.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder for the PNGs (default: RESULTS_DIR/plots).")] = None,
    machine: Annotated[Optional[str], typer.Option(
        help="Only runs whose device contains this text, or 'all' (default: the machine of the newest run).")] = None,
) -> None:
    """Draw PNG charts from the CSVs in the results directory (one machine per chart)."""
    plot_charts(settings(ctx).results_dir, run_id=run_id, target=target, draft=draft, out_dir=out, machine=machine)
