"""Console progress: the training loop's line every ``log_every`` steps, and evaluation's every few seconds,
each with an ETA; log lines rather than a redrawn bar, to read well in a terminal, train.log and captured stdout.
"""

from __future__ import annotations

import datetime
import logging
import math
import time

log = logging.getLogger(__name__)
# Images per second of inference over those of training (no backward, matching or update), for an evaluation's
# ETA before the first has run.
INFERENCE_SPEED_UP = 3.0


def format_duration(seconds: float) -> str:
    """H:MM:SS; "?" for NaN (no rate yet)."""
    return "?" if math.isnan(seconds) else str(datetime.timedelta(seconds=max(0, round(seconds))))


class Progress:
    """Steps done in this process against ``total_steps``, with rate and ETA for the run and the epoch. The rate
    leaves out compilation, warm-up and evaluation (``excluded_s``), which would otherwise promise hours for a run
    that takes minutes. The ETA adds the evaluations still to come (``evaluation_steps``: the steps after which one
    runs), each at what the last ones took, or before the first at an estimate from ``val_images``."""

    def __init__(
        self,
        *,
        total_steps: int,
        start_step: int,
        enabled: bool,
        steps_per_epoch: int | None = None,
        evaluation_steps: tuple[int, ...] = (),
        val_images: int = 0,
    ):
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.steps_per_epoch = steps_per_epoch
        self.evaluation_steps = evaluation_steps
        self.val_images = val_images
        self._t0 = time.perf_counter()

    def step_seconds(self, step: int, excluded_s: float = 0.0) -> float:
        """Mean seconds per step so far, less ``excluded_s``; NaN before the first step."""
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return max(0.0, time.perf_counter() - self._t0 - excluded_s) / done

    def eta_seconds(self, step: int, excluded_s: float = 0.0, evaluation_s: float = 0.0) -> float:
        """Seconds left in the run after ``step``, its evaluations still to come at ``evaluation_s`` each."""
        evaluations = sum(1 for s in self.evaluation_steps if s >= step)
        return self.step_seconds(step, excluded_s) * (self.total_steps - step) + evaluations * evaluation_s

    def report(
        self,
        *,
        step: int,
        epoch: int,
        epochs: int,
        loss: float,
        parts: dict[str, float],
        lr: float,
        step_ms: float,
        data_ms: float,
        images_per_s: float,
        excluded_s: float = 0.0,
        evaluation_s: float | None = None,
    ) -> None:
        """One progress line; ``evaluation_s``: one evaluation's mean time so far (None: estimated)."""
        if not self.enabled:
            return
        pct = 100.0 * step / max(1, self.total_steps)
        estimated = evaluation_s is None
        if estimated:
            evaluation_s = self.val_images / (INFERENCE_SPEED_UP * images_per_s) if images_per_s > 0 else 0.0
        eta = self.eta_seconds(step, excluded_s, evaluation_s)
        evaluations = sum(1 for s in self.evaluation_steps if s >= step)
        with_evaluations = (
            (
                f" with {evaluations} evaluation{'s' if evaluations != 1 else ''} of "
                f"{'~' if estimated else ''}{format_duration(evaluation_s)}"
            )
            if evaluations
            else ""
        )
        epoch_eta = ""
        if self.steps_per_epoch:
            left = min(self.total_steps, (epoch + 1) * self.steps_per_epoch) - step
            epoch_eta = f", epoch {format_duration(self.step_seconds(step, excluded_s) * left)}"
        parts_txt = " ".join(f"{k.removeprefix('loss_')} {v:.3f}" for k, v in parts.items())
        log.info(
            "epoch %d/%d step %d/%d [%3.0f%%] loss %.4f (%s) lr %.2e | step %.0f ms data %.0f ms "
            "%.1f img/s | ETA %s (run%s)%s",
            epoch + 1,
            epochs,
            step,
            self.total_steps,
            pct,
            loss,
            parts_txt,
            lr,
            step_ms,
            data_ms,
            images_per_s,
            format_duration(eta),
            with_evaluations,
            epoch_eta,
        )


class EvaluationProgress:
    """Inference over the validation images: "evaluation N/M images [P%] R img/s | ETA T", at most every
    ``every_s`` seconds (0: after every batch), where ``enabled``. ``total_images`` are this process's share (rank
    0's line stands for all). The rate leaves out the first batch, which holds cuDNN's planning and compilation.
    """

    def __init__(self, *, total_images: int | None, every_s: float, enabled: bool, share_of: int | None = None):
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 seconds, got {every_s!r}")
        self.total_images, self.every_s, self.enabled, self.share_of = total_images, every_s, enabled, share_of
        self._t0 = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (time, images) at the end of the first batch
        self._last_report = self._t0

    def images_per_s(self, images: int) -> float:
        """Images per second since the first batch ended; NaN before a second batch."""
        if self._first is None:
            return float("nan")
        t_first, images_first = self._first
        elapsed = time.perf_counter() - t_first
        return (images - images_first) / elapsed if elapsed > 0 and images > images_first else float("nan")

    def eta_seconds(self, images: int) -> float:
        rate = self.images_per_s(images)
        if self.total_images is None or math.isnan(rate):
            return float("nan")
        return max(0, self.total_images - images) / rate

    def update(self, images: int) -> None:
        """After a batch: ``images`` done so far in this process."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, images)
        if not self.enabled or now - self._last_report < self.every_s:
            return
        if self.total_images is not None and images >= self.total_images:
            return  # the pass is done: its closing line follows
        self._last_report = now
        rate = self.images_per_s(images)
        done = (
            f"{images} images"
            if self.total_images is None
            else f"{images}/{self.total_images} images [{100.0 * images / max(1, self.total_images):3.0f}%]"
        )
        share = f" (this process's share of {self.share_of})" if self.share_of is not None else ""
        log.info(
            "evaluation %s%s %s img/s | ETA %s",
            done,
            share,
            "?" if math.isnan(rate) else f"{rate:.1f}",
            format_duration(self.eta_seconds(images)),
        )
