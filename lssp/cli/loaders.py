"""Loading what a command runs: models for our engine, handles and engines for vLLM."""
from __future__ import annotations

import logging
from dataclasses import replace

from lssp.cli.app import Settings
from lssp.cli.output import err_console
from lssp.report.results import plural

log = logging.getLogger("lssp")


def load(s: Settings, name: str, draft: bool = False, target=None):
    from lssp.models.loading import feature_head_folder, load_model

    spec = s.registry.get(name)
    if s.compile and not spec.compile and not (draft and feature_head_folder(spec)):
        spec = replace(spec, compile=True, forward="compact")
    with err_console.status(f"Loading {name} ({spec.path or 'random init'})…"):
        loaded = load_model(spec, s.device, draft, s.compile_fallback, target)
    log.info("%s: %s on %s, %.1f MB", name, loaded.precision, loaded.placement, loaded.weight_bytes / 1e6)
    return loaded


def heads_run(engines: list[str]) -> bool:
    """Whether every engine named drafts with our feature heads (where not, a default draft that is one gives way
    to the registry's ``default_draft_model``)."""
    from lssp.engines import ENGINES

    return all(ENGINES[name].runs_feature_heads for name in engines)


def load_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    t_name = s.registry.target_name(target_name)
    d_name = s.registry.draft_name(draft_name) if (draft_name or need_draft) else None
    target = load(s, t_name)
    if d_name is None:
        return target, None, None
    return (target, *load_draft_for(s, target, d_name))  # after the target: on the GPU it left emptiest


def load_draft_for(s: Settings, target, name: str):
    """One more draft for a loaded target, and the logit width they share."""
    from lssp.models.loading import check_compatible

    draft = load(s, s.registry.draft_name(name), draft=True, target=target)
    return draft, check_compatible(target, draft)


def load_engine_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    """The pair as vLLM will run it: tokenizers and configs only on our side (no weights loaded here)."""
    from lssp.engines.vllm import EngineModel, require_vllm
    from lssp.models.loading import check_compatible

    require_vllm()
    t_spec = s.registry.get(s.registry.target_name(target_name))
    d_name = s.registry.draft_name(draft_name) if (draft_name or need_draft) else None
    with err_console.status(f"Reading {t_spec.name} for vLLM…"):
        target = EngineModel(t_spec)
        draft = EngineModel(s.registry.get(d_name), target) if d_name else None
    if draft is not None:
        check_compatible(target, draft)
    return target, draft


def start_vllm(target, draft, keys: list[tuple[int, int]]):
    """vLLM engines for (k, lookup) modes (k = 0: RSp), all started before anything is timed."""
    from lssp.engines.vllm import VllmEngines

    with err_console.status(f"Starting {plural(len(keys), 'vLLM engine')}…") as status:
        return VllmEngines(target, draft, keys, lambda key: status.update(f"Started vLLM for K={key[0]}…"))


def load_llamacpp_pair(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool = True):
    """The pair as llama.cpp will run it: GGUF files (converted and cached where needed) and tokenizers."""
    from lssp.engines.llamacpp import LlamacppModel
    from lssp.engines.llamacpp_build import require_build
    from lssp.models.loading import check_compatible

    build = require_build()
    t_spec = s.registry.get(s.registry.target_name(target_name))
    d_name = s.registry.draft_name(draft_name, heads=False) if (draft_name or need_draft) else None
    with err_console.status(f"Preparing {t_spec.name} for llama.cpp (GGUF)…"):
        target = LlamacppModel(t_spec, build)
        draft = LlamacppModel(s.registry.get(d_name), build) if d_name else None
    if draft is not None:
        check_compatible(target, draft)
    return target, draft


def llamacpp_pair(s: Settings, wanted: list[str], target_name: str | None, draft_name: str | None,
                  need_draft: bool = True, confidences: tuple[float, ...] | list[float] = (0.0,)):
    """Where ``wanted`` names llamacpp: the build checked and what llama.cpp refuses refused, one line each, before
    anything else loads; then the pair as GGUF files (``load_llamacpp_pair``). None where it is not wanted."""
    if "llamacpp" not in wanted:
        return None
    check_llamacpp(wanted, confidences)
    return load_llamacpp_pair(s, target_name, draft_name, need_draft)


def check_vllm(wanted: list[str], confidences: tuple[float, ...] | list[float]) -> None:
    """Where ``wanted`` names vllm, one line first for an option vLLM has no equivalent of."""
    if "vllm" in wanted:
        from lssp.engines.vllm import check_options

        check_options(confidences)


def check_llamacpp(wanted: list[str], confidences: tuple[float, ...] | list[float] = (0.0,)) -> list[str]:
    """``wanted``; where it names llamacpp, one line first if llama.cpp is not built or an option has no llama.cpp
    equivalent."""
    if "llamacpp" in wanted:
        from lssp.engines.llamacpp import check_ready

        check_ready(confidences)
    return wanted


def llamacpp_runner(s: Settings, target_name: str | None, draft_name: str | None, keys: list[tuple[int, int]],
                    need_draft: bool = True):
    """(target, draft, engine) for a command that runs llama.cpp alone, its servers for ``keys`` started."""
    pair = llamacpp_pair(s, ["llamacpp"], target_name, draft_name, need_draft)
    return (*pair, llamacpp_engine(pair, keys))


def llamacpp_engine(pair, modes: list):
    """llama.cpp's engine for ``modes`` (the llamacpp ``Mode``s of a list, or (k, lookup) keys, k = 0: RSp) of
    ``pair`` (``llamacpp_pair``), its servers started."""
    from lssp.engines import LlamacppEngine, Mode

    keys = [LlamacppEngine.key(m) if isinstance(m, Mode) else m for m in modes
            if not isinstance(m, Mode) or m.engine == "llamacpp"]
    return LlamacppEngine(start_llamacpp(*pair, keys))


def start_llamacpp(target, draft, keys: list[tuple[int, int]]):
    """One llama-server per (k, lookup) mode (k = 0: RSp), all started before anything is timed (``main`` stops
    them when the command ends, however it ends)."""
    from lssp.engines.llamacpp import LlamacppServers

    with err_console.status(f"Starting {plural(len(set(keys)), 'llama-server')}…") as status:
        servers = LlamacppServers(target, draft, keys, lambda key: status.update(f"Started llama-server for K={key[0]}…"))
    return servers


def start_engine(s: Settings, name: str, keys: list[tuple[int, int]], target_name: str | None,
                 draft_name: str | None, need_draft: bool = True, loaded: tuple | None = None):
    """(target, draft, engine): engine ``name`` started for the (k, lookup) ``keys`` (k = 0: RSp) before anything is
    timed. The one place that maps an engine's name to how it starts: ours and hf run the models loaded here
    (``loaded``: (target, drafts, the logit width each shares with it), where a command has them already; hf runs the
    first draft), vLLM and llama.cpp their own copies."""
    from lssp.engines import OursEngine, TransformersEngine, VllmEngine

    def ours_models():
        if loaded:
            return loaded
        t, d, vocab = load_pair(s, target_name, draft_name, need_draft)
        return t, [d] if d else [], [vocab]

    def ours():
        t, drafts, vocabs = ours_models()
        return t, drafts[0] if drafts else None, OursEngine(t, drafts, vocabs)

    def hf():
        t, drafts, _ = ours_models()
        d = drafts[0] if drafts else None
        return t, d, TransformersEngine(t, d)

    def vllm():
        t, d = load_engine_pair(s, target_name, draft_name, need_draft)
        return t, d, VllmEngine(start_vllm(t, d, keys))

    def llamacpp():
        return llamacpp_runner(s, target_name, draft_name, keys, need_draft)

    starters = {"ours": ours, "hf": hf, "vllm": vllm, "llamacpp": llamacpp}
    return starters[name]()
