"""The llamassp command line: one module per command; each parses, calls the library, renders."""
from __future__ import annotations

import signal
import sys
import threading

import typer
from rich.text import Text

from lssp.cli import bench, ceiling, compare, cost, distill, export, latency, load, models, plan, plot, verify  # noqa: F401
from lssp.cli import eval as eval_command  # noqa: F401  (registers; the module is named after its command)
from lssp.cli.app import GLOBAL_FLAGS, GLOBAL_OPTIONS_WITH_VALUE, app
from lssp.cli.output import console, err_console, interrupt_said
from lssp.errors import UserError

__all__ = ["app", "main"]


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options written after the subcommand (``eval --seed 7``) in front of it."""
    front, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg == "--":
            rest += argv[i:]
            break
        if name in GLOBAL_OPTIONS_WITH_VALUE:
            takes_next = "=" not in arg and i + 1 < len(argv)
            front += argv[i:i + 1 + takes_next]
            i += 1 + takes_next
            continue
        (front if arg in GLOBAL_FLAGS else rest).append(arg)
        i += 1
    return front + rest


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (``timeout``, a batch scheduler) stops a run like Ctrl-C: what was complete is saved."""
    raise KeyboardInterrupt


BUG_EXIT = 3  # an internal error: a bug in llamassp (a user's mistake exits 2)


def main(argv: list[str] | None = None) -> int:
    """Run the app; user mistakes become one red line and exit code 2, bugs an "internal error" line and exit code 3
    (tracebacks with -v); Ctrl-C (or SIGTERM) exits 130."""
    from lssp.engines.llamacpp import servers_started, stop_servers

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    started_before = servers_started()
    try:
        return _run(hoist_global_options(list(sys.argv[1:] if argv is None else argv)))
    finally:
        stop_servers(since=started_before)  # every llama-server the command started, however it ended
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: list[str]) -> int:
    """The app, with every way it can end turned into an exit code."""
    verbose = any(a in ("-v", "--verbose") for a in args)
    interrupt_said(reset=True)
    try:
        code = app(args=args, standalone_mode=False)  # returns typer.Exit's code (130 on Ctrl-C: typer turns it so)
    except UserError as exc:
        return _fail(str(exc), verbose)
    except typer.Exit as exc:
        code = exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except Exception as exc:  # noqa: BLE001 - classify, then one line
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # a usage error (typer vendors click's): one line
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            err_console.print(Text.assemble(("error:", "bold red"), f" {exc.format_message()}{where}"), soft_wrap=True)
            return exc.exit_code
        if type(exc).__name__ == "OutOfMemoryError":
            return _fail("CUDA out of memory: try an 8bit/4bit entry, more GPUs (gpus: N), or fewer --max-new-tokens", verbose)
        if verbose:
            raise
        if isinstance(exc, (OSError, MemoryError)):  # the machine's doing (a full disk, a read-only folder, memory)
            return _fail(f"{type(exc).__name__}: {exc} (run with -v for the traceback)", False)
        err_console.print(f"[bold red]internal error[/bold red] (a bug in llamassp, not a mistake of yours): "
                          f"{type(exc).__name__}: {exc}\n  rerun the same command with -v for the traceback, and "
                          "report both", soft_wrap=True)
        return BUG_EXIT
    if code == 130 and not interrupt_said():  # Ctrl-C or SIGTERM where the command kept nothing (loading, say)
        err_console.print("\ninterrupted: nothing was saved")
    return code if isinstance(code, int) else 0


def _fail(message: str, verbose: bool) -> int:
    if verbose and sys.exc_info()[0] is not None:
        console.print_exception()
    err_console.print(f"[bold red]error:[/bold red] {message}", soft_wrap=True)
    return 2
