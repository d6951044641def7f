"""Fused pieces of the deformable transformer's encoder work, each used on CUDA by default (policy.py) and tested
against the plain ops it replaces: the residual LayerNorm (add_norm.py, a Triton kernel)."""

from .add_norm import add_layer_norm, residual_norm
from .policy import PIECES, fused, fusion

__all__ = ["PIECES", "add_layer_norm", "fused", "fusion", "residual_norm"]
