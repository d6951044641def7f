"""Mixed precision: amp=bf16 (no loss scaling) or fp16 (with a GradScaler) autocasts on CUDA; amp=none, and any
amp on the CPU (whose bf16 matmuls are slower than fp32), runs in fp32.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from engine.config.choices import AMP_CHOICES

log = logging.getLogger(__name__)

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
        # No weight cache: a cached cast would be baked into a CUDA graph recorded meanwhile (compile/cuda_graphs.py).
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, cache_enabled=False)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
