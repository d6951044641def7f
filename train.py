"""Train and evaluate Deformable DETR: ``python train.py [hydra overrides]`` (configs/train.yaml).

    python train.py                                   # synthetic set, CPU-sized, trains then evaluates
    python train.py dataset=coco dataset.root=PATH    # COCO 2017, the published recipe
    python train.py eval_only=true checkpoint=PATH    # evaluate ours or an official checkpoint
    python train.py resume=auto                       # continue the latest run of this model and data
    torchrun --nproc_per_node=N train.py ...          # data parallel over N processes, one run directory

``train(cfg)`` and ``evaluate(cfg)`` take a composed config and are what the tests call.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from datasets import build_data_loader, build_dataset
from engine.checkpoint import check_training_state, load_checkpoint, load_model_weights, model_config_for_checkpoint
from engine.compile import compile_regions, size_warning
from engine.config import check_config, plain_config, register_configs
from engine.distributed import (DistContext, Ranks, argv_for_rank, average_over_processes, barrier,
                                broadcast_object, data_parallel, env_rank, init_distributed,
                                shutdown_distributed)
from engine.detection_images import build_detection_images
from engine.evaluation import evaluate_coco, record_evaluation
from engine.init_from import InitFrom, prepare_init_from
from engine.loop import NonFiniteLossError, Position, Trainer
from engine.num_classes import resolve_num_classes
from engine.optim import build_lr_scheduler, build_optimizer
from engine.precision import Precision
from engine.resume import config_for_resume, find_resume_checkpoint, restore_training_state
from engine.rng import seed_all
from engine.step import TrainStep
from engine.tensorboard import ScalarWriter
from models import build_model

log = logging.getLogger("train")
register_configs()  # the typed schemas configs/*.yaml name (engine/config.py), before Hydra composes

__all__ = ["NonFiniteLossError", "evaluate", "train"]


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


def build_val_loader(dataset, cfg: DictConfig, ctx: DistContext):
    return build_data_loader(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers, train=False,
                             seed=cfg.seed, rank=ctx.rank, world_size=ctx.world_size,
                             pad_to_multiple=cfg.dataset.pad_to_multiple)


def _compile(model, cfg: DictConfig, criterion=None) -> None:
    """compile=true: the model's regions (and the criterion's losses, in training) compiled in place as the run
    settings say, with a warning when the image sizes would defeat the chosen mode or backbone."""
    compile_regions(model, criterion=criterion, backend=cfg.compile_backend, mode=cfg.compile_mode,
                    regions=cfg.compile_regions, backbone=cfg.compile_backbone)
    if warning := size_warning(cfg.compile_mode, cfg.dataset.pad_to_multiple, cfg.compile_backbone):
        log.warning(warning)


def train(cfg: DictConfig) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval", "step"}."""
    cfg = check_config(cfg)
    ctx = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    try:
        return _train(cfg, ctx)
    finally:
        shutdown_distributed(ctx)


def _train(cfg: DictConfig, ctx: DistContext) -> dict:
    output_dir = resolve_output_dir(cfg, ctx)
    device = ctx.device
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

    seed_all(cfg.seed)  # same initial weights on every rank (data_parallel also broadcasts rank 0's)
    # model.init_from: a new run from another checkpoint's weights (reads it, puts its variant into cfg.model).
    # A resumed run has its own weights.
    init = prepare_init_from(cfg.model) if ckpt is None else InitFrom()
    model, criterion, postprocess = build_model(cfg.model)
    init.load_into(model)  # weights of matching name and shape; still epoch 0 with a fresh optimizer
    model.to(device)
    criterion.to(device)
    if cfg.compile:
        # In place: training and evaluation use it.
        _compile(model, cfg, criterion=criterion)
    optimizer = build_optimizer(model, cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim)
    precision = Precision(amp=cfg.amp, device=device)

    train_loader = build_data_loader(data["train"], batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                     train=True, seed=cfg.seed, rank=ctx.rank, world_size=ctx.world_size,
                                     pad_to_multiple=cfg.dataset.pad_to_multiple)
    if len(train_loader) == 0:
        raise ValueError(f"the training set has {len(data['train'])} images, fewer than one batch of "
                         f"{cfg.batch_size} x {ctx.world_size} processes")

    position = Position()
    if ckpt is not None:  # restore, then apply a changed lr schedule (engine.resume)
        epoch, step, steps_in_epoch, rng = restore_training_state(
            ckpt, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, scaler=precision.scaler,
            cfg_optim=cfg.optim, path=resume_path)
        position = Position(epoch=epoch, step=step, steps_in_epoch=steps_in_epoch,
                            rng=rng if ctx.world_size == 1 else None)
        log.info("resumed from %s at epoch %d, step %d", resume_path, epoch, step)

    trained, sync_gradients = data_parallel(model, ctx, gradient_sync=cfg.gradient_sync,
                                            find_unused_parameters=cfg.find_unused_parameters)
    step = TrainStep(model=trained, criterion=criterion, optimizer=optimizer,
                     precision=precision, clip_max_norm=cfg.optim.clip_max_norm,
                     average_num_boxes=lambda n: average_over_processes(n, ctx), sync_gradients=sync_gradients)
    if ctx.is_main:
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("run directory %s | %d processes on %s, %s%s | %.1fM trainable parameters | %d steps per "
                 "epoch, %d epochs", output_dir, ctx.world_size, device, precision.name,
                 ", compiled" if cfg.compile else "", n_params / 1e6, len(train_loader), cfg.epochs)
    trainer = Trainer(cfg=cfg, ctx=ctx, output_dir=output_dir, model=model, step=step,
                      postprocess=postprocess, lr_scheduler=lr_scheduler,
                      train_loader=train_loader, val_loader=build_val_loader(data["val"], cfg, ctx),
                      coco_gt=data["val"].coco, detection_images=build_detection_images(cfg, data["val"],
                                                                                        enabled=ctx.is_main),
                      position=position,
                      config_record=plain_config(cfg))
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
        ckpt = load_checkpoint(cfg.checkpoint)
        model_cfg = model_config_for_checkpoint(OmegaConf.to_container(cfg.model, resolve=True), ckpt,
                                                path=cfg.checkpoint)
        val_set = build_datasets(cfg, ctx, ("val",))["val"]
        # Classes of the checkpoint when model.num_classes is null, checked against the category ids.
        model_cfg["num_classes"] = resolve_num_classes(model_cfg["num_classes"], {"val": val_set},
                                                       checkpoint_state=ckpt["model"])
        model, _, postprocess = build_model(OmegaConf.create(model_cfg))
        load_model_weights(model, ckpt, path=cfg.checkpoint)
        model.to(ctx.device)
        if cfg.compile:
            _compile(model, cfg)
        detection_images = build_detection_images(cfg, val_set, enabled=ctx.is_main)
        evaluation = evaluate_coco(model=model, postprocess=postprocess, loader=build_val_loader(val_set, cfg, ctx),
                                   coco_gt=val_set.coco, device=ctx.device,
                                   precision=Precision(amp=cfg.amp, device=ctx.device),
                                   keep_detections=detection_images.image_ids, ranks=Ranks(ctx))
        if ctx.is_main:
            writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=True)
            record_evaluation(evaluation, writer=writer, json_path=output_dir / "eval.json",
                              step=int(ckpt.get("step", 0) or 0), what=f"of {cfg.checkpoint}",
                              detection_images=detection_images, log=log,
                              checkpoint=str(Path(cfg.checkpoint).resolve()))
            writer.close()
        return {"output_dir": output_dir, "eval": evaluation.stats}
    finally:
        shutdown_distributed(ctx)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    if env_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # console and files belong to rank 0
    try:
        if cfg.eval_only:
            evaluate(cfg)
        else:
            train(cfg)
    except Exception:
        # Hydra prints the error to the console only; train.log would otherwise just stop.
        log.exception("the run failed")
        raise


if __name__ == "__main__":
    sys.argv = argv_for_rank(sys.argv, env_rank())
    main()
