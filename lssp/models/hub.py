"""The Hugging Face hub, asked as little as possible: what a repo id looks like, what the local cache holds, and
whether the hub can be reached at all (asked once, in a few seconds, so that a machine without a network fails in
one line instead of retrying every file for half a minute)."""
from __future__ import annotations

import logging
import os
import re
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
PROBE_TIMEOUT_S = 3.0


def is_repo_id(text: str) -> bool:
    """``owner/name`` as the hub spells repo ids (one slash, no leading dot, not a .gguf file)."""
    return bool(REPO_ID.fullmatch(text)) and not text.endswith(".gguf")


def cached_file(repo_id: str, filename: str = "config.json", revision: str | None = None) -> Path | None:
    """``filename`` of ``repo_id`` in the local Hugging Face cache, or None (never asks the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # noqa: BLE001 - a malformed id or cache trouble means "not cached"
        return None
    return Path(found) if isinstance(found, str) else None


def offline_reason() -> str | None:
    """Why the hub is not to be asked (HF_HUB_OFFLINE, or no answer from it), or None when it can be.

    The first time the hub does not answer, offline mode is switched on for this process (and the processes it
    starts), so that transformers reads the cache at once instead of retrying each file.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline: HF_HUB_OFFLINE=1"
    if _hub_answers():
        return None
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    return f"unreachable: no answer from {constants.ENDPOINT}"


@cache
def _hub_answers() -> bool:
    """One request to the hub's front page, no retries: does anything answer?"""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - DNS, connection, TLS, proxy: all mean "no hub here"
        log.info("the hub does not answer (%s): working from the local cache", exc)
        return False
    return True


def require_cached_or_online(repo_id: str, revision: str | None, what: str) -> None:
    """Raise one line when ``repo_id`` is not in the cache and the hub cannot be asked (``what`` names it). Asking
    first also switches a machine without a network to offline mode, so that a cached model loads without retries."""
    from lssp.errors import UserError

    reason = offline_reason()
    if reason and cached_file(repo_id, revision=revision) is None:
        raise UserError(f"{what}: {repo_id} is not in the local Hugging Face cache and the hub is {reason}")
