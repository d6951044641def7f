"""One-to-many supervision while training (``model.one_to_many``), in one place: its setting, the parts of the model
only training uses, and mixed supervision's assignment and losses. The model at inference is the one-to-one model.

hybrid (H-DETR, Jia et al., CVPR 2023): ``num_queries_one2many`` extra queries, decoded beside the one-to-one
    queries by the same layers and heads, and matched one-to-one (the criterion's Hungarian matcher) to each image's
    targets repeated ``k_one2many`` times. Training-only: the extra queries' embeddings (``query_embed_one2many``).
mixed (MS-DETR, Zhao et al., CVPR 2024): the model's own queries are also supervised one-to-many, with no extra
    query: each target gets up to ``k_one2many`` of them by the quality of their predictions (``assign_one_to_many``),
    no Hungarian solve. Where the outputs come from depends on the decoder's order (``model.cross_attention_first``):
    cross-attention first (MS-DETR's main implementation): each decoder layer's cross-attention output, through a
        training-only FFN of its own (``AuxiliaryFFN``, ``aux_ffn``), read by the layer's shared class and box heads;
    the original order (MS-DETR's implementation (a)): each layer's output, through training-only class heads
        (``class_embed_one2many``, copies of the class heads at initialization), the boxes being the one-to-one ones.

Dimensions, named once: G stacked decoder layers, B images, Q queries, K classes, T targets per image (padded),
k the pairs kept per target.
"""

from __future__ import annotations

import re
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_convert

from models.losses import classification_loss, paired_box_iou, paired_generalized_box_iou


class OneToMany(StrEnum):
    none = "none"
    hybrid = "hybrid"
    mixed = "mixed"


# The parameters only training uses: the model for inference has none of them, and a checkpoint's are left out when
# it loads into one (engine/checkpoint/contents.py). Names under the detector.
TRAINING_ONLY = re.compile(
    r"^(query_embed_one2many|class_embed_one2many\.\d+|transformer\.decoder\.layers\.\d+\.aux_ffn)\."
)


def is_training_only(name: str) -> bool:
    """Whether the detector's parameter ``name`` exists for one-to-many supervision alone."""
    return TRAINING_ONLY.match(name) is not None


class AuxiliaryFFN(nn.Module):
    """Mixed supervision's FFN on a decoder layer's cross-attention output (MS-DETR's main implementation): post-norm,
    the shape of the layer's own FFN. (N, Q, C) -> (N, Q, C)."""

    def __init__(self, *, d_model: int, d_ffn: int, dropout: float):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.dropout1 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout2 = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tgt: torch.Tensor) -> torch.Tensor:
        return self.norm(tgt + self.dropout2(self.linear2(self.dropout1(F.relu(self.linear1(tgt))))))


# -- mixed supervision's assignment ----------------------------------------------------------------------------------
# MS-DETR's (its Stage2Assigner): a prediction's quality for a target mixes their IoU with the predicted probability
# of the target's class; a query whose best quality reaches the threshold is a positive of that target, as is each
# target's best query; a target keeps up to k of the queries of best quality for it, as many as it has positives.
QUALITY_IOU_WEIGHT = 0.7  # quality = 0.7 IoU + 0.3 probability
QUALITY_THRESHOLD = 0.4
# At most this share of an image's queries are positives: MS-DETR keeps a random subset of them, this the best.
MAX_POSITIVE_SHARE = 0.25


def assign_one_to_many(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    labels: torch.Tensor,
    target_boxes: torch.Tensor,
    real: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixed supervision's pairs of G stacked layers' predictions, in batched tensor ops on their device: nothing is
    read back to the host, no size depends on the values.

    logits (G, B, Q, K), boxes (G, B, Q, 4) normalized cxcywh (read without gradient); labels (B, T) int64,
    target_boxes (B, T, 4) cxcywh, real (B, T) bool: each image's targets, padded to T (T >= 1) with real False.
    -> (queries (G, B, T, k') int64, paired (G, B, T, k') bool, quality (G, B, T, k')), k' = min(k, Q): target t's
    pairs are its paired queries, best quality first.
    """
    G, B, Q, _ = logits.shape
    T = labels.shape[1]
    k = min(k, Q)
    with torch.no_grad():
        probability = logits.detach().float().sigmoid()  # (G, B, Q, K)
        index = labels.clamp(min=0)[None, :, None, :].expand(G, B, Q, T)
        class_probability = probability.gather(3, index).transpose(2, 3)  # (G, B, T, Q)
        predicted = box_convert(boxes.detach().float(), "cxcywh", "xyxy")[:, :, None]  # (G, B, 1, Q, 4)
        wanted = box_convert(target_boxes.float(), "cxcywh", "xyxy")[None, :, :, None]  # (1, B, T, 1, 4)
        iou = paired_box_iou(wanted, predicted)  # (G, B, T, Q)
        quality = QUALITY_IOU_WEIGHT * iou + (1 - QUALITY_IOU_WEIGHT) * class_probability  # (G, B, T, Q) in [0, 1]
        quality = quality.masked_fill(~real[None, :, :, None], -1.0)  # padding targets are nobody's

        best, best_target = quality.max(2)  # (G, B, Q): each query's best target
        positive = best >= QUALITY_THRESHOLD
        # Each real target's best query is a positive too (of its own best target, which may be another).
        forced = quality.argmax(3).masked_fill(~real[None], Q)  # (G, B, T); padding -> an extra column
        positive = torch.cat([positive, positive.new_zeros(G, B, 1)], 2).scatter(2, forced, True)[..., :Q]
        # The best positives, MAX_POSITIVE_SHARE of the queries at most. Stable sorts: of equal qualities, the
        # lower query comes first, on any device.
        cap = max(1, int(MAX_POSITIVE_SHARE * Q))
        ranked, order = torch.where(positive, best, -2.0).sort(dim=2, descending=True, stable=True)
        kept = torch.zeros_like(positive).scatter(2, order[..., :cap], ranked[..., :cap] > -2.0)  # (G, B, Q)
        # A target gets as many pairs as it has positives (at most k): its queries of best quality, positives or not.
        counts = (F.one_hot(best_target, T).bool() & kept[..., None]).sum(2)  # (G, B, T)
        values, queries = quality.sort(dim=3, descending=True, stable=True)
        values, queries = values[..., :k], queries[..., :k]  # (G, B, T, k), best first
        rank = torch.arange(k, device=logits.device)
        paired = (rank < counts[..., None]) & real[None, :, :, None]
    return queries, paired, values


def one_to_many_losses(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    labels: torch.Tensor,
    target_boxes: torch.Tensor,
    real: torch.Tensor,
    *,
    k: int,
    focal_alpha: float,
) -> dict[str, torch.Tensor]:
    """Mixed supervision's losses of G stacked layers, {"loss_ce", "loss_bbox", "loss_giou"} each (G,), before the
    division by the batch's target count (as the one-to-one losses). Inputs as assign_one_to_many takes them.

    Classification: the focal loss of every query against its class where it is paired (its pair of best quality's,
    the lowest target of equal ones), else none, as the one-to-one loss sums it. Boxes: L1 on normalized cxcywh and
    1 - GIoU of every pair (a query paired with two targets counts twice, as in MS-DETR)."""
    G, B, Q, K = logits.shape
    T = labels.shape[1]
    queries, paired, quality = assign_one_to_many(logits, boxes, labels, target_boxes, real, k)
    kk = queries.shape[3]
    with torch.no_grad():
        # Each query's pair of best quality, then the lowest target among equals: two order-free reductions.
        score = torch.where(paired, quality, -1.0).flatten(2)  # (G, B, T * k)
        slots = queries.flatten(2)  # the query of each pair
        best = torch.full((G, B, Q), -1.0, device=logits.device).scatter_reduce(2, slots, score, "amax")
        targets = torch.arange(T, device=logits.device).repeat_interleave(kk).expand(G, B, -1)  # (G, B, T * k)
        is_best = (score >= 0) & (score == best.gather(2, slots))
        winner = torch.full((G, B, Q), T, device=logits.device, dtype=torch.int64).scatter_reduce(
            2, slots, torch.where(is_best, targets, T), "amin"
        )  # (G, B, Q): T where unpaired
        padded_labels = torch.cat([labels, labels.new_full((B, 1), K)], 1)  # (B, T + 1): T -> no class
        classes = padded_labels[None].expand(G, B, T + 1).gather(2, winner)  # (G, B, Q)
    loss_ce = classification_loss(logits, classes, alpha=focal_alpha)

    chosen = boxes.gather(2, slots[..., None].expand(G, B, T * kk, 4)).view(G, B, T, kk, 4)
    chosen = chosen.float() if chosen.dtype in (torch.float16, torch.bfloat16) else chosen
    wanted = target_boxes.to(chosen.dtype)[None, :, :, None].expand_as(chosen)  # (G, B, T, k, 4)
    # A padding pair reads a real box against a padding target's box and counts 0: its gradient is 0 too.
    l1 = (chosen - wanted).abs().sum(-1)  # (G, B, T, k)
    giou = paired_generalized_box_iou(box_convert(chosen, "cxcywh", "xyxy"), box_convert(wanted, "cxcywh", "xyxy"))
    weight = paired.to(chosen.dtype)
    return {
        "loss_ce": loss_ce,
        "loss_bbox": (l1 * weight).sum((1, 2, 3)),
        "loss_giou": ((1 - giou) * weight).sum((1, 2, 3)),
    }
