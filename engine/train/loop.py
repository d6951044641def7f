"""The training loop: epochs of optimizer steps, then at each epoch's end the checkpoint and the evaluation.

Order at the end of an epoch: the lr schedule steps, the checkpoint is written, and only then does the
evaluation run, so that a failure in evaluation (a bad validation image, say) loses no training.

The training batches are one stream over all epochs (datasets/batch_plan.py), so the loader's workers
prefetch across an epoch's end; a resumed run starts the stream at its step. The loop delegates the rest:
reporting each log interval (engine/train/interval_report.py), the checkpoints (saving.py), evaluation
(epoch_evaluation.py) and stop signals (stopping.py). Nothing is lost beyond the last checkpoint:
checkpoint.pth is also rewritten mid-epoch every ``checkpoint_minutes``, and a stop signal lets the step
finish, writes it at that exact step and stops the run (TrainingStopped).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from torch.profiler import record_function

from datasets import ImageReadError
from datasets.loader import is_worker_death, stop_workers, worker_error_message
from engine.errors import LoaderWorkerDied
from engine.evaluation.coco import EvaluationStopped
from engine.reporting.gpu_profile import StepProfiler
from engine.runtime.device_batches import DeviceBatches
from engine.runtime.distributed import DistContext, barrier
from engine.runtime.rng import epoch_seed, restore_rng_state, seed_all

from .epoch_evaluation import EpochEvaluation
from .interval_report import IntervalReporter
from .resume import last_checkpoint_hint, resume_hint
from .run_timing import RunTiming, peak_memory_gib
from .saving import CheckpointSaver
from .schedule import Position, planned_steps
from .step import OptimizerStep
from .stopping import StopControl

log = logging.getLogger("train")


class TrainingLoop:
    """Runs ``cfg``'s schedule from ``position``; ``run()`` returns {"losses", "eval", "step", "timing"}.

    step            the OptimizerStep to run on each batch
    lr_scheduler    stepped at each epoch's end
    train_loader    datasets.build_data_loader(train=True): its batch_sampler is the stream of all epochs
    val_loader      the validation loader (its workers are started before the first checkpoint)
    """

    def __init__(self, *, cfg, ctx: DistContext, output_dir: Path, step: OptimizerStep, lr_scheduler, train_loader,
                 val_loader, position: Position, timing: RunTiming, reporter: IntervalReporter,
                 saver: CheckpointSaver, evaluation: EpochEvaluation, stopping: StopControl):
        self.cfg, self.ctx, self.output_dir = cfg, ctx, Path(output_dir)
        self.step, self.lr_scheduler = step, lr_scheduler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.position, self.timing = position, timing
        self.reporter, self.saver, self.evaluation, self.stopping = reporter, saver, evaluation, stopping
        self.batches = train_loader.batch_sampler
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = planned_steps(cfg, self.steps_per_epoch)
        self.profiler = StepProfiler(cfg.profile_steps, output_dir=self.output_dir, device=ctx.device, rank=ctx.rank,
                                     world_size=ctx.world_size, report=ctx.is_main)
        self._stream = None

    def run(self) -> dict:
        pos = self.position
        self.profiler.plan(pos.step + 1, self.total_steps)
        self.batches.start_at(pos.epoch, pos.steps_in_epoch)
        self._stream = DeviceBatches(iter(self.train_loader), self.ctx.device)
        if self.val_loader.num_workers > 0:
            # The validation loader's workers are forked now, before any checkpoint is written: forked while the
            # writer thread has the file open, they would inherit it and keep a replaced checkpoint's disk space
            # taken until the run ends. Its first evaluation then starts with its workers ready.
            iter(self.val_loader)
        try:
            if pos.pending_evaluation is not None:  # a resume of a run stopped during an evaluation
                self._evaluate(**pos.pending_evaluation)
                pos.pending_evaluation = None
                self._save(epoch_done=False)  # the checkpoint no longer asks for it
            for epoch in range(pos.epoch, self.cfg.epochs):
                if pos.step >= self.total_steps:
                    break
                self._train_epoch(epoch)
                self._close_epoch(epoch)
            self.saver.wait()
        except BaseException as error:
            # A dead worker's error is raised by a signal handler wherever the main thread is: with several dead
            # workers, into this cleanup too (even as _fail is entered), which is then done again.
            while True:
                try:
                    self._fail()
                    break
                except RuntimeError as another:
                    if not is_worker_death(another):
                        raise
            if isinstance(error, ImageReadError):  # a damaged image met while training: say where to resume from
                # The hint names the checkpoint being written.
                raise ImageReadError(f"{worker_error_message(error)}\n{last_checkpoint_hint(self.output_dir)}") \
                    from None
            if is_worker_death(error):
                raise LoaderWorkerDied(f"a data loader worker process died ({worker_error_message(error)}): it was "
                                       f"killed, or ran out of memory (fewer num_workers use less)\n"
                                       f"{resume_hint(self.output_dir)}") from None
            raise
        finally:
            self._stream = None  # the endless stream's iterator; its workers end with the loader
            self.reporter.writer.close()
            self.profiler.stop()
        record = self.timing.record(padding_waste=self.batches.padding_waste,
                                    peak_memory_gib=peak_memory_gib(self.ctx.device),
                                    **({"profile": self.profiler.summary} if self.profiler.summary else {}))
        if self.ctx.is_main:
            self.timing.write(self.output_dir, record)
            log.info("done: %s; outputs in %s", self.timing.summary(record), self.output_dir)
        return {"losses": self.reporter.losses, "eval": self.evaluation.stats, "step": pos.step, "timing": record}

    def _fail(self) -> None:
        """On the way out of a failing run: the write in flight finished, the loaders' workers ended."""
        self.saver.wait_quietly()
        for loader in (self.train_loader, self.val_loader):
            stop_workers(loader)

    def _train_epoch(self, epoch: int) -> None:
        pos, step_log = self.position, self.reporter.step_log
        seed_all(epoch_seed(self.cfg.seed, epoch=epoch, rank=self.ctx.rank))
        if pos.steps_in_epoch and pos.rng is not None:
            # Mid-epoch resume: the stream starts at the step (its batches depend on the seed and epoch only);
            # the generators (dropout) are put back as they were at the checkpoint.
            restore_rng_state(pos.rng)
        self.step.model.train()
        self.step.criterion.train()
        self._not_a_step()
        while pos.steps_in_epoch < self.steps_per_epoch and pos.step < self.total_steps:
            if self.profiler.before_step(pos.step + 1):
                self._not_a_step()  # the profiler's start is not the step's time
            profiled = self.profiler.active
            before = self.timing.step_started()
            t_data = time.perf_counter()
            with record_function("step.data"):
                images, masks, targets = next(self._stream)
            data_s = time.perf_counter() - t_data
            step_log.begin(step=pos.step, data_ms=data_s * 1e3)
            values = self.step(images, masks, targets)
            step_log.end(values, images=len(targets) * self.ctx.world_size)
            compiled = self.timing.step_ended(before, size=tuple(images.shape), data_s=data_s, profiled=profiled)
            pos.step += 1
            pos.steps_in_epoch += 1
            if self.profiler.after_step(pos.step, warm=self.timing.last_step_warm):
                self._not_a_step()  # nor is writing its trace
            if compiled.graphs or compiled.seconds >= 1.0:
                self.reporter.report_compilation(compiled, step=pos.step,
                                                 what=f"step {pos.step} ({images.shape[-2]}x{images.shape[-1]})")
            if pos.step % self.cfg.log_every == 0 or pos.step == self.total_steps:
                self._report(epoch)
                self.saver.check()
                if self.saver.due(pos, steps_per_epoch=self.steps_per_epoch):
                    self._save(epoch_done=False)
            if self.stopping.due():
                self._stop_here(epoch)
        if self.profiler.stop():  # the epoch's close is not a step
            self._not_a_step()

    def _report(self, epoch: int) -> None:
        """The interval's losses checked and logged; a stop request learnt by every process."""
        self.stopping.heard(self.reporter.report(epoch=epoch, step=self.position.step,
                                                 stop_requested=self.stopping.requested_here))

    def _save(self, *, epoch_done: bool) -> None:
        self.saver.save(self.position, epoch_done=epoch_done)
        self._not_a_step()  # the time held here is the checkpoint's, not the next step's

    def _not_a_step(self) -> None:
        """What happens between steps (evaluation, checkpoints) is kept out of the next step's time and images/s."""
        self.timing.pause()
        self.reporter.step_log.restart_clock()

    def _stop_here(self, epoch: int) -> None:
        """Write the exact position and stop: the step that was running when the signal came has finished."""
        self.profiler.stop()  # the checkpoint's write is not a step
        self._report(epoch)  # this interval's losses are checked before they are saved
        self._save(epoch_done=False)
        self.saver.wait()  # the message says the file holds this step
        raise self.stopping.stopped(epoch=epoch, step=self.position.step, total_steps=self.total_steps,
                                    latest=self.saver.latest)

    def _evaluate(self, *, epoch: int, epoch_complete: bool) -> None:
        """The evaluation after ``epoch`` (1-based); a stop signal stops it within a batch, saves the step with the
        evaluation to run first on resuming, and stops the run."""
        pos = self.position
        try:
            self.evaluation.run(epoch=epoch, step=pos.step, epoch_complete=epoch_complete,
                                should_stop=self.stopping.during_evaluation)
        except EvaluationStopped:
            pos.pending_evaluation = {"epoch": epoch, "epoch_complete": epoch_complete}
            self._save(epoch_done=False)
            self.saver.wait()  # the message says the file holds this step
            raise self.stopping.stopped(epoch=epoch - 1, step=pos.step, total_steps=self.total_steps,
                                        latest=self.saver.latest, evaluation=epoch) from None
        self.reporter.step_log.restart_clock()

    def _close_epoch(self, epoch: int) -> None:
        """Checkpoint first, then evaluate: nothing trained is lost to a failure in evaluation."""
        pos = self.position
        self._report(epoch)  # a non-finite loss stops the run here, before anything is saved
        epoch_done = pos.steps_in_epoch == self.steps_per_epoch
        if epoch_done:
            try:
                self.lr_scheduler.step()
            except Exception:
                self._save(epoch_done=False)  # every step of the epoch kept; resuming retries the close
                raise
            pos.epoch, pos.steps_in_epoch = epoch + 1, 0
        self._save(epoch_done=epoch_done)
        last = pos.step >= self.total_steps or epoch + 1 == self.cfg.epochs
        if last or (epoch_done and (epoch + 1) % self.cfg.eval_every == 0):
            self._evaluate(epoch=epoch + 1, epoch_complete=epoch_done)
        barrier(self.ctx)
        self.reporter.writer.flush()
