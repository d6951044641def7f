"""The level layout of the flattened value axis: (H, W) per level as host integers, and their offsets.

Inside a model the layout is known on the host (the feature maps' shapes), so it travels as a tuple of
(H, W) ints down to the kernel launch and is never read back from the device. A user may still pass an
(L, 2) tensor, as the original op takes; a CUDA tensor is then read once per tensor version (host_values).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

Levels = tuple[tuple[int, int], ...]


def level_starts(levels: Sequence[tuple[int, int]]) -> list[int]:
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

    For callers that hand the op the same CUDA spatial_shapes tensor in every layer: reading it each
    time would stall the host on the GPU queue a dozen times per step. The entry is dropped when the
    tensor dies (so its id cannot be reused stale) and ignored once the tensor is modified in place.
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


@torch.compiler.disable
def _read_levels(spatial_shapes: torch.Tensor) -> Levels:
    # A tensor's values are data to torch.compile: reading them is a graph break (run eagerly), after
    # which the layout is a constant of the next graph. Pass host ints to keep one graph.
    return tuple((int(h), int(w)) for h, w in host_values(spatial_shapes))


def as_levels(spatial_shapes) -> Levels:
    """((H, W), ...) from an (L, 2) integer tensor or a sequence of (H, W) pairs.

    A sequence is returned as given (its entries may be symbolic sizes under torch.compile); a tensor is
    read on the host. Shape and dtype are checked by the caller (msda.validation).
    """
    if isinstance(spatial_shapes, torch.Tensor):
        return _read_levels(spatial_shapes)
    return tuple((h, w) for h, w in spatial_shapes)
