"""Engines: one way to run a completion (ours, transformers, vLLM, llama.cpp) behind one interface (``base.Engine``).

Adding an engine is one module with an ``Engine`` subclass and its line in ``ENGINES``.
"""
from __future__ import annotations

from lssp.engines.base import Engine, EngineInfo, Mode, Request, request_seed
from lssp.engines.endpoint import EndpointEngine
from lssp.engines.llamacpp import LlamacppEngine
from lssp.engines.ours import OursEngine
from lssp.engines.transformers import TransformersEngine
from lssp.engines.vllm import VllmEngine
from lssp.errors import UserError

ENGINES: dict[str, type[Engine]] = {"ours": OursEngine, "hf": TransformersEngine, "vllm": VllmEngine,
                                    "llamacpp": LlamacppEngine, "endpoint": EndpointEngine}

__all__ = ["ENGINES", "EndpointEngine", "Engine", "EngineInfo", "LlamacppEngine", "Mode", "OursEngine", "Request", "TransformersEngine", "VllmEngine", "check_engines", "engine_class",
           "request_seed"]


def engine_class(name: str) -> type[Engine]:
    """The engine registered as ``name``, whose class attributes say what it can do (the base class for a name not
    registered: a test's stand-in)."""
    return ENGINES.get(name, Engine)


def check_engines(command: str, wanted: list[str], allowed: tuple[str, ...]) -> list[str]:
    """``wanted`` if ``command`` takes each of them (once); else one line saying which engines it takes."""
    unknown = [e for e in wanted if e not in allowed]
    if unknown or not wanted or len(set(wanted)) < len(wanted):
        raise UserError(f"{command} --engine {','.join(wanted) or repr('')}: {command} takes "
                        f"{' or '.join(allowed) if len(allowed) < 3 else ', '.join(allowed)}"
                        + (", comma-separated, each once" if len(allowed) > 1 else ""))
    return wanted
