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
