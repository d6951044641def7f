"""engine/train/hooks/interval_report.py: the images/s a log interval reports, when something that is not a step
paused it."""

from __future__ import annotations

import pytest
import torch

import engine.train.hooks.interval_report as interval_report
from engine.train.hooks.base import ComputeSpan, StepDone
from engine.train.hooks.interval_report import StepLog


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(log: StepLog, clock: _Clock, *, starts: float, ends: float) -> None:
    clock.now = starts
    span = ComputeSpan(torch.device("cpu"))
    clock.now = ends
    log.add(
        StepDone(
            number=1,
            epoch=0,
            values=torch.tensor([1.0]),
            names=("loss",),
            size=(2, 3, 8, 8),
            images=2,
            data_s=0.0,
            compute=span.end(),
        )
    )


@pytest.mark.parametrize("pauses", [[10.0], [10.0, 12.0]])
def test_a_pause_inside_an_interval_keeps_its_earlier_steps_time(monkeypatch, pauses):
    """Two steps of 1 s, a pause (a profiler's trace written, a checkpoint saved) that ends at 10 s or, twice, at
    12 s, then a third step of 1 s: 6 images in 3 s of steps, not 6 images in the last step's second alone."""
    clock = _Clock()
    monkeypatch.setattr(interval_report.time, "perf_counter", clock)
    log = StepLog()
    _step(log, clock, starts=0.0, ends=1.0)
    _step(log, clock, starts=1.0, ends=2.0)
    for pause_end in pauses:
        clock.now = pause_end
        log.restart_clock()
    _step(log, clock, starts=pauses[-1], ends=pauses[-1] + 1.0)
    interval = log.flush(("loss",))
    assert interval.wall_s == pytest.approx(3.0) and interval.images_per_s == pytest.approx(2.0)


def test_a_pause_between_intervals_starts_the_next_one_after_it(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(interval_report.time, "perf_counter", clock)
    log = StepLog()
    _step(log, clock, starts=0.0, ends=1.0)
    log.flush(("loss",))
    clock.now = 30.0  # an evaluation
    log.restart_clock()
    _step(log, clock, starts=30.0, ends=31.5)
    interval = log.flush(("loss",))
    assert interval.wall_s == pytest.approx(1.5) and interval.images_per_s == pytest.approx(2 / 1.5)


def test_a_pause_counts_for_its_own_interval_only(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(interval_report.time, "perf_counter", clock)
    log = StepLog()
    _step(log, clock, starts=0.0, ends=1.0)
    clock.now = 5.0
    log.restart_clock()
    _step(log, clock, starts=5.0, ends=6.0)
    assert log.flush(("loss",)).wall_s == pytest.approx(2.0)
    _step(log, clock, starts=6.0, ends=7.0)
    _step(log, clock, starts=7.0, ends=8.0)
    assert log.flush(("loss",)).wall_s == pytest.approx(2.0)
