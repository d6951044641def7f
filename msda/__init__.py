"""Multi-scale deformable attention with Triton forward and backward kernels (``import msda``)."""

from .ops import (
    IMPLS,
    MultiScaleDeformableAttentionFunction,
    level_start_index_from_shapes,
    multi_scale_deformable_attention,
)
from .reference import multi_scale_deformable_attention_reference

__all__ = [
    "IMPLS",
    "MultiScaleDeformableAttentionFunction",
    "level_start_index_from_shapes",
    "multi_scale_deformable_attention",
    "multi_scale_deformable_attention_reference",
]
