"""Train and evaluate Deformable DETR: ``python train.py [hydra overrides]`` (configs/train.yaml).

    python train.py                                   # synthetic set, CPU-sized, trains then evaluates
    python train.py dataset=coco dataset.root=PATH    # COCO 2017, the published recipe
    python train.py eval_only=true checkpoint=PATH    # evaluate ours or an official checkpoint
    python train.py resume=auto                       # continue the latest run
    torchrun --nproc_per_node=N train.py ...          # DistributedDataParallel, one run directory

``train(cfg)`` and ``evaluate(cfg)`` take a composed config and are what the tests call.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from datasets import build_data_loader, build_dataset
from engine.checkpoint import (LATEST, check_training_state, epoch_checkpoint_name, find_resume_checkpoint,
                               load_checkpoint, load_model_weights, model_config_for_checkpoint, publish_as,
                               save_checkpoint)
from engine.distributed import (DistContext, all_reduce_mean, argv_for_rank, barrier, broadcast_object, env_rank,
                                init_distributed, shutdown_distributed)
from engine.detection_images import build_detection_images
from engine.evaluation import evaluate_coco, write_eval_json
from engine.init_from import prepare_init_from
from engine.optim import build_lr_scheduler, build_optimizer, group_lrs
from engine.per_class_report import report_per_class
from engine.precision import Precision
from engine.progress import Progress, format_duration
from engine.rng import capture_rng_state, epoch_seed, restore_rng_state, seed_all
from engine.settings import check_run_settings
from engine.tensorboard import ScalarWriter
from models import build_model

log = logging.getLogger("train")

# Per-decoder-layer (loss_ce_0 ...) and encoder (loss_ce_enc) copies of a loss; logged only inside the total.
AUX_LOSS = re.compile(r"_(\d+|enc)$")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the run stops without saving that state."""


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
    if ctx.is_main:
        datasets = {s: build_dataset(s, cfg.dataset) for s in splits}
    barrier(ctx)
    if not ctx.is_main:
        datasets = {s: build_dataset(s, cfg.dataset) for s in splits}
    return datasets


def build_val_loader(dataset, cfg: DictConfig, ctx: DistContext):
    return build_data_loader(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers, train=False,
                             distributed=ctx.distributed, seed=cfg.seed)


def train(cfg: DictConfig) -> dict:
    """Train (and evaluate) as ``cfg`` says; returns {"output_dir", "losses" (per step run here), "eval"}."""
    check_run_settings(cfg)
    ctx = init_distributed(device=cfg.device)
    try:
        return _train(cfg, ctx)
    finally:
        shutdown_distributed(ctx)


def _train(cfg: DictConfig, ctx: DistContext) -> dict:
    output_dir = resolve_output_dir(cfg, ctx)
    device = ctx.device
    seed_all(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    init = prepare_init_from(cfg.model)  # model.init_from: reads it, puts its variant into cfg.model
    model, criterion, postprocess = build_model(cfg.model)
    init.load_into(model)  # weights of matching name and shape; still a new run (epoch 0, fresh optimizer)
    model.to(device)
    criterion.to(device)
    optimizer = build_optimizer(model, cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim)
    precision = Precision(amp=cfg.amp, device=device)

    data = build_datasets(cfg, ctx, ("train", "val"))
    train_loader = build_data_loader(data["train"], batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                     train=True, distributed=ctx.distributed, seed=cfg.seed)
    val_loader = build_val_loader(data["val"], cfg, ctx)
    detection_images = build_detection_images(cfg, data["val"], enabled=ctx.is_main)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(f"the training set has {len(data['train'])} images, fewer than one batch of "
                         f"{cfg.batch_size} x {ctx.world_size} processes")

    start_epoch, step, skip_in_epoch, resume_rng = 0, 0, 0, None
    resume_path = None
    if ctx.is_main:  # rank 0 picks (resume=auto looks at file times), so every rank resumes from the same file
        resume_path = find_resume_checkpoint(cfg.resume, output_dir=output_dir, search_root=Path("outputs"))
    resume_path = broadcast_object(resume_path, ctx)
    if resume_path is not None:
        ckpt = load_checkpoint(resume_path)
        check_training_state(ckpt, path=resume_path)
        load_model_weights(model, ckpt, path=resume_path)
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        precision.scaler.load_state_dict(ckpt["grad_scaler"])
        start_epoch, step, skip_in_epoch = ckpt["epoch"], ckpt["step"], ckpt["steps_in_epoch"]
        resume_rng = ckpt["rng"] if ctx.world_size == 1 else None
        log.info("resumed from %s at epoch %d, step %d", resume_path, start_epoch, step)
    elif cfg.resume == "auto":
        log.info("resume=auto: no checkpoint found, starting from scratch")

    model_without_ddp = model
    if ctx.distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        find_unused_parameters=cfg.find_unused_parameters)
    weight_dict = criterion.weight_dict
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=ctx.is_main)
    progress = Progress(total_steps=total_steps, start_step=step, enabled=ctx.is_main)
    if ctx.is_main:
        n_params = sum(p.numel() for p in model_without_ddp.parameters() if p.requires_grad)
        log.info("run directory %s | %d processes on %s, %s | %.1fM trainable parameters | %d steps per "
                 "epoch, %d steps to go", output_dir, ctx.world_size, device, precision.name, n_params / 1e6,
                 steps_per_epoch, total_steps - step)

    def checkpoint_state(*, epoch: int, steps_in_epoch: int) -> dict:
        return {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(), "grad_scaler": precision.scaler.state_dict(),
                "epoch": epoch, "steps_in_epoch": steps_in_epoch, "step": step,
                "config": OmegaConf.to_container(cfg, resolve=True), "rng": capture_rng_state()}

    losses_run, stats, epoch = [], None, start_epoch
    t_start = time.perf_counter()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            if step >= total_steps:
                break
            train_loader.sampler.set_epoch(epoch)
            seed_all(epoch_seed(cfg.seed, epoch=epoch, rank=ctx.rank))
            batches = iter(train_loader)
            done_in_epoch = 0
            if skip_in_epoch:
                # Mid-epoch resume: the sampler gives this epoch's order again; draw past the batches already
                # trained on, then put back the generators as they were at the checkpoint.
                for _ in range(skip_in_epoch):
                    next(batches)
                done_in_epoch, skip_in_epoch = skip_in_epoch, 0
                if resume_rng is not None:
                    restore_rng_state(resume_rng)
            model.train()
            criterion.train()
            t_data = time.perf_counter()
            for images, masks, targets in batches:
                images = images.to(device, non_blocking=True)
                masks = masks.to(device, non_blocking=True)
                targets = [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                            for k, v in t.items()} for t in targets]
                t_compute = time.perf_counter()
                data_ms = (t_compute - t_data) * 1e3

                with precision.autocast():
                    outputs = model(images, masks)
                loss_dict = criterion(outputs, targets)
                loss = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
                # One collective per step gives every rank the mean losses, for the log and so that all
                # ranks agree to stop when any of them sees a non-finite loss.
                names = sorted(loss_dict)
                reduced = all_reduce_mean(torch.stack([loss.detach().float()] +
                                                      [loss_dict[k].detach().float() for k in names]), ctx)
                reduced = reduced.tolist()
                loss_value, parts = reduced[0], dict(zip(names, reduced[1:]))
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(non_finite_message("loss", loss_value, parts, epoch, step,
                                                                output_dir))

                optimizer.zero_grad(set_to_none=True)
                precision.scaler.scale(loss).backward()
                precision.scaler.unscale_(optimizer)
                max_norm = cfg.optim.clip_max_norm if cfg.optim.clip_max_norm > 0 else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
                if not math.isfinite(grad_norm) and not precision.scaler.is_enabled():
                    # fp16's GradScaler skips overflowed steps itself; in fp32/bf16 this step would write
                    # NaN into the weights.
                    raise NonFiniteLossError(non_finite_message("gradient norm", grad_norm, parts, epoch,
                                                                step, output_dir))
                precision.scaler.step(optimizer)
                precision.scaler.update()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the clock must see the GPU's work, not the launches
                t_end = time.perf_counter()
                step += 1
                done_in_epoch += 1
                losses_run.append(loss_value)

                if step % cfg.log_every == 0 or step == total_steps:
                    step_ms = (t_end - t_compute) * 1e3
                    images_per_s = len(targets) * ctx.world_size / max(t_end - t_data, 1e-9)
                    lrs = group_lrs(optimizer)
                    weighted = {k: v * weight_dict[k] for k, v in parts.items()
                                if k in weight_dict and not AUX_LOSS.search(k)}
                    scalars = {"loss": loss_value, **weighted,
                               **{f"{k}_unscaled": v for k, v in parts.items() if k in weighted},
                               "lr": lrs.get("rest", next(iter(lrs.values()))), "step_time_ms": step_ms,
                               "data_time_ms": data_ms, "images_per_s": images_per_s, "grad_norm": grad_norm}
                    if "backbone" in lrs:
                        scalars["lr_backbone"] = lrs["backbone"]
                    if device.type == "cuda":
                        scalars["max_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
                    writer.add("train", scalars, step)
                    progress.report(step=step, epoch=epoch, epochs=cfg.epochs, loss=loss_value,
                                    parts={k: parts[k] for k in weighted}, lr=scalars["lr"], step_ms=step_ms,
                                    data_ms=data_ms, images_per_s=images_per_s)
                t_data = time.perf_counter()
                if step >= total_steps:
                    break

            epoch_done = done_in_epoch == steps_per_epoch
            if epoch_done:
                lr_scheduler.step()
            last = step >= total_steps or epoch + 1 == cfg.epochs
            if last or (epoch_done and (epoch + 1) % cfg.eval_every == 0):
                evaluation = evaluate_coco(model=model_without_ddp, postprocess=postprocess, loader=val_loader,
                                           coco_gt=data["val"].coco, device=device, precision=precision,
                                           keep_detections=detection_images.image_ids)
                stats, num_images = evaluation.stats, evaluation.num_images
                if ctx.is_main:
                    writer.add("eval", stats, step)
                    write_eval_json(output_dir / f"eval_epoch{epoch + 1:04d}.json", stats=stats, epoch=epoch + 1,
                                    step=step, epoch_complete=epoch_done, num_images=num_images,
                                    per_class=evaluation.per_class)
                    log.info("evaluation after epoch %d (step %d, %d images): %s", epoch + 1, step, num_images,
                             " ".join(f"{k} {v:.4f}" for k, v in stats.items()))
                    report_per_class(evaluation.per_class, writer=writer, step=step, log=log)
                    detection_images.write(writer, evaluation.detections, step)
            if ctx.is_main:
                state = checkpoint_state(epoch=epoch + 1 if epoch_done else epoch,
                                         steps_in_epoch=0 if epoch_done else done_in_epoch)
                if epoch_done and (epoch + 1) % cfg.checkpoint_every == 0:
                    saved = save_checkpoint(state, output_dir / epoch_checkpoint_name(epoch + 1))
                    publish_as(saved, output_dir / LATEST)
                else:
                    save_checkpoint(state, output_dir / LATEST)
            barrier(ctx)
            writer.flush()
    finally:
        writer.close()
    if ctx.is_main:
        log.info("done: %d steps in %s; outputs in %s", step, format_duration(time.perf_counter() - t_start),
                 output_dir)
    return {"output_dir": output_dir, "losses": losses_run, "eval": stats, "step": step}


def non_finite_message(what: str, value: float, parts: dict, epoch: int, step: int, output_dir: Path) -> str:
    latest = output_dir / LATEST
    kept = (f"the last good checkpoint, {latest}, is kept (resume={latest})" if latest.exists()
            else "no checkpoint had been written yet")
    losses = ", ".join(f"{k}={v:.4g}" for k, v in parts.items() if not AUX_LOSS.search(k))
    return (f"non-finite {what} ({value}) at epoch {epoch + 1}, step {step + 1} ({losses}); stopping without "
            f"saving this state: {kept}. Try a lower optim.lr, amp=none, or check the data")


def evaluate(cfg: DictConfig) -> dict:
    """Evaluate ``cfg.checkpoint`` on the validation split; writes eval.json and returns the AP figures.

    The model variant and sizes come from the checkpoint when it records them (our config, or the official
    checkpoints' args), otherwise from the config (e.g. experiment=two_stage).
    """
    if not cfg.checkpoint:
        raise ValueError("eval_only=true needs checkpoint=PATH (a checkpoint of this trainer or an official "
                         "Deformable DETR one)")
    check_run_settings(cfg)
    ctx = init_distributed(device=cfg.device)
    try:
        output_dir = resolve_output_dir(cfg, ctx)
        ckpt = load_checkpoint(cfg.checkpoint)
        model_cfg = model_config_for_checkpoint(OmegaConf.to_container(cfg.model, resolve=True), ckpt,
                                                path=cfg.checkpoint)
        model, _, postprocess = build_model(OmegaConf.create(model_cfg))
        load_model_weights(model, ckpt, path=cfg.checkpoint)
        model.to(ctx.device)
        val_set = build_datasets(cfg, ctx, ("val",))["val"]
        detection_images = build_detection_images(cfg, val_set, enabled=ctx.is_main)
        evaluation = evaluate_coco(model=model, postprocess=postprocess, loader=build_val_loader(val_set, cfg, ctx),
                                   coco_gt=val_set.coco, device=ctx.device,
                                   precision=Precision(amp=cfg.amp, device=ctx.device),
                                   keep_detections=detection_images.image_ids)
        stats, num_images = evaluation.stats, evaluation.num_images
        if ctx.is_main:
            step = int(ckpt.get("step", 0) or 0)
            writer = ScalarWriter(log_dir=output_dir / "tensorboard", enabled=True)
            writer.add("eval", stats, step)
            write_eval_json(output_dir / "eval.json", stats=stats, checkpoint=str(Path(cfg.checkpoint).resolve()),
                            step=step, num_images=num_images, per_class=evaluation.per_class)
            log.info("evaluation of %s (%d images): %s", cfg.checkpoint, num_images,
                     " ".join(f"{k} {v:.4f}" for k, v in stats.items()))
            report_per_class(evaluation.per_class, writer=writer, step=step, log=log)
            detection_images.write(writer, evaluation.detections, step)
            writer.close()
        return {"output_dir": output_dir, "eval": stats}
    finally:
        shutdown_distributed(ctx)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    if env_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # console and files belong to rank 0
    if cfg.eval_only:
        evaluate(cfg)
    else:
        train(cfg)


if __name__ == "__main__":
    sys.argv = argv_for_rank(sys.argv, env_rank())
    main()
