"""Multi-scale deformable attention as a PyTorch operator: ``msda::attention`` and its backward, and the
public entry point ``multi_scale_deformable_attention``.

The Triton forward and backward are registered with ``torch.library.custom_op``, each with a fake
(meta) implementation, and the backward is attached with ``register_autograd``, so torch.compile traces
through the op with no graph break and propagates dynamic shapes. Eager calls take a plain
``torch.autograd.Function`` over the same two functions instead: the dispatcher round trips of a custom
op cost more host time per call than a decoder-sized kernel takes on the GPU. The level layout is an
argument of the op as host integers (flattened H_0, W_0, H_1, W_1, ...; symbolic under dynamic shapes), so nothing
is read back from the device.

Dimensions, named once: N batch, S flattened value positions (sum of H_l * W_l), M heads, D channels per
head, Lq queries, L levels, P sampling points per level and head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logits_op import EagerAttentionFromLogits, attention_from_logits_op
from .reference import multi_scale_deformable_attention_reference
from .validation import resolve_impl, validate_inputs


def _pairs(flat_levels: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat_levels[0::2], flat_levels[1::2]))


# ----------------------------------------------------------------------------------------------------
# the operator
# ----------------------------------------------------------------------------------------------------
def _forward(value, sampling_locations, attention_weights, levels) -> torch.Tensor:
    """Triton forward on validated inputs -> (N, Lq, M*D)."""
    N, _, M, D = value.shape
    Lq = sampling_locations.shape[1]
    if N == 0 or Lq == 0:
        return value.new_zeros((N, Lq, M * D))  # nothing to gather: no launch
    from . import launch  # triton is imported only when the Triton path is used

    return launch.forward(value.contiguous(), levels, sampling_locations.contiguous(), attention_weights.contiguous())


def _backward_impl(grad_output, value, sampling_locations, attention_weights, levels, deterministic):
    """(grad_value, grad_sampling_locations, grad_attention_weights), each in its input's dtype."""
    N = value.shape[0]
    Lq = sampling_locations.shape[1]
    if N == 0 or Lq == 0:
        return torch.zeros_like(value), torch.zeros_like(sampling_locations), torch.zeros_like(attention_weights)
    from . import launch

    return launch.backward(
        grad_output.contiguous(),
        value.contiguous(),
        levels,
        sampling_locations.contiguous(),
        attention_weights.contiguous(),
        deterministic=deterministic,
    )


@torch.library.custom_op("msda::attention", mutates_args=())
def attention_op(
    value: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    flat_levels: list[int],
    deterministic: bool,
) -> torch.Tensor:
    """Triton forward on validated inputs -> (N, Lq, M*D). ``deterministic`` only matters to the backward."""
    return _forward(value, sampling_locations, attention_weights, _pairs(flat_levels))


@attention_op.register_fake
def _attention_fake(value, sampling_locations, attention_weights, flat_levels, deterministic):
    N, _, M, D = value.shape
    return value.new_empty((N, sampling_locations.shape[1], M * D))


@torch.library.custom_op("msda::attention_backward", mutates_args=())
def attention_backward_op(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    flat_levels: list[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_value, grad_sampling_locations, grad_attention_weights), each in its input's dtype."""
    return _backward_impl(grad_output, value, sampling_locations, attention_weights, _pairs(flat_levels), deterministic)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_output, value, sampling_locations, attention_weights, flat_levels, deterministic):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _setup_context(ctx, inputs, output):
    value, sampling_locations, attention_weights, flat_levels, deterministic = inputs
    ctx.save_for_backward(value, sampling_locations, attention_weights)
    ctx.flat_levels = flat_levels
    ctx.deterministic = deterministic


def _backward(ctx, grad_output):
    value, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_loc, grad_weight = attention_backward_op(
        grad_output, value, sampling_locations, attention_weights, ctx.flat_levels, ctx.deterministic
    )
    need_value, need_loc, need_weight = ctx.needs_input_grad[:3]
    return (
        grad_value if need_value else None,
        grad_loc if need_loc else None,
        grad_weight if need_weight else None,
        None,
        None,
    )


attention_op.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """The op for eager calls: the same forward and backward as msda::attention, without the dispatcher."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, levels, deterministic):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.levels = levels
        ctx.deterministic = deterministic
        return _forward(value, sampling_locations, attention_weights, levels)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        value, sampling_locations, attention_weights = ctx.saved_tensors
        grads = _backward_impl(grad_output, value, sampling_locations, attention_weights, ctx.levels, ctx.deterministic)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None, None)


# ----------------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------------
def multi_scale_deformable_attention(
    value: torch.Tensor,
    spatial_shapes,
    level_start_index: torch.Tensor | None,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    impl: str = "auto",
    deterministic: bool | None = None,
    weights_are_logits: bool = False,
) -> torch.Tensor:
    """Multi-scale deformable attention, the original Deformable DETR op's semantics.

    value               (N, S, M, D)        float32 | float16 | bfloat16 (float64 for testing)
    spatial_shapes      (L, 2) int64 tensor (on value's device or the CPU), or a sequence of (H, W) ints:
                        the level layout, S = sum(H_l * W_l). A sequence costs no device read at all
                        (what the model passes); a CUDA tensor is read once per tensor version.
    level_start_index   (L,) int64 or None  checked against spatial_shapes when given, else computed
    sampling_locations  (N, Lq, M, L, P, 2) normalized (x, y); [0, 1] spans the map, outside reads zeros;
                                            float32 or value's dtype
    attention_weights   (N, Lq, M, L, P)    already softmaxed over L*P by the caller (or their logits, with
                                            weights_are_logits); float32 or value's dtype
    impl                "triton" (CUDA, or CPU under TRITON_INTERPRET=1) | "pytorch" | "auto"
    deterministic       None: follow torch.are_deterministic_algorithms_enabled(); True: a backward whose
                        grad_value is bitwise identical run to run; False: the faster atomic scatter.
    weights_are_logits  True: attention_weights are the logits, softmaxed here over each query's L*P samples per
                        head: by the Triton kernels as they read them (msda/logits_op.py), or by torch.softmax
                        before the reference. Their gradient is the logits'.
    returns             (N, Lq, M*D) in value's dtype; each gradient comes back in its input's dtype.

    Bilinear sampling as grid_sample(align_corners=False, padding_mode="zeros") at 2*loc-1, accumulated in
    float32 by the Triton path.
    """
    levels = validate_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    impl = resolve_impl(impl, value.device)
    if impl == "pytorch":
        if weights_are_logits:
            N, Lq, M, L, P = attention_weights.shape  # softmax over L*P
            attention_weights = F.softmax(attention_weights.reshape(N, Lq, M, L * P), -1).view(N, Lq, M, L, P)
        return multi_scale_deformable_attention_reference(value, levels, sampling_locations, attention_weights)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if torch.compiler.is_compiling():  # traced: the registered op, which torch.compile sees through
        flat_levels = [size for level in levels for size in level]
        if weights_are_logits:
            return attention_from_logits_op(
                value, sampling_locations, attention_weights, flat_levels, bool(deterministic)
            )[0]
        return attention_op(value, sampling_locations, attention_weights, flat_levels, bool(deterministic))
    if weights_are_logits:
        return EagerAttentionFromLogits.apply(value, sampling_locations, attention_weights, levels, bool(deterministic))
    return EagerAttention.apply(value, sampling_locations, attention_weights, levels, bool(deterministic))
