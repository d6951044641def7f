"""Evaluation during training: after every ``eval_every`` epochs and after the last step, timed apart from training,
its compilation reported. A stop signal stops it within a batch; the checkpoint then asks the resumed run to run it
first (``Position.pending_evaluation``), which ``start`` does.

Where a hook offers weights of its own (the model EMA), the trained weights are evaluated first (TensorBoard's
eval_raw/*, a log line, and ``raw`` in the json), then the offered ones, whose figures are the evaluation's (eval/*,
the json, the run's metrics); the json names the weights it scored.
"""

from __future__ import annotations

import functools
import logging
import time

from datasets.loader import stop_workers
from engine.evaluation.coco import EvaluationStopped
from engine.evaluation.validation import Validation
from engine.runtime.distributed import barrier

from .base import Ending, EpochEnd, Hook, StopRequested

log = logging.getLogger(__name__)


class EpochEvaluation(Hook):
    """Runs the run's Validation at the epochs' ends the plan says; its figures go to the run's metrics."""

    def __init__(self, validation: Validation):
        self.validation = validation

    def start(self, run) -> bool:
        if self.validation.loader.num_workers > 0:
            # Fork the validation workers now, before any checkpoint is written: forked while the writer thread has
            # a file open, they would inherit it and hold a replaced checkpoint's disk space until the run ends.
            iter(self.validation.loader)
        pending = run.position.pending_evaluation
        if pending is None:
            return False
        self.evaluate(run, epoch=pending["epoch"], complete=pending["epoch_complete"])
        run.position.pending_evaluation = None  # the saver writes that the checkpoint no longer asks for it
        return True

    def epoch_end(self, run, end: EpochEnd) -> bool:
        evaluates = run.plan.evaluates_after(end.epoch, complete=end.complete, step=run.position.step)
        if evaluates:
            self.evaluate(run, epoch=end.epoch + 1, complete=end.complete)
        barrier(run.ctx)
        run.writer.flush()
        return evaluates

    def close(self, run, ending: Ending) -> None:
        if ending is not Ending.DONE:  # the run ends at once: the workers with it
            stop_workers(self.validation.loader)

    def evaluate(self, run, *, epoch: int, complete: bool) -> None:
        """Evaluate after ``epoch`` (1-based: epochs done). Stopped by a signal, it records itself as the checkpoint's
        pending evaluation and asks the run to stop."""
        step, timing = run.position.step, run.timing
        before, t0 = timing.clock.totals(), time.perf_counter()
        what, json_path = f"after epoch {epoch}, step {step}", run.output_dir / f"eval_epoch{epoch:04d}.json"
        evaluate = functools.partial(
            self.validation.run,
            writer=run.writer,
            step=step,
            epoch=epoch,
            epoch_complete=complete,
            steps_s=round(timing.steps_s, 3),  # what the training's steps took so far: AP against seconds
            should_stop=run.stop.during_evaluation,
        )
        offered = run.evaluated_weights()
        try:
            if offered is None:
                evaluation = evaluate(json_path=json_path, what=what, weights="raw")
            else:
                raw = evaluate(json_path=None, what=what, record=False)
                if run.ctx.is_main:
                    run.writer.add("eval_raw", raw.stats, step)
                    log.info(
                        "evaluation %s of the raw weights: %s",
                        what,
                        " ".join(f"{k} {v:.4f}" for k, v in raw.stats.items()),
                    )
                with offered.applied():
                    evaluation = evaluate(
                        json_path=json_path, what=f"{what} of {offered.label}", weights=offered.name, raw=raw.stats
                    )
        except EvaluationStopped:
            run.position.pending_evaluation = {"epoch": epoch, "epoch_complete": complete}
            raise StopRequested from None
        compiled = timing.clock.totals().since(before)
        timing.add_evaluation(time.perf_counter() - t0, compiled)
        timing.report_compilation(compiled, what=f"evaluation after epoch {epoch}", step=step, writer=run.writer)
        run.metrics.evaluation = evaluation.stats
