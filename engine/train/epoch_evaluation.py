"""Evaluation during training: after every ``eval_every`` epochs and after the last step, its time kept apart
from training's and its compilation (the first evaluation of a size records or compiles its graph) reported."""

from __future__ import annotations

import time
from pathlib import Path

from engine.evaluation.validation import Validation
from engine.reporting.tensorboard import ScalarWriter

from .interval_report import IntervalReporter
from .run_timing import RunTiming


class EpochEvaluation:
    """Runs the run's Validation at an epoch's end; ``stats`` holds the last figures (None before any)."""

    def __init__(self, validation: Validation, *, output_dir: Path, writer: ScalarWriter, timing: RunTiming,
                 reporter: IntervalReporter):
        self.validation, self.output_dir, self.writer = validation, Path(output_dir), writer
        self.timing, self.reporter = timing, reporter
        self.stats: dict | None = None

    def run(self, *, epoch: int, step: int, epoch_complete: bool, should_stop=None) -> None:
        """Evaluate after ``epoch`` (1-based: epochs done), at optimizer step ``step``; ``should_stop``: asked
        after each batch (engine.evaluation.coco.EvaluationStopped)."""
        before, t0 = self.timing.clock.totals(), time.perf_counter()
        evaluation = self.validation.run(writer=self.writer, json_path=self.output_dir / f"eval_epoch{epoch:04d}.json",
                                         step=step, what=f"after epoch {epoch}, step {step}", epoch=epoch,
                                         epoch_complete=epoch_complete, should_stop=should_stop)
        compiled = self.timing.clock.totals().since(before)
        self.timing.add_evaluation(time.perf_counter() - t0, compiled)
        if compiled.graphs or compiled.seconds >= 1.0:
            self.reporter.report_compilation(compiled, what=f"evaluation after epoch {epoch}", step=step)
        self.stats = evaluation.stats
