"""What the training loop tells its hooks (all a run does besides the step itself), and in which order.

The loop (engine/train/loop.py) calls every hook, in the order of engine/train/run.py's list, at the points
``Hook``'s methods say. A hook that spent time that is not a step's returns True from its call; the loop then calls
``pause`` on every hook once that point's calls are over. A hook that wants the run to stop after this step raises
``StopRequested``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch


class Ending(enum.Enum):
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


class StopRequested(Exception):
    """Raised by a hook to end the run after this step (or during an evaluation): the loop closes it STOPPED."""


class ComputeSpan:
    """One step's time: CUDA events around its work on a GPU (the stream's time from its first to its last operation),
    the host's clock elsewhere. Started when made; ``end()`` after the step; ``ms()`` once the end event completed."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start, self._end = time.perf_counter(), None

    def end(self) -> ComputeSpan:
        if self._cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()
        return self

    def ms(self) -> float:
        return self._start.elapsed_time(self._end) if self._cuda else (self._end - self._start) * 1e3


@dataclass(frozen=True)
class StepDone:
    """What an optimizer step did."""

    number: int  # counted from 1 over the whole run (a resumed run goes on counting)
    epoch: int  # counted from 0
    values: torch.Tensor  # the step's result vector on the device (engine.train.step.OptimizerStep)
    size: tuple  # the batch's shape (B, C, H, W) on this process
    images: int  # the step's images over all processes
    data_s: float  # how long the loop waited for the batch
    compute: ComputeSpan  # the step's own time, the batch's wait left out


@dataclass(frozen=True)
class EpochEnd:
    """epoch: counted from 0; complete: all its steps ran (not only those up to max_steps or a stop)."""

    epoch: int
    complete: bool


class Hook:
    """A part of a run the loop calls, at these points in this order; each method does nothing unless overridden."""

    def start(self) -> bool | None:
        """Once, before the first step (a resumed run's pending evaluation runs here)."""

    def before_step(self, number: int) -> bool | None:
        """Before step ``number`` (counted from 1 over the whole run) fetches its batch."""

    def after_step(self, done: StepDone) -> bool | None:
        """After the step, with what it did."""

    def epoch_end(self, end: EpochEnd) -> bool | None:
        """After an epoch's last step, or where the run's steps end inside it."""

    def pause(self) -> None:
        """Time that is not a step's has passed (a checkpoint, an evaluation, a profile's start or end): the next
        step's time starts now."""

    def close(self, ending: Ending) -> None:
        """Once at the end: DONE, STOPPED (a stop signal: save the position and stop) or FAILED. close(FAILED)
        follows any other close that raised, and may find the hook in any state."""
