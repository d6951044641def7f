"""engine/train/run_timing.py: which steps the steady figures (bench/throughput.py's rows) are taken from."""

from __future__ import annotations

import pytest

from engine.compile.clock import CompileTotals
from engine.train.run_timing import RunTiming


class _Clock:
    """A CompileClock whose totals the test moves: seconds and graphs compiled so far."""

    def __init__(self):
        self.now = CompileTotals()

    def totals(self) -> CompileTotals:
        return self.now

    def compile(self, seconds: float, graphs: int) -> None:
        self.now = CompileTotals(seconds=self.now.seconds + seconds, graphs=self.now.graphs + graphs)


def _steps(timing: RunTiming, clock: _Clock, count: int, *, size=(4, 3, 64, 96), compile_at=None) -> None:
    for number in range(count):
        before = timing.step_started()
        if number == compile_at:
            clock.compile(seconds=2.0, graphs=1)
        timing.step_ended(before, size=size, data_s=0.0)


@pytest.mark.parametrize(
    "compile_at, first_steady",
    [
        (None, 2 + (20 - 2) // 2 + 1),  # warm from step 3 (two warm-up steps of the size): steps 12 to 20
        (9, 10 + (20 - 10) // 2 + 1),  # step 10 compiled a graph: steps 11 to 20 are warm, the last half from 16
    ],
)
def test_steady_steps_are_the_second_half_of_the_warm_steps_after_the_last_graph_compiled(compile_at, first_steady):
    clock = _Clock()
    timing = RunTiming(started=0.0, clock=clock)
    _steps(timing, clock, 20, compile_at=compile_at)
    steady = timing.steady()
    assert timing.steps == 20
    assert steady["first_step"] == first_steady
    assert steady["steps"] == 20 - first_steady + 1
    assert steady["images_per_s"] > 0


def test_a_run_whose_last_step_compiled_has_no_steady_figures_yet():
    clock = _Clock()
    timing = RunTiming(started=0.0, clock=clock)
    _steps(timing, clock, 10, compile_at=9)
    assert timing.steady() is None


def test_profiled_steps_are_left_out_of_the_steady_steps_whatever_they_compiled():
    clock = _Clock()
    timing = RunTiming(started=0.0, clock=clock)
    for number in range(1, 21):
        before = timing.step_started()
        if number == 18:
            clock.compile(seconds=2.0, graphs=1)
        timing.step_ended(before, size=(4, 3, 64, 96), profiled=number >= 17)
    steady = timing.steady()
    # Warm steps 3 to 16 (the profiled 17 to 20 left out): the second half is 10 to 16.
    assert (steady["first_step"], steady["steps"]) == (10, 7)
