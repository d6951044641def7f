"""How many images an optimizer step takes, and how each process puts them through the model.

``total_batch_size`` is the batch of the optimizer step over all processes (the original trained every published
model at 32): each of the run's processes takes an equal share of it, the loader's batch. ``batch_size`` is the
most images a process puts through the model in one forward and backward pass, what its GPU's memory holds: a
share larger than that is split into equal passes whose gradients add up before the update (gradient
accumulation), which gives the step of the whole share. With ``total_batch_size`` null the step is
``batch_size`` images per process, as the original's per-GPU batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatch:
    """total: images per optimizer step, all processes; per_process: each process's share (the loader's batch);
    passes: forward and backward passes a process makes per step, of ``per_pass`` images each."""

    total: int
    per_process: int
    passes: int

    @property
    def per_pass(self) -> int:
        return self.per_process // self.passes

    def describe(self, world_size: int) -> str:
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        passes = (f"{self.passes} passes of {self.per_pass} accumulated" if self.passes > 1
                  else f"1 pass of {self.per_pass}")
        return f"batch {self.total} per optimizer step ({self.per_process} per process x {processes}, {passes})"


def step_batch(*, total_batch_size: int | None, batch_size: int, world_size: int) -> StepBatch:
    """The step's batch for these settings on ``world_size`` processes; a total that the processes cannot share
    equally is an error naming the keys."""
    if total_batch_size is None:
        return StepBatch(total=batch_size * world_size, per_process=batch_size, passes=1)
    if total_batch_size % world_size:
        raise ValueError(f"total_batch_size={total_batch_size} cannot be shared equally by {world_size} processes: "
                         f"set a multiple of {world_size}, or total_batch_size=null for batch_size={batch_size} per "
                         "process")
    share = total_batch_size // world_size
    passes = -(-share // batch_size)  # the fewest passes of at most batch_size images ...
    while share % passes:  # ... that split the share equally (every pass the same size: one CUDA graph)
        passes += 1
    return StepBatch(total=total_batch_size, per_process=share, passes=passes)
