"""The chart of a load run: SSp's ratio to RSp against concurrency, per-user latency and throughput."""
from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lssp.report.plot import save_figure  # noqa: E402

# (row key, what it is, line style, marker, x shift: throughput's points a little to the right, its interval's bar
# beside latency's at the same level)
FIGURES = (("latency_ratio", "per-user latency (RSp median TPOT ÷ SSp's)", "-", "o", 1.0),
           ("throughput_ratio", "throughput (SSp tokens/s ÷ RSp's)", "--", "s", 1.04))


def load_chart(rows: Sequence[Mapping[str, Any]], path: Path, title: str, caption: str) -> Path | None:
    """Draw both ratios of every SSp mode in ``rows`` (a load run's CSV rows) against concurrency into ``path``
    (PNG), each with its 95% interval as a bar where it has one; None where there is nothing to draw (no SSp row with a ratio)."""
    ssp = [r for r in rows if r.get("mode") == "ssp"]
    labels = list(dict.fromkeys(str(r["label"]) for r in ssp))
    unbatched = {str(r["label"]) for r in ssp if str(r.get("batched")) == "False"}
    if not any(_finite(r.get(key)) for r in ssp for key, *_ in FIGURES):
        return None
    fig, ax = plt.subplots(figsize=(7.0, 4.2), layout="constrained")
    levels = sorted({int(r["concurrency"]) for r in rows})
    colours = plt.get_cmap("tab10")
    for i, label in enumerate(labels):
        mine = sorted((r for r in ssp if r["label"] == label), key=lambda r: int(r["concurrency"]))
        for key, what, style, marker, shift in FIGURES:
            points = [(int(r["concurrency"]) * shift, float(r[key])) for r in mine if _finite(r.get(key))]
            if points:
                ax.plot(*zip(*points), style, marker=marker, color=colours(i), label=f"{label}{' (not batched)' if label in unbatched else ''}: {what}")
            bars = [(int(r["concurrency"]) * shift, float(r[key + "_low"]), float(r[key + "_high"])) for r in mine
                    if _finite(r.get(key + "_low")) and _finite(r.get(key + "_high"))]
            if bars:  # the 95% interval where the figure has one (latency; throughput over several passes)
                ax.vlines(*zip(*bars), color=colours(i), linewidth=1.2, alpha=0.6)
    ax.axhline(1.0, color="0.4", linewidth=0.9)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("SSp ÷ RSp (> 1: SSp pays)")
    fig.suptitle(textwrap.fill(title, 80), fontsize=10)
    ax.set_title(textwrap.fill(caption, 110), fontsize=7, color="0.35", loc="left")
    ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower left", fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def _finite(value: Any) -> bool:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return number == number and number not in (float("inf"), float("-inf"))
