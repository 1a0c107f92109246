"""Where a registry entry's weights and config come from: its folder, GGUF file (and the converted copy kept in the
cache), hub id, or an architecture for random weights."""
from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path
from typing import Any

import transformers
import yaml
from transformers import AutoConfig

from lssp.errors import UserError
from lssp.models.hub import require_cached_or_online
from lssp.models.registry import ModelSpec

ARCHITECTURES_FILE = Path(__file__).with_name("architectures.yaml")


@cache
def architectures() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(ARCHITECTURES_FILE.read_text())


def random_config(spec: ModelSpec) -> Any:
    """The transformers config of an ``init: random`` entry."""
    fields = spec.config
    if isinstance(fields, str):
        if fields not in architectures():
            raise UserError(f"model {spec.name!r}: unknown architecture {fields!r}; known: {', '.join(architectures())}")
        fields = architectures()[fields]
    fields = dict(fields or {})
    model_type = fields.pop("model_type", "llama")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model {spec.name!r}: bad config: {exc}") from None


def model_source(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """The path or repo id from_pretrained takes, and the gguf_file/revision it needs; a repo id neither cached
    nor reachable (offline) is refused in one line, before transformers would retry each file."""
    local = spec.local_path()
    extra: dict[str, Any] = {"revision": spec.revision} if spec.revision else {}
    if local is None:
        require_cached_or_online(spec.path, spec.revision, f"model {spec.name!r}")
        return spec.path, extra
    if not local.exists():
        raise UserError(f"model {spec.name!r}: {local} does not exist")
    if spec.is_gguf:
        converted = gguf_copy_dir(local, spec.dtype)
        if (converted / "model.safetensors").exists():
            return str(converted), extra
        return str(local.parent), {**extra, "gguf_file": local.name}
    return str(local), extra


def cache_root() -> Path:
    """Where converted and exported copies are kept: $LLAMASSP_CACHE, else ~/.cache/llamassp."""
    return Path(os.environ.get("LLAMASSP_CACHE") or Path.home() / ".cache" / "llamassp")


def gguf_copy_dir(gguf: Path, dtype: str) -> Path:
    """Where the converted copy of a GGUF file lives: $LLAMASSP_CACHE, else ~/.cache/llamassp.

    transformers takes ~20 s to dequantize a GGUF model and read its tokenizer; the copy
    (safetensors and tokenizer files) loads in under a second. Its name covers the file's
    content (size, first and last MiB: the same file in two virtual environments shares one
    copy), the dtype and the transformers version.
    """
    key = f"{content_key(gguf)}|{dtype}|{transformers.__version__}"
    root = cache_root()
    return root / "gguf" / f"{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def content_key(path: Path, chunk: int = 2**20) -> str:
    """Size and a digest of the first and last ``chunk`` bytes: cheap, and the same wherever the file lies."""
    size = path.stat().st_size
    digest = hashlib.sha1()
    with path.open("rb") as f:
        digest.update(f.read(chunk))
        f.seek(max(0, size - chunk))
        digest.update(f.read(chunk))
    return f"{size}:{digest.hexdigest()}"
