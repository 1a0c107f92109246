"""`models`: the registry, one row per entry; compact at 80 columns, `--wide` and `--json` for the rest."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from lssp.cli.app import app, settings
from lssp.cli.options import flag
from lssp.cli.output import console, table
from lssp.errors import UserError
from lssp.models.catalog import CatalogRow, catalog


@app.command("models")
def models_cmd(
    ctx: typer.Context,
    wide: Annotated[bool, flag("--wide", help="All the columns: path, dtype, quantization, forward, placement, "
                               "description.")] = False,
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", help="Write every entry with all its fields as JSON here ('-': standard output).")] = None,
) -> None:
    """List the registry: name, size (parameters, from the shape), precision, and where the weights come from
    (the hub, cached or not; a package; a folder) with any placement the entry asks."""
    reg = settings(ctx).registry
    rows = catalog(reg)
    if json_out is not None:
        _write_json(json_out, rows)
        if str(json_out) == "-":
            return
    if wide:
        _wide(rows, reg.source)
    else:
        _compact(rows, reg.source)


def _name_cell(row: CatalogRow) -> str:
    return row.name + (f"\n({row.role})" if row.role else "")


def _compact(rows: list[CatalogRow], source: Path) -> None:
    out = table(f"Models in {source}", [("name", "left"), ("size", "right"), ("precision", "left"),
                                        ("where", "left")], keep_whole=("name", "precision"))
    for row in rows:
        where = Text(row.where, style="green" if row.on_disk else "dim")
        out.add_row(_name_cell(row), row.size, row.precision, where)
    console.print(out)
    console.print("[dim]size: parameters (from the shape); green: on disk; --wide, --json: all fields[/dim]")


def _wide(rows: list[CatalogRow], source: Path) -> None:
    """Every field, one block per entry (readable at any width, unlike a table of nine columns)."""
    import textwrap

    def indented(text: str, style: str = "") -> None:
        lines = textwrap.wrap(text, width=max(console.width, 40), initial_indent="  ", subsequent_indent="    ",
                              break_on_hyphens=False)
        console.print(Text("\n".join(lines), style=style), soft_wrap=True)

    console.print(f"[bold]Models in {source}[/bold]")
    for row in rows:
        console.print(Text.assemble((row.name, "bold"), f"  ({row.role})" if row.role else ""))
        size = f"{row.size} parameters" if row.size[-1] in "BMK" else row.size
        quantization = "no quantization" if row.quantization == "none" else row.quantization
        indented(f"{size}{f' ({row.shape})' if row.shape else ''} · {row.dtype} · {quantization} · "
                 f"{row.forward} forward")
        origin = "random init" if row.source == "random" else (
            f"{row.source} {row.path} ({'on disk' if row.on_disk else 'not on disk'})")
        indented(f"placement {row.placement} · {origin}")
        if row.description:
            indented(row.description, "dim")


def _write_json(path: Path, rows: list[CatalogRow]) -> None:
    text = json.dumps([row.as_dict() for row in rows], indent=1) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return
    try:
        path.write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    console.print(f"[dim]→ {path}[/dim]")
