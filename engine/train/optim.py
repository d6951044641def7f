"""AdamW with the published Deformable DETR parameter groups, and the StepLR schedule.

Three groups, matched on parameter names (substring, as in the original recipe):
    backbone     names containing any of ``backbone_names`` ("backbone.0")            lr_backbone
    linear_proj  names containing any of ``linear_proj_names``
                 ("reference_points", "sampling_offsets")                              lr * linear_proj_mult
    rest         everything else                                                       lr
Frozen parameters (requires_grad False) are left out; empty groups are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _matches(name: str, keys: Sequence[str]) -> bool:
    return any(k in name for k in keys)


def group_base_lrs(*, lr: float, lr_backbone: float, linear_proj_mult: float) -> dict[str, float]:
    """Each group's lr before any drop (also what a resumed run applies when optim.lr* changed)."""
    return {"rest": lr, "backbone": lr_backbone, "linear_proj": lr * linear_proj_mult}


def build_param_groups(model: torch.nn.Module, *, lr: float, lr_backbone: float,
                       linear_proj_mult: float, backbone_names: Sequence[str],
                       linear_proj_names: Sequence[str]) -> list[dict]:
    base = group_base_lrs(lr=lr, lr_backbone=lr_backbone, linear_proj_mult=linear_proj_mult)
    groups = {name: ([], group_lr) for name, group_lr in base.items()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _matches(name, backbone_names):
            key = "backbone"
        elif _matches(name, linear_proj_names):
            key = "linear_proj"
        else:
            key = "rest"
        groups[key][0].append(p)
    return [{"params": params, "lr": group_lr, "name": key}
            for key, (params, group_lr) in groups.items() if params]


def build_optimizer(model: torch.nn.Module, cfg_optim) -> torch.optim.AdamW:
    """Fused AdamW over the published parameter groups; ``cfg_optim`` is configs/optim/adamw.yaml.

    Build it after the model is on its device (the fused kernel runs where the parameters are).
    """
    groups = build_param_groups(
        model, lr=cfg_optim.lr, lr_backbone=cfg_optim.lr_backbone,
        linear_proj_mult=cfg_optim.lr_linear_proj_mult,
        backbone_names=list(cfg_optim.lr_backbone_names),
        linear_proj_names=list(cfg_optim.lr_linear_proj_names))
    # fused: one kernel for all parameters, no per-parameter host reads of the step count, and a device-side
    # found_inf flag with which engine.train.step skips a non-finite update without a sync.
    return torch.optim.AdamW(groups, lr=cfg_optim.lr, weight_decay=cfg_optim.weight_decay, fused=True)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg_optim) -> torch.optim.lr_scheduler.StepLR:
    """Every group's lr times 0.1 once ``lr_drop`` epochs are done (stepped once per epoch)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg_optim.lr_drop, gamma=cfg_optim.lr_gamma)


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Current lr per named group, for logging."""
    return {g.get("name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}

