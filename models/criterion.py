"""Deformable DETR set criterion (losses) and build_criterion, the config adapter.

Losses follow the published Deformable DETR: sigmoid focal classification loss, L1 and GIoU box
losses normalized by the number of target boxes (averaged over processes), and the same losses on
every auxiliary decoder output (suffix _0.._{dec_layers-2}) and, in two-stage mode, on the encoder
proposals with class-agnostic targets (suffix _enc).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou, sigmoid_focal_loss

from models.matcher import HungarianMatcher
from models.model_config import read_criterion_config, resolved_num_classes
from models.postprocess import PostProcess

_KNOWN_LOSSES = ("labels", "boxes", "cardinality")


class SetCriterion(nn.Module):
    """Hungarian-matched detection losses.

    forward(outputs, targets) -> dict of UNWEIGHTED scalar losses; multiply by weight_dict[k] and sum
    over the keys present in weight_dict to get the training loss.
      outputs: "pred_logits" (B, Q, K) logits, "pred_boxes" (B, Q, 4) normalized cxcywh,
               optional "aux_outputs" (list of dicts with the same two keys) and "enc_outputs" (dict).
      targets: per image {"labels": (n_i,) int64 in [0, K), "boxes": (n_i, 4) normalized cxcywh};
               other keys are ignored.
    Keys: loss_ce, class_error (logged only), loss_bbox, loss_giou, cardinality_error (logged only);
    loss_ce_i, loss_bbox_i, loss_giou_i, cardinality_error_i per aux output; the same with _enc.
    """

    def __init__(
        self,
        *,
        num_classes: int,
        matcher: nn.Module,
        weight_dict: dict[str, float],
        losses: tuple[str, ...] = ("labels", "boxes", "cardinality"),
        focal_alpha: float = 0.25,
    ):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"SetCriterion: num_classes must be >= 1, got {num_classes!r}")
        unknown = [name for name in losses if name not in _KNOWN_LOSSES]
        if unknown:
            raise ValueError(f"SetCriterion: unknown losses {unknown}; expected a subset of {_KNOWN_LOSSES}")
        # torchvision's convention (as the original): alpha in [0, 1], or -1 to disable the weighting.
        if not (0.0 <= focal_alpha <= 1.0 or focal_alpha == -1):
            raise ValueError(f"SetCriterion: focal_alpha must be in [0, 1] or -1, got {focal_alpha!r}")
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.losses = tuple(losses)
        self.focal_alpha = focal_alpha

    # -- individual losses: (outputs, targets, indices, num_boxes) -> dict --------------------------

    def loss_labels(self, outputs, targets, indices, num_boxes, log=True):
        """Sigmoid focal loss over all B*Q*K logits; unmatched queries have all-zero targets."""
        src_logits = outputs["pred_logits"]  # (B, Q, K)
        if src_logits.dtype in (torch.float16, torch.bfloat16):
            # The loss sums B*Q*K small terms; accumulate them in fp32 (the gradient flows through the cast).
            src_logits = src_logits.float()
        B, Q, K = src_logits.shape
        batch_idx, src_idx = _src_permutation_idx(indices)
        target_classes_o = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)]).to(
            src_logits.device, torch.int64
        )
        # Index K is the "no object" class: its one-hot column is dropped below, leaving zeros.
        target_classes = torch.full((B, Q), K, dtype=torch.int64, device=src_logits.device)  # (B, Q)
        target_classes[batch_idx, src_idx] = target_classes_o
        onehot = torch.zeros((B, Q, K + 1), dtype=src_logits.dtype, device=src_logits.device)  # (B, Q, K+1)
        onehot.scatter_(2, target_classes.unsqueeze(-1), 1)
        onehot = onehot[:, :, :-1]  # (B, Q, K)

        focal = sigmoid_focal_loss(src_logits, onehot, alpha=self.focal_alpha, gamma=2.0, reduction="none")
        # The original normalizes as mean over queries, sum over the rest, / num_boxes, then * Q.
        loss_ce = focal.mean(1).sum() / num_boxes * Q
        losses = {"loss_ce": loss_ce}
        if log:
            losses["class_error"] = 100 - _top1_accuracy(src_logits[batch_idx, src_idx], target_classes_o)
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes):
        """|#queries whose argmax is not the last class - #targets|, averaged over images.

        Logged only, no gradient. Kept exactly as the original computes it (a DETR carry-over that
        treats the last logit as "no object"), so logged numbers compare with published logs.
        """
        pred_logits = outputs["pred_logits"]  # (B, Q, K)
        tgt_lengths = torch.as_tensor([len(t["labels"]) for t in targets], device=pred_logits.device)  # (B,)
        card_pred = (pred_logits.argmax(-1) != pred_logits.shape[-1] - 1).sum(1)  # (B,)
        return {"cardinality_error": F.l1_loss(card_pred.float(), tgt_lengths.float())}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        """L1 on normalized cxcywh and 1 - GIoU on xyxy, over matched pairs, each / num_boxes."""
        batch_idx, src_idx = _src_permutation_idx(indices)
        src_boxes = outputs["pred_boxes"][batch_idx, src_idx]  # (M, 4)
        if src_boxes.dtype in (torch.float16, torch.bfloat16):
            src_boxes = src_boxes.float()
        target_boxes = torch.cat([t["boxes"][J] for t, (_, J) in zip(targets, indices)]).to(
            src_boxes.device, src_boxes.dtype
        )  # (M, 4)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none")
        # diag of the pairwise matrix (no eps), as the original; torchvision's generalized_box_iou_loss
        # adds eps terms that change the numbers slightly.
        giou = torch.diag(
            generalized_box_iou(box_convert(src_boxes, "cxcywh", "xyxy"), box_convert(target_boxes, "cxcywh", "xyxy"))
        )  # (M,)
        return {"loss_bbox": loss_bbox.sum() / num_boxes, "loss_giou": (1 - giou).sum() / num_boxes}

    def get_loss(self, loss, outputs, targets, indices, num_boxes, **kwargs):
        fn = {"labels": self.loss_labels, "boxes": self.loss_boxes, "cardinality": self.loss_cardinality}[loss]
        return fn(outputs, targets, indices, num_boxes, **kwargs)

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, outputs: dict, targets: list[dict]) -> dict[str, torch.Tensor]:
        main_outputs = {k: v for k, v in outputs.items() if k not in ("aux_outputs", "enc_outputs")}
        device = outputs["pred_logits"].device
        num_boxes = _num_boxes(targets, device)

        losses = {}
        indices = self.matcher(main_outputs, targets)
        for loss in self.losses:
            losses.update(self.get_loss(loss, main_outputs, targets, indices, num_boxes))

        for i, aux_outputs in enumerate(outputs.get("aux_outputs", [])):
            indices = self.matcher(aux_outputs, targets)
            losses.update(self._suffixed(aux_outputs, targets, indices, num_boxes, f"_{i}"))

        if "enc_outputs" in outputs:
            enc_outputs = outputs["enc_outputs"]
            # Encoder proposals are class-agnostic: every target is class 0 (the original's bin_targets).
            bin_targets = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]
            indices = self.matcher(enc_outputs, bin_targets)
            losses.update(self._suffixed(enc_outputs, bin_targets, indices, num_boxes, "_enc"))
        return losses

    def _suffixed(self, outputs, targets, indices, num_boxes, suffix):
        out = {}
        for loss in self.losses:
            # class_error is logged for the final layer only.
            kwargs = {"log": False} if loss == "labels" else {}
            out.update({k + suffix: v for k, v in self.get_loss(loss, outputs, targets, indices, num_boxes, **kwargs).items()})
        return out


def _src_permutation_idx(indices):
    """(batch_idx, query_idx) int64 tensors addressing the matched predictions in (B, Q, ...)."""
    batch_idx = torch.cat([torch.full_like(src, b) for b, (src, _) in enumerate(indices)])
    src_idx = torch.cat([src for src, _ in indices])
    return batch_idx, src_idx


@torch.no_grad()
def _top1_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Percentage of rows whose argmax equals the label; 0 when there are no rows (as the original)."""
    if labels.numel() == 0:
        return torch.zeros([], device=logits.device)
    return (logits.argmax(-1) == labels).float().mean() * 100


def _num_boxes(targets: list[dict], device) -> float:
    """Total target boxes, averaged over processes, at least 1: the normalizer of every box loss."""
    num_boxes = torch.as_tensor([float(sum(len(t["labels"]) for t in targets))], device=device)
    world_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(num_boxes)
        world_size = torch.distributed.get_world_size()
    return torch.clamp(num_boxes / world_size, min=1).item()


# -- config adapter -----------------------------------------------------------------------------------

def build_criterion(cfg) -> tuple[SetCriterion, PostProcess]:
    """Build (SetCriterion, PostProcess) from the model config (DictConfig or mapping).

    Reads num_classes, dec_layers, aux_loss, two_stage, set_cost_{class,bbox,giou},
    {cls,bbox,giou}_loss_coef, focal_alpha, checked by models/model_config.py (CriterionConfig).
    weight_dict holds loss_ce/loss_bbox/loss_giou, copies suffixed _0.._{dec_layers-2} when aux_loss,
    and _enc copies when two_stage.
    """
    c = read_criterion_config(cfg)
    num_classes, dec_layers = resolved_num_classes(c), c.dec_layers

    # The original matcher hard-codes alpha=0.25, gamma=2 (HungarianMatcher's defaults); focal_alpha
    # from the config weights the loss only.
    matcher = HungarianMatcher(
        cost_class=float(c.set_cost_class), cost_bbox=float(c.set_cost_bbox), cost_giou=float(c.set_cost_giou)
    )
    base = {"loss_ce": float(c.cls_loss_coef), "loss_bbox": float(c.bbox_loss_coef), "loss_giou": float(c.giou_loss_coef)}
    weight_dict = dict(base)
    if c.aux_loss:
        for i in range(dec_layers - 1):
            weight_dict.update({k + f"_{i}": v for k, v in base.items()})
    if c.two_stage:
        weight_dict.update({k + "_enc": v for k, v in base.items()})
    criterion = SetCriterion(
        num_classes=num_classes, matcher=matcher, weight_dict=weight_dict, focal_alpha=float(c.focal_alpha)
    )
    return criterion, PostProcess()
