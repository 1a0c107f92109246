"""Progress lines in a log: the time left counts only what this run did (a resumed phase starts part done)."""
from __future__ import annotations

import io

from rich.console import Console

from lssp.cli import progress


def test_a_resumed_phase_estimates_from_its_own_rate(monkeypatch) -> None:
    out = io.StringIO()
    clock = iter([0.0, 0.0, 10.0, 20.0])
    monkeypatch.setattr(progress, "err_console", Console(file=out, force_terminal=False, width=200))
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    with progress.phase_progress() as update:
        update("collect", 0.90, "resumed")  # 90% done by an earlier run
        update("collect", 0.95, "on")  # 5% in 10 s: 10 s for the last 5%
        update("collect", 1.0, "done")
    lines = out.getvalue().splitlines()
    assert "left" not in lines[0]
    assert lines[1].endswith("10s elapsed, ~10s left")
    assert lines[2].endswith("20s elapsed, ~0s left")
