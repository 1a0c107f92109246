"""The app: global options (before or after the subcommand), settings, logging."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from lssp.cli.options import flag
from lssp.cli.output import console, err_console
from lssp.errors import UserError
from lssp.models.registry import REGISTRY_ENV, Registry, load_registry, registry_path
from lssp.report.results import check_writable_dir

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure speculative sampling (SSp) against regular sampling (RSp).")


log = logging.getLogger("lssp")

# Options every command accepts before or after its name (main() moves them in front).
GLOBAL_OPTIONS_WITH_VALUE = ("--config", "--results-dir", "--seed", "--device")
GLOBAL_FLAGS = ("-v", "--verbose", "--compile", "--compile-fallback")


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
            self._registry = replace(load_registry(self.config), notify=_say)
        return self._registry

    def writable_results_dir(self, json_out: Path | None = None) -> Path:
        """The results directory, made if needed and proven writable, before any model loads; ``json_out``'s
        folder must exist (a mistyped path is not created), unless it is the results directory, which the run makes."""
        if self.results_dir.exists() and not self.results_dir.is_dir():
            raise UserError(f"--results-dir {self.results_dir} is a file, not a folder")
        made_by_run = json_out is not None and json_out.parent.resolve() == self.results_dir.resolve()
        if json_out is not None and not json_out.parent.is_dir() and not made_by_run:
            raise UserError(f"--json {json_out}: the folder {json_out.parent} does not exist")
        check_writable_dir(self.results_dir)
        return self.results_dir


def _say(line: str) -> None:
    """A one-line notice, dim on stderr: the registry's (how a model named by its hub id or path loads, a default
    draft swapped) and the library's (``lssp.notices``)."""
    from rich.text import Text

    err_console.print(Text(line, style="dim"), soft_wrap=True)


class _NoticeHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _say(record.getMessage())


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
    config: Annotated[Optional[Path], typer.Option(
        help=f"Model registry (default: ${REGISTRY_ENV}, else models.yaml here or beside the tool).",
        show_default=False)] = None,
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
    if device is not None and not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device):
        raise UserError(f"--device takes cpu, cuda, cuda:N or auto, got {device!r}")
    ctx.obj = Settings(registry_path(config), results_dir, seed, verbose, device, compile, compile_fallback)
    _configure_logging(verbose)


def _configure_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    from lssp.notices import NOTICES

    logs = RichHandler(console=err_console, show_path=False)
    logs.addFilter(lambda record: record.name != NOTICES.name)  # those are said plainly, below
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", handlers=[logs],
                        force=True)
    NOTICES.setLevel(logging.INFO)
    NOTICES.handlers = [_NoticeHandler()]
    import transformers

    transformers.logging.set_verbosity_info() if verbose else transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
