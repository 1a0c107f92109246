"""Issue 45's bars on this machine, in one go: ours against llama.cpp on the same GGUF (the issue's own command, greedy
and at T=0.7), our RSp against its floor, SSp over RSp on the story openings, the eval's time, verify of the default
pair, and whether the llama-server built here starts; beside them, as a reference, ours' RSp over llama.cpp's own
decoding with nothing around it (llama-bench). Each command writes its results files as usual (under OUT);
this script then reads their JSON and writes OUT/cpu-bars.json and OUT/cpu-bars.md: every bar, its value, met or not,
the runs it came from, and the CPU. Run it on every kind of machine the project meets (say which in the results).
Beside them, as references, ours against llama.cpp's bare decode as the context grows and on a 512-token prefill
(``benchmarks/depth.py``, OUT/depth.json), and against llama.cpp's fastest block format here, the file's 4-bit
blocks requantized (``benchmarks/llamacpp_formats.py``, OUT/formats.json).
Usage: .venv/bin/python benchmarks/cpu_bars.py OUT [--quick] [--reread]   (~7 minutes on 2 cores; --quick: ~3,
too few prompts for a verdict)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lssp.report.results import cpu_flags, cpu_name  # noqa: E402

BARS = {"fastest": 0.7, "rsp": 1.0, "floor": 1.3, "stories": 1.4, "eval_s": 60.0}
MET = {True: "yes", False: "**no**", None: "–"}  # None: a reference row, not a bar


def llamassp(out: Path, *args: str) -> tuple[int, float]:
    """Run one command (its results under ``out``); its exit code and wall time."""
    start = time.perf_counter()
    code = subprocess.call([sys.executable, str(REPO / "llamassp.py"), "--results-dir", str(out), *args], cwd=REPO)
    return code, time.perf_counter() - start


def overall(rows: list[dict], engine: str) -> list[dict]:
    """``engine``'s rows over all prompts (a run of one task has no "all" rows: its rows are)."""
    tasks = {r.get("task") for r in rows}
    return [r for r in rows if r["engine"] == engine and ("all" not in tasks or r.get("task") == "all")]


def fastest(rows: list[dict], engine: str) -> float:
    return min(r["ms_per_token"] for r in overall(rows, engine))


def rsp(rows: list[dict], engine: str) -> dict:
    return next(r for r in overall(rows, engine) if r["mode"] == "rsp")


def raw_decode() -> dict:
    """llama.cpp's own decoding of the default target's GGUF (llama-bench, as many threads as the engines use): a
    reference beside the bars, which take llama-server's timings; {} with "why" where it cannot run."""
    from lssp.engines.llamacpp import threads
    from lssp.engines.llamacpp_build import find_build, gguf_path, raw_decode
    from lssp.errors import UserError
    from lssp.models.registry import load_registry

    registry = load_registry(REPO / "models.yaml")
    build = find_build()
    if build is None:
        return {"why": "not built (./setup.sh --llamacpp)"}
    try:
        found = raw_decode(build, gguf_path(registry.get(registry.target_name(None)), build), threads())
    except UserError as error:
        return {"why": str(error)}
    return {"ms_per_token": found.ms_per_token, "sd_ms": found.sd_ms, "label": found.label}


def smoke() -> str:
    """Whether the llama-server built here starts ("" where it does), or why not."""
    from lssp.engines.llamacpp_build import find_build, smoke_model, smoke_test

    build, model = find_build(), smoke_model()
    if build is None or model is None:
        return "not built (./setup.sh --llamacpp)" if build is None else "no GGUF to start it on"
    return smoke_test(build.server, model) or ""


def measure(out: Path, quick: bool) -> dict:
    """Run every command; what the bars are read from."""
    n = ["--nb-prompts", "2" if quick else "8"]
    got: dict = {"codes": {}}
    for t in ("0", "0.7"):
        got["codes"][f"engines-t{t}"] = llamassp(out, "latency", "--engine", "ours,llamacpp", "--k", "2,3,4", "--lookup",
                                                 "0,4", "--ignore-eos", "--temperature", t, *n,
                                                 "--json", str(out / f"engines-t{t}.json"))[0]
        if t == "0":
            got["raw_decode"] = raw_decode()
    got["codes"]["stories"] = llamassp(out, "latency", "--k", "2,3,4", *(["--nb-prompts", "4"] if quick else []),
                                       "--json", str(out / "stories.json"))[0]
    problems = "100" if quick else "1000"
    got["codes"]["eval"], got["eval_wall_s"] = llamassp(out, "eval", "--both", "--nb-prompts", problems,
                                                        "--json", str(out / "eval.json"))
    for t, extra in (("0", ["--k", "1,2,4"]), ("0.7", ["--k", "1,4"] + (["--samples", "200"] if quick else []))):
        got["codes"][f"verify-t{t}"] = llamassp(out, "verify", "--temperature", t, *extra,
                                                "--json", str(out / f"verify-t{t}.json"))[0]
    got["llama_server"] = smoke()
    got["codes"]["depth"] = subprocess.call([sys.executable, str(REPO / "benchmarks" / "depth.py"), str(out / "depth"),
                                             "--passes", "1" if quick else "2"], cwd=REPO)
    got["codes"]["formats"] = subprocess.call([sys.executable, str(REPO / "benchmarks" / "llamacpp_formats.py"),
                                               str(out / "formats"), "--passes", "1" if quick else "2"], cwd=REPO)
    return got


def bars(out: Path, got: dict) -> list[dict]:
    """Each bar: what it asks, the value, met or not, the runs."""
    def read(name: str) -> list[dict]:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else []

    rows: list[dict] = []

    def bar(what: str, value: float | str, met: bool | None, runs: list[dict]) -> None:
        rows.append({"bar": what, "value": value, "met": None if met is None else bool(met),
                     "runs": sorted({r["run_id"] for r in runs if r.get("run_id")})})

    for t in ("0", "0.7"):
        engines = read(f"engines-t{t}.json")
        if {r["engine"] for r in engines} >= {"ours", "llamacpp"}:
            ratio = fastest(engines, "ours") / fastest(engines, "llamacpp")
            bar(f"T={t}: ours' fastest ÷ llama.cpp's fastest <= {BARS['fastest']}", round(ratio, 3),
                ratio <= BARS["fastest"], engines)
            ratio = rsp(engines, "ours")["ms_per_token"] / rsp(engines, "llamacpp")["ms_per_token"]
            bar(f"T={t}: ours' RSp ÷ llama.cpp's RSp <= {BARS['rsp']}", round(ratio, 3), ratio <= BARS["rsp"], engines)
        ours = rsp(engines, "ours") if t == "0" and engines else {}
        if ours.get("over_floor") is not None:  # each completion over the floor probed beside it (latency.over_floor)
            ratio, low, high = (ours[key] for key in ("over_floor", "over_floor_low", "over_floor_high"))
            bar(f"ours' RSp ÷ its floor ({ours['floor_precision']}, {ours['floor_ms']:.2f} ms at the median "
                f"{ours['bandwidth_gbs']:.1f} GB/s) <= {BARS['floor']}", f"{ratio:.3f} [{low:.3f}–{high:.3f}]",
                ratio <= BARS["floor"], engines)
        raw = got.get("raw_decode", {})
        if t == "0" and ours and raw.get("ms_per_token"):  # a reference, not a bar: llama.cpp with nothing around it
            bar(f"reference: ours' RSp ÷ llama.cpp's own decode ({raw['label']}: {raw['ms_per_token']:.2f} ± "
                f"{raw['sd_ms']:.2f} ms/token)", round(ours["ms_per_token"] / raw["ms_per_token"], 3), None, engines)
    stories = [r for r in read("stories.json") if r["mode"] == "ssp"]
    if stories:
        best = max(r["speedup"] for r in stories)
        bar(f"SSp ÷ RSp on the story openings >= {BARS['stories']}", round(best, 3), best >= BARS["stories"], stories)
    evals = read("eval.json")
    if evals:
        seconds = sum(r["trials"] * r["s_per_problem"] for r in evals)
        bar(f"eval --both: seconds beyond loading <= {BARS['eval_s']:g} (per 1000 problems)",
            round(seconds * 1000 / evals[0]["trials"], 1), seconds * 1000 / evals[0]["trials"] <= BARS["eval_s"], evals)
    for t in ("0", "0.7"):
        verdicts = read(f"verify-t{t}.json")
        verdicts = verdicts if isinstance(verdicts, list) else [verdicts]
        lossless = bool(verdicts) and all(v.get("lossless") is True for v in verdicts)
        bar(f"verify T={t}: LOSSLESS", "lossless" if lossless else "not shown", lossless, verdicts)
    bar("the llama-server built here starts", got["llama_server"] or "starts", not got["llama_server"], [])
    depth = out / "depth.json"
    for row in json.loads(depth.read_text())["rows"] if depth.exists() else []:  # references: benchmarks/depth.py
        bar(f"reference: ours ÷ llama.cpp, bare, {row['test']} (depth.py: {row['ours_ms_per_token']:.3g} against "
            f"{row['llamacpp_ms_per_token']:.3g} ms/token)", row["ours_over_llamacpp"], None, [])
    formats = out / "formats.json"
    if formats.exists():  # reference: llama.cpp's fastest block format here (benchmarks/llamacpp_formats.py)
        found = json.loads(formats.read_text())
        row = next(r for r in found["rows"] if r["format"] == found["fastest"])
        bar(f"reference: ours, bare, ÷ llama.cpp's fastest block format here ({found['fastest']}: "
            f"{row['tg64_at_d64_ms_per_token']:.3g} ms/token, tg64 @ d64; a copy requantized from the file, its greedy "
            f"tokens equal to the file's on {row['greedy_prompts_equal_to_q4_1']:.0%} of prompts; llamacpp_formats.py)",
            row["ours_q4_1_over_it"], None, [])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reread", action="store_true", help="read the files OUT holds again, running nothing but "
                        "the server check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reread:
        got = {"codes": {}, "llama_server": smoke(), "raw_decode": raw_decode()}
    else:
        got = measure(args.out, args.quick)
    found = bars(args.out, got)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2")))
    report = {"cpu": cpu_name(), "flags": flags, "quick": args.quick, "exit_codes": got["codes"], "bars": found}
    (args.out / "cpu-bars.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Issue 45's bars on {cpu_name()} ({', '.join(flags)})", "", "| bar | value | met | runs |",
             "|---|---|---|---|"] + [f"| {b['bar']} | {b['value']} | {MET[b['met']]} | "
                                     f"{', '.join(b['runs'])} |" for b in found]
    (args.out / "cpu-bars.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(b["met"] is not False for b in found) else 1


if __name__ == "__main__":
    sys.exit(main())
