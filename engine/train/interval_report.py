"""What the loop reports once per log interval: losses checked for NaN/inf, then the progress line and
TensorBoard; and a line for every step or evaluation that compiled.

The step results are read from the GPU once per interval (engine/train/step_log.py). A non-finite loss found
there stops the run before the next checkpoint, so checkpoint.pth stays the last good state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from engine.compile.clock import CompileTotals, describe_graphs, describe_work
from engine.errors import NonFiniteLossError
from engine.reporting.progress import Progress
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import DistContext, all_reduce_mean
from models.criterion import AUX_SUFFIX

from .optim import group_lrs
from .run_timing import RunTiming
from .step import OptimizerStep
from .step_log import Interval, StepLog

log = logging.getLogger("train")

class IntervalReporter:
    """Collects the steps of a log interval (``step_log``) and reports them (``report``).

    describe_kept   what a run that stops without saving keeps (engine/train/saving.py), for its message
    """

    def __init__(self, *, step: OptimizerStep, optimizer, ctx: DistContext, writer: ScalarWriter,
                 progress: Progress, timing: RunTiming, epochs: int, fp16_skips_overflows: bool,
                 describe_kept: Callable[[], str]):
        self.step, self.optimizer, self.ctx = step, optimizer, ctx
        self.writer, self.progress, self.timing, self.epochs = writer, progress, timing, epochs
        # fp16's GradScaler skips overflowing steps itself: only the loss is checked then.
        self.checked = ("loss",) if fp16_skips_overflows else ("loss", "grad_norm")
        self.describe_kept = describe_kept
        self.step_log = StepLog(device=ctx.device)
        self.losses: list[float] = []

    def report(self, *, epoch: int, step: int, stop_requested: bool) -> bool:
        """Read the interval's results (the one sync of the interval), stop on a non-finite loss, log; whether
        any process was asked to stop (False when no step ran since the last report)."""
        if not len(self.step_log):
            return False
        average = (lambda t: all_reduce_mean(t, self.ctx)) if self.ctx.distributed else None
        interval = self.step_log.flush(self.step.value_names, average, stop=stop_requested)
        bad = interval.first_non_finite(self.checked)
        if bad is not None:
            index, row = bad
            what = "loss" if not math.isfinite(row["loss"]) else "gradient norm"
            raise NonFiniteLossError(self._non_finite_message(what, row, epoch=epoch, step=index))
        self.losses.extend(r["loss"] for r in interval.rows)
        if self.ctx.is_main:
            self._log_interval(interval, epoch=epoch, step=step)
        return interval.stop_requested

    def _log_interval(self, interval: Interval, *, epoch: int, step: int) -> None:
        weights = self.step.criterion.weight_dict
        last = interval.last
        lrs = group_lrs(self.optimizer)
        weighted = {k: last[k] * weights[k] for k in self.step.loss_names if k in weights and not AUX_SUFFIX.search(k)}
        scalars = {"loss": last["loss"], **weighted, **{f"{k}_unscaled": last[k] for k in weighted},
                   "lr": lrs.get("rest", next(iter(lrs.values()))), "step_time_ms": interval.step_ms,
                   "data_time_ms": interval.data_ms, "images_per_s": interval.images_per_s,
                   "grad_norm": last["grad_norm"]}
        if "backbone" in lrs:
            scalars["lr_backbone"] = lrs["backbone"]
        if self.ctx.device.type == "cuda":
            scalars["max_memory_mb"] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20
        self.writer.add("train", scalars, step)
        self.progress.report(step=step, epoch=epoch, epochs=self.epochs, loss=last["loss"], parts=weighted,
                             lr=scalars["lr"], step_ms=interval.step_ms, data_ms=interval.data_ms,
                             images_per_s=interval.images_per_s,
                             excluded_s=self.timing.not_training_s + self.timing.eval_s,
                             evaluation_s=self.timing.evaluation_s)

    def report_compilation(self, compiled: CompileTotals, *, what: str, step: int) -> None:
        """One line per step (or evaluation) that compiled, and the run's compile totals in TensorBoard."""
        if not self.ctx.is_main:
            return
        total = self.timing.compile
        log.info("%s: %s in %.1f s%s; %.1f s of compilation in this run so far", what, describe_work(compiled),
                 compiled.seconds,
                 f" ({parts})" if (parts := describe_graphs(compiled)) else "", total.seconds)
        self.writer.add("compile", {"seconds": total.seconds, "graphs": total.graphs}, step)

    def _non_finite_message(self, what: str, row: dict, *, epoch: int, step: int) -> str:
        kept = self.describe_kept()  # the last good checkpoint may still be being written
        losses = ", ".join(f"{k}={row[k]:.4g}" for k in self.step.loss_names if not AUX_SUFFIX.search(k))
        return (f"non-finite {what} ({row['loss'] if what == 'loss' else row['grad_norm']}) at epoch {epoch + 1}, "
                f"step {step + 1} ({losses}); that update was skipped and the run stops without saving: {kept}. "
                f"Try a lower optim.lr, amp=none, or check the data")
