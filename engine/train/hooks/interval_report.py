"""Once per log interval: losses checked for NaN/inf, then the progress line and TensorBoard. ``StepLog.flush`` reads
the steps' result vectors (engine.train.step.OptimizerStep), averaged over processes, in the interval's one sync. Its
step time is the mean ComputeSpan: a step's work and any gap in it (the matching on the host), not the data loading.
A non-finite loss stops the run before the next checkpoint: checkpoint.pth stays good.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from engine.errors import NonFiniteLossError
from engine.reporting.progress import Progress
from engine.runtime.distributed import all_reduce_mean
from models.criterion import AUX_SUFFIX

from .base import ComputeSpan, Ending, EpochEnd, Hook, StepDone

log = logging.getLogger(__name__)


@dataclass
class Interval:
    """Host values of the steps since the last flush."""

    first_step: int  # global index (0-based) of the first step in the interval
    rows: list[dict[str, float]]  # one per step: name -> value (averaged over processes)
    step_ms: float  # mean time of a step's compute (CUDA events, or the host clock on CPU)
    data_ms: float  # mean host time waiting for a batch
    images_per_s: float  # all processes' images over the interval's wall time
    wall_s: float
    stop_requested: bool = False  # some process was asked to stop (engine/runtime/stop_request.py)

    def first_non_finite(self, names: tuple[str, ...]) -> tuple[int, dict[str, float]] | None:
        """(global step index, row) of the first step where one of ``names`` is NaN/inf, else None."""
        for i, row in enumerate(self.rows):
            if not all(math.isfinite(row[n]) for n in names):
                return self.first_step + i, row
        return None


class StepLog:
    """Collects step results on the device; ``flush(names, average)`` returns an Interval."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []
        self._spans: list[ComputeSpan] = []
        self._data_ms: list[float] = []
        self._images = self._first_step = 0
        self._t_flush = time.perf_counter()
        self._t_last_end = self._t_flush  # when the last step ended (its launches, on a GPU)
        self._paused_wall_s = 0.0  # this interval's time before its last pause

    def add(self, done: StepDone) -> None:
        if not self._values:
            self._first_step = done.number - 1
        self._values.append(done.values)
        self._spans.append(done.compute)
        self._data_ms.append(done.data_s * 1e3)
        self._images += done.images
        self._t_last_end = time.perf_counter()

    def flush(self, names: tuple[str, ...], average=None, *, stop: bool = False) -> Interval | None:
        """Read the interval's results in one device->host transfer (None when no step ran). ``average`` maps a device
        tensor to its mean over processes: every rank takes the same decisions. ``stop`` (this process was asked to
        stop) travels as one more row: every process learns at the same step whether any was."""
        if not self._values:
            return None
        stacked = torch.stack(self._values)  # (steps, len(names))
        stacked = torch.cat([stacked, torch.full_like(stacked[:1], float(stop))])  # and the stop flag's row
        if average is not None:
            stacked = average(stacked)
        *values, flag_row = stacked.tolist()  # the interval's one sync
        step_ms = [span.ms() for span in self._spans]
        now = time.perf_counter()
        wall_s = self._paused_wall_s + now - self._t_flush
        interval = Interval(
            first_step=self._first_step,
            rows=[dict(zip(names, row)) for row in values],
            step_ms=sum(step_ms) / len(step_ms),
            data_ms=sum(self._data_ms) / len(self._data_ms),
            images_per_s=self._images / max(wall_s, 1e-9),
            wall_s=wall_s,
            stop_requested=flag_row[0] > 0,
        )
        self._values, self._spans, self._data_ms, self._images = [], [], [], 0
        self._t_flush, self._paused_wall_s = now, 0.0
        return interval

    def restart_clock(self) -> None:
        """Leave what happened since the last step (evaluation, checkpoints, a profiler's start or export) out of the
        interval's images/s. Its steps before it still count, with their time up to the last one's end (not their
        images over the time after it alone). On a GPU that end is when the host had queued the step, whose work may
        finish during the pause: such an interval's images/s can read high by up to one step's GPU time."""
        if self._values:
            self._paused_wall_s += max(0.0, self._t_last_end - self._t_flush)
        self._t_flush = time.perf_counter()


class IntervalReporter(Hook):
    """Reads and reports each log interval's steps at its end, at an epoch's end and at a stop; whether any process
    was asked to stop travels in the same read. ``loss_weights``: the criterion's weight_dict (which losses make the
    total, and how much each weighs); ``progress``: the console's progress line; ``fp16_skips_overflows``: the fp16
    GradScaler skips overflowing steps itself, so only the loss is checked."""

    def __init__(self, *, loss_weights: dict[str, float], progress: Progress, fp16_skips_overflows: bool):
        self.loss_weights, self.progress = dict(loss_weights), progress
        self.checked = ("loss",) if fp16_skips_overflows else ("loss", "grad_norm")
        self.step_log = StepLog()
        self._step, self._epoch, self._names = 0, 0, ()  # the last step added, its epoch, its values' names

    def start(self, run) -> None:
        self._step = run.plan.start_step

    def after_step(self, run, done: StepDone) -> None:
        self.step_log.add(done)
        self._step, self._epoch, self._names = done.number, done.epoch, done.names
        if run.plan.due_for_log(done.number):
            self.report(run, epoch=done.epoch)

    def epoch_end(self, run, end: EpochEnd) -> None:
        self.report(run, epoch=end.epoch)  # a non-finite loss stops the run here, before anything is saved

    def pause(self, run) -> None:
        self.step_log.restart_clock()

    def close(self, run, ending: Ending) -> None:
        if ending is Ending.STOPPED:
            self.report(run, epoch=self._epoch)  # the interval's losses are checked before they are saved

    def report(self, run, *, epoch: int) -> None:
        """Read the interval's results (the one sync of the interval), stop on a non-finite loss, log, and tell the
        run's stop state whether any process was asked to stop. Nothing when no step ran since the last report."""
        average = (lambda t: all_reduce_mean(t, run.ctx)) if run.ctx.distributed else None
        interval = self.step_log.flush(self._names, average, stop=run.stop.requested)
        if interval is None:
            return
        bad = interval.first_non_finite(self.checked)
        if bad is not None:
            raise NonFiniteLossError(self._non_finite_message(*bad, epoch=epoch))
        run.metrics.losses.extend(r["loss"] for r in interval.rows)
        run.metrics.checked_step = self._step
        if run.ctx.is_main:
            self._log_interval(run, interval, epoch=epoch, step=self._step)
        run.stop.heard(interval.stop_requested)

    def _losses(self) -> tuple[str, ...]:
        return self._names[2:]  # after the total loss and the gradient norm

    def _log_interval(self, run, interval: Interval, *, epoch: int, step: int) -> None:
        weights = self.loss_weights
        last = interval.rows[-1]
        lrs = run.metrics.lrs
        weighted = {k: last[k] * weights[k] for k in self._losses() if k in weights and not AUX_SUFFIX.search(k)}
        scalars = {
            "loss": last["loss"],
            **weighted,
            **{f"{k}_unscaled": last[k] for k in weighted},
            "lr": lrs.get("rest", next(iter(lrs.values()), float("nan"))),
            "step_time_ms": interval.step_ms,
            "data_time_ms": interval.data_ms,
            "images_per_s": interval.images_per_s,
            "grad_norm": last["grad_norm"],
        }
        if "backbone" in lrs:
            scalars["lr_backbone"] = lrs["backbone"]
        if run.ctx.device.type == "cuda":
            scalars["max_memory_mb"] = torch.cuda.max_memory_allocated(run.ctx.device) / 2**20
        run.writer.add("train", scalars, step)
        self.progress.report(
            step=step,
            epoch=epoch,
            epochs=run.plan.epochs,
            loss=last["loss"],
            parts=weighted,
            lr=scalars["lr"],
            step_ms=interval.step_ms,
            data_ms=interval.data_ms,
            images_per_s=interval.images_per_s,
            evaluation_s=run.timing.evaluation_s,
            excluded_s=run.timing.not_training_s + run.timing.eval_s,
        )

    def _non_finite_message(self, step: int, row: dict, *, epoch: int) -> str:
        """The run's failure, but for what it keeps, which is only known once its writes have ended: the run adds it
        (engine/train/resume.py, explained_failure)."""
        what, value = ("loss", row["loss"]) if not math.isfinite(row["loss"]) else ("gradient norm", row["grad_norm"])
        losses = ", ".join(f"{k}={row[k]:.4g}" for k in self._losses() if not AUX_SUFFIX.search(k))
        return (
            f"non-finite {what} ({value}) at epoch {epoch + 1}, step {step + 1} ({losses}); that update was "
            f"skipped and the run stops without saving"
        )
