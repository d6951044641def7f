"""The step timing hook: each optimizer step's wall time, its wait for data and its compilation into the run's
timing (engine/train/run_timing.py), and a line for each step that compiled."""

from __future__ import annotations

from engine.compile.clock import CompileTotals

from .base import Hook, StepDone


class StepTiming(Hook):
    """First in the list: a step's time ends before any other hook works."""

    def __init__(self) -> None:
        self._before: CompileTotals | None = None
        self._profiled = False

    def before_step(self, run, number: int) -> None:
        self._before, self._profiled = run.timing.step_started(), run.timing.profiling

    def after_step(self, run, done: StepDone) -> None:
        compiled = run.timing.step_ended(self._before, size=done.size, data_s=done.data_s, profiled=self._profiled)
        what = f"step {done.number} ({done.size[-2]}x{done.size[-1]})"
        run.timing.report_compilation(compiled, what=what, step=done.number, writer=run.writer)

    def pause(self, run) -> None:
        run.timing.pause()
