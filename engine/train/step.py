"""One optimizer step, the only one: train.py, bench/ and the tests all call ``OptimizerStep``.

forward under autocast -> Hungarian matching and losses -> backward -> gradient clipping -> AdamW.

The step reads nothing back from the GPU except the cost matrices for the matching (one copy, see
models.matcher): the losses, the gradient norm and whether the update was skipped stay on the device
as one vector per step, which engine/train/step_log.py reads once per log interval. A step whose gradient
norm is not finite (a NaN/inf loss gives NaN gradients) is skipped on the device, as GradScaler skips
fp16 overflows: the fused AdamW is handed a ``found_inf`` flag and leaves weights, moments and its
step count untouched. On several processes the gradients are averaged before the norm, so the norm
and the decision are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from engine.runtime.precision import Precision
from models.criterion import NumBoxes
from models.host_copy import to_device_async


class OptimizerStep:
    """``step(images, masks, targets)`` -> (2 + len(loss_names),) float32 device vector:
    [weighted total loss, gradient norm (before clipping), each loss in ``loss_names`` order, unweighted].

    model            the module to train (plain, DDP-wrapped or compiled)
    sync_gradients   called after backward, before clipping: averages the gradients over processes when the
                     model is not DDP-wrapped (engine.runtime.distributed.GradientAllReduce.sync); None: nothing to do
    criterion        models.criterion.SetCriterion; weight_dict says which losses make the total
    optimizer        AdamW; fused=True lets a non-finite step be skipped without a host sync
    clip_max_norm    total L2 norm of the gradients is clipped to this (0: measured, not clipped)
    average_num_boxes  maps this process's number of target boxes to the value every loss is divided by, or
                     to a function giving it that the criterion calls after the matching: the mean over
                     processes, at least 1 (engine.runtime.distributed.average_over_processes; the default is this
                     process's count, at least 1)
    """

    def __init__(self, *, model: torch.nn.Module, criterion: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 precision: Precision, clip_max_norm: float,
                 average_num_boxes: Callable[[float], NumBoxes] | None = None,
                 sync_gradients: Callable[[], None] | None = None):
        if clip_max_norm < 0:
            raise ValueError(f"clip_max_norm must be >= 0 (0 disables clipping), got {clip_max_norm}")
        self.model = model
        self.criterion = criterion
        self.optimizer = optimizer
        self.precision = precision
        self.max_norm = clip_max_norm if clip_max_norm > 0 else float("inf")
        self.average_num_boxes = average_num_boxes or (lambda n: max(1.0, n))
        self.sync_gradients = sync_gradients
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # The fused AdamW honours a device-side found_inf flag; the others would need a host check.
        self.skips_on_device = bool(optimizer.defaults.get("fused"))
        self.loss_names: tuple[str, ...] | None = None
        self._weights: torch.Tensor | None = None

    def __call__(self, images: torch.Tensor, masks: torch.Tensor, targets: list[dict]) -> torch.Tensor:
        # The phases are named for torch.profiler (bench/e2e.py attributes the GPU's idle time to them).
        # The count is averaged over processes first, then clamped to >= 1 (a rank may have no boxes at all).
        # Started before the forward; the criterion takes the value after the matching.
        with record_function("step.losses"):
            num_boxes = self.average_num_boxes(float(sum(len(t["labels"]) for t in targets)))
        with record_function("step.forward"), self.precision.autocast():
            outputs = self.model(images, masks)
        with record_function("step.losses"):
            loss_dict = self.criterion(outputs, targets, num_boxes=num_boxes)
            parts = torch.stack([loss_dict[k].float() for k in self._names(loss_dict)])  # (K,)
            loss = (parts * self._weight_vector(parts.device)).sum()

        with record_function("step.backward"):
            self.optimizer.zero_grad(set_to_none=True)
            scaler = self.precision.scaler
            scaler.scale(loss).backward()
            if self.sync_gradients is not None:
                self.sync_gradients()
        with record_function("step.update"):
            scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm).float()
            if scaler.is_enabled():
                scaler.step(self.optimizer)  # fp16: the scaler finds overflows and skips those steps itself
                scaler.update()
            else:
                self._step_unless_non_finite(grad_norm)
        return torch.cat([loss.detach().reshape(1), grad_norm.reshape(1), parts.detach()])

    def _step_unless_non_finite(self, grad_norm: torch.Tensor) -> None:
        if not self.skips_on_device:
            if torch.isfinite(grad_norm):  # a host read; only optimizers without a fused kernel get here
                self.optimizer.step()
            return
        self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _names(self, loss_dict: dict) -> tuple[str, ...]:
        names = tuple(sorted(loss_dict))
        if self.loss_names is None:
            self.loss_names = names
        elif names != self.loss_names:
            raise RuntimeError(f"the criterion's losses changed between steps: {self.loss_names} -> {names}")
        return names

    def _weight_vector(self, device: torch.device) -> torch.Tensor:
        """weight_dict as a vector over loss_names (0 for logged-only values), copied to the device once."""
        if self._weights is None:
            weights = torch.tensor([float(self.criterion.weight_dict.get(k, 0.0)) for k in self.loss_names])
            self._weights = to_device_async(weights, device)
        return self._weights

    @property
    def value_names(self) -> tuple[str, ...]:
        """Names of the entries of the vector a step returns (known after the first step)."""
        if self.loss_names is None:
            raise RuntimeError("value_names are known after the first step")
        return ("loss", "grad_norm", *self.loss_names)
