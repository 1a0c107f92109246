"""The one run loop: warm-ups, rotation, repeats, the split pass, and Ctrl-C keeping whole prompts."""
from __future__ import annotations

import pytest

from lssp.engines import Mode
from lssp.measure.runloop import rotated, run_interleaved

OURS = [Mode("rsp"), Mode("ssp", 2)]
MIXED = [*OURS, Mode("rsp", engine="vllm"), Mode("ssp", 2, engine="vllm")]


def recorder():
    calls = []

    def run(mode: Mode, prompt: str, index: int, time_forwards: bool) -> tuple[str, int, bool]:
        calls.append((mode, index, time_forwards))
        return mode.name, index, time_forwards

    return calls, run


def interrupt_at(moment: str):
    def progress(message: str, done: int, total: int) -> None:
        if message == moment:
            raise KeyboardInterrupt
    return progress


def test_warm_ups_then_every_mode_on_every_prompt_rotating():
    calls, run = recorder()
    seen = []
    steps, interrupted = run_interleaved(["a", "b", "c"], OURS, run, "w", repeats=2,
                                         progress=lambda message, done, total: seen.append((done, total)))
    assert not interrupted and [c[1] for c in calls[:2]] == [-1, -1]  # the warm-ups come first, untimed
    assert len(steps) == 2 * 3 * 2 and [s.mode for s in steps[:4]] == [OURS[0], OURS[1], OURS[1], OURS[0]]
    assert seen[-1] == (len(calls), len(calls))  # the total was right from the start
    assert all(time_forwards for *_, time_forwards in calls)  # no split pass: the timed passes time forwards


def test_warmed_is_called_between_the_warm_ups_and_the_first_timed_completion():
    calls, run = recorder()
    at = []
    run_interleaved(["a", "b"], OURS, run, "w", warmed=lambda: at.append(len(calls)))
    assert at == [len(OURS)]  # after every warm-up, before anything timed (graphs built before are not counted)


def test_the_split_pass_runs_only_its_modes_and_the_timed_passes_do_not_sync():
    calls, run = recorder()
    steps, _ = run_interleaved(["a", "b"], MIXED, run, "w", split_modes=OURS)
    split = [s for s in steps if s.split_pass]
    assert {s.mode for s in split} == set(OURS) and len(split) == 2 * 2
    assert all(not s.result[2] for s in steps if not s.split_pass) and all(s.result[2] for s in split)


def test_ctrl_c_keeps_the_prompts_complete_in_every_mode_of_their_pass():
    _, run = recorder()
    steps, interrupted = run_interleaved(["a", "b", "c"], MIXED, run, "w", split_modes=OURS,
                                         progress=interrupt_at("prompt 2/3 split pass ssp k=2"))
    assert interrupted
    assert {(s.index, s.split_pass) for s in steps} == {(0, False), (1, False), (2, False), (0, True)}
    assert len([s for s in steps if s.split_pass]) == len(OURS)  # the split pass counts its own modes, not all four


def test_ctrl_c_in_the_middle_of_a_prompt_drops_that_prompt_and_before_any_prompt_goes_on_up():
    _, run = recorder()
    order = rotated(MIXED, 1)
    steps, interrupted = run_interleaved(["a", "b"], MIXED, run, "w", progress=interrupt_at(f"prompt 2/2 {order[1].name}"))
    assert interrupted and {s.index for s in steps} == {0} and len(steps) == len(MIXED)
    with pytest.raises(KeyboardInterrupt):
        run_interleaved(["a"], MIXED, run, "w", progress=interrupt_at(f"prompt 1/1 {MIXED[0].name}"))


def test_a_server_failing_mid_run_keeps_whole_prompts_where_asked():
    """``ServerFailure`` at prompt c's second mode: with ``failures`` the prompts a and b come back, interrupted, the
    line kept; without, it goes on up (a command that keeps nothing); at the first prompt, it goes on up too."""
    from lssp.errors import ServerFailure

    def failing_at(index: int):
        calls, record = recorder()

        def run(mode: Mode, prompt: str, at: int, time_forwards: bool):
            if at == index and mode == OURS[1]:
                raise ServerFailure("server x failed")
            return record(mode, prompt, at, time_forwards)
        return run

    failures: list[str] = []
    steps, interrupted = run_interleaved(["a", "b", "c"], OURS, failing_at(2), "w", failures=failures)
    assert interrupted and failures == ["server x failed"] and sorted({s.index for s in steps}) == [0, 1]
    with pytest.raises(ServerFailure):
        run_interleaved(["a", "b", "c"], OURS, failing_at(2), "w")
    with pytest.raises(ServerFailure):
        run_interleaved(["a", "b"], OURS, failing_at(0), "w", failures=[])
