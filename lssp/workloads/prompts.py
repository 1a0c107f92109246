"""Built-in prompt lists. These stay out of any draft's training data (see distill.py)."""
from __future__ import annotations

from pathlib import Path

from lssp.errors import UserError

# The reference tool's untimed warm-up sentence and its timed sentences. The reference lost
# a comma between two of them (so it timed 15); here all 16 stand on their own.
WARMUP_PROMPT = "In which country is Hamburg?\n"
LATENCY_PROMPTS = [
    "How are you doing today?\n",
    "It was a dark and stormy night.",
    "The sun rose slowly over the horizon, casting a warm glow on the world below.",
    "I never believed in ghosts until the day I met one.",
    "The sound of the train whistle echoed through the valley as I stood at the station, waiting.",
    "She walked into the room and everything changed.",
    "The smell of freshly baked bread filled the air as I entered the bakery.",
    "The first time I saw her, I knew she was trouble.",
    "The world was ending, and I was the only one who knew.",
    "It was the best of times, it was the worst of times.",
    "The forest was alive with the sound of animals as I walked deeper into the woods.",
    "As I looked out over the city, I knew that anything was possible.",
    "The sound of gunfire echoed through the streets as I ran for cover.",
    "The waves crashed against the shore, a never-ending cycle of destruction and creation.",
    "I woke up to find myself in a strange place, with no memory of how I got there.",
    "The clock struck midnight, and I knew that my life would never be the same.",
]
COMPARE_EXAMPLES = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
]
HELD_OUT = frozenset([WARMUP_PROMPT, *LATENCY_PROMPTS, *COMPARE_EXAMPLES])


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line; ``\\n`` inside a line stands for a newline."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompts file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts")
    return prompts
