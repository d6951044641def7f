"""The detection losses' pieces that the one-to-one criterion (models/criterion.py) and mixed supervision
(models/one_to_many.py) share: the focal classification loss of every query, and the GIoU of paired boxes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.ops import sigmoid_focal_loss


def classification_loss(logits: torch.Tensor, classes: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """(G,) sigmoid focal loss of G stacked predictions' logits (G, B, Q, K) against each query's class ``classes``
    (G, B, Q) int64, K for none (all-zero targets), before the division by the target count. As the original: mean
    over queries, sum over the rest, times Q."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        # The loss sums B*Q*K small terms; accumulate them in fp32 (the gradient flows through the cast).
        logits = logits.float()
    K, Q = logits.shape[-1], logits.shape[2]
    onehot = F.one_hot(classes, K + 1)[..., :K].to(logits.dtype)  # (G, B, Q, K)
    focal = sigmoid_focal_loss(logits, onehot, alpha=alpha, gamma=2.0, reduction="none")
    return focal.mean(2).sum((1, 2)) * Q


def paired_generalized_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GIoU of each box of ``a`` (..., 4) with the box of ``b`` (..., 4) at the same place, xyxy: the diagonal of
    torchvision's pairwise generalized_box_iou, computed by the same operations (no eps, as the original's loss)
    without the pairwise matrix."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    inter_wh = (torch.min(a[..., 2:], b[..., 2:]) - torch.max(a[..., :2], b[..., :2])).clamp(min=0)
    inter = inter_wh[..., 0] * inter_wh[..., 1]
    union = area_a + area_b - inter
    hull_wh = (torch.max(a[..., 2:], b[..., 2:]) - torch.min(a[..., :2], b[..., :2])).clamp(min=0)
    hull = hull_wh[..., 0] * hull_wh[..., 1]
    return inter / union - (hull - union) / hull


def paired_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of boxes ``a`` (..., 4) and ``b`` (..., 4), xyxy, broadcast against each other."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    inter_wh = (torch.min(a[..., 2:], b[..., 2:]) - torch.max(a[..., :2], b[..., :2])).clamp(min=0)
    inter = inter_wh[..., 0] * inter_wh[..., 1]
    return inter / (area_a + area_b - inter)
