"""The training loop: it fetches each batch, runs the step and keeps the position; all else is a hook of the run's list
(engine/train/hooks/base.py says when each is called, engine/train/run.py makes the list). The training batches are
one stream over all epochs (datasets/batch_plan.py), so the loader's workers prefetch across an epoch's end."""

from __future__ import annotations

import time

from torch.profiler import record_function

from datasets.loader import is_worker_death, stop_workers
from engine.runtime.device_batches import DeviceBatches
from engine.runtime.rng import epoch_seed, restore_rng_state, seed_all
from engine.runtime.stop_request import TrainingStopped

from .hooks.base import ComputeSpan, Ending, EpochEnd, RunState, StepDone, StopRequested
from .step import OptimizerStep


class TrainingLoop:
    """Runs ``run``'s plan from its position with ``step`` on ``loader``'s batches, calling ``run.hooks`` in their
    order with ``run`` (``loader``: datasets.build_data_loader(train=True), whose batch_sampler is the stream of all
    epochs)."""

    def __init__(self, *, step: OptimizerStep, loader, run: RunState):
        self.step, self.loader, self.state = step, loader, run
        self._batches = None

    def run(self) -> None:
        """Train to the plan's end, or raise: TrainingStopped after a stop signal, the run's error otherwise. The
        hooks are closed once: DONE, STOPPED (the stop control's TrainingStopped ends the run) or, on any other
        error, FAILED."""
        ending, closed = Ending.DONE, False
        try:
            try:
                self._call("start")
                for epoch in range(self.state.position.epoch, self.state.plan.epochs):
                    if self.state.position.step >= self.state.plan.total_steps:
                        break
                    self._train_epoch(epoch)
            except StopRequested:
                ending = Ending.STOPPED
            try:
                self._call("close", ending)
            except TrainingStopped:
                closed = ending is Ending.STOPPED
                raise
            closed = True
        except BaseException:
            if not closed:
                self._fail()
            raise
        finally:
            if ending is Ending.STOPPED and closed:
                stop_workers(self.loader)  # a stopped run exits at once: its prefetching workers end now
            self._batches = None  # the endless stream's iterator; its workers end with the loader

    def _train_epoch(self, epoch: int) -> None:
        pos, plan, ctx = self.state.position, self.state.plan, self.state.ctx
        seed_all(epoch_seed(plan.seed, epoch=epoch, rank=ctx.rank))
        if pos.steps_in_epoch and pos.rng is not None:
            # Mid-epoch resume: the stream starts at the step (its batches depend on the seed and epoch only);
            # the generators (dropout) are put back as they were at the checkpoint.
            restore_rng_state(pos.rng)
        if self._batches is None:
            self.loader.batch_sampler.start_at(pos.epoch, pos.steps_in_epoch)
            self._batches = DeviceBatches(iter(self.loader), ctx.device)
        self.step.model.train()
        self.step.criterion.train()
        self._pause()
        while pos.steps_in_epoch < plan.steps_per_epoch and pos.step < plan.total_steps:
            self._call("before_step", pos.step + 1)
            fetch = time.perf_counter()
            with record_function("step.data"):
                images, masks, targets = next(self._batches)
            data_s = time.perf_counter() - fetch
            compute = ComputeSpan(ctx.device)
            values = self.step(images, masks, targets)
            pos.step, pos.steps_in_epoch = pos.step + 1, pos.steps_in_epoch + 1
            done = StepDone(
                number=pos.step,
                epoch=epoch,
                values=values,
                names=self.step.value_names,
                size=tuple(images.shape),
                images=len(targets) * ctx.world_size,
                data_s=data_s,
                compute=compute.end(),
            )
            self._call("after_step", done)
        complete = pos.steps_in_epoch == plan.steps_per_epoch
        if complete:
            pos.epoch, pos.steps_in_epoch = epoch + 1, 0
        self._call("epoch_end", EpochEnd(epoch=epoch, complete=complete))

    def _call(self, event: str, *args) -> None:
        """Every hook's ``event``, in order; then, if one spent time that is not a step's, every hook's pause. A stop
        a hook asks for (StopRequested, or TrainingStopped as a stopped run closes) is raised once every hook has
        seen the event; any other error at once."""
        paused, stop = False, None
        for hook in self.state.hooks:
            try:
                paused = bool(getattr(hook, event)(self.state, *args)) or paused
            except (StopRequested, TrainingStopped) as request:
                stop = stop or request
        if paused:
            self._pause()
        if stop is not None:
            raise stop

    def _pause(self) -> None:
        for hook in self.state.hooks:
            hook.pause(self.state)

    def _fail(self) -> None:
        """On the way out of a failing run: the hooks closed FAILED (the write in flight finished, the validation
        loader's workers ended), and the training loader's workers ended."""
        # A dead worker's error is raised by a signal handler wherever the main thread is: with several dead workers,
        # into this cleanup too (even as it starts), which is then done again.
        while True:
            try:
                for hook in self.state.hooks:
                    hook.close(self.state, Ending.FAILED)
                stop_workers(self.loader)
                break
            except RuntimeError as another:
                if not is_worker_death(another):
                    raise
