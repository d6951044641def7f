"""Turn Deformable DETR outputs into per-image detections in absolute pixel coordinates."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.ops import box_convert


class PostProcess(nn.Module):
    """Top-k (query, class) pairs per image, as the published Deformable DETR (k = 100).

    forward(outputs, target_sizes) -> [{"scores": (k,), "labels": (k,) int64, "boxes": (k, 4)}] per image
      outputs["pred_logits"] (B, Q, K) logits, outputs["pred_boxes"] (B, Q, 4) normalized cxcywh
      target_sizes (B, 2) as (h, w) of the image the boxes should be expressed in
    Scores are sigmoid probabilities, sorted descending; a query can appear once per class. Boxes are
    xyxy in absolute pixels (normalized xyxy scaled by (w, h, w, h)). k = min(num_select, Q*K).
    """

    def __init__(self, *, num_select: int = 100):
        super().__init__()
        if num_select < 1:
            raise ValueError(f"PostProcess: num_select must be >= 1, got {num_select!r}")
        self.num_select = num_select

    @torch.no_grad()
    def forward(self, outputs: dict, target_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        scores, labels, boxes = self.batched(outputs, target_sizes)
        return [{"scores": s, "labels": l, "boxes": b} for s, l, b in zip(scores, labels, boxes)]

    def batched(self, outputs: dict, target_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same detections as (scores (B, k), labels (B, k) int64, boxes (B, k, 4)): no loop over the
        images, so that an exported graph (export.py, postprocess=true) keeps a symbolic batch size."""
        out_logits, out_bbox = outputs["pred_logits"], outputs["pred_boxes"]
        B, Q, K = out_logits.shape
        if target_sizes.shape != (B, 2):
            raise ValueError(
                f"PostProcess: target_sizes must have shape ({B}, 2) as (h, w), got {tuple(target_sizes.shape)}"
            )
        prob = out_logits.sigmoid().view(B, Q * K)  # (B, Q*K)
        k = min(self.num_select, Q * K)
        scores, topk_indexes = torch.topk(prob, k, dim=1)  # (B, k)
        # Flattened index = query * K + class.
        topk_queries = topk_indexes // K  # (B, k)
        labels = topk_indexes % K  # (B, k)

        if out_bbox.dtype in (torch.float16, torch.bfloat16):
            # Pixel coordinates up to ~1333 are not exact in 8-bit mantissas (1333 -> 1336 in bf16).
            out_bbox = out_bbox.float()
        boxes = box_convert(out_bbox, "cxcywh", "xyxy")  # (B, Q, 4)
        boxes = torch.gather(boxes, 1, topk_queries.unsqueeze(-1).expand(-1, -1, 4))  # (B, k, 4)
        img_h, img_w = target_sizes.unbind(1)
        scale = torch.stack([img_w, img_h, img_w, img_h], dim=1).to(boxes)  # (B, 4)
        boxes = boxes * scale[:, None, :]
        return scores, labels, boxes
