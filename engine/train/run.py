"""A training run as ``python train.py`` makes it: data, resume, the run's plan and model, its hooks, then the loop
(``train(cfg)``). ``build_hooks`` is the index of what a run does besides stepping."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from datasets.per_class_ap import category_names
from engine.checkpoint.contents import EMA_KEY, check_training_state
from engine.checkpoint.init_from import InitFrom, prepare_init_from
from engine.checkpoint.io import LATEST, load_checkpoint
from engine.checkpoint.num_classes import resolve_num_classes
from engine.config.registry import check_config, plain_config
from engine.evaluation.detection_images import build_detection_images
from engine.evaluation.validation import Validation
from engine.reporting.progress import Progress
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.distributed import DistContext, Ranks, any_process, broadcast_object
from engine.runtime.stop_request import StopRequest

from .build import TrainingSetup, build_training
from .hooks.base import Hook
from .hooks.ema import ModelEma, build_ema
from .hooks.evaluation import EpochEvaluation
from .hooks.interval_report import IntervalReporter
from .hooks.lr_schedule import EpochLrSchedule
from .hooks.profiling import StepProfiler
from .hooks.saving import CheckpointSaver
from .hooks.stopping import StopControl
from .hooks.timing import RunTiming, peak_memory_gib
from .loop import TrainingLoop
from .resume import (
    checkpoint_step_images,
    config_for_resume,
    explained_failure,
    find_resume_checkpoint,
    position_in_this_run,
)
from .run_plan import Position, RunPlan, plan_run, step_batch
from .run_setup import (
    build_datasets,
    build_loader,
    in_run_directory,
    prepare_compilation,
    size_buckets,
    warn_unbounded_sizes,
)

log = logging.getLogger(__name__)


def train(cfg: DictConfig, *, started: float | None = None) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval", "step",
    "timing"}. ``started``: the job's start (time.perf_counter), from which timing.json counts; default now."""
    started = time.perf_counter() if started is None else started
    cfg = check_config(cfg)
    with in_run_directory(cfg) as (ctx, output_dir), StopRequest() as stop:
        return run_training(cfg, ctx, output_dir, stop, started=started)


def run_training(cfg: DictConfig, ctx: DistContext, output_dir: Path, stop: StopRequest, *, started: float) -> dict:
    """The run inside its directory, its lock held and its stop signals caught (``train``)."""
    timing = RunTiming(started=started, report=ctx.is_main)
    batch = step_batch(total_batch_size=cfg.total_batch_size, batch_size=cfg.batch_size, world_size=ctx.world_size)
    if ctx.is_main:
        log.info("%s", batch.describe(ctx.world_size))
    prepare_compilation(cfg)
    # The data first: it is checked before anything is trained, and may decide model.num_classes.
    data = build_datasets(cfg, ctx, ("train", "val"))
    resume_path, ckpt = None, None
    if ctx.is_main:  # rank 0 picks (resume=auto looks at file times), so every rank resumes from the same file
        resume_path = find_resume_checkpoint(
            cfg.resume, output_dir=output_dir, search_root=Path("outputs"), config=plain_config(cfg)
        )
    resume_path = broadcast_object(resume_path, ctx)
    if resume_path is not None:
        ckpt = load_checkpoint(resume_path)
        check_training_state(ckpt, path=resume_path)
    cfg, init = settle_config(cfg, ckpt=ckpt, resume_path=resume_path, data=data, report=ctx.is_main)

    buckets = size_buckets(cfg, ctx, data["train"], data["val"], batch_size=batch.per_process)
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
        init=init,
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
    hooks = build_hooks(
        cfg,
        ctx,
        output_dir,
        setup,
        plan=plan,
        position=position,
        timing=timing,
        stop=stop,
        val_loader=val_loader,
        val_set=data["val"],
        ckpt=ckpt,
    )
    try:
        TrainingLoop(
            step=setup.step, loader=train_loader, position=position, plan=plan, hooks=hooks.ordered(), ctx=ctx
        ).run()
    except BaseException as error:
        explained = explained_failure(error, output_dir)
        if explained is None:
            raise
        raise explained from None
    finally:
        hooks.writer.close()
    result = timing.record(
        padding_waste=train_loader.batch_sampler.padding_waste, peak_memory_gib=peak_memory_gib(ctx.device)
    )
    if ctx.is_main:
        timing.write(output_dir, result)
        log.info("done: %s; outputs in %s", timing.summary(result), output_dir)
    return {
        "output_dir": output_dir,
        "losses": hooks.reporter.losses,
        "eval": hooks.evaluation.stats,
        "step": position.step,
        "timing": result,
    }


def settle_config(
    cfg: DictConfig, *, ckpt: dict | None, resume_path, data: dict, report: bool
) -> tuple[DictConfig, InitFrom]:
    """The run's config, settled once and read-only from here on: a resumed run's model is its checkpoint's
    (engine/train/resume.py), a new run's variant is ``model.init_from``'s (whose weights come back as InitFrom), and
    the classes come from the data where model.num_classes is null."""
    settled = config_for_resume(cfg, ckpt, path=resume_path, report=report) if ckpt is not None else copy.deepcopy(cfg)
    init = prepare_init_from(settled.model) if ckpt is None else InitFrom()
    settled.model.num_classes = resolve_num_classes(
        settled.model.num_classes, data, resumed_from=str(resume_path) if ckpt is not None else None
    )
    OmegaConf.set_readonly(settled, True)
    return settled, init


@dataclass
class RunHooks:
    """The parts of a run that are not the step, each a hook; ``ordered()`` is the order the loop calls them in."""

    timing: RunTiming
    profiler: StepProfiler
    reporter: IntervalReporter
    lr_schedule: EpochLrSchedule
    ema: ModelEma | None
    saver: CheckpointSaver
    evaluation: EpochEvaluation
    stopping: StopControl
    writer: ScalarWriter  # the run's TensorBoard, which the hooks write to

    def ordered(self) -> list[Hook]:
        # The timing first (a step's time ends before any hook works), the profiler next (its trace's export is not a
        # step's time); before the saver the report (a checkpoint holds no step with a non-finite loss), the lr
        # schedule and the EMA (a checkpoint holds the next epoch's lr and this step's average); after it the
        # evaluation (a failed one loses no training); the stop control last (it ends a stopped run).
        optional = [self.ema] if self.ema is not None else []
        return [
            self.timing,
            self.profiler,
            self.reporter,
            self.lr_schedule,
            *optional,
            self.saver,
            self.evaluation,
            self.stopping,
        ]


def build_hooks(
    cfg: DictConfig,
    ctx: DistContext,
    output_dir: Path,
    setup: TrainingSetup,
    *,
    plan: RunPlan,
    position: Position,
    timing: RunTiming,
    stop: StopRequest,
    val_loader,
    val_set,
    ckpt: dict | None,
) -> RunHooks:
    """Every part of the run besides the step, wired for this run (``ckpt``: the checkpoint it resumes, or None)."""
    stopping = StopControl(
        stop,
        distributed=ctx.distributed,
        is_main=ctx.is_main,
        any_process=(lambda flag: any_process(flag, ctx)) if ctx.distributed else bool,
        position=position,
        total_steps=plan.total_steps,
        latest=output_dir / LATEST,
    )
    ema = build_ema(cfg.ema, setup.model, ckpt)
    # The saver before the others: it finds a disk without room for a checkpoint before anything is written.
    coco_gt = val_set.coco
    saver = CheckpointSaver(
        output_dir=output_dir,
        is_main=ctx.is_main,
        model=setup.model,
        optimizer=setup.optimizer,
        lr_scheduler=setup.lr_scheduler,
        scaler=setup.precision.scaler,
        config_record=plain_config(cfg),
        categories=category_names(coco_gt, coco_gt.getCatIds()),
        checkpoint_every=cfg.checkpoint_every,
        checkpoint_minutes=cfg.checkpoint_minutes,
        timing=timing,
        position=position,
        plan=plan,
        extra_state={EMA_KEY: ema} if ema is not None else None,
    )
    writer = timing.writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=ctx.is_main)
    progress = Progress(
        total_steps=plan.total_steps,
        start_step=position.step,
        enabled=ctx.is_main,
        steps_per_epoch=plan.steps_per_epoch,
        evaluation_steps=plan.evaluation_steps,
        val_images=len(val_set),
    )
    reporter = IntervalReporter(
        step=setup.step,
        ctx=ctx,
        writer=writer,
        progress=progress,
        timing=timing,
        plan=plan,
        stopping=stopping,
        fp16_skips_overflows=setup.precision.scaler.is_enabled(),
        describe_kept=saver.describe_kept,
    )
    plan_compiled = setup.run_model.compile_plan
    validation = Validation(
        model=setup.model,
        postprocess=setup.run_model.postprocess,
        loader=val_loader,
        coco_gt=coco_gt,
        precision=setup.precision,
        ranks=Ranks(ctx),
        compiled=plan_compiled is not None and plan_compiled.evaluation,
        backend=cfg.eval_backend,
        detection_images=build_detection_images(cfg, val_set, enabled=ctx.is_main),
    )
    evaluation = EpochEvaluation(
        validation,
        output_dir=output_dir,
        writer=writer,
        timing=timing,
        ctx=ctx,
        position=position,
        plan=plan,
        saver=saver,
        stopping=stopping,
        ema=ema,
    )
    profiler = StepProfiler(
        cfg.profile_steps,
        output_dir=output_dir,
        device=ctx.device,
        timing=timing,
        trains=(position.step + 1, plan.total_steps),
        rank=ctx.rank,
        world_size=ctx.world_size,
        report=ctx.is_main,
    )
    return RunHooks(
        timing=timing,
        profiler=profiler,
        reporter=reporter,
        lr_schedule=EpochLrSchedule(setup.lr_scheduler),
        ema=ema,
        saver=saver,
        evaluation=evaluation,
        stopping=stopping,
        writer=writer,
    )


def running_as(plan) -> str:
    """How the model runs, for the run's first log line."""
    if plan is None:
        return ", eager"
    return ", CUDA graphs of the eager model" if plan.mode == "graphs" else f", compiled ({plan.mode})"
