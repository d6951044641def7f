"""LayerNorm(x + y) as one Triton kernel each way (models/fused/add_norm_kernels.py), and the encoder layer's residual
norm that uses it on CUDA.

Unfused, ``norm(x + y)`` writes the sum, reads it back to normalize it, and its backward reads the sum again twice
(the input's gradient, then the weight's); fused, the forward reads x and y once and writes the output, and the
backward reads x, y and the output's gradient once and writes the sum's gradient, which is the gradient of x and of y,
with the weight's and bias's as per-program partial sums reduced by one small sum. Nothing but x and y is kept for
the backward (the unfused ops keep the sum and two statistics per row).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .policy import fused

# Lower-precision sums that autocast normalizes in float32, by device type: CUDA's autocast runs layer_norm in
# float32; the CPU's keeps bfloat16.
_FLOAT32_NORM_UNDER_AUTOCAST = ("cuda",)


def residual_norm(norm: nn.LayerNorm, dropout: nn.Dropout, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """norm(x + dropout(y)): fused on CUDA where the dropout does nothing, else exactly the plain modules' ops."""
    if fused("add_norm", x) and (dropout.p == 0 or not dropout.training) and _fusable(norm, x, y):
        return add_layer_norm(x, y, norm.weight, norm.bias, norm.eps)
    return norm(x + dropout(y))


def _fusable(norm: nn.LayerNorm, x: torch.Tensor, y: torch.Tensor) -> bool:
    return norm.weight is not None and norm.bias is not None and len(norm.normalized_shape) == 1 and x.shape == y.shape


def add_layer_norm(x, y, weight, bias, eps: float) -> torch.Tensor:
    """F.layer_norm(x + y, (C,), weight, bias, eps) over the last dimension C, x and y of one shape (..., C).

    The sum is rounded to the dtype torch's x + y has; the output has the dtype F.layer_norm would give it, under
    autocast too. Gradients of x, y, weight and bias, each in its input's dtype.
    """
    z_dtype = torch.result_type(x, y)
    out_dtype = z_dtype
    if (
        x.device.type in _FLOAT32_NORM_UNDER_AUTOCAST
        and torch.is_autocast_enabled(x.device.type)
        and z_dtype in (torch.float16, torch.bfloat16)
    ):
        out_dtype = torch.float32
    return AddLayerNorm.apply(x, y, weight, bias, float(eps), out_dtype)


class AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, weight, bias, eps, out_dtype):
        ctx.save_for_backward(x, y, weight)
        ctx.eps = eps
        ctx.bias_dtype = bias.dtype
        return _forward(x, y, weight, bias, eps, out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, y, weight = ctx.saved_tensors
        grad_x, grad_y, grad_weight, grad_bias = _backward(grad_out, x, y, weight, ctx.eps)
        return grad_x, grad_y, grad_weight, grad_bias.to(ctx.bias_dtype), None, None


def _dtypes(x, y):
    """(SUM_DTYPE, COMPUTE_DTYPE) of the kernels, as Triton types."""
    import triton.language as tl

    z_dtype = torch.result_type(x, y)
    sum_dtype = {torch.float64: tl.float64, torch.float32: tl.float32, torch.float16: tl.float16}.get(
        z_dtype, tl.bfloat16
    )
    return sum_dtype, tl.float64 if z_dtype == torch.float64 else tl.float32


def _device(t: torch.Tensor):
    """Triton launches on the current device: switch only for tensors on another one."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _block_c(C: int) -> int:
    return 1 << (C - 1).bit_length()


def _forward(x, y, weight, bias, eps, out_dtype):
    C = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // C if C else 0
    if rows == 0:
        return out
    from .add_norm_kernels import add_layer_norm_forward_kernel

    block_r, warps = forward_config(C)
    sum_dtype, compute_dtype = _dtypes(x, y)
    with _device(x):
        add_layer_norm_forward_kernel[(-(-rows // block_r),)](
            x.contiguous(),
            y.contiguous(),
            weight.contiguous(),
            bias.contiguous(),
            out,
            rows,
            eps,
            C=C,
            BLOCK_R=block_r,
            BLOCK_C=_block_c(C),
            SUM_DTYPE=sum_dtype,
            COMPUTE_DTYPE=compute_dtype,
            num_warps=warps,
        )
    return out


def _backward(grad_out, x, y, weight, eps):
    C = x.shape[-1]
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    separate = y.dtype != x.dtype
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format) if separate else grad_x
    rows = x.numel() // C if C else 0
    accum = torch.float64 if torch.result_type(x, y) == torch.float64 else torch.float32
    if rows == 0:
        zeros = torch.zeros(C, dtype=weight.dtype, device=x.device)
        return grad_x, grad_y, zeros, zeros.clone()
    from .add_norm_kernels import add_layer_norm_backward_kernel

    block_r, warps = backward_config(C)
    programs = min(-(-rows // block_r), _max_programs(x.device))
    partial = torch.empty((2, programs, C), dtype=accum, device=x.device)  # weight's, bias's
    sum_dtype, compute_dtype = _dtypes(x, y)
    with _device(x):
        add_layer_norm_backward_kernel[(programs,)](
            grad_out.contiguous(),
            x.contiguous(),
            y.contiguous(),
            weight.contiguous(),
            grad_x,
            grad_y,
            partial[0],
            partial[1],
            rows,
            eps,
            C=C,
            BLOCK_R=block_r,
            BLOCK_C=_block_c(C),
            SUM_DTYPE=sum_dtype,
            COMPUTE_DTYPE=compute_dtype,
            GRAD_Y=separate,
            num_warps=warps,
        )
    grads = partial.sum(1).to(weight.dtype)  # (2, C), summed in a fixed order
    return grad_x, grad_y, grads[0], grads[1]


# ----------------------------------------------------------------------------------------------------
# launch configuration: guesses for a memory-bound row kernel, to be timed on a GPU (/work/notes plan)
# ----------------------------------------------------------------------------------------------------
def forward_config(C: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps): about 4096 elements a program."""
    block_c = _block_c(C)
    return max(1, 4096 // block_c), 8 if block_c >= 2048 else 4


def backward_config(C: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps): about 2048 elements a step; the program also holds two accumulators of that size."""
    block_c = _block_c(C)
    return max(1, 2048 // block_c), 8 if block_c >= 2048 else 4


@functools.lru_cache(maxsize=16)
def _max_programs(device: torch.device) -> int:
    """Backward programs, each looping over row blocks: a few per SM on a GPU, few under the interpreter (which pays
    per program); each writes one row of partial sums."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4
