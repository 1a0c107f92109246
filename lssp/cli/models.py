"""`models`: the registry, one row per entry."""
from __future__ import annotations

import typer
from rich.text import Text

from lssp.cli.app import app, settings
from lssp.cli.output import console, table


@app.command("models")
def models_cmd(ctx: typer.Context) -> None:
    """List the registry: name, source, precision, placement, and whether it is on disk."""
    reg = settings(ctx).registry
    out = table(f"Models in {reg.source}", [(c, "left") for c in ("name", "path", "dtype", "quant", "placement", "local")],
                keep_whole=("name",))
    for spec in reg.models.values():
        tag = ("\n(default target)" if spec.name == reg.default_target
               else "\n(default draft)" if spec.name == reg.default_draft else "")
        placement = spec.device_map or "auto"
        if spec.gpus:
            placement += f", {spec.gpus} GPUs"
        if spec.max_memory:
            placement += f", max_memory {spec.max_memory}"
        vllm = [f"pipeline {spec.pipeline_parallel_size}" if spec.pipeline_parallel_size else "",
                spec.distributed_executor_backend or "", spec.speculative_method or ""]
        if any(vllm):
            placement += ", vLLM: " + ", ".join(v for v in vllm if v)
        source = (f"random init: {spec.config if isinstance(spec.config, str) else 'custom config'}" if spec.is_random
                  else spec.path)
        local = spec.available_locally()
        out.add_row(spec.name + tag, source, spec.dtype, spec.quantization, placement,
                    Text("yes", style="green") if local else Text("no", style="dim"))
    console.print(out)
