"""The lr schedule, stepped at the end of each completed epoch (before its checkpoint is written)."""

from __future__ import annotations

import torch

from .base import EpochEnd, Hook


class EpochLrSchedule(Hook):
    def __init__(self, lr_scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.lr_scheduler = lr_scheduler

    def epoch_end(self, end: EpochEnd) -> None:
        if end.complete:
            self.lr_scheduler.step()
