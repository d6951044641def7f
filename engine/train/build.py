"""One assembly of a training: the model on its device, compiled as the run's plan says (engine/compile/run_model.py),
its optimizer, schedule, precision, data parallelism and step. train.py, bench/ and the tests all build through it,
so that a benchmark times the step a run takes, compiled as a run compiles it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.checkpoint.init_from import InitFrom
from engine.compile.run_model import RunModel, build_run_model
from engine.runtime.distributed import DistContext, average_over_processes, data_parallel
from engine.runtime.precision import Precision
from engine.runtime.rng import seed_all

from .optim import build_lr_scheduler, build_optimizer
from .resume import restore_training_state
from .run_plan import StepBatch, step_batch
from .step import OptimizerStep


@dataclass
class TrainingSetup:
    """What ``build_training`` assembles: the run's model, its optimizer and schedule, precision and step."""

    run_model: RunModel
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    step: OptimizerStep  # over the module to train (DDP-wrapped under torchrun with gradient_sync=ddp)

    @property
    def model(self) -> torch.nn.Module:
        return self.run_model.model


def build_training(
    cfg,
    *,
    ctx: DistContext,
    batch: StepBatch | None = None,
    model_config=None,
    init: InitFrom | None = None,
    ckpt: dict | None = None,
    ckpt_path: str | os.PathLike | None = None,
    evaluation_batches: int = 0,
    training_steps: int = 0,
) -> TrainingSetup:
    """The training of ``cfg`` (a composed config) on ``ctx``'s device and processes. ``batch``: the run's step batch
    (None: from cfg); ``model_config``: the checked ModelConfig of cfg.model (None: cfg.model, checked as it is
    built); ``init``: a new run's model.init_from weights; ``ckpt``, ``ckpt_path``: a checkpoint to resume (weights,
    optimizer, schedule and scaler, engine.train.resume); ``evaluation_batches``, ``training_steps``: as
    build_run_model takes them."""
    seed_all(cfg.seed)  # the same initial weights on every rank (data_parallel also broadcasts rank 0's)
    if batch is None:
        batch = step_batch(total_batch_size=cfg.total_batch_size, batch_size=cfg.batch_size, world_size=ctx.world_size)
    run_model = build_run_model(
        cfg.model if model_config is None else model_config,
        cfg.compile,
        device=ctx.device,
        training=True,
        # weights of matching name and shape, before the model moves; still epoch 0 with a fresh optimizer
        load_weights=init.load_into if init is not None else None,
        evaluation_batches=evaluation_batches,
        training_steps=training_steps,
        pass_batch=batch.per_pass,
    )
    model, criterion = run_model.model, run_model.criterion
    plan = run_model.compile_plan
    if plan is not None and plan.mode == "graphs" and ctx.world_size > 1 and cfg.gradient_sync == "ddp":
        raise ValueError(
            "compile.mode=graphs records the backward as a CUDA graph, which DistributedDataParallel's "
            "hooks cannot run inside; use gradient_sync=allreduce (the default) or "
            "compile.mode=reduce-overhead"
        )
    optimizer = build_optimizer(model, cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim)
    precision = Precision(amp=cfg.amp, device=ctx.device)
    if precision.dtype is not None:
        # The float32 matmuls kept out of autocast (the attention's sampling offsets and reference points, so that
        # a location is not rounded to 8 bits) run on TF32 tensor cores: rounding their inputs to 10 bits moves a
        # location by a thousandth of its offset. Process-wide; a run with amp=none stays in full float32.
        torch.backends.cuda.matmul.allow_tf32 = True
    if ckpt is not None:  # before data_parallel, which starts every rank from rank 0's weights
        restore_training_state(
            ckpt,
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            scaler=precision.scaler,
            cfg_optim=cfg.optim,
            path=ckpt_path,
        )
    trained, sync_gradients = data_parallel(
        model, ctx, gradient_sync=cfg.gradient_sync, find_unused_parameters=cfg.find_unused_parameters
    )
    step = OptimizerStep(
        model=trained,
        criterion=criterion,
        optimizer=optimizer,
        precision=precision,
        clip_max_norm=cfg.optim.clip_max_norm,
        average_num_boxes=lambda n: average_over_processes(n, ctx),
        sync_gradients=sync_gradients,
        images_per_pass=batch.per_pass if batch.passes > 1 else None,
    )
    return TrainingSetup(
        run_model=run_model, optimizer=optimizer, lr_scheduler=lr_scheduler, precision=precision, step=step
    )
