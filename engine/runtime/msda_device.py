"""Whether ``model.msda``'s attention can run on the run's device, checked with the settings rather than at the
first forward (the rule is msda.validation.resolve_impl's)."""

from __future__ import annotations

import torch

from msda.validation import resolve_impl


def check_msda_device(msda: str, device: torch.device) -> None:
    """A ValueError naming ``model.msda`` when its implementation cannot run on ``device``."""
    try:
        resolve_impl(str(msda), device)
    except ValueError as error:
        raise ValueError(
            f"model.msda={msda} runs the Triton kernels, which need a GPU, but this run is on {device}: "
            "set model.msda=auto (Triton on a GPU, the PyTorch reference elsewhere) or "
            "model.msda=pytorch, or run on a GPU (device=cuda); TRITON_INTERPRET=1 runs the kernels on "
            "the CPU through Triton's interpreter, very slowly"
        ) from error
