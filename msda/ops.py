"""Multi-scale deformable attention: validation, kernel launch, autograd Function, public entry point.

Dimensions, named once: N batch, S flattened value positions (sum of H_l * W_l), M heads, D channels per
head, Lq queries, L levels, P sampling points per level and head.
"""

from __future__ import annotations

import os
import weakref

import torch

from .reference import multi_scale_deformable_attention_reference

IMPLS = ("triton", "pytorch", "auto")
LAYOUT_ARGS = ("spatial_shapes", "level_start_index")
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------
def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got {_describe(t)}")


def level_starts(levels) -> list[int]:
    """Offsets of each level in the flattened S axis: 0, H_0*W_0, H_0*W_0 + H_1*W_1, ..."""
    starts = [0]
    for h, w in levels[:-1]:
        starts.append(starts[-1] + h * w)
    return starts


def level_start_index_from_shapes(spatial_shapes: torch.Tensor) -> torch.Tensor:
    """(L,) int64 level_start_index on spatial_shapes' device."""
    sizes = spatial_shapes.long().prod(dim=1)
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


_HOST_COPIES: dict[int, tuple[int, list]] = {}  # id(tensor) -> (its _version when read, its values)


def host_values(t: torch.Tensor) -> list:
    """t.tolist(), read from the device once per tensor and version rather than once per call.

    A model passes the same spatial_shapes tensor to every attention layer; reading it each time would
    stall the host on the GPU queue a dozen times per step. The entry is dropped when the tensor dies
    (so its id cannot be reused stale) and ignored once the tensor is modified in place (_version).
    """
    if t.device.type == "cpu":
        return t.tolist()
    try:
        version = t._version
    except RuntimeError:  # inference-mode tensors keep no version counter: read every time
        return t.tolist()
    cached = _HOST_COPIES.get(id(t))
    if cached is not None and cached[0] == version:
        return cached[1]
    values = t.tolist()
    if cached is None:
        weakref.finalize(t, _HOST_COPIES.pop, id(t), None)
    _HOST_COPIES[id(t)] = (version, values)
    return values


def validate_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Check the contract of ``multi_scale_deformable_attention``; returns the levels as [(H, W), ...].

    Raises TypeError for a non-tensor or an unsupported dtype and ValueError for a wrong shape, an
    inconsistent level layout or mixed devices; each message names the argument, the expected and the actual.
    """
    _check_tensor("value", value, 4, "(N, S, M, D)")
    _check_tensor("spatial_shapes", spatial_shapes, 2, "(L, 2)")
    _check_tensor("sampling_locations", sampling_locations, 6, "(N, Lq, M, L, P, 2)")
    _check_tensor("attention_weights", attention_weights, 5, "(N, Lq, M, L, P)")
    if level_start_index is not None:
        _check_tensor("level_start_index", level_start_index, 1, "(L,)")

    if value.dtype not in VALUE_DTYPES:
        raise TypeError(f"value must be float32, float16, bfloat16 or float64, got {value.dtype}")
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if t.dtype not in (torch.float32, value.dtype):
            raise TypeError(
                f"{name} must be float32 or value's dtype ({value.dtype}), got {t.dtype}")
    for name, t in (("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        if t is not None and t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an integer tensor (int64), got {t.dtype}")

    # The level layout may live on the CPU beside GPU tensors: reading it then costs no device sync.
    device = value.device
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights),
                    ("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        if t is not None and t.device != device and not (name in LAYOUT_ARGS and t.device.type == "cpu"):
            raise ValueError(
                f"all tensors must be on value's device ({device}; spatial_shapes and level_start_index may "
                f"also be on the CPU), got {name} on {t.device}")

    N, S, M, D = value.shape
    if spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] == 0:
        raise ValueError(f"spatial_shapes must be (L, 2) with L >= 1 rows of (H, W), got {_describe(spatial_shapes)}")
    levels = [(int(h), int(w)) for h, w in host_values(spatial_shapes)]
    L = len(levels)
    if any(h <= 0 or w <= 0 for h, w in levels):
        raise ValueError(f"spatial_shapes must hold positive (H, W), got {levels}")
    total = sum(h * w for h, w in levels)
    if total != S:
        raise ValueError(
            f"value's S dimension must equal sum(H*W) over spatial_shapes = {total}, got S = {S} "
            f"(value {_describe(value)}, spatial_shapes {levels})")
    if level_start_index is not None:
        expected_start = level_starts(levels)
        if host_values(level_start_index) != expected_start:
            raise ValueError(
                f"level_start_index must be the cumulative sizes of spatial_shapes, {expected_start}, "
                f"got {level_start_index.tolist()}")

    Nq, Lq, Mq, Lq_levels, P, two = sampling_locations.shape
    if (Nq, Mq, Lq_levels, two) != (N, M, L, 2):
        raise ValueError(
            f"sampling_locations must be (N={N}, Lq, M={M}, L={L}, P, 2), got {_describe(sampling_locations)}")
    if P == 0:
        raise ValueError(f"sampling_locations must have P >= 1 points, got {_describe(sampling_locations)}")
    if tuple(attention_weights.shape) != (N, Lq, M, L, P):
        raise ValueError(
            f"attention_weights must be (N, Lq, M, L, P) = {(N, Lq, M, L, P)} to match sampling_locations, "
            f"got {_describe(attention_weights)}")
    if D == 0:
        raise ValueError(f"value must have D >= 1 channels per head, got {_describe(value)}")
    return levels


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map impl ("triton" | "pytorch" | "auto") to "triton" or "pytorch" for tensors on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "auto":
        return "triton" if device.type == "cuda" else "pytorch"
    if impl == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError(
            f"impl='triton' needs CUDA tensors, got tensors on {device}; move them to a GPU, use impl='pytorch' "
            f"(or 'auto'), or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU")
    return impl


# ----------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------
class MultiScaleDeformableAttentionFunction(torch.autograd.Function):
    """Triton forward and backward on validated, contiguous tensors; ``levels`` is [(H, W), ...] on the host.

    grad_value is accumulated with atomic adds, so it is nondeterministic run to run in the last bits.
    """

    @staticmethod
    def forward(ctx, value, levels, sampling_locations, attention_weights):
        from . import launch  # triton is imported only when the Triton path is used

        ctx.levels = levels
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        return launch.forward(value, levels, sampling_locations, attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        from . import launch

        value, sampling_locations, attention_weights = ctx.saved_tensors
        grad_value, grad_loc, grad_weight = launch.backward(
            grad_output.contiguous(), value, ctx.levels, sampling_locations, attention_weights)
        need_value, _, need_loc, need_weight = ctx.needs_input_grad
        return (grad_value if need_value else None, None,
                grad_loc if need_loc else None, grad_weight if need_weight else None)


def multi_scale_deformable_attention(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor | None,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """Multi-scale deformable attention, the original Deformable DETR op's semantics.

    value               (N, S, M, D)        float32 | float16 | bfloat16 (float64 for testing)
    spatial_shapes      (L, 2) int64        (H_l, W_l) per level, S = sum(H_l * W_l); on value's device or
                                            the CPU (a CPU tensor saves the one device->host read per call)
    level_start_index   (L,) int64 or None  checked against spatial_shapes when given, else computed
    sampling_locations  (N, Lq, M, L, P, 2) normalized (x, y); [0, 1] spans the map, outside reads zeros;
                                            float32 or value's dtype
    attention_weights   (N, Lq, M, L, P)    already softmaxed over L*P by the caller; float32 or value's dtype
    impl                "triton" (CUDA, or CPU under TRITON_INTERPRET=1) | "pytorch" | "auto"
    returns             (N, Lq, M*D) in value's dtype; each gradient comes back in its input's dtype.

    Bilinear sampling as grid_sample(align_corners=False, padding_mode="zeros") at 2*loc-1, accumulated in
    float32 by the Triton path. Its grad_value uses atomics: nondeterministic in the last bits.
    """
    levels = validate_inputs(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    impl = resolve_impl(impl, value.device)
    N, _, M, D = value.shape
    Lq = sampling_locations.shape[1]
    if N == 0 or Lq == 0:
        # Nothing to gather: no launch, but stay connected to the inputs so backward gives zero gradients.
        connected = 0 * (value.sum() + sampling_locations.sum() + attention_weights.sum())
        return value.new_zeros((N, Lq, M * D)) + connected.to(value.dtype)
    if impl == "pytorch":
        return multi_scale_deformable_attention_reference(value, levels, sampling_locations, attention_weights)
    return MultiScaleDeformableAttentionFunction.apply(
        value.contiguous(), tuple(levels), sampling_locations.contiguous(), attention_weights.contiguous())
