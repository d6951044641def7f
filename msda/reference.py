"""PyTorch reference for multi-scale deformable attention (``model.msda=pytorch``).

Bilinear sampling through ``F.grid_sample(mode="bilinear", padding_mode="zeros", align_corners=False)``
at ``2 * loc - 1``, exactly as the original Deformable DETR's ``ms_deform_attn_core_pytorch``. It runs
anywhere autograd runs and is the ground truth the Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def multi_scale_deformable_attention_reference(
    value: torch.Tensor,
    spatial_shapes,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """Reference op. Shapes as in ``msda.multi_scale_deformable_attention``; returns (N, Lq, M*D).

    spatial_shapes is an (L, 2) tensor or a list of (H, W) pairs.
    Computation happens in value's dtype (as the original); sampling locations are cast to it.
    """
    N, _S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    levels = spatial_shapes.tolist() if isinstance(spatial_shapes, torch.Tensor) else spatial_shapes
    level_sizes = [h * w for h, w in levels]  # no int(): sizes may be symbolic under torch.compile
    value_per_level = value.split(level_sizes, dim=1)
    # grid_sample takes grids in [-1, 1] with align_corners=False pixel-centre convention.
    sampling_grids = (2 * sampling_locations - 1).to(value.dtype)  # (N, Lq, M, L, P, 2)
    sampled_per_level = []
    for level, (H, W) in enumerate(levels):
        # (N, H*W, M, D) -> (N*M, D, H, W)
        value_l = value_per_level[level].flatten(2).transpose(1, 2).reshape(N * M, D, H, W)
        # (N, Lq, M, P, 2) -> (N*M, Lq, P, 2)
        grid_l = sampling_grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled = F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False)
        sampled_per_level.append(sampled)  # (N*M, D, Lq, P)
    # (N, Lq, M, L, P) -> (N*M, 1, Lq, L*P)
    weights = attention_weights.transpose(1, 2).reshape(N * M, 1, Lq, L * P).to(value.dtype)
    stacked = torch.stack(sampled_per_level, dim=-2).flatten(-2)  # (N*M, D, Lq, L*P)
    output = (stacked * weights).sum(-1).view(N, M * D, Lq)  # (N, M*D, Lq)
    return output.transpose(1, 2).contiguous()  # (N, Lq, M*D)


def off_cell_edges(levels, loc, margin: float = 1e-3) -> torch.Tensor:
    """(N, Lq, M, L, P, 1) bool: the samples whose pixel coordinates are at least ``margin`` from a cell edge.

    Bilinear sampling's gradient by location jumps where a coordinate crosses a whole pixel (another pair of corners
    is read). A float32 kernel that rounds a coordinate lying within its rounding of that edge to the other side is
    right on that side, and the fp64 reference, on this one, differs by the jump: one such sample of a million
    outweighs all the others in a relative error. Gradients by location are compared away from the edges."""
    sides = torch.tensor([[w, h] for h, w in levels], dtype=torch.float64, device=loc.device)
    pixels = loc.double() * sides[None, None, None, :, None, :] - 0.5
    return ((pixels - pixels.round()).abs() >= margin).all(-1, keepdim=True)
