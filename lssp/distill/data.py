"""The prompt set a draft is distilled on: written here, disjoint from every benchmark prompt."""
from __future__ import annotations

import random

from lssp.workloads.prompts import HELD_OUT
from lssp.workloads.tasks import all_task_texts

CHARACTERS = ["an old fisherman", "a young girl", "a retired teacher", "a lonely robot", "a curious cat", "two brothers",
              "a detective", "a baker", "a nurse on night shift", "a traveling musician", "a dragon", "a farmer",
              "an astronaut", "a shy student", "a king", "a street vendor", "a scientist", "a grandmother", "a pilot", "a thief"]
PLACES = ["a quiet village", "the mountains", "a busy market", "a space station", "an abandoned castle", "the desert",
          "a small island", "a hospital", "a library", "the old harbor", "a snowy forest", "a crowded train", "a school",
          "a farm", "the city at night", "a lighthouse", "a jungle", "a museum", "a kitchen", "a garden"]
TOPICS = ["photosynthesis", "the water cycle", "gravity", "volcanoes", "the Roman Empire", "electricity", "vaccines",
          "climate change", "black holes", "the internet", "democracy", "the human heart", "bees", "rainbows",
          "earthquakes", "the moon", "DNA", "inflation", "recycling", "sleep", "the printing press", "magnets",
          "the stock market", "dinosaurs", "solar panels", "tides", "memory", "coffee", "chess", "the immune system"]
TASKS = ["Write a short poem about {t}.", "Explain {t} to a ten-year-old.", "Give three facts about {t}.",
         "Summarize what you know about {t} in two sentences.", "Why is {t} important?", "What is {t}?",
         "Describe {t} in simple words.", "List some common misconceptions about {t}.",
         "Write a tweet about {t}.", "How would you teach {t} to a beginner?"]
STORY_OPENERS = ["Once there was {c} who lived in {p}.", "{C} walked slowly through {p}.",
                 "Nobody in {p} expected {c} to arrive that morning.", "Every evening, {c} sat by the window in {p}.",
                 "The letter reached {c} in {p} on a rainy Tuesday.", "Long ago, in {p}, {c} found a strange key.",
                 "{C} had never left {p} before.", "It started when {c} heard a knock in {p}."]
FACT_STARTS = ["{T} is", "The history of {t} begins", "Scientists study {t} because", "One surprising fact about {t} is that",
               "In simple terms, {t} works by", "Most people think {t}", "The main reason for {t} is",
               "A short introduction to {t}:"]
CODE_STARTS = ["def fibonacci(n):\n", "# Python function to reverse a string\ndef", "import os\n\ndef list_files(path):\n",
               "class Stack:\n    def __init__(self):\n", "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
               "for i in range(10):\n", "SELECT name, age FROM users WHERE", "function add(a, b) {\n",
               "def read_csv(path):\n", "# Sort a list of numbers\nnumbers = [5, 3, 8, 1]\n", "def factorial(n):\n",
               "#include <stdio.h>\n\nint main() {\n", "def count_words(text):\n", "public class Hello {\n"]
# Narrative and descriptive prose, first and third person: the register of plain text continuation.
SUBJECTS = ["The old man", "My sister", "The stranger", "Nobody", "The little boy", "Our teacher", "The captain",
            "Her father", "The woman next door", "The soldier", "My best friend", "The young doctor", "The girl",
            "The writer", "Everyone in town", "The boy with the red hat", "The guard", "My grandfather"]
ACTIONS = ["opened the door", "looked up at the sky", "closed the book", "stopped in the middle of the road",
           "picked up the phone", "turned around", "smiled for the first time in years", "ran toward the river",
           "sat down on the bench", "read the letter twice", "heard footsteps behind", "lit a candle",
           "packed a small bag", "climbed the hill", "knocked on the door", "found the map"]
TIMES = ["at dawn", "late at night", "on the first day of winter", "after the storm", "that summer",
         "in the spring of 1952", "just before midnight", "the next morning", "on a cold Monday", "years later"]
SCENES = ["The rain fell steadily on the roof of the old house", "A thick fog covered the harbor",
          "The streets were empty and silent", "The fire crackled in the fireplace", "Snow had buried the village",
          "The market was loud and full of color", "The wind howled through the trees", "The moon hung low over the fields",
          "The kitchen smelled of cinnamon and coffee", "The city lights flickered in the distance",
          "The train slowed down as it reached the border", "Birds sang in the garden"]
FEELINGS = ["afraid", "happy", "tired", "lost", "hopeful", "angry", "curious", "alone", "free", "nervous"]
NARRATIVES = ["{S} {a} {w}.", "{S} {a} and waited.", "{s2}, and {s} {a}.", "{s2} {w}.", "I {a} {w}.",
              "I had never felt so {f}.", "{S} felt {f} as {s} {a}.", "When I {a}, I knew something was wrong.",
              "{s2}. I was {f}.", "{S} {a}. It was the last time anyone saw {o}.", "We {a} {w}, {f} and quiet.",
              "Years ago, {s} {a}, and nothing was ever the same."]
QUESTIONS = ["What is the tallest mountain in the world?", "How do airplanes fly?", "Who wrote Romeo and Juliet?",
             "What causes the seasons?", "How many legs does a spider have?", "What is the speed of light?",
             "Why do we dream?", "What is the largest ocean?", "How do I boil an egg?", "What is a prime number?",
             "How does a refrigerator work?", "What is the boiling point of water?", "Why do leaves change color?",
             "What language is spoken in Brazil?", "How far is the sun from the earth?", "What is machine learning?"]


def _arithmetic(rng: random.Random) -> str:
    # Deliberately not the eval's "a * b = " few-shot format.
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return rng.choice([f"What is {a} plus {b}?", f"Compute {a} minus {b}.", f"{a} + {b} =", f"Calculate {a} times {b}.",
                       f"If I have {a} apples and buy {b} more, how many do I have?", f"What is {a} divided by {b}?"])


def _narrative(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    return rng.choice(NARRATIVES).format(
        S=subject, s=subject[0].lower() + subject[1:], a=rng.choice(ACTIONS), w=rng.choice(TIMES), s2=rng.choice(SCENES), f=rng.choice(FEELINGS),
        o=rng.choice(["him", "her", "them"]))


def _fill(template: str, rng: random.Random) -> str:
    c, p, t = rng.choice(CHARACTERS), rng.choice(PLACES), rng.choice(TOPICS)
    return template.format(c=c, C=c[0].upper() + c[1:], p=p, t=t, T=t[0].upper() + t[1:])


def training_prompts(n: int, seed: int, chat_share: float = 0.4) -> list[tuple[str, bool]]:
    """``n`` (prompt, use_chat_template) pairs, none of them a benchmark prompt."""
    rng = random.Random(seed)
    kinds = [
        lambda: _fill(rng.choice(STORY_OPENERS), rng),
        lambda: _narrative(rng),
        lambda: _fill(rng.choice(FACT_STARTS), rng),
        lambda: _fill(rng.choice(TASKS), rng),
        lambda: rng.choice(QUESTIONS),
        lambda: rng.choice(CODE_STARTS),
        lambda: _arithmetic(rng),
    ]
    held_out = HELD_OUT | all_task_texts()
    out: list[tuple[str, bool]] = []
    while len(out) < n:
        prompt = rng.choice(kinds)()
        if prompt in held_out:
            continue
        out.append((prompt, rng.random() < chat_share))
    return out
