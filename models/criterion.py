"""Deformable DETR set criterion (losses) and build_criterion, the config adapter.

Losses follow the published Deformable DETR: sigmoid focal classification loss, L1 and GIoU box
losses normalized by the number of target boxes (averaged over processes), and the same losses on
every auxiliary decoder output (suffix _0.._{dec_layers-2}) and, in two-stage mode, on the encoder
proposals with class-agnostic targets (suffix _enc). With one-to-many supervision (models/one_to_many.py), the
decoder's losses once more on its one-to-many outputs (suffix _one2many after the layer's: loss_ce_one2many,
loss_ce_0_one2many, ...): hybrid matching's extra queries matched to each image's targets repeated k_one2many times,
or mixed supervision's pairs of up to k_one2many queries per target.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import box_convert

from models.compiled_regions import CompiledRegions, Region
from models.host_copy import to_device_async
from models.losses import classification_loss, paired_generalized_box_iou
from models.matcher import PADDING_BOX, HungarianMatcher
from models.model_config import read_criterion_config, resolved_num_classes
from models.one_to_many import OneToMany, one_to_many_losses
from models.postprocess import PostProcess

_KNOWN_LOSSES = ("labels", "boxes", "cardinality")
_PER_BOX = ("loss_ce", "loss_bbox", "loss_giou")  # divided by num_boxes

# What the losses are divided by: a number, a device tensor, or a function giving either (SetCriterion.forward).
NumBoxes = float | torch.Tensor | Callable[[], float | torch.Tensor]


def target_slots(num_targets: int) -> int:
    """Targets (and matched pairs per layer) the losses are padded to for a batch of ``num_targets``: the next
    power of two above it, at least 8, so that at least one padding target exists for the padding pairs to
    point at and a run meets a handful of sizes (engine/compile/cuda_graphs.py records one graph per size)."""
    return max(8, 1 << num_targets.bit_length())


# The suffix of the one-to-many queries' copy of a decoder loss (hybrid matching), after the layer's suffix.
ONE2MANY_SUFFIX = "_one2many"
# The suffix of a per-decoder-layer (loss_ce_0, loss_ce_0_one2many ...) or encoder-proposal (loss_ce_enc) copy of
# a loss. The last layer's one-to-many losses (loss_ce_one2many) are not such a copy: they are reported beside the
# one-to-one ones.
AUX_SUFFIX = re.compile(r"_(\d+|enc)(_one2many)?$")


def combination_over_passes(name: str) -> str:
    """How a loss of this criterion combines over passes that each saw a part of one batch (gradient
    accumulation): "sum" for the losses divided by the batch's box count, "boxes" for class_error (a mean over
    matched boxes), "images" for cardinality_error (a mean over images); their one-to-many copies alike."""
    base = AUX_SUFFIX.sub("", name).removesuffix(ONE2MANY_SUFFIX)
    if base in _PER_BOX:
        return "sum"
    return "boxes" if base == "class_error" else "images"


class SetCriterion(CompiledRegions, nn.Module):
    """Hungarian-matched detection losses.

    forward(outputs, targets) -> dict of UNWEIGHTED scalar losses; multiply by weight_dict[k] and sum
    over the keys present in weight_dict to get the training loss.
      outputs: "pred_logits" (B, Q, K) logits, "pred_boxes" (B, Q, 4) normalized cxcywh,
               optional "aux_outputs" (list of dicts with the same two keys), "enc_outputs" (dict) and
               "one2many_outputs" (a dict with pred_logits (B, Q2, K), pred_boxes and aux_outputs: needs one_to_many).
      targets: per image {"labels": (n_i,) int64 in [0, K), "boxes": (n_i, 4) normalized cxcywh};
               other keys are ignored.
    Keys: loss_ce, class_error (logged only), loss_bbox, loss_giou, cardinality_error (logged only);
    loss_ce_i, loss_bbox_i, loss_giou_i, cardinality_error_i per aux output; the same with _enc; the decoder's
    (all but _enc) with _one2many appended for one2many_outputs.

    one_to_many: "none", "hybrid" or "mixed" (models/one_to_many.py); k_one2many: for hybrid, how many times each
    image's targets are repeated for the one-to-many queries' matching, whose losses are divided by k_one2many times
    num_boxes (the repeated targets' count, as H-DETR divides them); for mixed, the most queries paired with a target,
    whose losses are divided by num_boxes (as MS-DETR's).
    """

    def __init__(
        self,
        *,
        num_classes: int,
        matcher: nn.Module,
        weight_dict: dict[str, float],
        losses: tuple[str, ...] = ("labels", "boxes", "cardinality"),
        focal_alpha: float = 0.25,
        one_to_many: str = "none",
        k_one2many: int = 6,
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
        if not isinstance(k_one2many, int) or k_one2many < 1:
            raise ValueError(f"SetCriterion: k_one2many must be an integer >= 1, got {k_one2many!r}")
        self.one_to_many = OneToMany(str(one_to_many))  # a ValueError naming the choices for another value
        self.k_one2many = k_one2many
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.losses = tuple(losses)
        self.focal_alpha = focal_alpha

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, outputs: dict, targets: list[dict], num_boxes: NumBoxes | None = None) -> dict[str, torch.Tensor]:
        """Unweighted losses (see the class docstring).

        num_boxes normalizes every loss: the number of target boxes per process, at least 1. None counts
        this process's targets; a multi-process trainer passes the average over processes (a device
        tensor, so that no value is read back to the host), or a function giving it, called after the
        matching (so that a collective still running need not finish before the matching's host sync).
        """
        if num_boxes is None:
            num_boxes = max(1.0, float(sum(len(t["labels"]) for t in targets)))
        groups = _prediction_groups(outputs, targets, self.one_to_many, self.k_one2many)
        matches, tgt_lengths = matched(self.matcher, [(g.logits, g.boxes, g.targets, g.repeats) for g in groups])
        if callable(num_boxes):
            num_boxes = num_boxes()
        losses = {}
        for group, group_matches in zip(groups, matches):
            # H-DETR divides the one-to-many losses by the count of the repeated targets.
            group_boxes = num_boxes if group.repeats == 1 else num_boxes * group.repeats
            losses.update(self._group_losses(group, group_matches, tgt_lengths, group_boxes))
        if self.one_to_many == OneToMany.mixed:
            losses.update(self._mixed_losses(outputs["one2many_outputs"], targets, num_boxes))
        return losses

    def _mixed_losses(self, outputs: dict, targets: list[dict], num_boxes) -> dict:
        """Mixed supervision's losses of every decoder layer (models/one_to_many.py), through its region, each
        divided by num_boxes and named with its layer's suffix (_0_one2many, ..., _one2many)."""
        layers = [*outputs.get("aux_outputs", []), outputs]
        suffixes = [f"_{i}{ONE2MANY_SUFFIX}" for i in range(len(layers) - 1)] + [ONE2MANY_SUFFIX]
        logits = torch.stack([o["pred_logits"] for o in layers])  # (G, B, Q, K)
        boxes = torch.stack([o["pred_boxes"] for o in layers])  # (G, B, Q, 4)
        # Each image's targets padded to T (a power of two: a few sizes in a run, one graph each): made on the
        # device from the targets there, no copy of host values.
        T = target_slots(max((len(t["labels"]) for t in targets), default=0))
        device = logits.device
        labels = _padded([t["labels"].to(device, torch.int64) for t in targets], T, 0)  # (B, T)
        tgt_boxes = _padded([t["boxes"].to(device) for t in targets], T, PADDING_BOX)  # (B, T, 4)
        real = _padded([torch.ones(len(t["labels"]), dtype=torch.bool, device=device) for t in targets], T, False)
        sums = self.stacked_mixed_losses(logits, boxes, labels, tgt_boxes, real)
        return {
            name + suffix: value / num_boxes
            for name, values in sums.items()
            for suffix, value in zip(suffixes, values.unbind())
        }

    def stacked_mixed_losses(self, logits, boxes, labels, tgt_boxes, real) -> dict:
        """models.one_to_many.one_to_many_losses with this criterion's k_one2many and focal_alpha: {name: (G,)}."""
        return one_to_many_losses(
            logits, boxes, labels, tgt_boxes, real, k=self.k_one2many, focal_alpha=self.focal_alpha
        )

    def _group_losses(self, group: _Group, m: _Matches, tgt_lengths, num_boxes) -> dict:
        """All losses of G stacked predictions (G, B, Q, ...) at once, named with each layer's suffix, through the
        group's region (``_Group.losses_of``)."""
        logits, suffixes, r = group.logits, group.suffixes, group.repeats
        labels = torch.cat([_repeated(t["labels"], r) for t in group.targets]).to(logits.device, torch.int64)  # (T,)
        tgt_boxes = torch.cat([_repeated(t["boxes"], r) for t in group.targets]).to(logits.device)  # (T, 4)
        padding = m.slots - len(labels)  # padding targets after the real ones (target_slots)
        labels = F.pad(labels, (0, padding))
        tgt_boxes = F.pad(tgt_boxes, (0, 0, 0, padding), value=PADDING_BOX)
        if r != 1:
            tgt_lengths = tgt_lengths * r
        sums = getattr(self, group.losses_of)(
            logits, group.boxes, labels, tgt_boxes, m.layer, m.batch, m.query, m.target, tgt_lengths
        )
        per_layer = {name: values / num_boxes if name in _PER_BOX else values for name, values in sums.items()}
        losses = {
            name + suffix: value
            for name, values in per_layer.items()
            for suffix, value in zip(suffixes, values.unbind())
        }
        if "labels" in self.losses and suffixes[-1] in ("", ONE2MANY_SUFFIX):
            # class_error is logged for the decoder's final layer only; its real matches start its block of pairs.
            g = len(suffixes) - 1
            rows = slice(g * m.slots, g * m.slots + m.per_layer[g])
            losses["class_error" + suffixes[-1]] = 100 - _top1_accuracy(
                logits[g, m.batch[rows], m.query[rows]], labels[m.target[rows]]
            )
        return losses

    def compile_regions(self, *, graphs: bool = False) -> list[Region]:
        """``stacked_losses``, ``stacked_proposal_losses`` and, with one-to-many supervision,
        ``stacked_one2many_losses`` (hybrid) or ``stacked_mixed_losses`` (models/compiled_regions.py): hundreds of
        small launches forward and backward, between the matching and the backward. Compiled by Inductor with
        symbolic sizes, one graph for every number of matched pairs (mixed: padded targets); ``graphs``:
        the eager losses recorded (their forward and backward, engine/compile/cuda_graphs.py). Where the plan uses
        CUDA graphs (reduce-overhead, graphs), they are replayed, one recording per padded number of targets
        (``target_slots``) and, for the two-stage proposals (one per encoder token), per image size too.
        A region per group of predictions, so that the graphs of a group, which replay between the forward and the
        backward of the groups before it, are never another group's own."""
        one_to_many = {OneToMany.none: (), OneToMany.hybrid: ("stacked_one2many_losses",)}
        names = ("stacked_losses", "stacked_proposal_losses") + one_to_many.get(
            self.one_to_many, ("stacked_mixed_losses",)
        )
        if graphs:
            return [Region(name, training=True) for name in names]
        return [Region(name) for name in names]

    def stacked_proposal_losses(self, *args) -> dict:
        """``stacked_losses`` of the two-stage encoder's proposals (G = 1, one proposal per encoder token)."""
        return SetCriterion.stacked_losses(self, *args)

    def stacked_one2many_losses(self, *args) -> dict:
        """``stacked_losses`` of the one-to-many queries (hybrid matching), against the repeated targets."""
        return SetCriterion.stacked_losses(self, *args)

    def stacked_losses(self, logits, boxes, labels, tgt_boxes, layer, batch, query, target, tgt_lengths) -> dict:
        """{name: (G,)} of G stacked layers, before the division by num_boxes (for the names in _PER_BOX).

        Tensors only, no host values and no size that depends on the values, so that engine/compile can compile
        it once for every batch and engine/compile/cuda_graphs.py records it once per padded size. logits
        (G, B, Q, K), boxes (G, B, Q, 4), labels (S,) and tgt_boxes (S, 4), the batch's targets followed by
        padding targets;
        the matched pairs' layer, batch, query and target indices (M,), where a padding pair has query Q and
        a padding target; tgt_lengths (B,), the real targets per image. Padding adds nothing to any loss.
        """
        sums = {}
        if "labels" in self.losses:
            sums["loss_ce"] = self._loss_labels(logits, labels, layer, batch, query, target)
        if "boxes" in self.losses:
            sums.update(_loss_boxes(boxes, tgt_boxes, layer, batch, query, target, num_layers=logits.shape[0]))
        if "cardinality" in self.losses:
            sums["cardinality_error"] = _loss_cardinality(logits, tgt_lengths)
        return sums

    def _loss_labels(self, logits, labels, layer, batch, query, target) -> torch.Tensor:
        """(G,) sigmoid focal loss over all B*Q*K logits per layer, times num_boxes; unmatched queries have
        all-zero targets."""
        G, B, Q, K = logits.shape
        # Index K is the "no object" class. Padding pairs (query Q) write to an extra column, dropped.
        target_classes = torch.full((G, B, Q + 1), K, dtype=torch.int64, device=logits.device)
        target_classes[layer, batch, query] = labels[target]
        return classification_loss(logits, target_classes[..., :Q], alpha=self.focal_alpha)


class _Matches(NamedTuple):
    """The matched (prediction, target) pairs of G stacked layers, as device index tensors (M = G * slots,).

    Each layer has a block of ``slots`` pairs (``target_slots``): its real pairs, then padding pairs
    (query Q, the group's number of predictions per image, and the first padding target); per_layer (host ints)
    says how many real pairs each layer has.
    """

    layer: torch.Tensor
    batch: torch.Tensor
    query: torch.Tensor
    target: torch.Tensor  # index into the batch's targets concatenated image after image, then the padding
    per_layer: list[int]
    slots: int


class _Group(NamedTuple):
    """G stacked predictions matched and scored together, and what they are matched to."""

    suffixes: list[str]  # each layer's loss-name suffix
    logits: torch.Tensor  # (G, B, Q, K)
    boxes: torch.Tensor  # (G, B, Q, 4) normalized cxcywh
    targets: list[dict]  # each image's own
    repeats: int = 1  # each image's targets repeated this many times (the one-to-many queries)
    losses_of: str = "stacked_losses"  # the method (a compiled region of its own) computing their losses


def _prediction_groups(outputs: dict, targets: list[dict], one_to_many: OneToMany, k_one2many: int) -> list[_Group]:
    """What the Hungarian matcher pairs: the decoder layers stacked (aux outputs _0, _1, ..., then the final layer
    ""), the two-stage encoder proposals ("_enc") and, with hybrid matching, the one-to-many queries' decoder layers
    ("_0_one2many", ..., "_one2many")."""
    groups = [_decoder_group(outputs, targets, "")]
    if "enc_outputs" in outputs:
        enc = outputs["enc_outputs"]
        # Encoder proposals are class-agnostic: every target is class 0 (the original's bin_targets).
        bin_targets = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]
        groups.append(
            _Group(
                ["_enc"],
                enc["pred_logits"][None],
                enc["pred_boxes"][None],
                bin_targets,
                losses_of="stacked_proposal_losses",
            )
        )
    if ("one2many_outputs" in outputs) != (one_to_many != OneToMany.none):
        held = "have" if "one2many_outputs" in outputs else "have no"
        raise ValueError(
            f"SetCriterion: the outputs {held} one2many_outputs but the criterion's one_to_many is {one_to_many}: "
            "build the model and the criterion from one config (model.one_to_many)"
        )
    if one_to_many == OneToMany.hybrid:
        # Not the encoder's proposals: H-DETR counts their loss once, with the one-to-one queries'.
        groups.append(
            _decoder_group(outputs["one2many_outputs"], targets, ONE2MANY_SUFFIX)._replace(
                repeats=k_one2many, losses_of="stacked_one2many_losses"
            )
        )
    return groups


def _decoder_group(outputs: dict, targets: list[dict], suffix: str) -> _Group:
    layers = [*outputs.get("aux_outputs", []), outputs]
    suffixes = [f"_{i}{suffix}" for i in range(len(layers) - 1)] + [suffix]
    return _Group(
        suffixes,
        torch.stack([o["pred_logits"] for o in layers]),
        torch.stack([o["pred_boxes"] for o in layers]),
        targets,
    )


def _repeated(values: torch.Tensor, repeats: int) -> torch.Tensor:
    """(n, ...) -> (repeats * n, ...): the whole of ``values`` ``repeats`` times, as H-DETR repeats the targets."""
    return values if repeats == 1 else values.repeat(repeats, *[1] * (values.dim() - 1))


def matched(matcher: HungarianMatcher, groups: list[tuple]) -> tuple[list[_Matches], torch.Tensor]:
    """Every group's matches (groups as ``HungarianMatcher.match_groups`` takes them, repeats given) and the targets
    per image, on the predictions' device, solved where ``matcher`` solves them."""
    device = groups[0][0].device
    sizes = [len(t["labels"]) for t in groups[0][2]]
    on_device = matcher.solves_on(device)
    # Named for torch.profiler. Solved on the host, the host waits for the GPU here, then the GPU for the host.
    with torch.profiler.record_function("step.matching"):
        solved = matcher.match_groups_on_device(groups) if on_device else matcher.match_groups(groups)
    if on_device:
        matches = [_matches_from_assignment(*group) for group in solved]
        return matches, to_device_async(torch.tensor(sizes, dtype=torch.int64), device)
    queries, repeats = [logits.shape[2] for logits, *_ in groups], [r for *_, r in groups]
    return _matches_from_pairs(solved, sizes, device, queries, repeats)


def _matches_from_pairs(
    pairs: list[list[list]], tgt_lengths: list[int], device, num_queries: list[int], repeats: list[int]
) -> tuple[list[_Matches], torch.Tensor]:
    """The matcher's host indices of every group, padded (``_Matches``; ``num_queries``: each group's predictions
    per image, the query of its padding pairs; ``repeats``: how many times each group's targets are repeated),
    and the targets per image, in one host->device copy.

    Indexing a CUDA tensor with CPU indices copies them one by one, each copy waiting for the GPU; packing
    them into one buffer makes a single asynchronous copy (models.host_copy).
    """
    arrays, layouts = [], []
    for layers, queries, r in zip(pairs, num_queries, repeats, strict=True):
        starts = np.cumsum([0] + [n * r for n in tgt_lengths])  # where each image's (repeated) targets start
        slots = target_slots(int(starts[-1]))
        columns = np.empty((4, len(layers), slots), dtype=np.int64)  # layer, batch, query, target
        columns[0] = np.arange(len(layers))[:, None]
        columns[1:] = np.asarray([0, queries, starts[-1]])[:, None, None]  # a padding pair's batch, query, target
        per_layer = []
        for g, per_image in enumerate(layers):
            pairs = [len(rows) for rows, _ in per_image]
            count = sum(pairs)
            per_layer.append(count)
            if not count:
                continue
            image = np.repeat(np.arange(len(per_image)), pairs)
            columns[1, g, :count] = image
            columns[2, g, :count] = torch.cat([rows for rows, _ in per_image]).numpy()
            columns[3, g, :count] = torch.cat([cols for _, cols in per_image]).numpy() + starts[image]
        arrays.extend(columns.reshape(4, -1))
        layouts.append((per_layer, slots))
    arrays.append(np.asarray(tgt_lengths, dtype=np.int64))
    flat = to_device_async(torch.from_numpy(np.concatenate(arrays)), device).split([len(a) for a in arrays])
    matches = [
        _Matches(*flat[4 * i : 4 * i + 4], per_layer=per_layer, slots=slots)
        for i, (per_layer, slots) in enumerate(layouts)
    ]
    return matches, flat[-1]


def _matches_from_assignment(assignment: torch.Tensor, layout: tuple) -> _Matches:
    """``_matches_from_pairs``'s pairs, in its order, from the device solve of one group
    (HungarianMatcher.match_groups_on_device: ``assignment`` (G, B, R), ``layout`` (G, B, Q, sizes, r)), made on the
    device with nothing read back."""
    G, B, Q, sizes, r = layout
    R = assignment.shape[2]
    device = assignment.device
    repeated = [n * r for n in sizes]
    starts = np.cumsum([0] + repeated)
    slots = target_slots(int(starts[-1]))
    count = sum(min(Q, n) for n in repeated)
    per_image = torch.tensor([[min(Q, n) for n in repeated], [n < Q for n in repeated], starts[:-1].tolist()])
    pairs, targets_first, start = to_device_async(per_image.to(torch.int64), device)[:, :, None]  # (B, 1) each
    k = torch.arange(R, device=device)
    column = assignment.long()
    # An image's rows are its targets (each row's column its query) or, with more targets than queries, its queries.
    query = torch.where(targets_first.bool(), column, k)  # (G, B, R)
    target = torch.where(targets_first.bool(), k, column) + start
    batch = torch.arange(B, device=device)[:, None].expand(B, R)
    # Each layer's pairs image after image, queries increasing, then the rows past each image's pairs.
    key = torch.where(k < pairs, batch * (Q + 1) + query, torch.iinfo(torch.int64).max)
    width = min(slots, B * R)
    order = key.view(G, B * R).argsort(dim=1)[:, :width]
    real = torch.arange(width, device=device) < count

    def padded(values: torch.Tensor, padding: int) -> torch.Tensor:
        taken = values.expand(G, B, R).reshape(G, B * R).gather(1, order)
        column = torch.full((G, slots), padding, dtype=torch.int64, device=device)
        column[:, :width] = torch.where(real, taken, padding)
        return column.flatten()

    layer = torch.arange(G, device=device)[:, None].expand(G, slots).flatten()
    return _Matches(
        layer,
        padded(batch, 0),
        padded(query, Q),
        padded(target, int(starts[-1])),
        per_layer=[count] * G,
        slots=slots,
    )


def _loss_boxes(boxes, tgt_boxes, layer, batch, query, target, *, num_layers: int) -> dict[str, torch.Tensor]:
    """(G,) L1 on normalized cxcywh and 1 - GIoU on xyxy, summed over each layer's matched pairs."""
    num_queries = boxes.shape[2]
    real = query < num_queries  # (M,): padding pairs have query Q and read query Q-1's box, added as 0
    src_boxes = boxes[layer, batch, query.clamp(max=num_queries - 1)]  # (M, 4)
    if src_boxes.dtype in (torch.float16, torch.bfloat16):
        src_boxes = src_boxes.float()
    target_boxes = tgt_boxes[target].to(src_boxes.dtype)  # (M, 4)
    l1 = (src_boxes - target_boxes).abs().sum(-1)  # (M,)
    giou = paired_generalized_box_iou(
        box_convert(src_boxes, "cxcywh", "xyxy"), box_convert(target_boxes, "cxcywh", "xyxy")
    )  # (M,)
    zeros = src_boxes.new_zeros(num_layers)
    return {
        "loss_bbox": zeros.index_add(0, layer, torch.where(real, l1, 0.0)),
        "loss_giou": zeros.index_add(0, layer, torch.where(real, 1 - giou, 0.0)),
    }


@torch.no_grad()
def _loss_cardinality(logits, tgt_lengths) -> torch.Tensor:
    """(G,) |#queries whose argmax is not the last class - #targets|, averaged over images.

    Logged only, no gradient. Kept exactly as the original computes it (a DETR carry-over that
    treats the last logit as "no object"), so logged numbers compare with published logs.
    """
    card_pred = (logits.argmax(-1) != logits.shape[-1] - 1).sum(2)  # (G, B)
    return (card_pred.float() - tgt_lengths.float()).abs().mean(1)


@torch.no_grad()
def _top1_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Percentage of rows whose argmax equals the label; 0 when there are no rows (as the original)."""
    if labels.numel() == 0:
        return torch.zeros([], device=logits.device)
    return (logits.argmax(-1) == labels).float().mean() * 100


# -- config adapter -----------------------------------------------------------------------------------


def build_criterion(cfg) -> tuple[SetCriterion, PostProcess]:
    """Build (SetCriterion, PostProcess) from the model config (DictConfig or mapping).

    Reads num_classes, dec_layers, aux_loss, two_stage, set_cost_{class,bbox,giou},
    {cls,bbox,giou}_loss_coef, focal_alpha, one_to_many, k_one2many, lambda_one2many, cls_loss_coef_one2many,
    checked by models/model_config.py (CriterionConfig). weight_dict holds loss_ce/loss_bbox/loss_giou, copies
    suffixed _0.._{dec_layers-2} when aux_loss, _enc copies when two_stage, and with one-to-many supervision the
    decoder's (not _enc) suffixed _one2many, weighted lambda_one2many times as much (H-DETR multiplies the losses
    themselves), loss_ce's at cls_loss_coef_one2many where set (MS-DETR's 2 against 1).
    """
    c = read_criterion_config(cfg)
    num_classes, dec_layers = resolved_num_classes(c), c.dec_layers

    # The original matcher hard-codes alpha=0.25, gamma=2 (HungarianMatcher's defaults); focal_alpha
    # from the config weights the loss only.
    matcher = HungarianMatcher(
        cost_class=float(c.set_cost_class), cost_bbox=float(c.set_cost_bbox), cost_giou=float(c.set_cost_giou)
    )
    base = {
        "loss_ce": float(c.cls_loss_coef),
        "loss_bbox": float(c.bbox_loss_coef),
        "loss_giou": float(c.giou_loss_coef),
    }
    decoder_suffixes = [f"_{i}" for i in range(dec_layers - 1)] if c.aux_loss else []
    decoder_suffixes.append("")
    weight_dict = {name + suffix: w for suffix in decoder_suffixes for name, w in base.items()}
    if c.two_stage:
        weight_dict.update({k + "_enc": v for k, v in base.items()})
    if c.one_to_many != OneToMany.none:
        cls_one2many = c.cls_loss_coef if c.cls_loss_coef_one2many is None else c.cls_loss_coef_one2many
        one2many = {**base, "loss_ce": float(cls_one2many)}
        weight_dict.update(
            {
                name + suffix + ONE2MANY_SUFFIX: w * float(c.lambda_one2many)
                for suffix in decoder_suffixes
                for name, w in one2many.items()
            }
        )
    criterion = SetCriterion(
        num_classes=num_classes,
        matcher=matcher,
        weight_dict=weight_dict,
        focal_alpha=float(c.focal_alpha),
        one_to_many=c.one_to_many,
        k_one2many=int(c.k_one2many),
    )
    return criterion, PostProcess()


def _padded(values: list[torch.Tensor], length: int, value) -> torch.Tensor:
    """(B, length, ...) of each image's (n_i, ...) values, padded after them with ``value``."""
    padded = pad_sequence(values, batch_first=True, padding_value=value)
    extra = length - padded.shape[1]
    return F.pad(padded, (0, 0) * (padded.dim() - 2) + (0, extra), value=value)
