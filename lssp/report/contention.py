"""Was the machine busy while we timed? The share of the CPUs' time that other work took.

Linux counts every CPU's busy time in ``/proc/stat`` (steal included: a virtual machine's host taking the CPU) and
each process's own in ``/proc/PID/stat``. What the CPUs spent beyond this process and the processes it started (a
vLLM engine, a llama-server) went to other work, which slows a timing whatever it measures; one prompt is enough to
see it, where a spread across prompts needs several.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_SHARE = 0.25  # other work took more than this share of all CPUs' time: the timing is unreliable


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float  # seconds, monotonic
    busy: float  # CPU-seconds all CPUs spent busy (user, system, interrupts, steal) since boot
    ours: float  # CPU-seconds of this process, its threads and its descendants


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def _busy_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (float(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _ticks()


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU-seconds of it and its waited-for children)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": state is field 0 here
        utime, stime, cutime, cstime = (float(v) for v in fields[11:15])
        table[int(entry.name)] = (int(fields[1]), (utime + stime + cutime + cstime) / _ticks())
    return table


def _our_seconds() -> float:
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, [os.getpid()]
    while stack:
        pid = stack.pop()
        total += table.get(pid, (0, 0.0))[1]
        stack.extend(children.get(pid, []))
    return total


def cpu_snapshot() -> CpuSnapshot | None:
    """Now's counters; None where the system does not keep them (not Linux)."""
    try:
        return CpuSnapshot(time.monotonic(), _busy_seconds(), _our_seconds())
    except (OSError, ValueError, IndexError):
        return None


def others_share(start: CpuSnapshot | None, end: CpuSnapshot | None) -> float:
    """The share of all CPUs' time between two snapshots that went to work other than ours (nan: not known)."""
    if start is None or end is None or end.wall <= start.wall:
        return float("nan")
    others = (end.busy - start.busy) - (end.ours - start.ours)
    return max(0.0, others) / ((end.wall - start.wall) * (os.cpu_count() or 1))


def busy_line(share: float) -> str | None:
    """One line saying the machine was busy, or None."""
    if not share > BUSY_SHARE:
        return None
    return (f"busy machine: other work took {share:.0%} of the CPUs' time while timing (a quiet machine: under "
            f"{BUSY_SHARE:.0%}): the timings are unreliable")
