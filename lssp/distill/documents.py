"""Training prompts that hand the target a text to work on: summarize it, answer from it, translate it, rewrite it.

A chat-trained head learns to answer questions; an answer that summarizes, quotes or translates a long input repeats
that input's words, which such a head predicts poorly (the task categories' summarization, RAG and translation).
These prompts put a text in front of the target as those tasks do, so the head learns from the target's own answers
to them. The texts are ShareGPT's answers (``conversations.exchanges``) of the conversations ``split_contexts`` keeps
for training (or holds out), so none of the evaluation draw's and none with a benchmark prompt; the question of a RAG
prompt is the conversation's own first human turn. Which task, template and cut each text gets is seeded.
"""
from __future__ import annotations

import random
import re

from lssp.distill.conversations import exchanges, split_contexts
from lssp.workloads import sharegpt

SHORTEST, LONGEST = 300, 2400  # characters of a text worked on (~70-550 tokens)
TRANSLATED = 700  # characters of a text translated, at most (the translation prompts' texts are short)
QUESTION = 300  # characters of a RAG question, at most
KINDS = (("summarize", 0.35), ("rag", 0.35), ("translate", 0.15), ("rewrite", 0.15))
SUMMARIZE = ("Summarize the following text in {n} sentences.\n\n{text}",
             "Summarize the following article in a few sentences.\n\n{text}",
             "Write a short summary of this passage:\n\n{text}",
             "What are the main points of the following text?\n\n{text}")
REWRITE = ("Rewrite the following text in simpler words.\n\n{text}",
           "Rewrite this passage to be more formal:\n\n{text}",
           "Shorten the following text, keeping its meaning.\n\n{text}")
RAG = "Answer the question using the passages below.\n\n{passages}\n\nQuestion: {question}"
INTO_ENGLISH = "Translate the following {language} text into English:\n\n{text}"
FROM_ENGLISH = "Translate the following text into {language}:\n\n{text}"
# A few frequent words of each language: a text with several of them (and few English ones) is taken as in it.
STOPWORDS = {"German": {"der", "die", "und", "nicht", "ist", "ich", "das", "mit", "auf", "für", "eine", "sie"},
             "French": {"le", "la", "les", "et", "est", "une", "pour", "dans", "que", "pas", "vous", "des"},
             "Spanish": {"el", "la", "los", "las", "y", "es", "una", "para", "que", "por", "con", "del"}}
ENGLISH = {"the", "and", "is", "of", "to", "in", "that", "for", "with", "you", "are", "this"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"[^\W\d_]+")


def language(text: str) -> str:
    """English, or the language among STOPWORDS whose frequent words the text uses most (at least 5, more than
    English's)."""
    words = [w.lower() for w in _WORD.findall(text)]
    english = sum(w in ENGLISH for w in words)
    counts = {name: sum(w in stop for w in words) for name, stop in STOPWORDS.items()}
    best = max(counts, key=counts.__getitem__)
    return best if counts[best] >= 5 and counts[best] > english else "English"


def cut(text: str, limit: int) -> str:
    """The text's first sentences, up to ``limit`` characters (its first ``limit`` where one sentence is longer)."""
    out = ""
    for sentence in _SENTENCE_END.split(text):
        if out and len(out) + 1 + len(sentence) > limit:
            break
        out = f"{out} {sentence}" if out else sentence
    return out[:limit]


def passages(text: str, rng: random.Random) -> str:
    """``text`` as 2 or 3 numbered passages (split at paragraph breaks, else between sentences)."""
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(parts) < 2:
        parts = _SENTENCE_END.split(text)
    n = min(len(parts), rng.choice((2, 3)))
    size = -(-len(parts) // n)
    groups = [" ".join(parts[i:i + size]) for i in range(0, len(parts), size)]
    return "\n\n".join(f"Passage {i + 1}: {g}" for i, g in enumerate(groups))


def document_prompt(question: str, text: str, rng: random.Random) -> str | None:
    """A prompt working on ``text`` (a ShareGPT answer; ``question``: what it answered), or None where the text is too
    short or too long."""
    text = text.strip()
    if not SHORTEST <= len(text) <= LONGEST:
        return None
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    if kind == "summarize":
        return rng.choice(SUMMARIZE).format(n=rng.choice(("two", "three")), text=text)
    if kind == "rewrite":
        return rng.choice(REWRITE).format(text=text)
    if kind == "rag":
        return RAG.format(passages=passages(text, rng), question=cut(question.strip(), QUESTION))
    spoken = language(text)
    if spoken != "English":
        return INTO_ENGLISH.format(language=spoken, text=cut(text, TRANSLATED))
    return FROM_ENGLISH.format(language=rng.choice(sorted(STOPWORDS)), text=cut(text, TRANSLATED))


def document_prompts(seed: int = 0, excluded_texts: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(training, held-out) prompts over the first answers of ``split_contexts``' conversations (the same split,
    the same order), one per conversation whose first answer is usable."""
    train, held = split_contexts(seed, multi_turn_share=0.0, excluded_texts=excluded_texts)
    by_key = dict(sharegpt.conversations())
    rng = random.Random(seed)

    def prompts(contexts: list) -> list[str]:
        out = []
        for context in contexts:
            turns, answers = exchanges(by_key[context.key.rsplit(":", 1)[0]])
            prompt = document_prompt(turns[0], answers[0], rng) if answers else None
            if prompt is not None:
                out.append(prompt)
        return out

    return prompts(train), prompts(held)
