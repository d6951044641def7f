"""What the training loop tells its hooks (all a run does besides the step itself), and in which order.

The loop (engine/train/loop.py) calls every hook, in the order of engine/train/run.py's list, at the points
``Hook``'s methods say, each with the run's shared state (``RunState``, below): the position, plan, timing, metrics
and writer. A hook holds nothing of another: what it tells the others goes into the state. A
hook that spent time that is not a step's returns True from its call; the loop then calls ``pause`` on every hook once
that point's calls are over. A hook that wants the run to stop after this step raises ``StopRequested``.

Besides the events, a hook may have a share of the checkpoint (``checkpoint_key`` with ``state_dict`` and
``load_state_dict``: the saver writes it under that key, a resume gives it back) and may offer weights to evaluate
in place of the trained ones (``evaluated_weights``, e.g. the model EMA).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import DistContext

from ..run_plan import Position, RunPlan
from ..run_stop import RunStop
from ..run_timing import RunTiming


class Ending(enum.Enum):
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


class StopRequested(Exception):
    """Raised by a hook to end the run after this step (or during an evaluation): the loop closes it STOPPED."""


class ComputeSpan:
    """One step's time: CUDA events around its work on a GPU (the stream's time from its first to its last operation),
    the host's clock elsewhere. Started when made; ``end()`` after the step; ``ms()`` once the end event completed."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start, self._end = time.perf_counter(), None

    def end(self) -> ComputeSpan:
        if self._cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()
        return self

    def ms(self) -> float:
        return self._start.elapsed_time(self._end) if self._cuda else (self._end - self._start) * 1e3


@dataclass(frozen=True)
class StepDone:
    """What an optimizer step did."""

    number: int  # counted from 1 over the whole run (a resumed run goes on counting)
    epoch: int  # counted from 0
    values: torch.Tensor  # the step's result vector on the device (engine.train.step.OptimizerStep)
    names: tuple[str, ...]  # what each of ``values`` is: "loss", "grad_norm", then each loss unweighted
    size: tuple  # the batch's shape (B, C, H, W) on this process
    images: int  # the step's images over all processes
    data_s: float  # how long the loop waited for the batch
    compute: ComputeSpan  # the step's own time, the batch's wait left out


@dataclass(frozen=True)
class EpochEnd:
    """epoch: counted from 0; complete: all its steps ran (not only those up to max_steps or a stop)."""

    epoch: int
    complete: bool


@dataclass(frozen=True)
class EvaluatedWeights:
    """Weights a hook offers for evaluation in place of the trained ones: ``name`` (as eval json names them),
    ``label`` (as the log does) and ``applied``, a context manager that puts them in the model's tensors for its
    block."""

    name: str
    label: str
    applied: Callable[[], contextlib.AbstractContextManager]


class Hook:
    """A part of a run the loop calls, at these points in this order; each method does nothing unless overridden."""

    # The key of this hook's share of the checkpoint (None: it has none), whose state_dict() the saver writes there
    # and whose load_state_dict() a resume calls with what the checkpoint holds there.
    checkpoint_key: str | None = None

    def start(self, run: RunState) -> bool | None:
        """Once, before the first step (a resumed run's pending evaluation runs here)."""

    def before_step(self, run: RunState, number: int) -> bool | None:
        """Before step ``number`` (counted from 1 over the whole run) fetches its batch."""

    def after_step(self, run: RunState, done: StepDone) -> bool | None:
        """After the step, with what it did."""

    def epoch_end(self, run: RunState, end: EpochEnd) -> bool | None:
        """After an epoch's last step, or where the run's steps end inside it."""

    def pause(self, run: RunState) -> None:
        """Time that is not a step's has passed (a checkpoint, an evaluation, a profile's start or end): the next
        step's time starts now."""

    def close(self, run: RunState, ending: Ending) -> None:
        """Once at the end: DONE, STOPPED (a stop signal: save the position and stop) or FAILED. close(FAILED)
        follows a close that raised anything but the stop itself, and may find the hook in any state."""

    def state_dict(self) -> dict:
        """This hook's share of the checkpoint (with a ``checkpoint_key``)."""
        raise NotImplementedError(f"{type(self).__name__} has a checkpoint_key but no state_dict")

    def load_state_dict(self, state: dict) -> None:
        """Restore the share ``state_dict`` gave, from a resumed checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} has a checkpoint_key but no load_state_dict")

    def evaluated_weights(self) -> EvaluatedWeights | None:
        """Weights to evaluate in place of the trained ones, or None."""
        return None


# -- the run's shared state ------------------------------------------------------------------------------------------
# Hooks hold nothing of each other. What one measures for the others goes into the state (the losses a log interval
# checked, the lr, the last evaluation's figures); what the run asks of all of them (their shares of the checkpoint,
# the weights to evaluate) is collected by the state through the Hook protocol, never by naming a hook.


@dataclass
class RunMetrics:
    """The run's latest figures, each written by the hook that measures it."""

    losses: list[float] = field(default_factory=list)  # every step's total loss, read at each log interval
    checked_step: int = 0  # the last step whose loss and gradient norm are known to be finite
    lrs: dict[str, float] = field(default_factory=dict)  # parameter group -> its lr now
    evaluation: dict[str, float] | None = None  # the last evaluation's figures (eval/*), None before any


@dataclass
class RunState:
    """A training run as its hooks see it; ``hooks``: every hook, in the order the loop calls them."""

    position: Position  # where training stands (the loop moves it on)
    plan: RunPlan  # what the run will do
    timing: RunTiming  # where its wall time goes
    metrics: RunMetrics
    writer: ScalarWriter  # the run's TensorBoard
    ctx: DistContext  # this process, its device and the others
    output_dir: Path  # the run directory
    stop: RunStop  # stop signals, and whether every process knows of one
    hooks: list[Hook]
    resumed_from: Path | None = None  # the checkpoint this run resumed, if any

    def checkpoint_shares(self) -> dict[str, Hook]:
        """The hooks with a share of the checkpoint, by their key; two hooks cannot share a key."""
        shares: dict[str, Hook] = {}
        for hook in self.hooks:
            key = hook.checkpoint_key
            if key is None:
                continue
            if key in shares:
                raise ValueError(
                    f"two hooks keep their state under the checkpoint key {key!r}: "
                    f"{type(shares[key]).__name__} and {type(hook).__name__}"
                )
            shares[key] = hook
        return shares

    def evaluated_weights(self) -> EvaluatedWeights | None:
        """The weights a hook offers to evaluate in place of the trained ones (the model EMA), None when none does;
        at most one hook may."""
        offered = [weights for hook in self.hooks if (weights := hook.evaluated_weights()) is not None]
        if len(offered) > 1:
            raise ValueError(f"several hooks offer weights to evaluate: {', '.join(w.name for w in offered)}")
        return offered[0] if offered else None
