"""Model EMA (``ema.decay``): a moving average of the model's weights, updated after every optimizer step, which
evaluation, predict.py and export.py use in place of the raw weights.

Update n moves the average towards the weights by ``1 - d_n``, ``d_n = decay * (1 - exp(-n / warmup))`` (RT-DETR's
schedule): early averages follow the weights closely, before they mean anything. Every floating tensor of the state
is averaged (a constant buffer stays as it is) in one foreach operation on the device: no host sync. Every process
holds the same weights, so the same average. The hook alone handles the average: it offers it to the evaluation
(``evaluated_weights``), and it is its share of checkpoint.pth (under ``ema``), so a resume goes on with it.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from engine.checkpoint.contents import EMA_KEY

from .base import EvaluatedWeights, Hook, StepDone

log = logging.getLogger(__name__)


class ModelEma(Hook):
    """The average of ``model``'s floating parameters and buffers; ``after_step`` updates it. ``decay``: the decay it
    ramps up to; ``warmup_steps``: the ramp's time constant, in updates."""

    checkpoint_key = EMA_KEY

    def __init__(self, model: torch.nn.Module, *, decay: float, warmup_steps: int):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema.decay must be in (0, 1) or null (no EMA), got {decay!r}")
        if warmup_steps < 1:
            raise ValueError(f"ema.warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        self.decay, self.warmup_steps, self.updates = decay, warmup_steps, 0
        state = model.state_dict(keep_vars=True)
        self.names = [name for name, t in state.items() if t.is_floating_point()]
        self.live = [state[name].detach() for name in self.names]
        self.average = [t.clone() for t in self.live]
        self.restored = False  # from a resumed checkpoint

    def start(self, run) -> None:
        if run.resumed_from is not None and not self.restored and run.ctx.is_main:
            log.warning(
                "ema.decay=%s: the resumed checkpoint %s holds no EMA; it starts from the resumed weights",
                self.decay,
                run.resumed_from,
            )

    @torch.no_grad()
    def after_step(self, run, done: StepDone) -> None:
        decay = self.decay * (1.0 - math.exp(-(self.updates + 1) / self.warmup_steps))
        torch._foreach_lerp_(self.average, self.live, 1.0 - decay)
        self.updates += 1

    def evaluated_weights(self) -> EvaluatedWeights:
        return EvaluatedWeights(name="ema", label="the model EMA", applied=self.applied)

    @contextlib.contextmanager
    def applied(self):
        """The average in the model's tensors for the block (evaluation), the weights back after it. In place: CUDA
        graphs and compiled graphs that read the model's tensors see the average."""
        with torch.no_grad():
            kept = [t.clone() for t in self.live]
            torch._foreach_copy_(self.live, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.live, kept)

    def state_dict(self) -> dict:
        return {
            "model": {name: t.detach().clone() for name, t in zip(self.names, self.average)},
            "updates": self.updates,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        averaged = state["model"]
        missing = [name for name in self.names if name not in averaged]
        if missing:
            raise ValueError(f"the checkpoint's EMA has no {missing[0]} ({len(missing)} tensors missing)")
        torch._foreach_copy_(
            self.average, [averaged[name].to(t.device, t.dtype) for name, t in zip(self.names, self.average)]
        )
        self.updates = int(state["updates"])
        self.restored = True


def build_ema(cfg_ema, model: torch.nn.Module) -> ModelEma | None:
    """The run's EMA of ``model`` (None with ema.decay null); a resume restores it through its checkpoint share."""
    if cfg_ema.decay is None:
        return None
    return ModelEma(model, decay=cfg_ema.decay, warmup_steps=cfg_ema.warmup_steps)
