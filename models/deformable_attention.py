"""MSDeformAttn: the multi-scale deformable attention module, its projections and initialization.

Dimensions, named once: N batch, Lq queries, S flattened value positions (sum of H_l * W_l), C d_model,
M heads, D = C // M channels per head, L levels, P sampling points per level and head.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import msda
from models.fused import fused
from models.host_copy import to_device_async
from msda import IMPLS


def level_sizes_xy(levels, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(L, 2) tensor of (W_l, H_l) made from host ints, with no device sync (models.host_copy).

    Eagerly, one tensor per sizes, dtype and device, made at its first use and then reused: a CUDA graph
    recorded over this (engine/compile/cuda_graphs.py) reads it at every replay, where a fresh host copy would be
    recorded as a read of a host buffer that is later freed. Under torch.compile it is part of the graph.
    """
    if torch.compiler.is_compiling():
        # Built from scalars: traced with symbolic sizes, torch.tensor becomes a call that AOTAutograd refuses to
        # cache, and every run compiled the transformer's graph from scratch, however warm its cache.
        return torch.stack(
            [
                torch.stack(
                    [
                        torch.scalar_tensor(w, dtype=dtype, device=device),
                        torch.scalar_tensor(h, dtype=dtype, device=device),
                    ]
                )
                for h, w in levels
            ]
        )
    return _cached_level_sizes_xy(tuple(tuple(hw) for hw in levels), dtype, device)


@functools.lru_cache(maxsize=256)
def _cached_level_sizes_xy(levels: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # usable in training even when first made under inference_mode
        return to_device_async(torch.tensor([[w, h] for h, w in levels], dtype=dtype), device)


class MSDeformAttn(nn.Module):
    """Each query reads P points per head and level around its reference point and mixes them.

    The attention itself is ``msda.multi_scale_deformable_attention`` through ``msda`` ("auto" | "triton" |
    "pytorch"); it follows ``torch.use_deterministic_algorithms`` for a deterministic backward. Sampling locations
    are computed in float32 with autocast off: in bf16 a location on a 167-wide level is off by up to a pixel.

    On CUDA, outside torch.compile (models/fused/policy.py), two pieces run fused: the sampling offsets and the
    attention logits, which both project the query, come from one float32 matmul over the two layers' weights side by
    side (the logits then in float32 too, where autocast made them bf16: one read of the query instead of two and no
    bf16 copy of it, for a third of the matmul on TF32 rather than bf16 tensor cores); and the logits go to the
    attention op unsoftmaxed, whose kernels softmax them as they read them (msda's weights_are_logits). Parameters
    stay the two nn.Linear layers, so checkpoints load unchanged. Elsewhere the unfused ops run as they always did.
    """

    def __init__(
        self, *, d_model: int = 256, n_levels: int = 4, nheads: int = 8, n_points: int = 4, msda: str = "auto"
    ):
        super().__init__()
        if d_model % nheads != 0:
            raise ValueError(f"d_model must be divisible by nheads, got d_model={d_model}, nheads={nheads}")
        if msda not in IMPLS:
            raise ValueError(f"msda must be one of {IMPLS}, got {msda!r}")
        self.d_model = d_model
        self.n_levels = n_levels
        self.nheads = nheads
        self.n_points = n_points
        self.msda = msda

        self.sampling_offsets = nn.Linear(d_model, nheads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, nheads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Offsets start as a fixed pattern: head h points along angle 2*pi*h/M, point p at distance p+1
        (in units of the level's pixels), so heads look in different directions before any training."""
        M, L, P = self.nheads, self.n_levels, self.n_points
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        thetas = torch.arange(M, dtype=torch.float32) * (2.0 * math.pi / M)
        grid_init = torch.stack([thetas.cos(), thetas.sin()], -1)  # (M, 2)
        # Normalize so the larger of |cos|, |sin| is 1: the first point lands on a neighbouring pixel.
        grid_init = (grid_init / grid_init.abs().max(-1, keepdim=True)[0]).view(M, 1, 1, 2).repeat(1, L, P, 1)
        for i in range(P):
            grid_init[:, :, i, :] *= i + 1
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid_init.view(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def forward(
        self,
        query: torch.Tensor,
        reference_points: torch.Tensor,
        input_flatten: torch.Tensor,
        input_spatial_shapes,
        input_level_start_index: torch.Tensor | None = None,
        input_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        query                  (N, Lq, C)    query features (with position embedding added)
        reference_points       (N, Lq, L, 2) normalized (x, y) per level, or (N, Lq, L, 4) boxes (cx, cy, w, h)
        input_flatten          (N, S, C)     the values, all levels flattened
        input_spatial_shapes   ((H_l, W_l), ...) host ints, as the model passes them; an (L, 2) int64
                                             tensor is accepted too (read on the host once per tensor)
        input_level_start_index (L,) int64 or None (checked when given; the layout implies it)
        input_padding_mask     (N, S) bool   True on padding, or None
        returns                (N, Lq, C)
        """
        N, Lq, _ = query.shape
        _, S, _ = input_flatten.shape
        M, L, P = self.nheads, self.n_levels, self.n_points
        D = self.d_model // M
        levels = msda.as_levels(input_spatial_shapes)
        if len(levels) != L:
            raise ValueError(f"MSDeformAttn built for {L} levels got spatial shapes of {len(levels)}: {levels}")

        value = self.value_proj(input_flatten)  # (N, S, C)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, S, M, D)  # (N, S, M, D)

        if fused("projections", query):
            sampling_offsets, attention_weights = self._offsets_and_logits(query)  # float32 both
        else:
            sampling_offsets, attention_weights = None, self.attention_weights(query)
        softmax_in_op = fused("softmax", query)
        attention_weights = attention_weights.view(N, Lq, M, L * P)
        if not softmax_in_op:
            attention_weights = F.softmax(attention_weights, -1)
        attention_weights = attention_weights.view(N, Lq, M, L, P)  # (N, Lq, M, L, P) weights, or their logits

        with torch.autocast(device_type=query.device.type, enabled=False):
            # float32 offsets and locations even under autocast (see the class docstring).
            dtype = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64 (gradcheck)
            if sampling_offsets is None:
                lin = self.sampling_offsets
                sampling_offsets = F.linear(query.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype))
            sampling_offsets = sampling_offsets.view(N, Lq, M, L, P, 2)  # (N, Lq, M, L, P, 2)
            reference_points = reference_points.to(dtype)
            if reference_points.shape[-1] == 2:
                # Offsets are in pixels of each level: divide by (W_l, H_l).
                offset_normalizer = level_sizes_xy(levels, dtype=dtype, device=query.device)  # (L, 2)
                sampling_locations = (
                    reference_points[:, :, None, :, None, :]
                    + sampling_offsets / offset_normalizer[None, None, None, :, None, :]
                )
            elif reference_points.shape[-1] == 4:
                # Offsets are relative to the reference box: half its size reached at the last point.
                sampling_locations = (
                    reference_points[:, :, None, :, None, :2]
                    + sampling_offsets / P * reference_points[:, :, None, :, None, 2:] * 0.5
                )
            else:
                raise ValueError(
                    f"reference_points must end in 2 (points) or 4 (boxes), got shape {tuple(reference_points.shape)}"
                )
            # (N, Lq, M, L, P, 2) float32

        if attention_weights.dtype != value.dtype:
            # msda takes float32 weights with low-precision values, but not the other way round.
            attention_weights = attention_weights.float()
        logits = {"weights_are_logits": True} if softmax_in_op else {}
        output = msda.multi_scale_deformable_attention(
            value, levels, input_level_start_index, sampling_locations, attention_weights, impl=self.msda, **logits
        )  # (N, Lq, C)
        return self.output_proj(output)

    def _offsets_and_logits(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampling offsets (N, Lq, M*L*P*2), attention logits (N, Lq, M*L*P)) from one matmul of the query over
        both layers' weights, in float32 (float64 for a float64 query) with autocast off, as the offsets always are.
        Both are views of the one product."""
        offsets, logits = self.sampling_offsets, self.attention_weights
        with torch.autocast(device_type=query.device.type, enabled=False):
            dtype = torch.promote_types(query.dtype, torch.float32)
            weight = torch.cat([offsets.weight, logits.weight]).to(dtype)  # (M*L*P*3, C)
            bias = torch.cat([offsets.bias, logits.bias]).to(dtype)
            projected = F.linear(query.to(dtype), weight, bias)  # (N, Lq, M*L*P*3)
        return projected.split([offsets.out_features, logits.out_features], -1)
