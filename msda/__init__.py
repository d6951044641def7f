"""Multi-scale deformable attention with Triton forward and backward kernels (``import msda``)."""

from .layout import as_levels, level_start_index_from_shapes
from .logits_op import attention_from_logits_op
from .ops import attention_op, multi_scale_deformable_attention
from .reference import multi_scale_deformable_attention_reference
from .validation import IMPLS

__all__ = [
    "IMPLS",
    "as_levels",
    "attention_from_logits_op",
    "attention_op",
    "level_start_index_from_shapes",
    "multi_scale_deformable_attention",
    "multi_scale_deformable_attention_reference",
]
