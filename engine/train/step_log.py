"""What the training loop reports, read from the GPU once per log interval instead of once per step.

Each step leaves its result vector (engine.train.step.OptimizerStep) on the device and, on CUDA, a pair of CUDA
events around its work. ``flush`` makes the one transfer of the interval: it stacks the vectors, averages
them over processes, reads them to the host and reads the events' elapsed times. The step time it reports
is the mean over the interval of the GPU stream's time from a step's first to its last operation, so it
covers the step's work and any gap in it (the matching on the host), and not the data loading.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass
class Interval:
    """Host values of the steps since the last flush."""

    first_step: int                 # global index (0-based) of the first step in the interval
    rows: list[dict[str, float]]    # one per step: name -> value (averaged over processes)
    step_ms: float                  # mean time of a step's compute (CUDA events, or the host clock on CPU)
    data_ms: float                  # mean host time waiting for a batch
    images_per_s: float             # all processes' images over the interval's wall time
    wall_s: float
    stop_requested: bool = False    # some process was asked to stop (engine/runtime/stop_request.py)

    @property
    def last(self) -> dict[str, float]:
        return self.rows[-1]

    def first_non_finite(self, names: tuple[str, ...]) -> tuple[int, dict[str, float]] | None:
        """(global step index, row) of the first step where one of ``names`` is NaN/inf, else None."""
        for i, row in enumerate(self.rows):
            if not all(math.isfinite(row[n]) for n in names):
                return self.first_step + i, row
        return None


class StepLog:
    """Collects step results on the device; ``flush(names, average)`` returns an Interval."""

    def __init__(self, *, device: torch.device):
        self.cuda = device.type == "cuda"
        self._values: list[torch.Tensor] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_ms: list[float] = []
        self._data_ms: list[float] = []
        self._images = 0
        self._first_step = 0
        self._t_flush = time.perf_counter()
        self._t_last_end = self._t_flush  # when the last step ended (its launches, on a GPU)
        self._paused_wall_s = 0.0  # this interval's time before its last pause
        self._t_start = 0.0
        self._start_event = None

    def __len__(self) -> int:
        return len(self._values)

    def begin(self, *, step: int, data_ms: float) -> None:
        """Called before a step's compute; ``step`` is its global 0-based index."""
        if not self._values:
            self._first_step = step
        self._data_ms.append(data_ms)
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._t_start = time.perf_counter()

    def end(self, values: torch.Tensor, *, images: int) -> None:
        """Called after a step with its result vector and the number of images it trained on (all ranks)."""
        if self.cuda:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
            self._events.append((self._start_event, end_event))
        else:
            self._host_ms.append((time.perf_counter() - self._t_start) * 1e3)
        self._values.append(values)
        self._images += images
        self._t_last_end = time.perf_counter()

    def flush(self, names: tuple[str, ...], average=None, *, stop: bool = False) -> Interval | None:
        """Read the interval's results (one device->host transfer); None when no step was run.

        ``average`` maps a device tensor to its mean over processes (engine.runtime.distributed), so that every
        rank sees the same values and takes the same decisions. ``stop`` (this process was asked to stop)
        travels in the same tensor, as one more row: every process learns at the same step whether any was.
        """
        if not self._values:
            return None
        stacked = torch.stack(self._values)  # (steps, len(names))
        flag = torch.full_like(stacked[:1], float(stop))  # (1, len(names))
        stacked = torch.cat([stacked, flag])  # (steps + 1, len(names))
        if average is not None:
            stacked = average(stacked)
        *values, flag_row = stacked.tolist()  # the interval's one sync
        if self.cuda:
            step_ms = [start.elapsed_time(end) for start, end in self._events]
        else:
            step_ms = self._host_ms
        now = time.perf_counter()
        wall_s = self._paused_wall_s + now - self._t_flush
        interval = Interval(first_step=self._first_step, rows=[dict(zip(names, row)) for row in values],
                            step_ms=sum(step_ms) / len(step_ms), data_ms=sum(self._data_ms) / len(self._data_ms),
                            images_per_s=self._images / max(wall_s, 1e-9), wall_s=wall_s,
                            stop_requested=flag_row[0] > 0)
        self._values, self._events, self._host_ms, self._data_ms, self._images = [], [], [], [], 0
        self._t_flush, self._paused_wall_s = now, 0.0
        return interval

    def restart_clock(self) -> None:
        """Exclude what happened since the last step (evaluation, checkpoints, a profiler's start or export) from the
        interval's images/s. The interval's steps before it still count, with their time up to the last one's end:
        a pause inside an interval would otherwise leave its earlier images over the time after it alone. On a GPU
        that end is when the host had queued the step, whose work may finish during the pause: such an interval's
        images/s can read high by up to one step's GPU time."""
        if self._values:
            self._paused_wall_s += max(0.0, self._t_last_end - self._t_flush)
        self._t_flush = time.perf_counter()
