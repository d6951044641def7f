"""Checks of the public contract of ``msda.multi_scale_deformable_attention`` and the choice of implementation.

Every failure raises TypeError (not a tensor, unsupported dtype) or ValueError (shape, layout, device)
naming the argument, what was expected and what was given. The checks read shapes, dtypes and devices
only, so under torch.compile they run once at trace time and cost nothing per step.
"""

from __future__ import annotations

import os

import torch

from .layout import Levels, as_levels, host_values, level_starts

IMPLS = ("triton", "pytorch", "auto")
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_TYPES = (int, torch.SymInt)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got {_describe(t)}")


def _check_layout_tensor(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor (int64), got {t.dtype}")
    # The level layout may live on the CPU beside GPU tensors: reading it then costs no device sync.
    if t.device != device and t.device.type != "cpu":
        raise ValueError(
            f"all tensors must be on value's device ({device}; spatial_shapes and level_start_index may "
            f"also be on the CPU), got {name} on {t.device}"
        )


def _levels_of(spatial_shapes, device: torch.device) -> Levels:
    """The layout as ((H, W), ...) from a tensor or a sequence of pairs, after checking its form."""
    if isinstance(spatial_shapes, torch.Tensor):
        _check_tensor("spatial_shapes", spatial_shapes, 2, "(L, 2)")
        _check_layout_tensor("spatial_shapes", spatial_shapes, device)
        if spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] == 0:
            raise ValueError(
                f"spatial_shapes must be (L, 2) with L >= 1 rows of (H, W), got {_describe(spatial_shapes)}"
            )
        return as_levels(spatial_shapes)
    form = "an (L, 2) integer tensor or a non-empty sequence of (H, W) integer pairs"
    if not isinstance(spatial_shapes, (list, tuple)) or len(spatial_shapes) == 0:
        raise TypeError(f"spatial_shapes must be {form}, got {type(spatial_shapes).__name__}")
    for pair in spatial_shapes:
        if (
            not isinstance(pair, (list, tuple, torch.Size))
            or len(pair) != 2
            or not all(isinstance(v, _INT_TYPES) and not isinstance(v, bool) for v in pair)
        ):
            raise TypeError(f"spatial_shapes must be {form}, got {spatial_shapes!r}")
    return as_levels(spatial_shapes)


def validate_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> Levels:
    """Check the contract of ``multi_scale_deformable_attention``; returns the levels as ((H, W), ...)."""
    _check_tensor("value", value, 4, "(N, S, M, D)")
    _check_tensor("sampling_locations", sampling_locations, 6, "(N, Lq, M, L, P, 2)")
    _check_tensor("attention_weights", attention_weights, 5, "(N, Lq, M, L, P)")
    if level_start_index is not None:
        _check_tensor("level_start_index", level_start_index, 1, "(L,)")

    if value.dtype not in VALUE_DTYPES:
        raise TypeError(f"value must be float32, float16, bfloat16 or float64, got {value.dtype}")
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if t.dtype not in (torch.float32, value.dtype):
            raise TypeError(f"{name} must be float32 or value's dtype ({value.dtype}), got {t.dtype}")
    device = value.device
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if t.device != device:
            raise ValueError(
                f"all tensors must be on value's device ({device}; spatial_shapes and level_start_index may "
                f"also be on the CPU), got {name} on {t.device}"
            )
    if level_start_index is not None:
        _check_layout_tensor("level_start_index", level_start_index, device)

    levels = _levels_of(spatial_shapes, device)
    N, S, M, D = value.shape
    L = len(levels)
    if any(h <= 0 or w <= 0 for h, w in levels):
        raise ValueError(f"spatial_shapes must hold positive (H, W), got {list(levels)}")
    total = sum(h * w for h, w in levels)
    if total != S:
        raise ValueError(
            f"value's S dimension must equal sum(H*W) over spatial_shapes = {total}, got S = {S} "
            f"(value {_describe(value)}, spatial_shapes {list(levels)})"
        )
    if level_start_index is not None:
        expected_start = level_starts(levels)
        if host_values(level_start_index) != expected_start:
            raise ValueError(
                f"level_start_index must be the cumulative sizes of spatial_shapes, {expected_start}, "
                f"got {level_start_index.tolist()}"
            )

    Nq, Lq, Mq, Lq_levels, P, two = sampling_locations.shape
    if (Nq, Mq, Lq_levels, two) != (N, M, L, 2):
        raise ValueError(
            f"sampling_locations must be (N={N}, Lq, M={M}, L={L}, P, 2), got {_describe(sampling_locations)}"
        )
    if P == 0:
        raise ValueError(f"sampling_locations must have P >= 1 points, got {_describe(sampling_locations)}")
    if tuple(attention_weights.shape) != (N, Lq, M, L, P):
        raise ValueError(
            f"attention_weights must be (N, Lq, M, L, P) = {(N, Lq, M, L, P)} to match sampling_locations, "
            f"got {_describe(attention_weights)}"
        )
    if D == 0:
        raise ValueError(f"value must have D >= 1 channels per head, got {_describe(value)}")
    return levels


def is_exporting() -> bool:
    """Whether torch.export is tracing. torch.compiler.is_exporting() is not that everywhere: torch 2.11's Dynamo folds
    it to True inside every torch.compile graph, which would turn off what only export must. torch.export (strict or
    not) sets the flag it reads for as long as it traces, and Dynamo reads the flag's value like any other global."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map impl ("triton" | "pytorch" | "auto") to "triton" or "pytorch" for tensors on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "pytorch"
    # torch.export traces msda::attention through its fake implementation: no kernel runs on ``device`` then,
    # so a CPU-only machine can export the op for a runtime that has it (export.py msda_node=tensorrt).
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and not is_exporting():
        raise ValueError(
            f"impl='triton' needs CUDA tensors, got tensors on {device}; move them to a GPU, use impl='pytorch' "
            f"(or 'auto'), or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU"
        )
    return impl
