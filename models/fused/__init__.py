"""Fused pieces of the deformable transformer's encoder work, each used on CUDA by default (policy.py) and tested
against the plain ops it replaces: the residual LayerNorm (add_norm.py, a Triton kernel), the FFN's linear and ReLU
(linear_activation.py). MSDeformAttn's shared projection and its softmax inside the msda kernels are in
models/deformable_attention.py, switched by the same policy."""

from .add_norm import add_layer_norm, residual_norm
from .linear_activation import linear_relu
from .policy import PIECES, fused, fusion

__all__ = ["PIECES", "add_layer_norm", "fused", "fusion", "linear_relu", "residual_norm"]
