"""Where the model's fused pieces run: on CUDA, with no setting; elsewhere the plain PyTorch ops, unchanged.

The pieces (``PIECES``):

    add_norm     LayerNorm(x + dropout(y)) of the encoder layer as one Triton kernel, forward and backward, where the
                 dropout does nothing (p = 0, or not training); models/fused/add_norm.py
    linear_relu  the encoder FFN's linear1 and its ReLU as one matmul with a ReLU epilogue;
                 models/fused/linear_activation.py
    projections  MSDeformAttn's sampling offsets and attention logits from one float32 matmul of the query
    softmax      the attention weights' softmax inside the msda kernels (msda's weights_are_logits)

A piece runs where its tensor is on CUDA, never inside torch.export (an exported graph keeps the plain ops and the
``msda::attention`` node that export.py's TensorRT translation replaces) and never under torch.compile: the pieces
run eagerly only (CUDA graphs record the eager model, so they are recorded too). Inductor fuses the elementwise work
into its own kernels, and an autograd.Function would be opaque to it; the attention's pieces made a compiled step
slower, the split logits needing copies to be contiguous and Inductor's softmax costing less than the one inside the
attention kernels.
``fusion(...)`` overrides the device rule per piece: tests force pieces on the CPU (Triton under its interpreter), a
benchmark turns them off on a GPU to time the difference.
"""

from __future__ import annotations

import contextlib

import torch

from msda.validation import is_exporting

PIECES = ("add_norm", "linear_relu", "projections", "softmax")
_forced: dict[str, bool] = {}


def fused(piece: str, t: torch.Tensor) -> bool:
    """Whether ``piece`` runs fused for the tensor ``t`` here."""
    if is_exporting() or torch.compiler.is_compiling():
        return False
    forced = _forced.get(piece)
    return t.is_cuda if forced is None else forced


@contextlib.contextmanager
def fusion(**pieces: bool | None):
    """Within the block each named piece runs fused (True) or unfused (False) on any device; None: by device."""
    unknown = set(pieces) - set(PIECES)
    if unknown:
        raise ValueError(f"unknown fused pieces {sorted(unknown)}; the pieces are {PIECES}")
    saved = dict(_forced)
    _forced.update({name: on for name, on in pieces.items() if on is not None})
    for name in (name for name, on in pieces.items() if on is None):
        _forced.pop(name, None)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
