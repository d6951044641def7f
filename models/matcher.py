"""Hungarian matcher between Deformable DETR predictions and ground-truth boxes.

Each image's queries are assigned one-to-one to its targets by minimising a cost that mixes a
focal-style classification cost, the L1 distance between boxes and the negative generalized IoU,
exactly as in the published Deformable DETR. Queries left unassigned are "no object".
"""
from __future__ import annotations

import math

import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou


class HungarianMatcher(nn.Module):
    """One-to-one assignment of queries to targets, per image.

    Cost for query q and target t (the published formula; prob = sigmoid(logit) of t's class):
        pos = alpha * (1 - prob)**gamma * -log(prob + 1e-8)
        neg = (1 - alpha) * prob**gamma * -log(1 - prob + 1e-8)
        C = cost_class * (pos - neg) + cost_bbox * |box_q - box_t|_1 + cost_giou * -GIoU(box_q, box_t)
    The L1 term is on normalized cxcywh boxes; GIoU on the same boxes converted to xyxy.

    The original hard-codes alpha=0.25, gamma=2 in the matcher (independently of the loss's alpha);
    those are the defaults here.
    """

    def __init__(
        self,
        *,
        cost_class: float = 2.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ):
        super().__init__()
        for name, value in (("cost_class", cost_class), ("cost_bbox", cost_bbox), ("cost_giou", cost_giou)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"HungarianMatcher: {name} must be a finite number >= 0, got {value!r}")
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: cost_class, cost_bbox and cost_giou are all 0; nothing to match on")
        if not 0.0 <= focal_alpha <= 1.0:
            raise ValueError(f"HungarianMatcher: focal_alpha must be in [0, 1], got {focal_alpha!r}")
        if not math.isfinite(focal_gamma) or focal_gamma < 0:
            raise ValueError(f"HungarianMatcher: focal_gamma must be a finite number >= 0, got {focal_gamma!r}")
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou
        self.focal_alpha = focal_alpha
        self.focal_gamma = focal_gamma

    def cost_matrix(self, outputs: dict, targets: list[dict]) -> torch.Tensor:
        """Full cost matrix (B*Q, T) where T is the total number of targets in the batch.

        outputs: "pred_logits" (B, Q, K) raw logits, "pred_boxes" (B, Q, 4) normalized cxcywh.
        targets: per image {"labels": (n_i,) int64 in [0, K), "boxes": (n_i, 4) normalized cxcywh}.
        Columns are the targets of image 0, then image 1, ... Rows are image-major queries.
        """
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        if logits.dtype in (torch.float16, torch.bfloat16):
            # Costs of nearby queries differ by less than a bf16 ulp; match in fp32.
            logits, boxes = logits.float(), boxes.float()
        out_prob = logits.flatten(0, 1).sigmoid()  # (B*Q, K)
        out_bbox = boxes.flatten(0, 1)  # (B*Q, 4)
        tgt_ids = torch.cat([t["labels"] for t in targets]).to(device=logits.device, dtype=torch.int64)  # (T,)
        tgt_bbox = torch.cat([t["boxes"] for t in targets]).to(device=boxes.device, dtype=out_bbox.dtype)  # (T, 4)

        alpha, gamma = self.focal_alpha, self.focal_gamma
        neg_cost = (1 - alpha) * (out_prob**gamma) * (-(1 - out_prob + 1e-8).log())  # (B*Q, K)
        pos_cost = alpha * ((1 - out_prob) ** gamma) * (-(out_prob + 1e-8).log())  # (B*Q, K)
        cost_class = pos_cost[:, tgt_ids] - neg_cost[:, tgt_ids]  # (B*Q, T)

        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)  # (B*Q, T)
        cost_giou = -generalized_box_iou(
            box_convert(out_bbox, "cxcywh", "xyxy"), box_convert(tgt_bbox, "cxcywh", "xyxy")
        )  # (B*Q, T)
        return self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Match each image's queries to its targets.

        Returns one (index_i, index_j) pair per image, both int64 CPU tensors of length
        min(Q, n_i): prediction index_i[k] is assigned to target index_j[k]. Images without
        targets get two empty tensors. Other keys in outputs/targets are ignored.
        """
        logits = outputs["pred_logits"]
        B, Q = logits.shape[:2]
        if len(targets) != B:
            raise ValueError(f"HungarianMatcher: got {len(targets)} target dicts for a batch of {B} images")
        sizes = [len(t["boxes"]) for t in targets]
        if sum(sizes) == 0:
            # Nothing to assign; skip the cost computation (cat of empty lists, cdist of empty sets).
            empty = torch.empty(0, dtype=torch.int64)
            return [(empty, empty) for _ in targets]

        # linear_sum_assignment needs float64-compatible numbers on the host.
        C = self.cost_matrix(outputs, targets).view(B, Q, -1).float().cpu()  # (B, Q, T)
        if not torch.isfinite(C).all():
            raise ValueError(
                "HungarianMatcher: the cost matrix has NaN/inf entries; check pred_logits/pred_boxes for "
                "non-finite values"
            )
        indices = []
        for b, c in enumerate(C.split(sizes, dim=-1)):
            rows, cols = linear_sum_assignment(c[b].numpy())
            indices.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return indices
