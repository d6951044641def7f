"""One assembly of what trains: model, compilation, optimizer, schedule, precision, data parallelism, step.

train.py, bench/e2e_steptime.py and bench/ddp.py all build through ``build_training``, from a composed config,
so that a benchmark times the step a run takes, compiled as a run compiles it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from models import build_model

from .compile import CompilePlan, compile_model, resolve_compile
from .distributed import DistContext, average_over_processes, data_parallel
from .init_from import InitFrom
from .optim import build_lr_scheduler, build_optimizer
from .precision import Precision
from .resume import Resumed, restore_training_state
from .rng import seed_all
from .step import TrainStep

log = logging.getLogger(__name__)


@dataclass
class Training:
    """What ``build_training`` assembles.

    model        the unwrapped DeformableDETR (checkpoints, evaluation); compiled regions are in it
    step         TrainStep over the module to train (DDP-wrapped under torchrun with gradient_sync=ddp)
    compile_plan what was compiled, or None (eager)
    resumed      the position restored from a checkpoint, or None
    """

    model: torch.nn.Module
    criterion: torch.nn.Module
    postprocess: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    step: TrainStep
    compile_plan: CompilePlan | None
    resumed: Resumed | None = None


def build_training(cfg, *, ctx: DistContext, init: InitFrom | None = None, ckpt: dict | None = None,
                   ckpt_path: str | os.PathLike | None = None, evaluation_batches: int = 0,
                   training_steps: int = 0) -> Training:
    """The training of ``cfg`` (a composed, checked config) on ``ctx``'s device and processes.

    init                 model.init_from's weights, loaded into the fresh model (a new run)
    ckpt, ckpt_path      a checkpoint to resume: weights, optimizer, schedule and scaler restored (engine.resume)
    evaluation_batches   the evaluation batches this process will run, which decides compile.evaluation=null
    training_steps       the optimizer steps this run will make, which decide compile.mode=auto on a GPU
    """
    seed_all(cfg.seed)  # the same initial weights on every rank (data_parallel also broadcasts rank 0's)
    model, criterion, postprocess = build_model(cfg.model)
    if init is not None:
        init.load_into(model)  # weights of matching name and shape; still epoch 0 with a fresh optimizer
    model.to(ctx.device)
    criterion.to(ctx.device)
    plan = resolve_compile(cfg.compile, device=ctx.device, evaluation_batches=evaluation_batches,
                           training_steps=training_steps)
    if plan is not None and plan.mode == "graphs" and ctx.world_size > 1 and cfg.gradient_sync == "ddp":
        raise ValueError("compile.mode=graphs records the backward as a CUDA graph, which DistributedDataParallel's "
                         "hooks cannot run inside; use gradient_sync=allreduce (the default) or "
                         "compile.mode=reduce-overhead")
    if plan is not None:
        compile_model(model, plan, criterion=criterion)  # in place: training and evaluation use it
    optimizer = build_optimizer(model, cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim)
    precision = Precision(amp=cfg.amp, device=ctx.device)
    resumed = None
    if ckpt is not None:  # before data_parallel, which starts every rank from rank 0's weights
        resumed = restore_training_state(ckpt, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                         scaler=precision.scaler, cfg_optim=cfg.optim, path=ckpt_path)
    trained, sync_gradients = data_parallel(model, ctx, gradient_sync=cfg.gradient_sync,
                                            find_unused_parameters=cfg.find_unused_parameters)
    step = TrainStep(model=trained, criterion=criterion, optimizer=optimizer, precision=precision,
                     clip_max_norm=cfg.optim.clip_max_norm,
                     average_num_boxes=lambda n: average_over_processes(n, ctx), sync_gradients=sync_gradients)
    return Training(model=model, criterion=criterion, postprocess=postprocess, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, precision=precision, step=step, compile_plan=plan, resumed=resumed)


def build_evaluation(cfg_model, cfg, *, ctx: DistContext, evaluation_batches: int = 0):
    """(model, postprocess, compile plan) for evaluating: ``cfg_model`` built on ctx's device, its evaluation
    compiled as the run's ``compile`` settings say (the weights are loaded afterwards: names are unchanged)."""
    model, _, postprocess = build_model(cfg_model)
    model.to(ctx.device)
    plan = resolve_compile(cfg.compile, device=ctx.device, evaluation_batches=evaluation_batches)
    if plan is not None and plan.evaluation:
        # The training regions are wrapped too but never called here: only the evaluation graph compiles.
        compile_model(model, plan)
    return model, postprocess, plan
