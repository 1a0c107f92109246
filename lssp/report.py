"""Results on disk: CSV rows appended with the environment, Markdown tables, JSON summaries."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def cpu_features() -> str:
    """The vector ISA torch uses and whether the CPU computes bf16 natively: the same model name can
    hide both, and bf16 matmuls without native support cost about K times more for K tokens."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = set((_cpuinfo("flags") or "").split())
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return f"{capability}, " + (f"bf16: {'+'.join(native)}" if native else "no native bf16")


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


def append_csv(path: Path, rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Append rows to a CSV, keeping every earlier row (new columns are added, never dropped)."""
    new = pd.DataFrame(list(rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        old = pd.read_csv(path)
        if list(new.columns) == list(old.columns):
            new.to_csv(path, mode="a", header=False, index=False)
            return new
        new = pd.concat([old, new], ignore_index=True)
        columns = list(old.columns) + [c for c in new.columns if c not in old.columns]
        new[columns].to_csv(path, index=False)
        return new
    new.to_csv(path, index=False)
    return new


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
