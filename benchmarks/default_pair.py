"""The default pair as the A/B scripts here load it: the registry's default target, its default drafter's entry and
the drafter's model (a fresh drafter per completion: ``lssp.drafters.entry_drafter``)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lssp.models.loading import LoadedModel, load_model  # noqa: E402
from lssp.models.registry import ModelSpec, load_registry  # noqa: E402


def load_default_target() -> LoadedModel:
    """The default target of ``models.yaml``, loaded."""
    registry = load_registry(REPO / "models.yaml")
    return load_model(registry.get(registry.target_name(None)))


def load_default_pair() -> tuple[LoadedModel, ModelSpec, LoadedModel]:
    """(the default target, the default draft's entry, the draft loaded for that target) of ``models.yaml``."""
    registry = load_registry(REPO / "models.yaml")
    target = load_model(registry.get(registry.target_name(None)))
    spec = registry.get(registry.draft_name(None))
    return target, spec, load_model(spec, draft=True, target=target)


def target_beside_llamacpp():
    """(the llama.cpp build here, the default target loaded, its GGUF file, the threads both engines use), for the
    scripts that set ours beside llama-bench; exits in one line where llama.cpp is not built."""
    from lssp.engines.llamacpp import threads
    from lssp.engines.llamacpp_build import find_build, gguf_path

    build = find_build()
    if build is None:
        sys.exit("llama.cpp is not built here (./setup.sh --llamacpp)")
    target = load_default_target()
    return build, target, gguf_path(target.spec, build), threads()


def default_llamacpp_servers(k: int):
    """(llama-servers of the default pair, RSp and the draft model at ``k``, started; the target as llama.cpp loads
    it; the draft), for the scripts that reach the same servers two ways; exits in one line where llama.cpp is not
    built."""
    from lssp.engines.llamacpp import LlamacppModel, LlamacppServers
    from lssp.engines.llamacpp_build import find_build

    build = find_build()
    if build is None:
        sys.exit("llama.cpp is not built here (./setup.sh --llamacpp)")
    registry = load_registry(REPO / "models.yaml")
    target = LlamacppModel(registry.get(registry.target_name(None)), build)
    draft = LlamacppModel(registry.get(registry.draft_name(None, heads=False)), build, target)
    return LlamacppServers(target, draft, [(0, 0), (k, 0)]), target, draft


def two_ways(out: Path, run, pairs, near: str, far: str) -> list[dict]:
    """A latency run's files in ``out``, then per (name, mode reached the ``near`` way, the same reached the ``far``
    way): both ms/token, far ÷ near (the geometric mean of per-prompt ratios, its 95% interval), acceptance, greedy
    agreement with RSp and tokens each way."""
    from lssp.measure.latency import paired_speedup
    from lssp.report.results import append_csv

    out.mkdir(parents=True, exist_ok=True)
    append_csv(out / "latency.csv", run.rows())
    append_csv(out / "latency_prompts.csv", run.prompt_rows())
    (out / f"latency-{run.info.run_id}.md").write_text(run.markdown())
    table = []
    for name, near_mode, far_mode in pairs:
        ratio, _ = paired_speedup(run.timings, far_mode, near_mode)  # far ms/token ÷ near, per prompt
        a = next(m for m in run.overall if m.how == near_mode)
        b = next(m for m in run.overall if m.how == far_mode)
        table.append({"mode": name, f"{near}_ms_per_token": round(a.ms_per_token, 3),
                      f"{far}_ms_per_token": round(b.ms_per_token, 3), f"{far}_over_{near}": ratio.estimate,
                      "low": ratio.low, "high": ratio.high, f"{near}_acceptance": a.acceptance_rate,
                      f"{far}_acceptance": b.acceptance_rate, f"{near}_same_as_rsp": a.same_as_rsp,
                      f"{far}_same_as_rsp": b.same_as_rsp, f"{near}_tokens": a.new_tokens, f"{far}_tokens": b.new_tokens})
    return table
