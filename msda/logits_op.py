"""The attention op on logits: ``msda::attention_from_logits``, the softmax of the attention weights done inside the
Triton kernels (``multi_scale_deformable_attention(..., weights_are_logits=True)`` calls it).

The forward softmaxes each query's L*P logits per head as it reads them and keeps two numbers per (query, head),
the max and the sum of the exponentials (the softmax stats), instead of a softmaxed copy of the weights; the
backward turns logits into weights with them and writes the logits' gradient directly (msda/kernels.py, LOGITS).
Against torch.softmax then ``msda::attention`` this saves the softmax's forward pass (read the logits, write the
weights) and its backward pass (read the weights and their gradient, write the logits'), and the weights' memory.

The backward reads the forward's output; the caller's next layer keeps that tensor anyway (the output projection's
input), so saving it costs no memory. Registered as msda/ops.py registers ``msda::attention``: a custom op with a fake
implementation and autograd for torch.compile, a plain autograd.Function for eager calls. ``msda::attention`` itself
is unchanged (export.py's TensorRT node replaces it by name and schema).
"""

from __future__ import annotations

import torch


def _pairs(flat_levels: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat_levels[0::2], flat_levels[1::2]))


def _stats_shape(value: torch.Tensor, sampling_locations: torch.Tensor) -> tuple:
    return (*sampling_locations.shape[:3], 2)  # (N, Lq, M, 2)


def _stats_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float64 if value.dtype == torch.float64 else torch.float32


def _forward(value, sampling_locations, logits, levels) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward on validated inputs -> (output (N, Lq, M*D), softmax stats (N, Lq, M, 2))."""
    N, _, M, D = value.shape
    Lq = sampling_locations.shape[1]
    stats = value.new_empty(_stats_shape(value, sampling_locations), dtype=_stats_dtype(value))
    if N == 0 or Lq == 0:
        return value.new_zeros((N, Lq, M * D)), stats
    from . import launch  # triton is imported only when the Triton path is used

    output = launch.forward(
        value.contiguous(), levels, sampling_locations.contiguous(), logits.contiguous(), softmax_stats=stats
    )
    return output, stats


def _backward_impl(grad_output, value, sampling_locations, logits, stats, output, levels, deterministic):
    """(grad_value, grad_sampling_locations, grad_logits), each in its input's dtype."""
    N = value.shape[0]
    Lq = sampling_locations.shape[1]
    if N == 0 or Lq == 0:
        return torch.zeros_like(value), torch.zeros_like(sampling_locations), torch.zeros_like(logits)
    from . import launch

    return launch.backward(
        grad_output.contiguous(),
        value.contiguous(),
        levels,
        sampling_locations.contiguous(),
        logits.contiguous(),
        deterministic=deterministic,
        softmax_stats=stats,
        output=output.contiguous(),
    )


@torch.library.custom_op("msda::attention_from_logits", mutates_args=())
def attention_from_logits_op(
    value: torch.Tensor,
    sampling_locations: torch.Tensor,
    logits: torch.Tensor,
    flat_levels: list[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (N, Lq, M*D), softmax stats (N, Lq, M, 2)) on validated inputs; the stats are for the backward."""
    return _forward(value, sampling_locations, logits, _pairs(flat_levels))


@attention_from_logits_op.register_fake
def _fake(value, sampling_locations, logits, flat_levels, deterministic):
    N, _, M, D = value.shape
    stats = value.new_empty(_stats_shape(value, sampling_locations), dtype=_stats_dtype(value))
    return value.new_empty((N, sampling_locations.shape[1], M * D)), stats


@torch.library.custom_op("msda::attention_from_logits_backward", mutates_args=())
def attention_from_logits_backward_op(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    sampling_locations: torch.Tensor,
    logits: torch.Tensor,
    stats: torch.Tensor,
    output: torch.Tensor,
    flat_levels: list[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_value, grad_sampling_locations, grad_logits), each in its input's dtype."""
    return _backward_impl(
        grad_output, value, sampling_locations, logits, stats, output, _pairs(flat_levels), deterministic
    )


@attention_from_logits_backward_op.register_fake
def _backward_fake(grad_output, value, sampling_locations, logits, stats, output, flat_levels, deterministic):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    value, sampling_locations, logits, flat_levels, deterministic = inputs
    out, stats = output
    ctx.save_for_backward(value, sampling_locations, logits, stats, out)
    ctx.flat_levels = flat_levels
    ctx.deterministic = deterministic


def _backward(ctx, grad_output, _grad_stats):
    value, sampling_locations, logits, stats, out = ctx.saved_tensors
    grads = attention_from_logits_backward_op(
        grad_output, value, sampling_locations, logits, stats, out, ctx.flat_levels, ctx.deterministic
    )
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None, None)


attention_from_logits_op.register_autograd(_backward, setup_context=_setup_context)


class EagerAttentionFromLogits(torch.autograd.Function):
    """The op for eager calls: the same forward and backward as msda::attention_from_logits, without the dispatcher;
    returns the output alone."""

    @staticmethod
    def forward(ctx, value, sampling_locations, logits, levels, deterministic):
        output, stats = _forward(value, sampling_locations, logits, levels)
        ctx.save_for_backward(value, sampling_locations, logits, stats, output)
        ctx.levels = levels
        ctx.deterministic = deterministic
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        value, sampling_locations, logits, stats, output = ctx.saved_tensors
        grads = _backward_impl(
            grad_output, value, sampling_locations, logits, stats, output, ctx.levels, ctx.deterministic
        )
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None, None)
