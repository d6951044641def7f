"""Console progress: the training loop's line every ``log_every`` steps, and evaluation's every few seconds,
each with an ETA.

A log line rather than a redrawn bar so that the same text reads well in a terminal, in Hydra's train.log
and in a batch system's captured stdout.
"""

from __future__ import annotations

import datetime
import logging
import math
import time

log = logging.getLogger("train")


def format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


class Progress:
    """Tracks steps done in this process against ``total_steps`` and reports rate and ETA.

    The rate is the mean wall time per step over the steps this process has run, evaluation and
    checkpointing included (so the ETA covers them too) and compilation and warm-up left out: a run's first
    steps compile, and counting them would promise hours for a run that then takes minutes.
    """

    def __init__(self, *, total_steps: int, start_step: int, enabled: bool):
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self._t0 = time.perf_counter()

    def eta_seconds(self, step: int, excluded_s: float = 0.0) -> float:
        """Seconds left after ``step``, at the rate so far less ``excluded_s`` (compilation and warm-up since the
        start)."""
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        per_step = max(0.0, time.perf_counter() - self._t0 - excluded_s) / done
        return per_step * (self.total_steps - step)

    def report(self, *, step: int, epoch: int, epochs: int, loss: float, parts: dict[str, float],
               lr: float, step_ms: float, data_ms: float, images_per_s: float, excluded_s: float = 0.0) -> None:
        if not self.enabled:
            return
        pct = 100.0 * step / max(1, self.total_steps)
        eta = self.eta_seconds(step, excluded_s)
        parts_txt = " ".join(f"{k.removeprefix('loss_')} {v:.3f}" for k, v in parts.items())
        log.info("epoch %d/%d step %d/%d [%3.0f%%] loss %.4f (%s) lr %.2e | step %.0f ms data %.0f ms "
                 "%.1f img/s | ETA %s", epoch + 1, epochs, step, self.total_steps, pct, loss, parts_txt, lr,
                 step_ms, data_ms, images_per_s, "?" if eta != eta else format_duration(eta))


class EvaluationProgress:
    """Inference over the validation images: "evaluation N/M images [P%] R img/s | ETA T", at most every
    ``every_s`` seconds (0: after every batch), on the process where ``enabled``.

    ``total_images`` are this process's: with several processes each infers its share, and rank 0's line
    stands for all (the shares are equal). The rate leaves the first batch out: it holds cuDNN's planning and,
    compiled, the evaluation graph's compilation, which would promise a long wait for a pass that then runs
    at the steady rate.
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
        rate, eta = self.images_per_s(images), self.eta_seconds(images)
        if self.total_images is None:
            done = f"{images} images"
        else:
            done = f"{images}/{self.total_images} images [{100.0 * images / max(1, self.total_images):3.0f}%]"
        share = f" (this process's share of {self.share_of})" if self.share_of is not None else ""
        log.info("evaluation %s%s %s img/s | ETA %s", done, share, "?" if math.isnan(rate) else f"{rate:.1f}",
                 "?" if math.isnan(eta) else format_duration(eta))
