"""The one run loop of every timed command: a warm-up per mode, passes over the prompts with the modes interleaved
prompt by prompt (their order rotating), a split pass where one is needed, and Ctrl-C keeping whole prompts."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from lssp.errors import ServerFailure

M = TypeVar("M", bound=Hashable)  # a way of generating: a Mode, or what a run interleaves (a format and a Mode, say)
P = TypeVar("P")  # a prompt, in whatever form the command keeps it
R = TypeVar("R")  # what one completion gives the command

# Called after each completion with what ran, how many completions are done and how many the run will make.
Progress = Callable[[str, int, int], None]
# Runs ``mode`` on prompt ``index`` (-1: the warm-up); the flag says whether to time every forward.
RunOne = Callable[[M, P, int, bool], R]


@dataclass
class Step(Generic[M, R]):
    """One timed completion."""

    index: int
    mode: M
    repeat: int  # which pass over the prompts
    split_pass: bool  # a pass synchronized around every forward, for the draft/target split only
    result: R


def rotated(modes: Sequence[M], index: int) -> list[M]:
    """The modes in the order prompt ``index`` runs them: each prompt starts one mode later than the one before,
    so no mode always runs first (after a cold cache) or last."""
    shift = index % len(modes) if modes else 0
    return [*modes[shift:], *modes[:shift]]


def run_interleaved(prompts: Sequence[P], modes: Sequence[M], run: RunOne, warmup: P, repeats: int = 1,
                    split_modes: Sequence[M] = (), progress: Progress | None = None,
                    describe: Callable[[P], str] = lambda prompt: "",
                    label: Callable[[M], str] = lambda mode: mode.name,
                    warmed: Callable[[], None] | None = None,
                    failures: list[str] | None = None) -> tuple[list[Step[M, R]], bool]:
    """Every mode on every prompt, ``repeats`` times, then ``split_modes`` once more each in a split pass (none:
    the timed passes time every forward themselves); ``warmed`` is called between the warm-up and the first timed
    completion. Returns the steps and whether Ctrl-C (or SIGTERM) cut the run, or with ``failures`` given, a
    server that failed (``ServerFailure``, its line appended there): then only the prompts completed in every mode
    of their pass are kept; with none complete it goes on up."""
    separate = bool(split_modes)
    passes = [(repeat, False) for repeat in range(repeats)] + ([(0, True)] if separate else [])
    total = len(modes) * (1 + repeats * len(prompts)) + len(split_modes) * len(prompts)
    done = 0

    def tick(message: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(message, done, total)

    for mode in modes:
        run(mode, warmup, -1, not separate)
        tick("warm-up " + label(mode))
    if warmed:
        warmed()
    steps: list[Step[M, R]] = []
    try:
        for repeat, split_pass in passes:
            for index, prompt in enumerate(prompts):
                for mode in rotated(split_modes if split_pass else modes, index):
                    steps.append(Step(index, mode, repeat, split_pass, run(mode, prompt, index, split_pass or not separate)))
                    what = describe(prompt)
                    tick(f"prompt {index + 1}/{len(prompts)}" + (f" {what}" if what else "")
                         + (" split pass" if split_pass else f" pass {repeat + 1}" if repeats > 1 else "") + f" {label(mode)}")
    except (KeyboardInterrupt, ServerFailure) as cut:
        if isinstance(cut, ServerFailure):
            if failures is None:
                raise
            failures.append(str(cut))
        steps = whole_prompts(steps, len(modes), len(split_modes))
        if not any(not s.split_pass for s in steps):
            raise
        return steps, True
    return steps, False


def whole_prompts(steps: Sequence[Step[M, R]], modes: int, split_modes: int) -> list[Step[M, R]]:
    """The steps of the prompts that ran in every mode of their pass."""
    count = Counter((s.repeat, s.split_pass, s.index) for s in steps)
    return [s for s in steps if count[(s.repeat, s.split_pass, s.index)] == (split_modes if s.split_pass else modes)]
