"""Results on disk: CSV rows appended with the environment, Markdown tables, JSON summaries."""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import platform
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers

from lssp.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _cpuinfo(field: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (none off Linux)."""
    return set((_cpuinfo("flags") or "").split())


def native_bf16() -> list[str]:
    """The CPU's instruction sets that compute bf16 natively (none: bf16 is emulated, and slow)."""
    return sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_features() -> str:
    """The vector ISA torch uses and whether the CPU computes bf16 natively: the same model name can
    hide both, and bf16 matmuls without native support cost about K times more for K tokens."""
    native = native_bf16()
    return f"{torch.backends.cpu.get_cpu_capability()}, " + (f"bf16: {'+'.join(native)}" if native else "no native bf16")


def device_description(device: torch.device | str | None = None) -> str:
    """GPU names, or the CPU model with its core count and torch's thread count."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        counts: dict[str, int] = {}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        return " + ".join(f"{c}x {n}" for n, c in counts.items())
    return f"CPU: {cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads, {cpu_features()})"


@cache
def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        # Results appended by earlier runs do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results", ":!benchmarks/results"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device | str | None = None) -> dict[str, str]:
    return {
        "device": device_description(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }


@dataclass
class RunInfo:
    """What every row of one run carries: its id, when it ran, and where."""

    run_id: str = field(default_factory=new_run_id)
    timestamp: str = field(default_factory=timestamp)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def here(cls, device: torch.device | str | None = None) -> RunInfo:
        return cls(env=environment(device))

    @classmethod
    def for_models(cls, *models: Any) -> RunInfo:
        """The environment of the first model's device, where every model is ("target: cuda:0-3; draft: cuda:3"), and
        the share of each kernel weights arena in huge pages ("target: 100%")."""
        present = [m for m in models if m is not None]
        info = cls.here(present[0].device)
        info.env["placement"] = "; ".join(f"{m.name}: {m.placement}" for m in present)
        # A forward streaming its weights from 4 KiB pages took up to 20% longer: say whether they got huge ones.
        pages = [(m.name, share) for m in present if (share := getattr(m, "huge_pages", None)) is not None]
        if pages:
            info.env["huge_pages"] = "; ".join(f"{name}: {share:.0%}" for name, share in pages)
        return info

    def head(self) -> dict[str, str]:
        return {"timestamp": self.timestamp, "run_id": self.run_id}

    def describe(self) -> str:
        """One line naming the machine and the code, for Markdown files and table footers."""
        env = self.env
        pages = f", weights in huge pages: {env['huge_pages']}" if env.get("huge_pages") else ""
        return (f"{env.get('device', '?')}, torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
                f"commit {env.get('git_commit', '?')}{pages}")


def _csv_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def csv_problem(path: Path) -> str | None:
    """Why new rows cannot be appended to this CSV as it is (None: they can)."""
    text = path.read_text(errors="replace")
    if not text:
        return None
    if not text.endswith("\n"):
        return "its last line is cut short"
    try:
        lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        return f"it does not parse ({exc})"
    width = len(lines[0])
    for number, fields in enumerate(lines[1:], start=2):
        if len(fields) != width:
            return f"line {number} has {len(fields)} fields where its header has {width}"
    return None


def _header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


@dataclass
class Appended:
    """Where rows went: the file asked for, or a part beside it (and why)."""

    path: Path
    note: str = ""


def append_csv(path: Path, rows: Iterable[Mapping[str, Any]]) -> Appended:
    """Append rows to a CSV without rewriting a byte of it.

    Rows whose columns the header lacks, or a malformed file, send the rows to the first
    part beside it that takes them (``latency.1.csv``, ``latency.2.csv``, …); earlier
    files are left as they are. ``read_csv_parts`` reads them back together.
    """
    rows = [dict(r) for r in rows]
    columns = list(dict.fromkeys(c for r in rows for c in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    note = ""
    for part in _parts(path, existing_only=False):
        if not part.exists() or part.stat().st_size == 0:
            header = columns
            with part.open("w", newline="") as f:
                csv.writer(f, lineterminator="\n").writerow(header)
            break
        problem = csv_problem(part)
        header = _header(part) if problem is None else []
        if problem is None and set(columns) <= set(header):
            note = ""  # an earlier run already said why rows go to this part
            break
        if part == path:
            note = (f"{path} is malformed ({problem}) and is left as it is" if problem
                    else f"{path} lacks columns {', '.join(c for c in columns if c not in header)}")
    with part.open("a", newline="") as f:
        writer = csv.writer(f, lineterminator=_line_end(part))
        for row in rows:
            writer.writerow([_csv_cell(row.get(c)) for c in header])
    return Appended(part, f"{note}; new rows went to {part}" if note else "")


def _line_end(path: Path) -> str:
    """The line end ``path``'s header uses ("\r\n" in files written before 2026-11-24), so that appended lines match."""
    with path.open("rb") as f:
        return "\r\n" if f.readline().endswith(b"\r\n") else "\n"


def _parts(path: Path, existing_only: bool = True) -> Iterator[Path]:
    """``name.csv``, then ``name.1.csv``, ``name.2.csv``, … (only those on disk, or without end)."""
    yield path
    for n in itertools.count(1):
        part = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if existing_only and not part.exists():
            return
        yield part


def read_csv_parts(path: Path) -> pd.DataFrame:
    """A results CSV with the parts ``append_csv`` put beside it; malformed parts are skipped."""
    frames = []
    for part in _parts(path):
        if part.exists() and part.stat().st_size and csv_problem(part) is None:
            frames.append(pd.read_csv(part))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def check_writable_dir(folder: Path) -> None:
    """Make the folder if needed and prove a file can be written there; one clear line if not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UserError(f"results directory {folder} is not writable: {exc.strerror or exc}") from None


class ResultWriter:
    """Writes a run's files; a failed write names the file and its reason, and the content goes
    to a fallback folder instead, so that nothing measured is lost."""

    def __init__(self, results_dir: Path, run_id: str) -> None:
        self.results_dir = results_dir
        self.run_id = run_id
        self.written: list[Path] = []
        self.notes: list[str] = []
        self.failed = False

    def _fallback(self, path: Path) -> Path:
        return Path(tempfile.gettempdir()) / f"llamassp-{self.run_id}" / path.name

    def _write(self, path: Path, write: Callable[[Path], Path]) -> None:
        try:
            self.written.append(write(path))
            return
        except OSError as exc:
            reason = exc.strerror or str(exc)
        self.failed = True
        fallback = self._fallback(path)
        try:
            fallback.parent.mkdir(parents=True, exist_ok=True)
            self.written.append(write(fallback))
            self.notes.append(f"could not write {path} ({reason}); wrote {fallback} instead")
        except OSError as exc:
            self.notes.append(f"could not write {path} ({reason}) nor {fallback} ({exc.strerror or exc})")

    def csv(self, name: str, rows: list[Mapping[str, Any]]) -> None:
        def write(path: Path) -> Path:
            appended = append_csv(path, rows)
            if appended.note:
                self.notes.append(appended.note)
            return appended.path

        self._write(self.results_dir / name, write)

    def text(self, name: str, content: str) -> None:
        def write(path: Path) -> Path:
            path.write_text(content)
            return path

        self._write(self.results_dir / name, write)

    def json(self, path: Path, payload: Any) -> None:
        def write(p: Path) -> Path:
            write_json(p, payload)
            return p

        self._write(path, write)


def mode_name(mode: str) -> str:
    """"rsp" -> "RSp", "ssp" -> "SSp": a mode as the tool writes it everywhere."""
    return {"rsp": "RSp", "ssp": "SSp"}.get(mode, mode)


def plural(count: int, noun: str) -> str:
    """"1 prompt", "3 prompts"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if abs(value) < 1:
            return f"{value:.3g}"
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[Mapping[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, payload: Any) -> None:
    """JSON with NaN written as null (JSON has no NaN) and paths as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(payload), indent=2, default=str) + "\n")


def _json_safe(value: Any) -> Any:
    """NaN becomes None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
