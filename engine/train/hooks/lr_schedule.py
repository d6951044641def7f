"""The lr schedule, stepped at the end of each completed epoch (before its checkpoint is written); the lr of each
parameter group goes into the run's metrics, for the log interval's report."""

from __future__ import annotations

import torch

from ..optim import group_lrs
from .base import EpochEnd, Hook


class EpochLrSchedule(Hook):
    def __init__(self, lr_scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.lr_scheduler = lr_scheduler

    def start(self, run) -> None:
        run.metrics.lrs = group_lrs(self.lr_scheduler.optimizer)

    def epoch_end(self, run, end: EpochEnd) -> None:
        if end.complete:
            self.lr_scheduler.step()
            run.metrics.lrs = group_lrs(self.lr_scheduler.optimizer)
