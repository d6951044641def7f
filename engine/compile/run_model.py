"""A detector on its device, compiled as the run's plan says: the one assembly that training (engine/train/build.py),
evaluation, predict.py and export.py (engine/checkpoint/trained_model.py) build a model through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models import build_model

from .plan import CompilePlan, compile_model, resolve_compile


@dataclass
class RunModel:
    """The model of a run on its device, and how it was compiled."""

    model: torch.nn.Module  # the unwrapped DeformableDETR (checkpoints, evaluation); compiled regions are in it
    criterion: torch.nn.Module  # its SetCriterion (on the device when built for training)
    postprocess: torch.nn.Module  # boxes and scores from its outputs
    compile_plan: CompilePlan | None  # what was compiled, or None (eager)


def build_run_model(
    cfg_model,
    cfg_compile,
    *,
    device: torch.device,
    training: bool,
    load_weights: Callable[[torch.nn.Module], object] | None = None,
    evaluation_batches: int = 0,
    training_steps: int = 0,
    pass_batch: int = 0,
) -> RunModel:
    """``cfg_model`` (a checked ModelConfig, or a mapping checked here) built on ``device``, ``load_weights(model)``
    called before it moves (model.init_from's, or a checkpoint's), and compiled in place as ``cfg_compile`` resolves
    there (None: eager): for ``training`` its training regions and losses too, else only evaluation's graph, if the
    plan compiles it. The counts decide the plan's open choices: this process's ``evaluation_batches``
    (compile.evaluation=null), the run's ``training_steps`` (compile.mode=auto on a GPU) and ``pass_batch``, the
    images of one training pass (compile.regions=null)."""
    model, criterion, postprocess = build_model(cfg_model)
    if load_weights is not None:
        load_weights(model)
    model.to(device)
    if device.type == "cuda":
        model.use_channels_last()  # before the optimizer and a resumed state take the parameters' layout
    plan = None
    if cfg_compile is not None:
        plan = resolve_compile(
            cfg_compile,
            device=device,
            evaluation_batches=evaluation_batches,
            training_steps=training_steps,
            pass_batch=pass_batch,
        )
    if training:
        criterion.to(device)
        if plan is not None:
            compile_model(model, plan, criterion=criterion)  # in place: training and evaluation
    elif plan is not None and plan.evaluation:
        # The training regions are wrapped too but never called here: only the evaluation graph compiles.
        compile_model(model, plan)
    return RunModel(model=model, criterion=criterion, postprocess=postprocess, compile_plan=plan)
