"""Where a run stands and how long it is: its position, its optimizer steps, its evaluations."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Position:
    """Where training stands: epochs completed, optimizer steps done, batches done in the current epoch."""

    epoch: int = 0
    step: int = 0
    steps_in_epoch: int = 0
    rng: dict | None = None  # generator states to restore after skipping a resumed epoch's done batches
    # An evaluation a stop signal interrupted, to run before anything else: {"epoch", "epoch_complete"}
    pending_evaluation: dict | None = None


def planned_steps(cfg, steps_per_epoch: int) -> int:
    """The optimizer steps a run of ``cfg`` makes in all: its epochs, capped by max_steps."""
    total = steps_per_epoch * cfg.epochs
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def evaluation_steps(cfg, *, total_steps: int, steps_per_epoch: int) -> tuple[int, ...]:
    """The optimizer steps after which the run evaluates: the end of every ``eval_every``-th epoch, and its last
    step."""
    ends = (epoch * steps_per_epoch for epoch in range(cfg.eval_every, cfg.epochs + 1, cfg.eval_every))
    return tuple(sorted({step for step in ends if step < total_steps} | {total_steps}))


def planned_evaluations(cfg, *, total_steps: int, steps_per_epoch: int, start_epoch: int = 0) -> int:
    """How many evaluations this run will make (every eval_every epochs, and after the last step)."""
    last_epoch = min(cfg.epochs, math.ceil(total_steps / max(1, steps_per_epoch)))
    return len(range(start_epoch + cfg.eval_every, last_epoch + 1, cfg.eval_every)) + 1
