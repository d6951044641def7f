"""Mixed precision: which autocast dtype a run uses and whether it needs a GradScaler.

amp = bf16 (default): autocast to bfloat16 on CUDA; bf16 has fp32's exponent range, so no loss scaling.
amp = fp16: autocast to float16 with a GradScaler, which skips steps whose gradients overflowed.
amp = none: fp32. On the CPU autocast is off whatever amp says: CPU bf16 matmuls are slower than fp32
and the CPU run exists to check the pipeline, not to be fast.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from engine.config.choices import AMP_CHOICES

log = logging.getLogger(__name__)

# The autocast dtype of each of the amp setting's choices.
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context and loss scaling for one device."""

    def __init__(self, *, amp: str, device: torch.device):
        if amp not in AMP_CHOICES:
            raise ValueError(f"amp must be one of {', '.join(AMP_CHOICES)}, got {amp!r}")
        self.device = device
        self.dtype = AMP_DTYPES[amp] if device.type == "cuda" else None
        if amp != "none" and self.dtype is None:
            log.info("amp=%s applies on CUDA only; running in fp32 on %s", amp, device)
        if self.dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError("amp=bf16 needs a GPU with bfloat16 support; use amp=fp16 or amp=none")
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.dtype is torch.float16)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        # No weight cache: a cast cached across calls would be baked into a CUDA graph recorded while it was
        # cached (engine/compile/cuda_graphs.py); a weight used twice in one forward is cast twice instead.
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, cache_enabled=False)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
