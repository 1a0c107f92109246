"""`export-draft`: a standard Llama copy of a draft with a frequent-token head, for engines such as vLLM."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.output import console, err_console
from lssp.errors import UserError


@app.command("export-draft")
def export_draft_cmd(
    ctx: typer.Context,
    draft: Annotated[Optional[str], typer.Argument(
        help="Draft model (default: the registry's default_draft_model, else its default_draft).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder to write (default: the cache folder vLLM runs use).")] = None,
) -> None:
    """Write the draft with a full-width output layer: rows outside its head are held far below it."""
    from lssp.models.draft_head import has_subset_head
    from lssp.models.eagle import is_feature_head
    from lssp.models.eagle3 import is_eagle3_head
    from lssp.models.export import export_draft, exported_dir

    s = settings(ctx)
    spec = s.registry.get(s.registry.draft_name(draft, heads=False))  # a head is exported as it is
    local = spec.local_path()
    if local is None or not local.is_dir():
        raise UserError(f"model {spec.name!r}: export-draft reads a local folder, not {spec.path!r}")
    if is_eagle3_head(local):
        raise UserError(f"model {spec.name!r} is an EAGLE-3 head in its published layout: vLLM's eagle3 method loads "
                        f"{local} as it is, and llama.cpp's converter reads it with its target's folder")
    if is_feature_head(local):
        raise UserError(f"model {spec.name!r} is a feature head in EAGLE's layout: vLLM's eagle method loads {local} "
                        "as it is")
    if not has_subset_head(local):
        raise UserError(f"model {spec.name!r} has a full output layer already: vLLM loads {local} as it is")
    target = out or exported_dir(local)
    if target.exists() and any(target.iterdir()) and out is not None:
        raise UserError(f"{target} exists and is not empty; give a new folder")
    with err_console.status(f"Exporting {spec.name}…"):
        report = export_draft(local, target)
    console.print(f"{spec.name} → {report.out}: {report.head_tokens} head rows kept, the other "
                  f"{report.vocab_size - report.head_tokens} set to −w; on {report.positions} probe positions h·w ≥ "
                  f"{report.min_projection:.2f} and the excluded tokens together get at most "
                  f"{report.excluded_mass:.1e} of the probability (T=1)", soft_wrap=False)
