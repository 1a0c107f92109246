"""Every weight format of the default pair, RSp and SSp at K 2–4, in one interleaved run (issue 45's format table).

`latency` times one target; a format is a registry entry of its own (the target and its draft model in that
format), so this script loads every pair of FORMATS, then takes the prompts in turn and, for each prompt, every
format and mode in a rotated order, so that all of them see the machine alike (`latency`'s run loop, Ctrl-C keeping
the prompts done in every cell). Each completion's ms/token is
`latency`'s (first emission to last token); per format and mode: pooled ms/token, α, tokens per target forward, the
speedup over the reference format's RSp with its paired 95% interval (per-prompt ratios, as `latency`'s verdict),
and the same over the format's own RSp. The rows name the CPU, the formats' precisions and the share of the CPUs'
time other work took (over 25%: flagged busy). Greedy by default; `--temperature 0.7` for the sampled table.

Usage: python benchmarks/formats.py [--formats dynamic-fp16,q4_1,...] [--nb-prompts 8] [--ks 2,3,4]
       [--max-new-tokens 64] [--temperature 0] [--out benchmarks/results]
Writes OUT/formats-RUNID.json (rows) and OUT/formats-RUNID.md (the table).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lssp.decoding.sampling import SamplingParams  # noqa: E402
from lssp.engines import Mode, OursEngine, Request, request_seed  # noqa: E402
from lssp.errors import UserError  # noqa: E402
from lssp.measure.runloop import run_interleaved  # noqa: E402
from lssp.models.loading import check_compatible, load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.contention import BUSY_SHARE, cpu_snapshot, others_share  # noqa: E402
from lssp.report.results import RunInfo, markdown_table  # noqa: E402
from lssp.report.stats import ratio_interval  # noqa: E402
from lssp.workloads.prompts import LATENCY_PROMPTS, WARMUP_PROMPT  # noqa: E402

# name: (target entry, draft entry), the first the reference whose RSp every speedup is over.
FORMATS = {
    "dynamic-fp16": ("smollm2-135m-compact", "smollm2-135m-draft"),
    "q4_1": ("smollm2-135m-q4", "smollm2-135m-draft-q4"),
    "int4-compiled": ("smollm2-135m-int4-compiled", "smollm2-135m-draft-int4-compiled"),
    "bf16": ("smollm2-135m-bf16", "smollm2-135m-draft-bf16"),
}


def ms_per_token(stats: list) -> float:
    """`latency`'s pooled decode ms/token: timed spans ÷ timed tokens."""
    tokens = sum(s.timed_tokens for s in stats)
    return 1000 * sum(s.timed_s for s in stats) / tokens if tokens else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list of " + ", ".join(FORMATS))
    ap.add_argument("--nb-prompts", type=int, default=8)
    ap.add_argument("--ks", default="2,3,4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise SystemExit(f"formats.py: unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    ks = [int(k) for k in args.ks.split(",")]
    params = SamplingParams(args.temperature)
    registry = load_registry(REPO / "models.yaml")

    engines, precisions, info = {}, {}, None
    for name in list(names):  # every pair loaded (and compiled) before anything is timed
        target_name, draft_name = FORMATS[name]
        try:
            target = load_model(registry.get(target_name))
            draft = load_model(registry.get(draft_name), draft=True, target=target)
        except UserError as exc:  # a format this machine cannot run (q4_1 without AVX512-VNNI): said, left out
            print(f"formats.py: {name} left out: {exc}", file=sys.stderr)
            names.remove(name)
            continue
        engines[name] = OursEngine(target, [draft], [check_compatible(target, draft)])
        precisions[name] = f"{target.precision} / {draft.precision}"
        info = info or RunInfo.for_models(target, draft)
        print(f"loaded {name}: {precisions[name]}", file=sys.stderr)
    if not names:
        raise SystemExit("formats.py: no format can run on this machine")
    modes = [Mode("rsp"), *(OursEngine.ssp_mode("ours", k) for k in ks)]
    cells = [(name, mode) for name in names for mode in modes]
    prompts = LATENCY_PROMPTS[:args.nb_prompts]
    def complete(cell: tuple[str, Mode], text: str, index: int, time_forwards: bool):
        name, mode = cell
        engine = engines[name]
        request = Request(engine.target.encode(text), args.max_new_tokens, params, request_seed(args.seed, index),
                          time_forwards=time_forwards)
        return engine.complete(mode, request).stats

    start = None

    def warmed() -> None:  # compiled graphs built and first-call costs paid: the CPU share counts from here
        nonlocal start
        start = cpu_snapshot()

    def progress(message: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {message}", file=sys.stderr)

    steps, interrupted = run_interleaved(prompts, cells, complete, WARMUP_PROMPT, progress=progress,
                                         label=lambda cell: f"{cell[0]} {cell[1].name}", warmed=warmed)
    busy = others_share(start, cpu_snapshot())
    stats: dict[tuple[str, Mode], dict[int, object]] = {cell: {} for cell in cells}
    for step in steps:
        stats[step.mode][step.index] = step.result

    reference = stats[(names[0], modes[0])]
    rows = []
    for name, mode in cells:
        done = stats[(name, mode)]
        own_rsp = stats[(name, modes[0])]
        over_reference = ratio_interval([(reference[i].ms_per_token, done[i].ms_per_token) for i in done])
        over_own = ratio_interval([(own_rsp[i].ms_per_token, done[i].ms_per_token) for i in done])
        all_stats = list(done.values())
        drafted, accepted = sum(s.drafted for s in all_stats), sum(s.accepted for s in all_stats)
        forwards = sum(s.target_forwards for s in all_stats)
        rows.append({
            **info.head(), "format": name, "precision": precisions[name], "mode": mode.mode, "k": mode.k,
            "temperature": args.temperature, "prompts": len(done), "max_new_tokens": args.max_new_tokens,
            "ms_per_token": ms_per_token(all_stats),
            "alpha": accepted / (accepted + sum(s.rejections for s in all_stats)) if drafted else float("nan"),
            "tokens_per_forward": sum(s.new_tokens for s in all_stats) / forwards if mode.mode == "ssp" else float("nan"),
            "speedup_over_reference": over_reference.estimate, "reference_low": over_reference.low,
            "reference_high": over_reference.high, "speedup_over_own_rsp": over_own.estimate,
            "own_low": over_own.low, "own_high": over_own.high, "reference": f"{names[0]} RSp",
            "others_cpu_share": round(busy, 3), "noisy": busy > BUSY_SHARE, "interrupted": interrupted, **info.env,
        })
    fastest = min(rows, key=lambda r: r["ms_per_token"])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"formats-{info.run_id}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    def ranged(estimate: float, low: float, high: float) -> str:
        return f"{estimate:.2f} [{low:.2f}–{high:.2f}]" if low == low else f"{estimate:.2f}"

    shown = [{"format": r["format"], "mode": r["mode"].upper() + (f" K={r['k']}" if r["k"] else ""),
              "ms/token": f"{r['ms_per_token']:.1f}", "α": "–" if r["alpha"] != r["alpha"] else f"{r['alpha']:.2f}",
              f"× {names[0]} RSp": ranged(r["speedup_over_reference"], r["reference_low"], r["reference_high"]),
              "× own RSp": "–" if r["mode"] == "rsp" else
              ranged(r["speedup_over_own_rsp"], r["own_low"], r["own_high"])} for r in rows]
    busy_text = f" · **busy: other work took {busy:.0%} of the CPUs' time**" if busy > BUSY_SHARE else ""
    table = (f"# formats run {info.run_id}\n\n{info.describe()} · T={args.temperature:g} · {len(prompts)} story "
             f"openings × ≤{args.max_new_tokens} tokens · one interleaved run; speedups: geometric mean of per-prompt "
             f"ratios with their 95% t interval{busy_text}\n\nFormats (target / draft): "
             + "; ".join(f"{name}: {precisions[name]}" for name in names) + "\n\n"
             + markdown_table(shown, list(shown[0])) + f"\nFastest: {fastest['format']} {fastest['mode'].upper()}"
             + (f" K={fastest['k']}" if fastest["k"] else "") + f", {fastest['ms_per_token']:.1f} ms/token.\n")
    stem.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
