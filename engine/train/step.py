"""One optimizer step, the only one: train.py, bench/ and the tests all call ``OptimizerStep``.

On a GPU nothing is read back to the host (the matching is solved there, models/assignment.py; on the CPU scipy
solves it): the step's values stay on the device for engine/train/hooks/interval_report.py to read once per log
interval. A step whose gradient norm is not finite (a NaN/inf loss) is skipped on the device, as GradScaler skips
fp16 overflows: the fused AdamW gets a ``found_inf`` flag and leaves weights, moments and step count untouched. The
gradients are averaged over processes before the norm, so every rank decides alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.profiler import record_function

from engine.runtime.precision import Precision
from models.criterion import NumBoxes, combination_over_passes
from models.host_copy import to_device_async


class OptimizerStep:
    """``step(images, masks, targets)`` -> (2 + len(loss_names),) float32 device vector:
    [weighted total loss, gradient norm (before clipping), each loss in ``loss_names`` order, unweighted].

    model              the module to train (plain, DDP-wrapped or compiled)
    criterion          models.criterion.SetCriterion; weight_dict says which losses make the total
    optimizer          AdamW; fused=True lets a non-finite step be skipped without a host sync
    clip_max_norm      the gradients' total L2 norm is clipped to this (0: measured, not clipped)
    average_num_boxes  this process's target box count -> what every loss is divided by (default: the count, at
                       least 1), or a function the criterion calls for it after the matching (the mean over
                       processes: engine.runtime.distributed.average_over_processes)
    sync_gradients     called after backward, before clipping: averages the gradients over processes when the model
                       is not DDP-wrapped (engine.runtime.distributed.GradientAllReduce.sync); None: nothing to do
    images_per_pass    the most images one forward and backward pass takes: a larger batch is split into equal
                       passes whose gradients add up; None: one pass
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        criterion: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        clip_max_norm: float,
        average_num_boxes: Callable[[float], NumBoxes] | None = None,
        sync_gradients: Callable[[], None] | None = None,
        images_per_pass: int | None = None,
    ):
        if clip_max_norm < 0:
            raise ValueError(f"clip_max_norm must be >= 0 (0 disables clipping), got {clip_max_norm}")
        if images_per_pass is not None and images_per_pass < 1:
            raise ValueError(f"images_per_pass must be >= 1 or None, got {images_per_pass}")
        self.model, self.criterion, self.optimizer, self.precision = model, criterion, optimizer, precision
        self.images_per_pass = images_per_pass
        self.max_norm = clip_max_norm if clip_max_norm > 0 else float("inf")
        self.average_num_boxes = average_num_boxes or (lambda n: max(1.0, n))
        self.sync_gradients = sync_gradients
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # The fused AdamW honours a device-side found_inf flag; the others would need a host check.
        self.skips_on_device = bool(optimizer.defaults.get("fused"))
        self.loss_names: tuple[str, ...] | None = None
        self._weights: torch.Tensor | None = None

    def __call__(self, images: torch.Tensor, masks: torch.Tensor, targets: list[dict]) -> torch.Tensor:
        # The phases are named for torch.profiler: profile_steps' trace shows where the host's time goes. The box
        # count, started before the forward, is the whole step's: the passes' losses add up to the batch's.
        with record_function("step.losses"):
            num_boxes = self.average_num_boxes(float(sum(len(t["labels"]) for t in targets)))
            if callable(num_boxes):  # the mean over processes, still being reduced: read by the first pass only
                num_boxes = functools.cache(num_boxes)
        self.optimizer.zero_grad(set_to_none=True)
        passes = self._passes(len(targets))
        size = len(targets) // passes
        loss = parts = None
        for first in range(0, len(targets), size):
            # One pass takes the batch itself, not a view of it: Dynamo traces a view through its base.
            pass_images, pass_masks = (
                (images, masks) if passes == 1 else (images[first : first + size], masks[first : first + size])
            )
            pass_loss, pass_parts = self._forward_backward(
                pass_images, pass_masks, targets[first : first + size], num_boxes
            )
            if passes > 1:
                pass_parts = pass_parts * self._pass_coefficients(targets, first, size, passes, pass_parts.device)
            loss = pass_loss if loss is None else loss + pass_loss
            parts = pass_parts if parts is None else parts + pass_parts
        with record_function("step.backward"):
            if self.sync_gradients is not None:
                self.sync_gradients()
        with record_function("step.update"):
            scaler = self.precision.scaler
            scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm).float()
            if scaler.is_enabled():
                scaler.step(self.optimizer)  # fp16: the scaler finds overflows and skips those steps itself
                scaler.update()
            else:
                self._step_unless_non_finite(grad_norm)
        return torch.cat([loss.reshape(1), grad_norm.reshape(1), parts])

    def _forward_backward(self, images, masks, targets, num_boxes) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: its weighted loss and unweighted losses (K,), detached; its gradients add to the params' .grad."""
        with record_function("step.forward"), self.precision.autocast():
            outputs = self.model(images, masks)
        with record_function("step.losses"):
            loss_dict = self.criterion(outputs, targets, num_boxes=num_boxes)
            parts = torch.stack([loss_dict[k].float() for k in self._names(loss_dict)])  # (K,)
            loss = (parts * self._weight_vector(parts.device)).sum()
        with record_function("step.backward"):
            self.precision.scaler.scale(loss).backward()
        return loss.detach(), parts.detach()

    def _passes(self, images: int) -> int:
        if self.images_per_pass is None or images <= self.images_per_pass:
            return 1
        if images % self.images_per_pass:
            raise ValueError(f"a batch of {images} images cannot be split into passes of {self.images_per_pass}")
        return images // self.images_per_pass

    def _pass_coefficients(
        self, targets: list[dict], first: int, size: int, passes: int, device: torch.device
    ) -> torch.Tensor:
        """(K,) what one pass's values count for in the step's: the losses divided by the step's box count add
        up; a mean over images (cardinality_error) is averaged over the equal passes; a mean over matched boxes
        (class_error) is weighted by the pass's boxes."""
        boxes = sum(len(t["labels"]) for t in targets)
        in_pass = sum(len(t["labels"]) for t in targets[first : first + size])
        share = {"sum": 1.0, "images": 1.0 / passes, "boxes": in_pass / boxes if boxes else 1.0 / passes}
        coefficients = torch.tensor([share[combination_over_passes(k)] for k in self.loss_names])
        return to_device_async(coefficients, device)

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
