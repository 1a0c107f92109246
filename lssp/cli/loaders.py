"""Loading what a command runs: models for our engine, the pair as vLLM and llama.cpp read it, and every engine started
through one registry (``STARTERS``)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lssp.cli.app import Settings
from lssp.cli.output import err_console
from lssp.errors import UserError
from lssp.report.results import plural

if TYPE_CHECKING:
    from lssp.measure.load import LoadBackend, LoadSetup

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
        draft = LlamacppModel(s.registry.get(d_name), build, target) if d_name else None
    if draft is not None:
        check_compatible(target, draft)
    return target, draft


def check_ready(wanted: Sequence[str], confidences: Sequence[float] = (0.0,)) -> list[str]:
    """``wanted``, each engine's readiness checked first (``Engine.check_ready``: installed or built, options it has
    no equivalent of): one line before anything loads."""
    from lssp.engines import engine_class

    for name in wanted:
        engine_class(name).check_ready(confidences)
    return list(wanted)


def check_ssp(command: str, engine: str, ks: Sequence[int], lookup: int, has_draft: bool = True) -> None:
    """One line (``UserError``) before anything starts where ``engine`` would not run SSp at one of ``ks`` with an
    n-gram length ``lookup`` as asked (``Engine.refuses``: llama.cpp's n-gram drafter below its n-gram length)."""
    from lssp.engines import engine_class

    kind = engine_class(engine)
    for k in ks:
        why = kind.refuses(kind.ssp_mode(engine, k, lookup, has_draft=has_draft))
        if why:
            raise UserError(f"{command} --engine {engine} --k {k} --lookup {lookup}: {why}")


@dataclass(frozen=True)
class Starter:
    """How one engine starts from the CLI: its pair as it runs it (``models``: (target, draft, the logit width they
    share, or None)), the engine for a command's (k, n-gram) keys (``engine``), and its servers under load
    (``serve``: the ``LoadBackend``)."""

    models: Callable[[Settings, str | None, str | None, bool], tuple[Any, Any, int | None]]
    engine: Callable[[Any, list, list, list[tuple[int, int]]], Any]  # (target, drafts, their widths, keys)
    serve: Callable[[Any, Any, int | None, LoadSetup, list], LoadBackend] | None = None  # None: not under load


def _ours_models(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool):
    return load_pair(s, target_name, draft_name, need_draft)


def _vllm_models(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool):
    return (*load_engine_pair(s, target_name, draft_name, need_draft), None)


def _llamacpp_models(s: Settings, target_name: str | None, draft_name: str | None, need_draft: bool):
    return (*load_llamacpp_pair(s, target_name, draft_name, need_draft), None)


def _ours(t, drafts: list, vocabs: list, keys):
    from lssp.engines import OursEngine

    return OursEngine(t, drafts, vocabs)


def _hf(t, drafts: list, vocabs: list, keys):
    from lssp.engines import TransformersEngine

    return TransformersEngine(t, drafts[0] if drafts else None)


def _vllm(t, drafts: list, vocabs: list, keys):
    from lssp.engines import VllmEngine
    from lssp.engines.vllm import VllmEngines

    with err_console.status(f"Starting {plural(len(keys), 'vLLM engine')}…") as status:
        return VllmEngine(VllmEngines(t, drafts[0] if drafts else None, keys,
                                      lambda key: status.update(f"Started vLLM for K={key[0]}…")))


def _llamacpp(t, drafts: list, vocabs: list, keys):
    from lssp.engines import LlamacppEngine
    from lssp.engines.llamacpp import LlamacppServers

    with err_console.status(f"Starting {plural(len(set(keys)), 'llama-server')}…") as status:
        servers = LlamacppServers(t, drafts[0] if drafts else None, keys,
                                  lambda key: status.update(f"Started llama-server for K={key[0]}…"))
    return LlamacppEngine(servers)  # ``main`` stops the servers when the command ends, however it ends


def _stopping(t, setup: LoadSetup):
    from lssp.decoding.generation import Stopping

    return Stopping() if setup.ignore_eos else Stopping(token_ids=t.eos_ids)


def _serve_ours(t, d, vocab, setup: LoadSetup, requests: list) -> LoadBackend:
    from lssp.measure.load_backends import EngineLoadBackend

    setup.draft_method = "draft"
    return EngineLoadBackend(_ours(t, [d] if d else [], [vocab], []), setup, _stopping(t, setup))


def _serve_vllm(t, d, vocab, setup: LoadSetup, requests: list) -> LoadBackend:
    from lssp.engines import Engine
    from lssp.engines.vllm import draft_method, draft_sampling
    from lssp.engines.vllm_server import VllmServers
    from lssp.measure.load_backends import VllmLoadBackend

    keys = [Engine.key(m) for m in setup.modes]
    with err_console.status(f"Starting {plural(len(keys), 'vLLM server')} together (about a minute on a "
                            "CPU)…") as status:
        servers = VllmServers(t, d, keys, lambda key: status.update(f"vLLM server for K={key[0]} is up…"))
    setup.draft_method = f"{draft_method(d)} ({draft_sampling(d)})" if d else ""
    return VllmLoadBackend(servers, setup, sorted(t.eos_ids), t.tokenizer)


def _serve_llamacpp(t, d, vocab, setup: LoadSetup, requests: list) -> LoadBackend:
    """One llama-server per mode with a slot per request in flight, each slot as long as the longest request
    needs."""
    from lssp.engines import Engine
    from lssp.engines.llamacpp import LlamacppServers
    from lssp.measure.load_llamacpp import LlamacppLoadBackend, slot_context

    slots = setup.levels[-1]
    per_slot = slot_context([len(r.ids) for r in requests], setup.max_new_tokens, max(m.k for m in setup.modes))
    keys = [Engine.key(m) for m in setup.modes]
    with err_console.status(f"Starting {plural(len(keys), 'llama-server')} with {plural(slots, 'slot')} "
                            "each…") as status:
        servers = LlamacppServers(t, d, keys, lambda key: status.update(f"llama-server for K={key[0]} is up…"),
                                  slots=slots, context=per_slot * slots)
    setup.draft_method = "draft-simple" if d else ""
    return LlamacppLoadBackend(servers, setup, _stopping(t, setup))


# The one place that maps an engine's name to how the CLI starts it: ours and hf run the models loaded here, vLLM
# and llama.cpp their own copies.
STARTERS: dict[str, Starter] = {
    "ours": Starter(_ours_models, _ours, _serve_ours),
    "hf": Starter(_ours_models, _hf),
    "vllm": Starter(_vllm_models, _vllm, _serve_vllm),
    "llamacpp": Starter(_llamacpp_models, _llamacpp, _serve_llamacpp),
}


def start_engine(s: Settings, name: str, keys: list[tuple[int, int]], target_name: str | None,
                 draft_name: str | None, need_draft: bool = True, loaded: tuple | None = None):
    """(target, draft, engine): engine ``name`` started for the (k, n-gram) ``keys`` (``Engine.key``; (0, 0): RSp)
    before anything is timed. ``loaded``: (target, drafts, the logit width each shares with it) where a command has
    loaded our models already (ours runs them all, hf the first)."""
    from lssp.engines import engine_class

    starter = STARTERS[name]
    if loaded and engine_class(name).runs_our_weights:
        t, drafts, vocabs = loaded
    else:
        t, d, vocab = starter.models(s, target_name, draft_name, need_draft)
        drafts, vocabs = ([d], [vocab]) if d else ([], [])
    ours_only = [(d.name, key) for d in drafts for key in ("prompt_lookup", "confidence") if getattr(d.spec, key)]
    if ours_only and not engine_class(name).takes_lookup:
        draft, key = ours_only[0]
        what = "copy first, then the draft" if key == "prompt_lookup" else "the confidence stop"
        raise UserError(f"{draft}: {key} ({what}) runs on our engine alone, not "
                        f"{engine_class(name).label or name}; use the entry without it there")
    return t, drafts[0] if drafts else None, starter.engine(t, drafts, vocabs, keys)


def endpoints_and_tokenizer(s: Settings, target_name: str | None, values: list[str]):
    """(the target as a tokenizer only, the --endpoint servers, each asked what it serves) for a command over servers
    already running; one line for a malformed --endpoint, a server that does not answer, or one that tokenizes a
    probe text otherwise than the target's tokenizer (where it says, ``POST /tokenize``)."""
    from lssp.engines.endpoint import introduce, parse_endpoints, tokenizer_mismatch, with_tokenizer
    from lssp.engines.vllm import EngineModel

    endpoints = parse_endpoints(values)
    with err_console.status("Reading the target's tokenizer and asking each server what it serves…"):
        target = EngineModel(s.registry.get(s.registry.target_name(target_name)))
        endpoints = [with_tokenizer(introduce(e), target.tokenizer) for e in endpoints]
        for endpoint in endpoints:  # prompts go as token ids: the servers must read them as TARGET's tokenizer does
            mismatch = tokenizer_mismatch(endpoint, lambda text: target.tokenizer.encode(text, add_special_tokens=False))
            if mismatch:
                raise UserError(f"--endpoint {endpoint.label} ({endpoint.model}) does not tokenize as {target.name}: "
                                f"{mismatch}; give the served model's tokenizer as TARGET")
    target.engine_placement = "remote servers (--endpoint)"
    return target, endpoints
