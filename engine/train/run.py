"""A training run as ``python train.py`` makes it: data, resume, model, then the loop (``train(cfg)``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from datasets.per_class_ap import category_names
from engine.checkpoint.contents import check_training_state
from engine.checkpoint.init_from import InitFrom, prepare_init_from
from engine.checkpoint.io import load_checkpoint
from engine.checkpoint.num_classes import resolve_num_classes
from engine.config.registry import check_config, plain_config
from engine.evaluation.detection_images import build_detection_images
from engine.evaluation.validation import Validation
from engine.reporting.progress import Progress
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import (
    DistContext,
    Ranks,
    any_process,
    broadcast_object,
    init_distributed,
    shutdown_distributed,
)
from engine.runtime.stop_request import StopRequest

from .build import TrainingSetup, build_training
from .epoch_evaluation import EpochEvaluation
from .interval_report import IntervalReporter
from .loop import TrainingLoop
from .resume import config_for_resume, find_resume_checkpoint
from .run_setup import (
    build_datasets,
    build_loader,
    holding_the_run_directory,
    prepare_compilation,
    resolve_output_dir,
    size_buckets,
    warn_unbounded_sizes,
)
from .run_timing import RunTiming
from .saving import CheckpointSaver
from .schedule import Position, evaluation_steps, planned_evaluations, planned_steps
from .step_batch import step_batch
from .stopping import StopControl

log = logging.getLogger("train")


def train(cfg: DictConfig, *, started: float | None = None) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval", "step",
    "timing"}. ``started``: the process's start (time.perf_counter), from which timing.json counts; default now."""
    cfg = check_config(cfg)
    ctx = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    try:
        output_dir = resolve_output_dir(cfg, ctx)
        with holding_the_run_directory(output_dir, ctx), StopRequest() as stop:
            return run_training(cfg, ctx, output_dir, stop,
                                started=time.perf_counter() if started is None else started)
    finally:
        shutdown_distributed(ctx)


def run_training(cfg: DictConfig, ctx: DistContext, output_dir: Path, stop: StopRequest, *, started: float) -> dict:
    """The run inside its directory, its lock held and its stop signals caught (``train``)."""
    timing = RunTiming(started=started)
    batch = step_batch(total_batch_size=cfg.total_batch_size, batch_size=cfg.batch_size, world_size=ctx.world_size)
    if ctx.is_main:
        log.info("%s", batch.describe(ctx.world_size))
    prepare_compilation(cfg)
    # The data first: it is checked before anything is trained, and may decide model.num_classes.
    data = build_datasets(cfg, ctx, ("train", "val"))

    # The checkpoint to resume and the config the resumed run uses (engine/train/resume.py).
    resume_path, ckpt = None, None
    if ctx.is_main:  # rank 0 picks (resume=auto looks at file times), so every rank resumes from the same file
        resume_path = find_resume_checkpoint(cfg.resume, output_dir=output_dir, search_root=Path("outputs"),
                                             config=plain_config(cfg))
    resume_path = broadcast_object(resume_path, ctx)
    if resume_path is not None:
        ckpt = load_checkpoint(resume_path)
        check_training_state(ckpt, path=resume_path)
        cfg = config_for_resume(cfg, ckpt, path=resume_path, report=ctx.is_main)
    # Classes from the data when model.num_classes is null; category ids checked against them.
    cfg.model.num_classes = resolve_num_classes(cfg.model.num_classes, data,
                                                resumed_from=str(resume_path) if resume_path is not None else None)

    buckets = size_buckets(cfg, ctx, data["train"], data["val"], batch_size=batch.per_process)
    train_loader = build_loader(data["train"], cfg, ctx, train=True, buckets=buckets, batch_size=batch.per_process)
    val_loader = build_loader(data["val"], cfg, ctx, train=False, buckets=buckets, batch_size=batch.per_pass)
    steps_per_epoch = train_loader.batch_sampler.steps_per_epoch
    if steps_per_epoch == 0:
        raise ValueError(f"the training set has {len(data['train'])} images, too few for one batch of "
                         f"{batch.per_process} per process on {ctx.world_size} processes"
                         + (" once batched by size (dataset.size_buckets=0 batches any images together)"
                            if buckets is not None else ""))
    total_steps = planned_steps(cfg, steps_per_epoch)
    start_epoch = ckpt["epoch"] if ckpt is not None else 0
    evaluations = planned_evaluations(cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                      start_epoch=start_epoch)

    # model.init_from: a new run from another checkpoint's weights (reads it, puts its variant into cfg.model).
    # A resumed run has its own weights.
    init = prepare_init_from(cfg.model) if ckpt is None else InitFrom()
    setup = build_training(cfg, ctx=ctx, init=init, ckpt=ckpt, ckpt_path=resume_path,
                           evaluation_batches=len(val_loader.batch_sampler) * evaluations, training_steps=total_steps)
    position = Position()
    if setup.resumed is not None:
        resumed = setup.resumed
        position = Position(epoch=resumed.epoch, step=resumed.step, steps_in_epoch=resumed.steps_in_epoch,
                            rng=resumed.rng if ctx.world_size == 1 else None,
                            pending_evaluation=resumed.pending_evaluation)
        # Epochs counted from 1, as the progress line counts them: the one in progress, or the next.
        log.info("resumed from %s at step %d: epoch %d/%d, %d of its %d steps done", resume_path, resumed.step,
                 resumed.epoch + 1, cfg.epochs, resumed.steps_in_epoch, steps_per_epoch)
    if ctx.is_main:
        warn_unbounded_sizes(cfg, buckets, setup.compile_plan, training=True)
        n_params = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
        log.info("run directory %s | %d processes on %s, %s%s | %.1fM trainable parameters | %s | %d steps per "
                 "epoch, %d epochs", output_dir, ctx.world_size, ctx.device, setup.precision.name,
                 running_as(setup.compile_plan), n_params / 1e6, batch.describe(ctx.world_size), steps_per_epoch,
                 cfg.epochs)
    loop = training_loop(cfg, ctx, output_dir, setup, train_loader=train_loader, val_loader=val_loader,
                         coco_gt=data["val"].coco, val_set=data["val"], position=position, timing=timing, stop=stop)
    return {"output_dir": output_dir, **loop.run()}


def training_loop(cfg: DictConfig, ctx: DistContext, output_dir: Path, setup: TrainingSetup, *, train_loader,
                  val_loader, coco_gt, val_set, position: Position, timing: RunTiming,
                  stop: StopRequest) -> TrainingLoop:
    """The loop and the parts it delegates to, wired for this run."""
    steps_per_epoch = train_loader.batch_sampler.steps_per_epoch
    total_steps = planned_steps(cfg, steps_per_epoch)
    plan = setup.compile_plan
    # The saver first: it finds a disk without room for a checkpoint before anything is written.
    saver = CheckpointSaver(output_dir=output_dir, is_main=ctx.is_main, model=setup.model,
                            optimizer=setup.optimizer, lr_scheduler=setup.lr_scheduler,
                            scaler=setup.precision.scaler, config_record=plain_config(cfg),
                            categories=category_names(coco_gt, coco_gt.getCatIds()),
                            checkpoint_every=cfg.checkpoint_every, checkpoint_minutes=cfg.checkpoint_minutes,
                            timing=timing)
    writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=ctx.is_main)
    reporter = IntervalReporter(step=setup.step, optimizer=setup.optimizer, ctx=ctx, writer=writer,
                                progress=Progress(total_steps=total_steps, start_step=position.step,
                                                  enabled=ctx.is_main, steps_per_epoch=steps_per_epoch,
                                                  evaluation_steps=evaluation_steps(cfg, total_steps=total_steps,
                                                                                    steps_per_epoch=steps_per_epoch),
                                                  val_images=len(val_set)),
                                timing=timing, epochs=cfg.epochs,
                                fp16_skips_overflows=setup.precision.scaler.is_enabled(),
                                describe_kept=saver.describe_kept)
    validation = Validation(model=setup.model, postprocess=setup.run_model.postprocess, loader=val_loader,
                            coco_gt=coco_gt, precision=setup.precision, ranks=Ranks(ctx),
                            compiled=plan is not None and plan.evaluation, backend=cfg.eval_backend,
                            detection_images=build_detection_images(cfg, val_set, enabled=ctx.is_main))
    evaluation = EpochEvaluation(validation, output_dir=output_dir, writer=writer, timing=timing, reporter=reporter)
    return TrainingLoop(cfg=cfg, ctx=ctx, output_dir=output_dir, step=setup.step, lr_scheduler=setup.lr_scheduler,
                        train_loader=train_loader, val_loader=val_loader, position=position, timing=timing,
                        reporter=reporter, saver=saver, evaluation=evaluation,
                        stopping=StopControl(stop, distributed=ctx.distributed, is_main=ctx.is_main,
                                             any_process=(lambda flag: any_process(flag, ctx)) if ctx.distributed
                                             else bool))


def running_as(plan) -> str:
    """How the model runs, for the run's first log line."""
    if plan is None:
        return ", eager"
    return ", CUDA graphs of the eager model" if plan.mode == "graphs" else f", compiled ({plan.mode})"
