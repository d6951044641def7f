"""Whether the attention ``model.msda`` chooses can run on the run's device, checked with the settings.

``model.msda=triton`` runs the Triton kernels, which need CUDA tensors (or Triton's CPU interpreter,
TRITON_INTERPRET=1). Left to the first forward, another device fails there in the operator's words (``impl=``),
after the data is checked and the run directory written; refused here, it is one message naming the setting, as
``compile.mode=reduce-overhead`` on a CPU is. The rule is the operator's own (msda.validation.resolve_impl).
"""

from __future__ import annotations

import torch

from msda.validation import resolve_impl


def check_msda_device(msda: str, device: torch.device) -> None:
    """A ValueError naming ``model.msda`` when its implementation cannot run on ``device``."""
    try:
        resolve_impl(str(msda), device)
    except ValueError as error:
        raise ValueError(f"model.msda={msda} runs the Triton kernels, which need a GPU, but this run is on {device}: "
                         "set model.msda=auto (Triton on a GPU, the PyTorch reference elsewhere) or "
                         "model.msda=pytorch, or run on a GPU (device=cuda); TRITON_INTERPRET=1 runs the kernels on "
                         "the CPU through Triton's interpreter, very slowly") from error
