"""The training loop: epochs of TrainStep, log intervals, the epoch's checkpoint, then evaluation.

Order at the end of an epoch: the lr schedule steps, the checkpoint is written, and only then does the
evaluation run, so that a failure in evaluation (a bad validation image, say) loses no training. Losses
and timings are read from the GPU once per log interval (engine.step_log); a non-finite loss found
there stops the run before the next checkpoint, so checkpoint.pth stays the last good state.

The training batches are one stream over all epochs (datasets/batch_plan.py), so the loader's workers
prefetch across an epoch's end; a resumed run starts the stream at its step. A step that compiled (a new
size's graph, a CUDA-graph recording) is logged with what it compiled and how long that took, and its
compilation is left out of the ETA and of the training time (engine/run_timing.py).

Nothing is lost beyond the last checkpoint: checkpoint.pth is also rewritten mid-epoch every
``checkpoint_minutes``, and a stop signal (engine/stop_request.py) lets the step finish, writes it at that
exact step and stops the run (TrainingStopped). Checkpoints are written while training goes on
(engine/checkpoint_writer.py); a stop and the end of the run wait for the write. On several processes the
request travels in the log interval's all-reduce, so every rank stops at the same step without a sync of
its own.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from datasets import ImageReadError
from datasets.per_class_ap import category_names

from .build import Training
from .checkpoint import LATEST, check_free_space, checkpoint_bytes, epoch_checkpoint_name
from .checkpoint_writer import CheckpointWriter
from .compile_log import CompileTotals, describe_graphs, describe_work
from .detection_images import DetectionImages
from .distributed import DistContext, Ranks, all_reduce_mean, barrier
from .evaluation import evaluate_coco, record_evaluation
from .optim import group_lrs
from .progress import Progress
from .resume import last_checkpoint_hint
from .rng import capture_rng_state, epoch_seed, restore_rng_state, seed_all
from .run_timing import RunTiming
from .step_log import Interval, StepLog
from .stop_request import StopRequest, TrainingStopped
from .tensorboard import ScalarWriter

log = logging.getLogger("train")

# Per-decoder-layer (loss_ce_0 ...) and encoder (loss_ce_enc) copies of a loss; logged only inside the total.
AUX_LOSS = re.compile(r"_(\d+|enc)$")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops without saving that state."""


@dataclass
class Position:
    """Where training stands: epochs completed, optimizer steps done, batches done in the current epoch."""

    epoch: int = 0
    step: int = 0
    steps_in_epoch: int = 0
    rng: dict | None = None  # generator states to restore after skipping a resumed epoch's done batches


def planned_steps(cfg, steps_per_epoch: int) -> int:
    """The optimizer steps a run of ``cfg`` makes in all: its epochs, capped by max_steps."""
    total = steps_per_epoch * cfg.epochs
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


class Trainer:
    """Runs ``cfg``'s schedule from ``position``; ``fit()`` returns {"losses", "eval", "step", "timing"}.

    training         engine.build.Training: the unwrapped model (checkpoints, evaluation; its compiled regions are
                     in it), the step, the schedule, the compile plan
    train_loader     datasets.build_data_loader(train=True): its batch_sampler is the stream of all epochs
    config_record    the composed config as a plain dict, stored in every checkpoint
    timing           engine.run_timing.RunTiming of this process
    """

    def __init__(self, *, cfg, ctx: DistContext, output_dir: Path, training: Training, train_loader, val_loader,
                 coco_gt, detection_images: DetectionImages, position: Position, config_record: dict,
                 timing: RunTiming, stop: StopRequest | None = None):
        self.cfg, self.ctx, self.output_dir = cfg, ctx, Path(output_dir)
        self.model, self.step, self.postprocess = training.model, training.step, training.postprocess
        self.optimizer, self.precision = training.optimizer, training.precision
        self.lr_scheduler, self.train_loader, self.val_loader, self.coco_gt = (
            training.lr_scheduler, train_loader, val_loader, coco_gt)
        plan = training.compile_plan
        self.compiled_evaluation = plan is not None and plan.evaluation
        self.detection_images = detection_images
        self.position, self.config_record, self.timing = position, config_record, timing
        # Recorded in checkpoints, so that predict.py and export.py name the classes without the annotations.
        self.categories = category_names(coco_gt, coco_gt.getCatIds())
        self.batches = train_loader.batch_sampler
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = planned_steps(cfg, self.steps_per_epoch)
        if ctx.is_main:  # a full disk is found now, not at the end of an epoch of training
            check_free_space(self.output_dir, checkpoint_bytes(self.model))
        self.writer = ScalarWriter(log_dir=self.output_dir / "tensorboard", enabled=ctx.is_main)
        self.progress = Progress(total_steps=self.total_steps, start_step=position.step, enabled=ctx.is_main)
        self.step_log = StepLog(device=ctx.device)
        self.losses: list[float] = []
        self.eval_stats: dict | None = None
        self._stream = None
        self.stop = stop or StopRequest()
        self._stop_agreed = False  # every process has learnt of a stop request (at a log interval)
        self._last_save = time.monotonic()
        self.checkpoints = CheckpointWriter()

    # -- the schedule -----------------------------------------------------------------------------------
    def fit(self) -> dict:
        pos = self.position
        self.batches.start_at(pos.epoch, pos.steps_in_epoch)
        self._stream = iter(self.train_loader)
        if self.val_loader.num_workers > 0:
            # The validation loader's workers are forked now, before any checkpoint is written: forked while the
            # writer thread has the file open, they would inherit it and keep a replaced checkpoint's disk space
            # taken until the run ends. Its first evaluation then starts with its workers ready.
            iter(self.val_loader)
        try:
            for epoch in range(pos.epoch, self.cfg.epochs):
                if pos.step >= self.total_steps:
                    break
                self._train_epoch(epoch)
                self._close_epoch(epoch)
            self.timing.add_checkpoint(self.checkpoints.wait())
        except ImageReadError as error:  # a damaged image met while training: say where to resume from
            self.checkpoints.wait_quietly()  # the hint names the checkpoint being written
            raise ImageReadError(f"{error}\n{last_checkpoint_hint(self.output_dir)}") from error
        except BaseException:
            self.checkpoints.wait_quietly()
            raise
        finally:
            self._stream = None  # the endless stream's iterator; its workers end with the loader
            self.writer.close()
        record = self.timing.record(padding_waste=self.batches.padding_waste)
        if self.ctx.is_main:
            self.timing.write(self.output_dir, record)
            log.info("done: %s; outputs in %s", self.timing.summary(record), self.output_dir)
        return {"losses": self.losses, "eval": self.eval_stats, "step": pos.step, "timing": record}

    def _train_epoch(self, epoch: int) -> None:
        pos, device = self.position, self.ctx.device
        seed_all(epoch_seed(self.cfg.seed, epoch=epoch, rank=self.ctx.rank))
        if pos.steps_in_epoch and pos.rng is not None:
            # Mid-epoch resume: the stream starts at the step (its batches depend on the seed and epoch only);
            # the generators (dropout) are put back as they were at the checkpoint.
            restore_rng_state(pos.rng)
        self.step.model.train()
        self.step.criterion.train()
        self.step_log.restart_clock()
        self.timing.pause()
        while pos.steps_in_epoch < self.steps_per_epoch and pos.step < self.total_steps:
            before = self.timing.step_started()
            t_data = time.perf_counter()
            images, masks, targets = next(self._stream)
            images = images.to(device, non_blocking=True)
            masks = masks.to(device, non_blocking=True)
            targets = [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
                       for t in targets]
            self.step_log.begin(step=pos.step, data_ms=(time.perf_counter() - t_data) * 1e3)
            values = self.step(images, masks, targets)
            self.step_log.end(values, images=len(targets) * self.ctx.world_size)
            compiled = self.timing.step_ended(before, size=tuple(images.shape))
            pos.step += 1
            pos.steps_in_epoch += 1
            if compiled.graphs or compiled.seconds >= 1.0:
                self._report_compilation(compiled, what=f"step {pos.step} ({images.shape[-2]}x{images.shape[-1]})")
            if pos.step % self.cfg.log_every == 0 or pos.step == self.total_steps:
                self._report(epoch)
                self.checkpoints.check()
                self._save_if_due()
            self.stop.announce()
            if self._stop_agreed or (self.stop.requested and not self.ctx.distributed):
                self._stop_here(epoch)

    def _save_if_due(self) -> None:
        """checkpoint.pth mid-epoch once checkpoint_minutes have passed since the last save (rank 0 alone: it
        writes, no collective), right after a log interval's losses were checked."""
        minutes = self.cfg.checkpoint_minutes
        if (self.ctx.is_main and minutes is not None and time.monotonic() - self._last_save >= 60 * minutes
                and self.position.steps_in_epoch < self.steps_per_epoch):
            self._save(epoch_done=False)

    def _stop_here(self, epoch: int) -> None:
        """Write the exact position and stop: the step that was running when the signal came has finished."""
        self._report(epoch)  # this interval's losses are checked before they are saved
        self._save(epoch_done=False)
        self.timing.add_checkpoint(self.checkpoints.wait())  # the message below says the file holds this step
        pos, latest = self.position, self.output_dir / LATEST
        signum = self.stop.signum if self.stop.signum is not None else int(signal.SIGTERM)
        message = (f"stopped by {signal.Signals(signum).name if self.stop.requested else 'another process'} at epoch "
                   f"{epoch + 1}, step {pos.step} of {self.total_steps}: {latest} holds that step; continue with "
                   f"resume=auto (in this run directory) or resume={latest}")
        if self.ctx.is_main:
            log.warning(message)
        raise TrainingStopped(signum, message)

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
        self.writer.flush()

    # -- reporting ----------------------------------------------------------------------------------------
    def _report(self, epoch: int) -> None:
        """Read the interval's results (the one sync of the interval), stop on a non-finite loss, log."""
        step = self.step
        if not len(self.step_log):
            return
        average = (lambda t: all_reduce_mean(t, self.ctx)) if self.ctx.distributed else None
        interval = self.step_log.flush(step.value_names, average, stop=self.stop.requested)
        self._stop_agreed = self._stop_agreed or interval.stop_requested
        checked = ("loss",) if self.precision.scaler.is_enabled() else ("loss", "grad_norm")  # fp16 skips overflows
        bad = interval.first_non_finite(checked)
        if bad is not None:
            index, row = bad
            what = "loss" if not math.isfinite(row["loss"]) else "gradient norm"
            raise NonFiniteLossError(self._non_finite_message(what, row, epoch=epoch, step=index))
        self.losses.extend(r["loss"] for r in interval.rows)
        if self.ctx.is_main:
            self._log_interval(interval, epoch)

    def _log_interval(self, interval: Interval, epoch: int) -> None:
        weights = self.step.criterion.weight_dict
        last = interval.last
        lrs = group_lrs(self.optimizer)
        weighted = {k: last[k] * weights[k] for k in self.step.loss_names if k in weights and not AUX_LOSS.search(k)}
        scalars = {"loss": last["loss"], **weighted, **{f"{k}_unscaled": last[k] for k in weighted},
                   "lr": lrs.get("rest", next(iter(lrs.values()))), "step_time_ms": interval.step_ms,
                   "data_time_ms": interval.data_ms, "images_per_s": interval.images_per_s,
                   "grad_norm": last["grad_norm"]}
        if "backbone" in lrs:
            scalars["lr_backbone"] = lrs["backbone"]
        if self.ctx.device.type == "cuda":
            scalars["max_memory_mb"] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20
        step = self.position.step
        self.writer.add("train", scalars, step)
        self.progress.report(step=step, epoch=epoch, epochs=self.cfg.epochs, loss=last["loss"], parts=weighted,
                             lr=scalars["lr"], step_ms=interval.step_ms, data_ms=interval.data_ms,
                             images_per_s=interval.images_per_s, excluded_s=self.timing.not_training_s)

    def _report_compilation(self, compiled: CompileTotals, *, what: str) -> None:
        """One line per step (or evaluation) that compiled, and the run's compile totals in TensorBoard."""
        if not self.ctx.is_main:
            return
        total = self.timing.compile
        log.info("%s: %s in %.1f s%s; %.1f s of compilation in this run so far", what, describe_work(compiled),
                 compiled.seconds,
                 f" ({describe_graphs(compiled.by_function)})" if compiled.by_function else "", total.seconds)
        self.writer.add("compile", {"seconds": total.seconds, "graphs": total.graphs}, self.position.step)

    def _non_finite_message(self, what: str, row: dict, *, epoch: int, step: int) -> str:
        self.checkpoints.wait_quietly()  # the last good checkpoint may still be being written
        latest = self.output_dir / LATEST
        kept = (f"the last good checkpoint, {latest}, is kept (resume={latest})" if latest.exists()
                else "no checkpoint had been written yet")
        losses = ", ".join(f"{k}={row[k]:.4g}" for k in self.step.loss_names if not AUX_LOSS.search(k))
        return (f"non-finite {what} ({row['loss'] if what == 'loss' else row['grad_norm']}) at epoch {epoch + 1}, "
                f"step {step + 1} ({losses}); that update was skipped and the run stops without saving: {kept}. "
                f"Try a lower optim.lr, amp=none, or check the data")

    # -- checkpoint and evaluation ------------------------------------------------------------------------
    def _save(self, *, epoch_done: bool) -> None:
        pos = self.position
        if self.ctx.is_main:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "lr_scheduler": self.lr_scheduler.state_dict(),
                     "grad_scaler": self.precision.scaler.state_dict(), "epoch": pos.epoch,
                     "steps_in_epoch": pos.steps_in_epoch, "step": pos.step, "config": self.config_record,
                     "categories": self.categories, "rng": capture_rng_state()}
            if epoch_done and pos.epoch % self.cfg.checkpoint_every == 0:
                held = self.checkpoints.save(state, self.output_dir / epoch_checkpoint_name(pos.epoch),
                                             also_as=self.output_dir / LATEST)
            else:
                held = self.checkpoints.save(state, self.output_dir / LATEST)
            self.timing.add_checkpoint(held)
        self._last_save = time.monotonic()
        self.timing.pause()  # the time held here is the checkpoint's, not the next step's
        self.step_log.restart_clock()

    def _evaluate(self, *, epoch: int, epoch_complete: bool) -> None:
        before, t0 = self.timing.clock.totals(), time.perf_counter()
        evaluation = evaluate_coco(model=self.model, postprocess=self.postprocess, loader=self.val_loader,
                                   coco_gt=self.coco_gt, device=self.ctx.device, precision=self.precision,
                                   keep_detections=self.detection_images.image_ids, ranks=Ranks(self.ctx),
                                   compiled=self.compiled_evaluation, backend=self.cfg.eval_backend)
        compiled = self.timing.clock.totals().since(before)
        self.timing.add_evaluation(time.perf_counter() - t0, compiled)
        if compiled.graphs or compiled.seconds >= 1.0:
            self._report_compilation(compiled, what=f"evaluation after epoch {epoch}")
        self.eval_stats = evaluation.stats
        step = self.position.step
        if self.ctx.is_main:
            record_evaluation(evaluation, writer=self.writer, json_path=self.output_dir / f"eval_epoch{epoch:04d}.json",
                              step=step, what=f"after epoch {epoch}, step {step}",
                              detection_images=self.detection_images, log=log, epoch=epoch,
                              epoch_complete=epoch_complete)
        self.step_log.restart_clock()
