"""AdamW with the published Deformable DETR parameter groups, and the StepLR schedule.

Three groups, matched on parameter names by substring as in the original recipe: ``backbone`` (any of
lr_backbone_names) at lr_backbone, ``linear_proj`` (any of lr_linear_proj_names) at lr * lr_linear_proj_mult, and
``rest`` at lr. Frozen parameters are left out; empty groups are dropped.
"""

from __future__ import annotations

import torch


def group_base_lrs(cfg_optim) -> dict[str, float]:
    """Each group's lr before any drop (also what a resumed run applies when optim.lr* changed)."""
    return {
        "rest": cfg_optim.lr,
        "backbone": cfg_optim.lr_backbone,
        "linear_proj": cfg_optim.lr * cfg_optim.lr_linear_proj_mult,
    }


def build_optimizer(model: torch.nn.Module, cfg_optim) -> torch.optim.AdamW:
    """Fused AdamW over the published parameter groups (``cfg_optim``: configs/optim/adamw.yaml). Build it after
    the model is on its device: the fused kernel runs where the parameters are."""
    backbone_names, linear_proj_names = list(cfg_optim.lr_backbone_names), list(cfg_optim.lr_linear_proj_names)
    base = group_base_lrs(cfg_optim)
    params = {key: [] for key in base}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if any(k in name for k in backbone_names):
            params["backbone"].append(p)
        elif any(k in name for k in linear_proj_names):
            params["linear_proj"].append(p)
        else:
            params["rest"].append(p)
    groups = [{"params": group, "lr": base[key], "name": key} for key, group in params.items() if group]
    # fused: one kernel for all parameters, no per-parameter host reads of the step count, and a device-side
    # found_inf flag with which engine.train.step skips a non-finite update without a sync.
    return torch.optim.AdamW(groups, lr=cfg_optim.lr, weight_decay=cfg_optim.weight_decay, fused=True)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg_optim) -> torch.optim.lr_scheduler.StepLR:
    """Every group's lr times lr_gamma every ``lr_drop`` epochs (stepped once per epoch)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg_optim.lr_drop, gamma=cfg_optim.lr_gamma)


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Current lr per named group, for logging."""
    return {g.get("name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}
