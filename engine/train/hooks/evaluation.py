"""Evaluation during training: after every ``eval_every`` epochs and after the last step, timed apart from training,
its compilation reported. A stop signal stops it within a batch; the checkpoint then asks the resumed run to run it
first (``Position.pending_evaluation``), which ``start`` does.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from datasets.loader import stop_workers
from engine.evaluation.coco import EvaluationStopped
from engine.evaluation.validation import Validation
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import DistContext, barrier

from ..run_plan import Position, RunPlan
from .base import Ending, EpochEnd, Hook, StopRequested
from .ema import ModelEma
from .saving import CheckpointSaver
from .stopping import StopControl
from .timing import RunTiming

log = logging.getLogger(__name__)


class EpochEvaluation(Hook):
    """Runs the run's Validation at the epochs' ends the plan says; ``stats`` holds the last figures (None before any).
    With an ``ema``, the raw weights are evaluated first (TensorBoard's eval_raw/* and a log line), then the average,
    whose figures are the evaluation's (eval/*, the json, ``stats``)."""

    def __init__(
        self,
        validation: Validation,
        *,
        output_dir: Path,
        writer: ScalarWriter,
        timing: RunTiming,
        ctx: DistContext,
        position: Position,
        plan: RunPlan,
        saver: CheckpointSaver,
        stopping: StopControl,
        ema: ModelEma | None = None,
    ):
        self.validation, self.output_dir, self.writer = validation, Path(output_dir), writer
        self.timing, self.ctx, self.position, self.plan = timing, ctx, position, plan
        self.saver, self.stopping, self.ema = saver, stopping, ema
        self.stats: dict | None = None

    def start(self) -> bool:
        if self.validation.loader.num_workers > 0:
            # Fork the validation workers now, before any checkpoint is written: forked while the writer thread has
            # a file open, they would inherit it and hold a replaced checkpoint's disk space until the run ends.
            iter(self.validation.loader)
        pending = self.position.pending_evaluation
        if pending is None:
            return False
        self.evaluate(epoch=pending["epoch"], complete=pending["epoch_complete"])
        self.position.pending_evaluation = None
        self.saver.save(epoch_done=False)  # the checkpoint no longer asks for it
        return True

    def epoch_end(self, end: EpochEnd) -> bool:
        evaluates = self.plan.evaluates_after(end.epoch, complete=end.complete, step=self.position.step)
        if evaluates:
            self.evaluate(epoch=end.epoch + 1, complete=end.complete)
        barrier(self.ctx)
        self.writer.flush()
        return evaluates

    def close(self, ending: Ending) -> None:
        if ending is Ending.FAILED:
            stop_workers(self.validation.loader)

    def evaluate(self, *, epoch: int, complete: bool) -> None:
        """Evaluate after ``epoch`` (1-based: epochs done). Stopped by a signal, it records itself as the checkpoint's
        pending evaluation and asks the run to stop."""
        step = self.position.step
        before, t0 = self.timing.clock.totals(), time.perf_counter()
        what, json_path = f"after epoch {epoch}, step {step}", self.output_dir / f"eval_epoch{epoch:04d}.json"
        run = functools.partial(
            self.validation.run,
            writer=self.writer,
            step=step,
            epoch=epoch,
            epoch_complete=complete,
            should_stop=self.stopping.during_evaluation,
        )
        try:
            if self.ema is None:
                evaluation = run(json_path=json_path, what=what)
            else:
                raw = run(json_path=None, what=what, record=False)
                if self.ctx.is_main:
                    self.writer.add("eval_raw", raw.stats, step)
                    log.info(
                        "evaluation %s of the raw weights: %s",
                        what,
                        " ".join(f"{k} {v:.4f}" for k, v in raw.stats.items()),
                    )
                with self.ema.applied():
                    evaluation = run(json_path=json_path, what=f"{what} of the model EMA")
        except EvaluationStopped:
            self.position.pending_evaluation = {"epoch": epoch, "epoch_complete": complete}
            raise StopRequested from None
        compiled = self.timing.clock.totals().since(before)
        self.timing.add_evaluation(time.perf_counter() - t0, compiled)
        self.timing.report_compilation(compiled, what=f"evaluation after epoch {epoch}", step=step)
        self.stats = evaluation.stats
