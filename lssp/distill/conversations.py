"""Training contexts from ShareGPT's real conversations: the human turns a draft learns to answer as the target does.

A context is a conversation up to one of its human turns: the first turn alone, or (``multi_turn_share`` of the
conversations that have more) the turns and ShareGPT's own answers before a later human turn. The target writes the
answer (self-distillation, as EAGLE does): the draft learns the target's words, never the dataset's answers.

What is left out:
- the conversations whose first turns the evaluation draw uses (``--task sharegpt`` and ``load`` take the first N of
  ``lssp.workloads.sharegpt.draw``'s order): the first ``EVALUATION_RESERVED`` of that order are never trained on;
- the next ``HELD_OUT`` conversations of that order: the held-out split the learning curves are measured on;
- turns that are mostly not Latin-script text (the default target is an English model), empty, or longer than the
  draw's ``MAX_CHARS``; repeats of a first turn already kept (compared lower-cased, whitespace collapsed);
- any conversation with a turn that is one of the project's own benchmark prompts (``excluded_texts``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lssp.workloads import sharegpt

EVALUATION_RESERVED = 1000  # the draw's first conversations: what --task sharegpt and load measure on
HELD_OUT = 256  # the draw's next conversations: the held-out split of the learning curves
LATIN_SHARE = 0.95  # of a turn's characters, ASCII or Latin-1: the rest is dropped as another script
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Context:
    """Human ``turns`` and the dataset's ``answers`` between them (one fewer): the target writes the next answer."""

    key: str  # the conversation's id and the index of the human turn answered, e.g. "QWJhYvA_0:2"
    turns: tuple[str, ...]
    answers: tuple[str, ...]


def latin_text(text: str) -> bool:
    """Whether ``text`` is mostly Latin-script (ASCII and Latin-1 characters): what an English model can answer."""
    return bool(text) and sum(ord(ch) < 256 for ch in text) >= LATIN_SHARE * len(text)


def normalized(text: str) -> str:
    return _SPACES.sub(" ", text).strip().lower()


def exchanges(conversation: dict) -> tuple[list[str], list[str]]:
    """The human turns and model answers of a conversation while they alternate (human first), each usable text."""
    turns: list[str] = []
    answers: list[str] = []
    for i, message in enumerate(conversation.get("conversations") or []):
        want = "human" if i % 2 == 0 else "gpt"
        text = message.get("value") if isinstance(message, dict) and message.get("from") == want else None
        if not isinstance(text, str) or not text.strip() or len(text) > sharegpt.MAX_CHARS or not latin_text(text):
            break
        (turns if want == "human" else answers).append(text)
    return turns[:len(answers) + 1], answers[:len(turns)]


def _contexts(conversation_id: str, conversation: dict, rng: random.Random, multi_turn_share: float) -> list[Context]:
    turns, answers = exchanges(conversation)
    if not turns:
        return []
    out = [Context(f"{conversation_id}:0", (turns[0],), ())]
    later = len(turns) - 1  # human turns after the first
    if later >= 1 and rng.random() < multi_turn_share:
        at = rng.randint(1, later)
        out.append(Context(f"{conversation_id}:{at}", tuple(turns[:at + 1]), tuple(answers[:at])))
    return out


def split_contexts(seed: int = 0, multi_turn_share: float = 0.3,
                   excluded_texts: frozenset[str] = frozenset()) -> tuple[list[Context], list[Context]]:
    """(training, held-out) contexts, each list in an order shuffled with ``seed``. The evaluation draw's first
    EVALUATION_RESERVED conversations are in neither; the HELD_OUT after them form the held-out split."""
    order = [key for key, _ in sharegpt.draw(min(EVALUATION_RESERVED + HELD_OUT, len(sharegpt.first_turns())))]
    reserved, held = set(order[:EVALUATION_RESERVED]), set(order[EVALUATION_RESERVED:])
    excluded = {normalized(t) for t in excluded_texts}
    rng = random.Random(seed)
    seen: set[str] = set()
    train: list[Context] = []
    held_out: list[Context] = []
    for key, conversation in sharegpt.conversations():
        if key in reserved or not isinstance(conversation, dict):
            continue
        contexts = _contexts(key, conversation, rng, multi_turn_share)
        if not contexts:
            continue
        first = normalized(contexts[0].turns[0])
        if first in seen or any(normalized(t) in excluded for c in contexts for t in c.turns):
            continue
        seen.add(first)
        (held_out if key in held else train).extend(contexts)
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out
