"""A training run as ``python train.py`` makes it (``train(cfg, hooks=[...])``): its config settled, checked and
frozen (settle.py), the run's plan, model and step, its hooks and their shared state, then the loop. ``build_hooks``
is the index of what a run does besides stepping; ``hooks=`` adds one's own (engine/train/hooks/base.py says what a
hook is called with, and when)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from datasets.per_class_ap import category_names
from engine.config.registry import plain_config
from engine.evaluation.detection_images import build_detection_images
from engine.evaluation.validation import Validation
from engine.reporting.progress import Progress
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import DistContext, Ranks
from engine.runtime.stop_request import StopRequest

from .build import TrainingSetup, build_training
from .hooks.base import Hook, RunMetrics, RunState
from .hooks.ema import build_ema
from .hooks.evaluation import EpochEvaluation
from .hooks.interval_report import IntervalReporter
from .hooks.lr_schedule import EpochLrSchedule
from .hooks.profiling import StepProfiler
from .hooks.saving import CheckpointSaver, restore_checkpoint_shares
from .hooks.stopping import StopControl
from .hooks.timing import StepTiming
from .loop import TrainingLoop
from .resume import checkpoint_step_images, explained_failure, position_in_this_run
from .run_plan import Position, RunPlan, plan_run, step_batch
from .run_setup import (
    build_loader,
    check_two_stage_queries,
    in_run_directory,
    prepare_compilation,
    size_buckets,
    warn_unbounded_sizes,
)
from .run_stop import RunStop
from .run_timing import RunTiming, peak_memory_gib
from .settle import settle_training

log = logging.getLogger(__name__)


def train(cfg: DictConfig, *, hooks: Sequence[Hook] = (), started: float | None = None) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval", "step",
    "timing"}. ``hooks``: hooks of one's own, called in their order after the run's own (its checkpoint written and
    its evaluation done) and before its stop control; ``started``: the job's start (time.perf_counter), from which
    timing.json counts; default now."""
    started = time.perf_counter() if started is None else started
    with in_run_directory(cfg) as (ctx, output_dir), StopRequest() as stop:
        return run_training(cfg, ctx, output_dir, stop, hooks=list(hooks), started=started)


def run_training(
    cfg: DictConfig, ctx: DistContext, output_dir: Path, stop: StopRequest, *, hooks: list[Hook], started: float
) -> dict:
    """The run inside its directory, its lock held and its stop signals caught (``train``)."""
    timing = RunTiming(started=started, report=ctx.is_main)
    prepare_compilation(cfg)
    settled = settle_training(cfg, ctx, output_dir)
    cfg, data, ckpt, resume_path = settled.cfg, settled.data, settled.ckpt, settled.resume_path
    batch = step_batch(total_batch_size=cfg.total_batch_size, batch_size=cfg.batch_size, world_size=ctx.world_size)
    if ctx.is_main:
        log.info("%s", batch.describe(ctx.world_size))

    # Planned for the step's batch over all processes, which datasets/batch_plan.py splits among them.
    buckets = size_buckets(cfg, ctx, data["train"], data["val"], batch_size=batch.total)
    check_two_stage_queries(cfg.model, buckets)
    train_loader = build_loader(data["train"], cfg, ctx, train=True, buckets=buckets, batch_size=batch.per_process)
    val_loader = build_loader(data["val"], cfg, ctx, train=False, buckets=buckets, batch_size=batch.per_pass)
    steps_per_epoch = train_loader.batch_sampler.steps_per_epoch
    if steps_per_epoch == 0:
        raise ValueError(
            f"the training set has {len(data['train'])} images, too few for one batch of "
            f"{batch.per_process} per process on {ctx.world_size} processes"
            + (
                " once batched by size (dataset.size_buckets=0 batches any images together)"
                if buckets is not None
                else ""
            )
        )
    position = Position.of_checkpoint(ckpt, world_size=ctx.world_size)
    if ckpt is not None:  # counted in this run's steps, which may take another number of images
        position, renumbered = position_in_this_run(
            position,
            steps_per_epoch=steps_per_epoch,
            step_images=batch.total,
            checkpoint_step_images=checkpoint_step_images(ckpt),
        )
        if renumbered and ctx.is_main:
            log.warning("resuming %s: %s", resume_path, renumbered)
    plan = plan_run(cfg, batch=batch, steps_per_epoch=steps_per_epoch, start=position)
    setup = build_training(
        cfg,
        ctx=ctx,
        batch=batch,
        model_config=settled.checked.model,
        init=settled.init,
        ckpt=ckpt,
        ckpt_path=resume_path,
        evaluation_batches=len(val_loader.batch_sampler) * plan.evaluations,
        training_steps=plan.total_steps,
    )
    if ckpt is not None:  # epochs counted from 1, as the progress line counts them: the one in progress, or the next
        log.info(
            "resumed from %s at step %d: epoch %d/%d, %d of its %d steps of %d images done",
            resume_path,
            position.step,
            position.epoch + 1,
            plan.epochs,
            position.steps_in_epoch,
            steps_per_epoch,
            batch.total,
        )
    if ctx.is_main:
        warn_unbounded_sizes(cfg, buckets, setup.run_model.compile_plan, training=True)
        n_params = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
        log.info(
            "run directory %s | %d process%s on %s, %s%s | %.1fM trainable parameters | %s | %d steps per "
            "epoch, %d epochs",
            output_dir,
            ctx.world_size,
            "es" if ctx.world_size > 1 else "",
            ctx.device,
            setup.precision.name,
            running_as(setup.run_model.compile_plan),
            n_params / 1e6,
            batch.describe(ctx.world_size),
            steps_per_epoch,
            cfg.epochs,
        )
    own = build_hooks(cfg, ctx, setup, plan=plan, val_loader=val_loader, val_set=data["val"])
    run = RunState(
        position=position,
        plan=plan,
        timing=timing,
        metrics=RunMetrics(),
        writer=ScalarWriter(log_dir=output_dir / "tensorboard", enabled=ctx.is_main),
        ctx=ctx,
        output_dir=output_dir,
        stop=RunStop(stop, ctx),
        hooks=[*own[:-1], *hooks, own[-1]],  # one's own hooks before the stop control, which ends a stopped run
        resumed_from=resume_path,
    )
    if ckpt is not None:
        restore_checkpoint_shares(run, ckpt)
    try:
        TrainingLoop(step=setup.step, loader=train_loader, run=run).run()
    except BaseException as error:
        explained = explained_failure(error, output_dir)
        if explained is None:
            raise
        raise explained from None
    finally:
        run.writer.close()
    result = timing.record(
        padding_waste=train_loader.batch_sampler.padding_waste, peak_memory_gib=peak_memory_gib(ctx.device)
    )
    if ctx.is_main:
        timing.write(output_dir, result)
        log.info("done: %s; outputs in %s", timing.summary(result), output_dir)
    return {
        "output_dir": output_dir,
        "losses": run.metrics.losses,
        "eval": run.metrics.evaluation,
        "step": position.step,
        "timing": result,
    }


def build_hooks(
    cfg: DictConfig, ctx: DistContext, setup: TrainingSetup, *, plan: RunPlan, val_loader, val_set
) -> list[Hook]:
    """Every part of the run besides the step, in the order the loop calls them. The step timing first (a step's
    time ends before any hook works), the profiler next (its trace's export is not a step's time); before the saver
    the report (a checkpoint holds no step with a non-finite loss), the lr schedule and the EMA (a checkpoint holds
    the next epoch's lr and this step's average); after it the evaluation (a failed one loses no training); the stop
    control last (it ends a stopped run)."""
    compiled = setup.run_model.compile_plan
    validation = Validation(
        model=setup.model,
        postprocess=setup.run_model.postprocess,
        loader=val_loader,
        coco_gt=val_set.coco,
        precision=setup.precision,
        ranks=Ranks(ctx),
        compiled=compiled is not None and compiled.evaluation,
        backend=cfg.eval_backend,
        detection_images=build_detection_images(cfg, val_set, enabled=ctx.is_main),
    )
    progress = Progress(
        total_steps=plan.total_steps,
        start_step=plan.start_step,
        enabled=ctx.is_main,
        steps_per_epoch=plan.steps_per_epoch,
        evaluation_steps=plan.evaluation_steps,
        val_images=len(val_set),
    )
    training = {
        "model": setup.model,
        "optimizer": setup.optimizer,
        "lr_scheduler": setup.lr_scheduler,
        "grad_scaler": setup.precision.scaler,
    }
    record = {"config": plain_config(cfg), "categories": category_names(val_set.coco, val_set.coco.getCatIds())}
    ema = build_ema(cfg.ema, setup.model)
    return [
        StepTiming(),
        StepProfiler(cfg.profile_steps),
        IntervalReporter(
            loss_weights=setup.step.criterion.weight_dict,
            progress=progress,
            fp16_skips_overflows=setup.precision.scaler.is_enabled(),
        ),
        EpochLrSchedule(setup.lr_scheduler),
        *([ema] if ema is not None else []),
        CheckpointSaver(training=training, record=record, every=cfg.checkpoint_every, minutes=cfg.checkpoint_minutes),
        EpochEvaluation(validation),
        StopControl(),
    ]


def running_as(plan) -> str:
    """How the model runs, for the run's first log line."""
    if plan is None:
        return ", eager"
    return ", CUDA graphs of the eager model" if plan.mode == "graphs" else f", compiled ({plan.mode})"
