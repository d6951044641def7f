"""Frozen batch norm for the ResNet backbone: torchvision's FrozenBatchNorm2d, one kernel per call.

torchvision's module rebuilds its affine from the four statistics on every call (seven small kernels) and,
under bf16/fp16 autocast, multiplies the half-precision convolution output by float32 statistics, so the
whole residual stream of the backbone runs and is kept for backward in float32, and every convolution
casts its input back. Here the affine (scale, shift) is computed once per version of the statistics, in
the input's dtype, and applied with one ``addcmul``: the same function, with the activations of an
autocast run kept in its half-precision dtype. In half precision, scale and shift are rounded to it
before use, so the output carries those roundings too (about twice the error of rounding a float32 result
once; float32 and float64 inputs are computed as before).

Same buffers, same state_dict keys, so the official checkpoints load unchanged. The cache notices buffers
replaced (``.to()``, ``load_state_dict``) or modified in place through the tensor itself; a write through
``.data``, which bypasses the version counter, is not seen.
"""

from __future__ import annotations

import torch
from torchvision.ops.misc import FrozenBatchNorm2d as _TorchvisionFrozenBatchNorm2d


class FrozenBatchNorm2d(_TorchvisionFrozenBatchNorm2d):
    """y = (x - running_mean) / sqrt(running_var + eps) * weight + bias, all four fixed buffers.

    forward(x (B, C, H, W)) -> (B, C, H, W) in x's dtype.
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__(num_features, eps)
        self._affine: tuple | None = None  # (dtype, versions, buffers, scale, shift); see _scale_shift

    def _statistics(self) -> tuple[torch.Tensor, ...]:
        return self.weight, self.bias, self.running_mean, self.running_var

    def _scale_shift(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, C, 1, 1) scale and shift in ``dtype``, recomputed only when a buffer was replaced (.to(),
        load_state_dict into new tensors) or modified in place (its version counter moved)."""
        buffers = self._statistics()
        if any(t.is_inference() for t in buffers):  # made under inference mode: no version counter to key on
            return self._affine_of(*buffers, dtype=dtype)
        versions = tuple(t._version for t in buffers)
        cached = self._affine
        if (
            cached is not None
            and cached[0] == dtype
            and cached[1] == versions
            and all(a is b for a, b in zip(cached[2], buffers))
        ):
            return cached[3], cached[4]
        # Plain tensors even when first met under inference mode (evaluation), so a later training step may
        # save them for backward.
        with torch.inference_mode(False), torch.no_grad():
            scale, shift = self._affine_of(*buffers, dtype=dtype)
        self._affine = (dtype, versions, buffers, scale, shift)
        return scale, shift

    def _affine_of(self, weight, bias, running_mean, running_var, *, dtype: torch.dtype):
        """(1, C, 1, 1) scale and shift, computed in the statistics' dtype, then cast to ``dtype``."""
        scale = weight * (running_var + self.eps).rsqrt()
        shift = bias - running_mean * scale
        return scale.reshape(1, -1, 1, 1).to(dtype), shift.reshape(1, -1, 1, 1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the arithmetic is fused into the graph, nothing to cache
            scale, shift = self._affine_of(*self._statistics(), dtype=x.dtype)
        else:
            scale, shift = self._scale_shift(x.dtype)
        return torch.addcmul(shift, x, scale)
