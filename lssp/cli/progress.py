"""Progress: a bar on a terminal, a line every few seconds in a log or a pipe."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lssp.cli.output import err_console

Tick = Callable[..., None]  # (description) or (description, done, total)
# Without a terminal, at most one progress line per this many seconds ($LLAMASSP_LOG_EVERY; 0: every step).
LOG_EVERY_S = float(os.environ.get("LLAMASSP_LOG_EVERY", "5"))


class ProgressLog:
    """Progress as lines on stderr (for logs and pipes): at most one per LOG_EVERY_S, with the
    elapsed time and, from the fraction done, an estimate of the rest."""

    def __init__(self, label: str, start_fraction: float = 0.0) -> None:
        self.label = label
        self.start = time.perf_counter()
        self.last = -math.inf
        self.start_fraction = start_fraction  # done before this run (a resumed one): not in the rate

    def show(self, fraction: float, message: str, count: str = "") -> None:
        now = time.perf_counter()
        if now - self.last < LOG_EVERY_S and fraction < 1:
            return
        self.last = now
        elapsed, gained = now - self.start, fraction - self.start_fraction
        rest = f", ~{_duration(elapsed / gained * (1 - fraction))} left" if gained > 0 else ""
        err_console.print(f"{count}{self.label}: {message} · {_duration(elapsed)} elapsed{rest}", soft_wrap=True)


def _bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True)


@contextmanager
def progress(total: int | None, label: str, done_before: int = 0) -> Iterator[Tick]:
    """A bar on a terminal, ProgressLog lines elsewhere. Yields ``tick(description, done=None, total=None)``,
    called after each step: without ``done`` and ``total`` a step of the ``total`` given here, with them (the run
    loop's) where the run stands. ``done_before``: steps an earlier run did (a resumed eval), counted as done
    but not in the time estimate."""
    if err_console.is_terminal:
        with _bar() as bar:
            task = bar.add_task(label, total=total, completed=done_before)

            def advance(message: str, done: int | None = None, of: int | None = None) -> None:
                if of is not None:
                    bar.update(task, total=of, completed=done, description=message)
                else:
                    bar.update(task, advance=1, description=message)

            yield advance
        return
    lines, count = ProgressLog(label, done_before / max(1, total or 1)), done_before

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
        if phase not in logs:  # a phase's first report says where it starts (a resumed one: partly done)
            logs[phase] = ProgressLog(phase, start_fraction=fraction)
        logs[phase].show(fraction, message, f"[{fraction:.0%}] ")

    yield update


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
