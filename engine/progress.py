"""Console progress for the training loop: one ``logging`` line every ``log_every`` steps, with ETA.

A log line rather than a redrawn bar so that the same text reads well in a terminal, in Hydra's train.log
and in a batch system's captured stdout.
"""

from __future__ import annotations

import datetime
import logging
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
