"""Hungarian matcher between Deformable DETR predictions and ground-truth boxes.

Each image's queries are assigned one-to-one to its targets by minimising a cost that mixes a
focal-style classification cost, the L1 distance between boxes and the negative generalized IoU,
exactly as in the published Deformable DETR. Queries left unassigned are "no object".
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import box_convert

from models import assignment
from models.host_copy import to_device_async

# Every coordinate of a padding target's box (normalized cxcywh): a box of positive area, so that its GIoU with a
# prediction is finite. It pads the cost matrices' columns, never matched, and the criterion's targets, where the
# padding's zero contribution has a zero gradient.
PADDING_BOX = 0.5


# Where the assignments are solved: "auto" on the predictions' device if it is a GPU (models/assignment.py, which gives
# scipy's pairs with no host sync), else on the host with scipy; "device" on the predictions' device whatever it is
# (Triton's interpreter on the CPU, for tests), "host" on the host.
SOLVERS = ("auto", "device", "host")


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
        solver: str = "auto",
    ):
        super().__init__()
        if solver not in SOLVERS:
            raise ValueError(f"HungarianMatcher: solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
        self.solver = solver
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

    def solves_on(self, device: torch.device) -> bool:
        """Whether predictions on ``device`` are matched there (``match_groups_on_device``) or on the host."""
        return self.solver == "device" or (self.solver == "auto" and device.type == "cuda")

    def cost_matrix(self, outputs: dict, targets: list[dict]) -> torch.Tensor:
        """Each image's cost matrix, padded: (B, Q, T_max), T_max the most targets of an image in the batch.

        outputs: "pred_logits" (B, Q, K) raw logits, "pred_boxes" (B, Q, 4) normalized cxcywh.
        targets: per image {"labels": (n_i,) int64 in [0, K), "boxes": (n_i, 4) normalized cxcywh}.
        Image b's queries against its own targets are ``[b, :, :n_b]``; the columns after them are padding.
        """
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        return self.image_costs(logits[None], boxes[None], targets)[0]

    def image_costs(self, logits: torch.Tensor, boxes: torch.Tensor, targets: list[dict]) -> torch.Tensor:
        """Cost matrices of G stacked predictions, each image's queries against its own targets: (G, B, Q, T_max).

        logits (G, B, Q, K), boxes (G, B, Q, 4): e.g. every decoder layer's output at once. Only the blocks the
        assignment uses are computed (an image's queries never meet another image's targets), so the work and
        the host copy grow with the batch, not with its square. Padding columns cost 0 and are never read.
        """
        if logits.dtype in (torch.float16, torch.bfloat16):
            # Costs of nearby queries differ by less than a bf16 ulp; match in fp32.
            logits, boxes = logits.float(), boxes.float()
        G, B, Q, _ = logits.shape
        device = logits.device
        tgt_ids = pad_sequence(
            [t["labels"].to(device=device, dtype=torch.int64) for t in targets], batch_first=True
        )  # (B, T)
        tgt_bbox = pad_sequence(
            [t["boxes"].to(device=device, dtype=boxes.dtype) for t in targets],
            batch_first=True,
            padding_value=PADDING_BOX,
        )  # (B, T, 4)
        T = tgt_ids.shape[1]

        alpha, gamma = self.focal_alpha, self.focal_gamma
        # Only the targets' classes are needed: (G, B, Q, T)
        prob = logits.sigmoid().gather(3, tgt_ids[None, :, None, :].expand(G, B, Q, T))
        neg_cost = (1 - alpha) * (prob**gamma) * (-(1 - prob + 1e-8).log())
        pos_cost = alpha * ((1 - prob) ** gamma) * (-(prob + 1e-8).log())
        cost_class = pos_cost - neg_cost  # (G, B, Q, T)

        out_bbox = boxes[:, :, :, None, :]  # (G, B, Q, 1, 4)
        tgt = tgt_bbox[None, :, None, :, :]  # (1, B, 1, T, 4)
        cost_bbox = (out_bbox - tgt).abs().sum(-1)  # (G, B, Q, T)
        cost_giou = -pairwise_giou(box_convert(out_bbox, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy"))
        return self.cost_bbox * cost_bbox + self.cost_giou * cost_giou + self.cost_class * cost_class

    def stacked_costs(self, groups: list[tuple]) -> tuple[torch.Tensor, list[tuple]]:
        """Every group's cost matrices in one flat float32 tensor on the predictions' device, each image's block as
        (targets, queries), and each group's layout (G, B, Q, sizes, r): the input of both solvers (``match_groups``).
        Non-finite costs (a diverging run) become the largest float32, so that they are matched as costing the most
        and the loss, which they make non-finite, is what reports them."""
        costs, layouts = [], []
        for logits, boxes, targets, *repeats in groups:
            r = repeats[0] if repeats else 1
            if not isinstance(r, int) or r < 1:
                raise ValueError(f"HungarianMatcher: a group's repeats must be an integer >= 1, got {r!r}")
            G, B, Q = logits.shape[:3]
            if len(targets) != B:
                raise ValueError(f"HungarianMatcher: got {len(targets)} target dicts for a batch of {B} images")
            sizes = [len(t["boxes"]) for t in targets]
            layouts.append((G, B, Q, sizes, r))
            if sum(sizes):
                # Each image's block as (targets, queries): linear_sum_assignment solves a problem with fewer rows
                # than columns as given, and would otherwise copy every block into that layout.
                costs.append(self.image_costs(logits, boxes, targets).transpose(2, 3).flatten())
        device = groups[0][0].device if groups else torch.device("cpu")
        worst = torch.finfo(torch.float32).max
        flat = torch.cat(costs).float().nan_to_num_(nan=worst, posinf=worst) if costs else torch.empty(0, device=device)
        return flat, layouts

    @torch.no_grad()
    def match_groups(self, groups: list[tuple]) -> list[list[list]]:
        """Match every layer of every group on the host (scipy), with one device->host transfer for all costs.

        groups: [(logits (G, B, Q, K), boxes (G, B, Q, 4), targets[, repeats])], e.g. the decoder layers stacked and
        the two-stage encoder proposals with their class-agnostic targets. Returns, per group, per layer,
        per image, (index_i, index_j) as int64 CPU tensors of length min(Q, n_i * r): prediction index_i[k]
        is assigned to target index_j[k], index_i increasing. Images without targets get two empty tensors.

        repeats r (default 1): each image's n_i targets are matched as r copies of them, n_i * r targets where copy
        c of target j is target c * n_i + j (hybrid matching's one-to-many queries, as H-DETR repeats the targets).
        Their costs are computed and copied once and repeated on the host.
        """
        flat, layouts = self.stacked_costs(groups)
        flat = flat.cpu()
        blocks, offset = [], 0
        for G, B, Q, sizes, r in layouts:
            T = max(sizes, default=0)
            if T:
                C = flat[offset : offset + G * B * T * Q].view(G, B, T, Q).numpy()
                offset += G * B * T * Q
                blocks += [(C[g, b, :n], r) for g in range(G) for b, n in enumerate(sizes)]
        solved = iter(_solve_blocks(blocks))
        empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        return [
            [[next(solved) if max(sizes, default=0) else empty for _ in range(B)] for _ in range(G)]
            for G, B, Q, sizes, r in layouts
        ]

    @torch.no_grad()
    def match_groups_on_device(self, groups: list[tuple]) -> list[tuple[torch.Tensor, tuple]]:
        """``match_groups``' pairs, solved where the predictions are (models/assignment.py): nothing is read back.

        Returns per group (assignment, layout): assignment (G, B, R) int32 on the device, where each image's
        problem has min(Q, n_i * r) rows and max(Q, n_i * r) columns and row k holds its column (-1 past the rows):
        the query of target k where n_i * r < Q, else the target of query k (scipy's orientation of the host
        solve, so that ties fall alike); layout (G, B, Q, sizes, r).
        """
        flat, layouts = self.stacked_costs(groups)
        problems, offset = [], 0
        for G, B, Q, sizes, r in layouts:
            T = max(sizes, default=0)
            for g in range(G):
                for b, n in enumerate(sizes):
                    base = offset + (g * B + b) * T * Q
                    if n * r < Q:  # rows: the targets (row k is target k % n's block row), columns: the queries
                        problems.append((base, n * r, Q, max(n, 1), Q, Q, 1))
                    else:  # rows: the queries, columns: the repeated targets
                        problems.append((base, Q, n * r, Q, 1, n, Q))
            offset += G * B * T * Q
        table = to_device_async(torch.tensor(problems, dtype=torch.int64).view(-1, 7), flat.device)
        results, start = [], 0
        for layout in layouts:
            count = layout[0] * layout[1]
            # A launch per group, its block the size of the group's own widest problem: one launch for all would
            # scan the two-stage proposals' 20k columns in every decoder layer's program too.
            rows = max((p[1] for p in problems[start : start + count]), default=0)
            cols = max((p[2] for p in problems[start : start + count]), default=0)
            solved = assignment.solve(flat, table[start : start + count], max_rows=rows, max_cols=max(cols, rows))
            results.append((solved.view(*layout[:2], solved.shape[1]), layout))
            start += count
        return results

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Match each image's queries to its targets.

        Returns one (index_i, index_j) pair per image, both int64 CPU tensors of length
        min(Q, n_i): prediction index_i[k] is assigned to target index_j[k]. Images without
        targets get two empty tensors. Other keys in outputs/targets are ignored.
        """
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        return self.match_groups([(logits[None], boxes[None], targets)])[0][0]


def _solve_blocks(blocks: list[tuple[np.ndarray, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """_assignment of each (targets, queries) block with its rows repeated r times, in order. scipy releases the
    GIL while it solves, so large problems (hybrid matching's one-to-many blocks) are solved on several threads
    while the GPU waits for them; the pool lives for one call, leaving no thread behind when the loader forks."""
    threads = _solver_threads(sum(cost.size * repeats for cost, repeats in blocks))
    if threads < 2:
        return [_repeated_assignment(block) for block in blocks]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(_repeated_assignment, blocks))


def _solver_threads(costs: int) -> int:
    """Threads for a call whose blocks hold ``costs`` numbers in all: one per million, at most 8. Below that the
    threads' overhead outweighs them (bench/matching.py measures both)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cores, costs // 1_000_000)


def _repeated_assignment(block: tuple[np.ndarray, int]) -> tuple[torch.Tensor, torch.Tensor]:
    cost, repeats = block
    return _assignment(cost if repeats == 1 else np.tile(cost, (repeats, 1)))


def _assignment(cost: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(query indices increasing, their target indices) of the least-cost assignment of a (targets, queries)
    block: the pairs scipy gives for the (queries, targets) block, ties broken alike, without its copy into the
    layout it solves, which has the fewer rows."""
    if cost.shape[0] < cost.shape[1]:
        target_index, query_index = linear_sum_assignment(cost)
        by_query = np.argsort(query_index)
        query_index, target_index = query_index[by_query], target_index[by_query]
    else:
        query_index, target_index = linear_sum_assignment(cost.T)
    return torch.from_numpy(query_index.astype(np.int64)), torch.from_numpy(target_index.astype(np.int64))


def pairwise_giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalized IoU of boxes ``a`` and ``b`` (xyxy), broadcast against each other over their leading dimensions:
    torchvision's generalized_box_iou, elementwise."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    inter_wh = (torch.minimum(a[..., 2:], b[..., 2:]) - torch.maximum(a[..., :2], b[..., :2])).clamp(min=0)
    inter = inter_wh[..., 0] * inter_wh[..., 1]
    union = area_a + area_b - inter
    hull_wh = (torch.maximum(a[..., 2:], b[..., 2:]) - torch.minimum(a[..., :2], b[..., :2])).clamp(min=0)
    hull = hull_wh[..., 0] * hull_wh[..., 1]
    return inter / union - (hull - union) / hull
