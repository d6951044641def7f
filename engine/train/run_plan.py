"""Where a run stands (``Position``), what it will do (``RunPlan``) and what an optimizer step takes (``StepBatch``):
computed once, from the settings, the data and the checkpoint it resumes, and passed to everything that needs it.

``total_batch_size`` is the step's batch over all processes (the original trained every published model at 32),
shared equally by them; ``batch_size`` is the most images a process's GPU takes in one forward and backward pass: a
larger share is split into equal passes whose gradients add up (gradient accumulation). With ``total_batch_size``
null the step is ``batch_size`` images per process, as the original's per-GPU batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatch:
    total: int  # images per optimizer step, all processes
    per_process: int  # each process's share (the loader's batch)
    passes: int  # forward and backward passes a process makes per step, of ``per_pass`` images each

    @property
    def per_pass(self) -> int:
        return self.per_process // self.passes

    def describe(self, world_size: int) -> str:
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        passes = (
            f"{self.passes} passes of {self.per_pass} accumulated" if self.passes > 1 else f"1 pass of {self.per_pass}"
        )
        return f"batch {self.total} per optimizer step ({self.per_process} per process x {processes}, {passes})"


def step_batch(*, total_batch_size: int | None, batch_size: int, world_size: int) -> StepBatch:
    """The step's batch for these settings on ``world_size`` processes; a total that the processes cannot share
    equally is an error naming the keys."""
    if total_batch_size is None:
        return StepBatch(total=batch_size * world_size, per_process=batch_size, passes=1)
    if total_batch_size % world_size:
        raise ValueError(
            f"total_batch_size={total_batch_size} cannot be shared equally by {world_size} processes: "
            f"set a multiple of {world_size}, or total_batch_size=null for batch_size={batch_size} per "
            "process"
        )
    share = total_batch_size // world_size
    passes = -(-share // batch_size)  # the fewest passes of at most batch_size images ...
    while share % passes:  # ... that split the share equally (every pass the same size: one CUDA graph)
        passes += 1
    return StepBatch(total=total_batch_size, per_process=share, passes=passes)


@dataclass
class Position:
    """Where training stands: epochs completed, optimizer steps done, batches done in the current epoch."""

    epoch: int = 0
    step: int = 0
    steps_in_epoch: int = 0
    rng: dict | None = None  # generator states to restore after skipping a resumed epoch's done batches
    # An evaluation a stop signal interrupted, to run before anything else: {"epoch", "epoch_complete"}
    pending_evaluation: dict | None = None

    @classmethod
    def of_checkpoint(cls, ckpt: dict | None, *, world_size: int) -> Position:
        """Where a checkpoint of the training stands (the start for None). Generator states are restored only by one
        process: several processes draw from generators of their own, which one checkpoint does not hold."""
        if ckpt is None:
            return cls()
        return cls(
            epoch=ckpt["epoch"],
            step=ckpt["step"],
            steps_in_epoch=ckpt["steps_in_epoch"],
            rng=ckpt["rng"] if world_size == 1 else None,
            pending_evaluation=ckpt.get("pending_evaluation"),
        )


@dataclass(frozen=True)
class RunPlan:
    """The run's schedule."""

    batch: StepBatch
    steps_per_epoch: int  # optimizer steps in an epoch (the loader's batches of a process)
    epochs: int
    total_steps: int  # of the whole schedule: its epochs, capped by max_steps
    evaluation_steps: tuple[int, ...]  # the steps after which the run evaluates (plan_run)
    evaluations: int  # how many evaluations this run makes from where it starts
    start_step: int  # 0, or a resumed checkpoint's step
    eval_every: int  # epochs per evaluation
    log_every: int  # steps per log interval
    seed: int  # each epoch's generators are seeded from it

    def due_for_log(self, step: int) -> bool:
        """Whether step ``step`` (from 1) ends a log interval: every log_every steps, and the run's last."""
        return step % self.log_every == 0 or step == self.total_steps

    def evaluates_after(self, epoch: int, *, complete: bool, step: int) -> bool:
        """Whether the run evaluates at the end of ``epoch`` (from 0) that ended at ``step``: every eval_every-th
        completed epoch, and where its steps end."""
        return step >= self.total_steps or epoch + 1 == self.epochs or (complete and (epoch + 1) % self.eval_every == 0)


def plan_run(cfg, *, batch: StepBatch, steps_per_epoch: int, start: Position) -> RunPlan:
    """The plan of a run of ``cfg`` (a checked config) whose loader makes ``steps_per_epoch`` steps an epoch."""
    total = steps_per_epoch * cfg.epochs
    total = total if cfg.max_steps is None else min(total, cfg.max_steps)
    ends = (epoch * steps_per_epoch for epoch in range(cfg.eval_every, cfg.epochs + 1, cfg.eval_every))
    evaluation_steps = tuple(sorted({step for step in ends if step < total} | {total}))
    last_epoch = min(cfg.epochs, math.ceil(total / max(1, steps_per_epoch)))
    evaluations = len(range(start.epoch + cfg.eval_every, last_epoch + 1, cfg.eval_every)) + 1
    return RunPlan(
        batch=batch,
        steps_per_epoch=steps_per_epoch,
        epochs=cfg.epochs,
        total_steps=total,
        evaluation_steps=evaluation_steps,
        evaluations=evaluations,
        start_step=start.step,
        eval_every=cfg.eval_every,
        log_every=cfg.log_every,
        seed=cfg.seed,
    )
