"""relu(linear(x)) as one matmul with a ReLU epilogue (torch._addmm_activation: cuBLASLt's bias and ReLU epilogue on
CUDA), for the encoder FFN's linear1.

Unfused, the FFN's hidden activation (N, S, d_ffn, the widest tensor of the layer) is written by the matmul, read and
written again by the ReLU; fused, it is written once. torch._addmm_activation has no autograd formula, so the backward
is written here: the ReLU's mask from the output (as ReLU's own backward takes it), then the matmul's three gradients.
Under autocast the inputs are cast as autocast casts linear's, so the matmul runs in the same dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .policy import fused


def linear_relu(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """relu(linear(x)): fused on CUDA, else exactly the plain ops."""
    if fused("linear_relu", x) and linear.bias is not None:
        return linear_relu_fused(x, linear.weight, linear.bias)
    return torch.relu(linear(x))


def linear_relu_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """relu(x @ weight.T + bias) over x (..., K); weight (N, K), bias (N,)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        # What autocast does to linear's arguments: floating point, not float64, to the autocast dtype.
        x, weight, bias = (
            t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (x, weight, bias)
        )
    with torch.autocast(device, enabled=False):
        return LinearReLU.apply(x, weight, bias)


class LinearReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])  # (rows, K)
        out = torch._addmm_activation(bias, x2d, weight.t())  # (rows, N)
        ctx.save_for_backward(x2d, weight, out)
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x2d, weight, out = ctx.saved_tensors
        grad = torch.ops.aten.threshold_backward(grad_out.reshape(out.shape), out, 0)  # (rows, N): 0 where out <= 0
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(x2d)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias
