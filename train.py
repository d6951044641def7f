"""Train and evaluate Deformable DETR: ``python train.py [hydra overrides]`` (configs/train.yaml).

    python train.py                                   # synthetic set, CPU-sized, trains then evaluates
    python train.py dataset=coco dataset.root=PATH    # COCO 2017, the published recipe
    python train.py eval_only=true checkpoint=PATH    # evaluate ours or an official checkpoint
    python train.py resume=auto                       # continue the latest run of this model and data
    torchrun --nproc_per_node=N train.py ...          # data parallel over N processes, one run directory

``train(cfg)`` and ``evaluate(cfg)`` take a composed config and are what the tests call.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports below: the run's wall time counts them too

import contextlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from datasets import build_data_loader, build_dataset, build_size_buckets  # noqa: E402
from engine.build import build_evaluation, build_training  # noqa: E402
from engine.checkpoint import (check_training_state, load_checkpoint, load_model_weights,  # noqa: E402
                               model_config_for_checkpoint)
from engine.compile import use_compile_cache  # noqa: E402
from engine.compile_log import CompileClock, log_recompiles_to_file  # noqa: E402
from engine.config import check_config, plain_config, register_configs  # noqa: E402
from engine.console import keep_file_only_off_console, run_reporting_faults  # noqa: E402
from engine.detection_images import build_detection_images  # noqa: E402
from engine.distributed import (DistContext, Ranks, argv_for_rank, barrier, broadcast_object, env_rank,  # noqa: E402
                                init_distributed, shutdown_distributed)
from engine.evaluation import evaluate_coco, record_evaluation  # noqa: E402
from engine.init_from import InitFrom, prepare_init_from  # noqa: E402
from engine.loop import NonFiniteLossError, Position, Trainer, planned_steps  # noqa: E402
from engine.num_classes import resolve_num_classes  # noqa: E402
from engine.precision import Precision  # noqa: E402
from engine.resume import config_for_resume, find_resume_checkpoint  # noqa: E402
from engine.run_lock import RunLock  # noqa: E402
from engine.run_timing import RunTiming  # noqa: E402
from engine.stop_request import StopRequest, TrainingStopped, ignore_stop_signals  # noqa: E402
from engine.tensorboard import ScalarWriter  # noqa: E402

log = logging.getLogger("train")
register_configs()  # the typed schemas configs/*.yaml name (engine/config.py), before Hydra composes

__all__ = ["NonFiniteLossError", "TrainingStopped", "evaluate", "train"]


def resolve_output_dir(cfg: DictConfig, ctx: DistContext) -> Path:
    """The run directory: ``output_dir`` if set, else Hydra's; rank 0 decides and every rank uses it."""
    chosen = None
    if ctx.is_main:
        if cfg.output_dir:
            chosen = str(Path(cfg.output_dir).resolve())
        elif HydraConfig.initialized():
            chosen = str(Path(HydraConfig.get().runtime.output_dir).resolve())
        else:
            raise ValueError("output_dir is not set: run through `python train.py` (Hydra picks the run "
                             "directory) or pass output_dir=PATH")
        Path(chosen).mkdir(parents=True, exist_ok=True)
    return Path(broadcast_object(chosen, ctx))


def build_datasets(cfg: DictConfig, ctx: DistContext, splits: tuple[str, ...]) -> dict:
    """Rank 0 first (it may write the synthetic set to disk), then the others read what it wrote."""
    datasets = {}
    if ctx.is_main:  # checks the data (opens the validation images) and reports dropped annotations
        datasets = {s: build_dataset(s, cfg.dataset, check=True) for s in splits}
    barrier(ctx)
    if not ctx.is_main:
        datasets = {s: build_dataset(s, cfg.dataset, check=False) for s in splits}
    return datasets


def build_loader(dataset, cfg: DictConfig, ctx: DistContext, *, train: bool, buckets):
    return build_data_loader(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers, train=train,
                             buckets=buckets, seed=cfg.seed, rank=ctx.rank, world_size=ctx.world_size,
                             pad_to_multiple=cfg.dataset.pad_to_multiple, worker_init_fn=ignore_stop_signals)


def holding_the_run_directory(output_dir: Path, ctx: DistContext):
    """Rank 0 holds the run directory's lock for the job (engine/run_lock.py)."""
    return RunLock(output_dir) if ctx.is_main else contextlib.nullcontext()


def size_buckets(cfg: DictConfig, ctx: DistContext, train_set, val_set):
    """The run's size buckets (datasets/size_buckets.py; train_set None: evaluation's only), the same on every
    rank; rank 0 logs them."""
    buckets = build_size_buckets(train_set, val_set, cfg.dataset, batch_size=cfg.batch_size, seed=cfg.seed)
    if ctx.is_main:
        log.info("size buckets: %s", buckets.describe() if buckets is not None else
                 f"off (dataset.size_buckets=0): each batch is padded to its largest image, rounded up to a multiple "
                 f"of {cfg.dataset.pad_to_multiple}")
    return buckets


def warn_unbounded_sizes(cfg: DictConfig, buckets, plan, *, training: bool) -> None:
    """Without size buckets, a plan that builds graphs per input size builds them for every padded size met."""
    work = plan.per_size_work(training=training) if plan is not None and buckets is None else None
    if work:
        log.warning("dataset.size_buckets=0 with compile.mode=%s: each new padded batch size %s again (every multiple "
                    "of dataset.pad_to_multiple=%d up to the largest image); the size buckets bound that to a few "
                    "sizes, compile.mode=eager builds nothing", cfg.compile.mode, work, cfg.dataset.pad_to_multiple)


def prepare_compilation(cfg: DictConfig) -> None:
    """Compiled graphs and kernels kept in compile.cache_dir; recompilations logged to train.log."""
    use_compile_cache(cfg.compile.cache_dir)
    CompileClock.get()
    log_recompiles_to_file()


def _running_as(plan) -> str:
    """How the model runs, for the run's first log line."""
    if plan is None:
        return ", eager"
    return ", CUDA graphs of the eager model" if plan.mode == "graphs" else f", compiled ({plan.mode})"


def planned_evaluations(cfg: DictConfig, *, total_steps: int, steps_per_epoch: int, start_epoch: int = 0) -> int:
    """How many evaluations this run will make (every eval_every epochs, and after the last step)."""
    last_epoch = min(cfg.epochs, math.ceil(total_steps / max(1, steps_per_epoch)))
    return len(range(start_epoch + cfg.eval_every, last_epoch + 1, cfg.eval_every)) + 1


def train(cfg: DictConfig, *, started: float | None = None) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval", "step",
    "timing"}. ``started``: the process's start (time.perf_counter), from which timing.json counts; default now."""
    cfg = check_config(cfg)
    ctx = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    try:
        output_dir = resolve_output_dir(cfg, ctx)
        with holding_the_run_directory(output_dir, ctx), StopRequest() as stop:
            return _train(cfg, ctx, output_dir, stop, started=time.perf_counter() if started is None else started)
    finally:
        shutdown_distributed(ctx)


def _train(cfg: DictConfig, ctx: DistContext, output_dir: Path, stop: StopRequest, *, started: float) -> dict:
    timing = RunTiming(started=started)
    prepare_compilation(cfg)
    # The data first: it is checked before anything is trained, and may decide model.num_classes.
    data = build_datasets(cfg, ctx, ("train", "val"))

    # The checkpoint to resume and the config the resumed run uses (engine.resume).
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
    cfg.model.num_classes = resolve_num_classes(cfg.model.num_classes, data)

    buckets = size_buckets(cfg, ctx, data["train"], data["val"])
    train_loader = build_loader(data["train"], cfg, ctx, train=True, buckets=buckets)
    val_loader = build_loader(data["val"], cfg, ctx, train=False, buckets=buckets)
    steps_per_epoch = train_loader.batch_sampler.steps_per_epoch
    if steps_per_epoch == 0:
        raise ValueError(f"the training set has {len(data['train'])} images, too few for one batch of "
                         f"{cfg.batch_size} per process on {ctx.world_size} processes"
                         + (" once batched by size (dataset.size_buckets=0 batches any images together)"
                            if buckets is not None else ""))
    total_steps = planned_steps(cfg, steps_per_epoch)
    start_epoch = ckpt["epoch"] if ckpt is not None else 0
    evaluations = planned_evaluations(cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                                      start_epoch=start_epoch)

    # model.init_from: a new run from another checkpoint's weights (reads it, puts its variant into cfg.model).
    # A resumed run has its own weights.
    init = prepare_init_from(cfg.model) if ckpt is None else InitFrom()
    training = build_training(cfg, ctx=ctx, init=init, ckpt=ckpt, ckpt_path=resume_path,
                              evaluation_batches=len(val_loader.batch_sampler) * evaluations,
                              training_steps=total_steps)
    position = Position()
    if training.resumed is not None:
        epoch, step, steps_in_epoch, rng = training.resumed
        position = Position(epoch=epoch, step=step, steps_in_epoch=steps_in_epoch,
                            rng=rng if ctx.world_size == 1 else None)
        log.info("resumed from %s at epoch %d, step %d", resume_path, epoch, step)
    if ctx.is_main:
        warn_unbounded_sizes(cfg, buckets, training.compile_plan, training=True)
        n_params = sum(p.numel() for p in training.model.parameters() if p.requires_grad)
        log.info("run directory %s | %d processes on %s, %s%s | %.1fM trainable parameters | %d steps per "
                 "epoch, %d epochs", output_dir, ctx.world_size, ctx.device, training.precision.name,
                 _running_as(training.compile_plan), n_params / 1e6, steps_per_epoch, cfg.epochs)
    trainer = Trainer(cfg=cfg, ctx=ctx, output_dir=output_dir, training=training, train_loader=train_loader,
                      val_loader=val_loader, coco_gt=data["val"].coco,
                      detection_images=build_detection_images(cfg, data["val"], enabled=ctx.is_main),
                      position=position, config_record=plain_config(cfg), timing=timing, stop=stop)
    return {"output_dir": output_dir, **trainer.fit()}


def evaluate(cfg: DictConfig) -> dict:
    """Evaluate ``cfg.checkpoint`` on the validation split; writes eval.json and returns the AP figures.

    The model variant and sizes come from the checkpoint when it records them (our config, or the official
    checkpoints' args), otherwise from the config (e.g. experiment=two_stage).
    """
    if not cfg.checkpoint:
        raise ValueError("eval_only=true needs checkpoint=PATH (a checkpoint of this trainer or an official "
                         "Deformable DETR one)")
    cfg = check_config(cfg)
    ctx = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    try:
        output_dir = resolve_output_dir(cfg, ctx)
        with holding_the_run_directory(output_dir, ctx):
            return _evaluate(cfg, ctx, output_dir)
    finally:
        shutdown_distributed(ctx)


def _evaluate(cfg: DictConfig, ctx: DistContext, output_dir: Path) -> dict:
    prepare_compilation(cfg)
    ckpt = load_checkpoint(cfg.checkpoint)
    model_cfg = model_config_for_checkpoint(OmegaConf.to_container(cfg.model, resolve=True), ckpt,
                                            path=cfg.checkpoint)
    val_set = build_datasets(cfg, ctx, ("val",))["val"]
    # Classes of the checkpoint when model.num_classes is null, checked against the category ids.
    model_cfg["num_classes"] = resolve_num_classes(model_cfg["num_classes"], {"val": val_set},
                                                   checkpoint_state=ckpt["model"])
    buckets = size_buckets(cfg, ctx, None, val_set)
    loader = build_loader(val_set, cfg, ctx, train=False, buckets=buckets)
    model, postprocess, plan = build_evaluation(OmegaConf.create(model_cfg), cfg, ctx=ctx,
                                                evaluation_batches=len(loader.batch_sampler))
    if ctx.is_main:
        warn_unbounded_sizes(cfg, buckets, plan, training=False)
    load_model_weights(model, ckpt, path=cfg.checkpoint)
    detection_images = build_detection_images(cfg, val_set, enabled=ctx.is_main)
    evaluation = evaluate_coco(model=model, postprocess=postprocess, loader=loader,
                               coco_gt=val_set.coco, device=ctx.device,
                               precision=Precision(amp=cfg.amp, device=ctx.device),
                               keep_detections=detection_images.image_ids, ranks=Ranks(ctx),
                               compiled=plan is not None and plan.evaluation, backend=cfg.eval_backend)
    if ctx.is_main:
        writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=True)
        record_evaluation(evaluation, writer=writer, json_path=output_dir / "eval.json",
                          step=int(ckpt.get("step", 0) or 0), what=f"of {cfg.checkpoint}",
                          detection_images=detection_images, log=log,
                          checkpoint=str(Path(cfg.checkpoint).resolve()))
        writer.close()
    return {"output_dir": output_dir, "eval": evaluation.stats}


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    if env_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # console and files belong to rank 0
    keep_file_only_off_console()
    run_dir = Path(HydraConfig.get().runtime.output_dir) if env_rank() == 0 else None
    run_reporting_faults(lambda: evaluate(cfg) if cfg.eval_only else train(cfg, started=STARTED), run_dir=run_dir,
                         log=log, dated=not cfg.output_dir)


if __name__ == "__main__":
    sys.argv = argv_for_rank(sys.argv, env_rank())
    main()
