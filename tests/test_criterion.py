"""Tests for the Hungarian matcher, SetCriterion, build_criterion and PostProcess (CPU, fast)."""

import itertools
import math

import pytest
import torch
from helpers import RAND_CLASSES, criterion_cfg, make_criterion, rand_boxes, rand_outputs, rand_targets
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torchvision.ops import box_convert, generalized_box_iou

from models.criterion import SetCriterion, build_criterion, target_slots
from models.losses import paired_generalized_box_iou
from models.matcher import HungarianMatcher
from models.postprocess import PostProcess

K = RAND_CLASSES


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# -- matcher ---------------------------------------------------------------------------------------------


def scalar_giou(a, b):
    """GIoU of two cxcywh boxes, written out on Python floats."""
    ax0, ay0, ax1, ay1 = a[0] - a[2] / 2, a[1] - a[3] / 2, a[0] + a[2] / 2, a[1] + a[3] / 2
    bx0, by0, bx1, by1 = b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2
    inter = max(0.0, min(ax1, bx1) - max(ax0, bx0)) * max(0.0, min(ay1, by1) - max(ay0, by0))
    union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
    hull = (max(ax1, bx1) - min(ax0, bx0)) * (max(ay1, by1) - min(ay0, by0))
    return inter / union - (hull - union) / hull


def scalar_cost(logit, box, label, tgt_box, w_class=2.0, w_bbox=5.0, w_giou=2.0):
    p = 1 / (1 + math.exp(-logit[label]))
    pos = 0.25 * (1 - p) ** 2 * -math.log(p + 1e-8)
    neg = 0.75 * p**2 * -math.log(1 - p + 1e-8)
    l1 = sum(abs(x - y) for x, y in zip(box, tgt_box))
    return w_class * (pos - neg) + w_bbox * l1 - w_giou * scalar_giou(box, tgt_box)


@pytest.mark.parametrize("Q, n", [(3, 3), (4, 2), (5, 3), (2, 3), (1, 1)])
def test_matcher_cost_and_assignment_match_brute_force(gen, Q, n):
    outputs = rand_outputs(1, Q, gen)
    targets = rand_targets([n], gen)
    logits, boxes = outputs["pred_logits"][0].tolist(), outputs["pred_boxes"][0].tolist()
    labels, tgt_boxes = targets[0]["labels"].tolist(), targets[0]["boxes"].tolist()
    cost = [[scalar_cost(logits[q], boxes[q], labels[t], tgt_boxes[t]) for t in range(n)] for q in range(Q)]

    matcher = HungarianMatcher()
    C = matcher.cost_matrix(outputs, targets)[0]
    torch.testing.assert_close(C, torch.tensor(cost), rtol=1e-5, atol=1e-5)

    # Brute force: every injective assignment of min(Q, n) pairs.
    if n <= Q:
        candidates = [list(zip(qs, range(n))) for qs in itertools.permutations(range(Q), n)]
    else:
        candidates = [list(zip(range(Q), ts)) for ts in itertools.permutations(range(n), Q)]
    best = min(sum(cost[q][t] for q, t in pairs) for pairs in candidates)

    ((rows, cols),) = matcher(outputs, targets)
    assert rows.dtype == cols.dtype == torch.int64
    assert len(rows) == len(cols) == min(Q, n)
    assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)
    assert sum(cost[q][t] for q, t in zip(rows.tolist(), cols.tolist())) == pytest.approx(best, abs=1e-5)


@pytest.mark.parametrize("sizes", [[3, 0, 5], [1], [0, 2, 0, 7], [6, 1, 1, 4, 2]])
def test_each_images_cost_block_is_its_slice_of_the_whole_batchs_cost(gen, sizes):
    """image_costs computes only each image's own block; it equals that block of every query against every target
    of the batch, computed with torchvision's pairwise GIoU, for G stacked layers."""
    from torchvision.ops import box_convert, generalized_box_iou

    G, Q = 3, 6
    logits = torch.randn(G, len(sizes), Q, K, generator=gen)
    boxes = rand_boxes(G * len(sizes) * Q, gen).view(G, len(sizes), Q, 4)
    targets = rand_targets(sizes, gen)
    blocks = HungarianMatcher().image_costs(logits, boxes, targets)  # (G, B, Q, T_max)
    assert blocks.shape == (G, len(sizes), Q, max(sizes))
    labels, tgt = torch.cat([t["labels"] for t in targets]), torch.cat([t["boxes"] for t in targets])
    start = 0
    for b, n in enumerate(sizes):
        for g in range(G):
            prob = logits[g, b].sigmoid()[:, labels[start : start + n]]  # (Q, n)
            cost_class = 0.25 * (1 - prob) ** 2 * -(prob + 1e-8).log() - 0.75 * prob**2 * -(1 - prob + 1e-8).log()
            giou = generalized_box_iou(
                box_convert(boxes[g, b], "cxcywh", "xyxy"), box_convert(tgt[start : start + n], "cxcywh", "xyxy")
            )
            whole = 2 * cost_class + 5 * torch.cdist(boxes[g, b], tgt[start : start + n], p=1) - 2 * giou
            torch.testing.assert_close(blocks[g, b, :, :n], whole, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("sizes", [[3, 0, 5], [1, 4], [0, 2, 0, 7]])
def test_matching_alone_equals_matching_in_batch(gen, sizes):
    Q = 8
    outputs = rand_outputs(len(sizes), Q, gen)
    targets = rand_targets(sizes, gen)
    matcher = HungarianMatcher()
    batched = matcher(outputs, targets)
    for b, (rows, cols) in enumerate(batched):
        alone = {k: v[b : b + 1] for k, v in outputs.items()}
        ((rows_1, cols_1),) = matcher(alone, [targets[b]])
        assert torch.equal(rows, rows_1) and torch.equal(cols, cols_1)
        assert len(rows) == sizes[b]


@pytest.mark.parametrize("Q, sizes", [(8, [3, 0, 5]), (4, [6, 2]), (300, [1, 40, 7]), (5, [5, 5])])
def test_matcher_gives_the_pairs_of_the_published_layout_in_query_order(gen, Q, sizes):
    """The matcher solves each image's (targets, queries) block; its pairs are exactly those of scipy on the
    original's (queries, targets) block, in the same order, also with more targets than queries and with ties."""
    from scipy.optimize import linear_sum_assignment

    G = 2
    logits = torch.randn(G, len(sizes), Q, K, generator=gen)
    boxes = rand_boxes(G * len(sizes) * Q, gen).view(G, len(sizes), Q, 4)
    logits[1, :, 1:] = logits[1, :, :1]  # the second layer's queries cost the same: ties everywhere
    boxes[1, :, 1:] = boxes[1, :, :1]
    targets = rand_targets(sizes, gen)
    matcher = HungarianMatcher()
    costs = matcher.image_costs(logits, boxes, targets)
    (layers,) = matcher.match_groups([(logits, boxes, targets)])
    for g, per_image in enumerate(layers):
        for b, (queries, target_index) in enumerate(per_image):
            rows, cols = linear_sum_assignment(costs[g, b, :, : sizes[b]].numpy())
            assert queries.tolist() == rows.tolist() and target_index.tolist() == cols.tolist()
            assert queries.dtype == target_index.dtype == torch.int64


@pytest.mark.parametrize("sizes", [[0], [0, 0, 0]])
def test_matcher_on_batch_without_targets(gen, sizes):
    outputs = rand_outputs(len(sizes), 6, gen)
    indices = HungarianMatcher()(outputs, rand_targets(sizes, gen))
    assert len(indices) == len(sizes)
    for rows, cols in indices:
        assert rows.numel() == 0 and cols.numel() == 0 and rows.dtype == torch.int64


def test_matcher_matches_non_finite_predictions_last_and_the_loss_reports_them(gen):
    """A diverging run is stopped by its non-finite loss (the training step's check), not by the matcher."""
    outputs = rand_outputs(1, 4, gen)
    outputs["pred_boxes"][0, 1, 0] = float("nan")
    outputs["pred_logits"][0, 2] = float("nan")
    ((rows, _cols),) = HungarianMatcher()(outputs, rand_targets([2], gen))
    assert sorted(rows.tolist()) == [0, 3]  # the two finite queries take the two targets
    outputs["pred_boxes"][:] = float("nan")
    losses = make_criterion(aux_loss=False)(outputs, rand_targets([2], gen))
    assert not torch.isfinite(losses["loss_bbox"]) and not torch.isfinite(losses["loss_giou"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cost_bbox": -1.0}, "cost_bbox must be a finite number >= 0"),
        ({"cost_class": 0.0, "cost_bbox": 0.0, "cost_giou": 0.0}, "all 0"),
        ({"focal_alpha": 1.5}, "focal_alpha must be in"),
    ],
)
def test_matcher_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HungarianMatcher(**kwargs)


# -- criterion ---------------------------------------------------------------------------------------------


def perfect_outputs(targets, Q, gen):
    """Outputs whose queries perm[b][:n] predict targets exactly (confident logits); the rest background."""
    B = len(targets)
    logits = torch.full((B, Q, K), -12.0)
    boxes = rand_boxes(B * Q, gen).view(B, Q, 4)
    perms = []
    for b, t in enumerate(targets):
        perm = torch.randperm(Q, generator=gen)[: len(t["labels"])]
        logits[b, perm, t["labels"]] = 12.0
        boxes[b, perm] = t["boxes"]
        perms.append(perm)
    return {"pred_logits": logits, "pred_boxes": boxes}, perms


def test_perfect_predictions_are_recovered_with_zero_box_loss(gen):
    targets = rand_targets([3, 5], gen)
    outputs, perms = perfect_outputs(targets, Q=10, gen=gen)
    criterion = make_criterion(aux_loss=False)
    for (rows, cols), perm in zip(criterion.matcher(outputs, targets), perms):
        # Query rows[k] matched target cols[k] means query perm[cols[k]] was the one placed there.
        assert len(rows) == len(perm) and torch.equal(perm[cols], rows)
    losses = criterion(outputs, targets)
    assert losses["loss_bbox"].item() < 1e-6
    assert losses["loss_giou"].item() < 1e-6
    assert losses["class_error"].item() == 0.0
    assert losses["cardinality_error"].item() >= 0


def focal_by_hand(logits, onehot, alpha=0.25, gamma=2.0):
    p = logits.sigmoid()
    ce = -(onehot * p.log() + (1 - onehot) * (1 - p).log())
    p_t = p * onehot + (1 - p) * (1 - onehot)
    alpha_t = alpha * onehot + (1 - alpha) * (1 - onehot)
    return alpha_t * ce * (1 - p_t) ** gamma


def test_loss_values_match_the_published_formulas(gen):
    targets = rand_targets([2, 3], gen)
    outputs = rand_outputs(2, 6, gen)
    criterion = make_criterion(aux_loss=False)
    indices = criterion.matcher(outputs, targets)
    losses = criterion(outputs, targets)
    num_boxes, Q = 5.0, 6

    onehot = torch.zeros(2, Q, K)
    l1, giou = 0.0, 0.0
    for b, (rows, cols) in enumerate(indices):
        for q, t in zip(rows.tolist(), cols.tolist()):
            onehot[b, q, targets[b]["labels"][t]] = 1.0
            pred, tgt = outputs["pred_boxes"][b, q], targets[b]["boxes"][t]
            l1 += (pred - tgt).abs().sum().item()
            giou += 1 - scalar_giou(pred.tolist(), tgt.tolist())
    expected_ce = focal_by_hand(outputs["pred_logits"], onehot).mean(1).sum() / num_boxes * Q
    torch.testing.assert_close(losses["loss_ce"], expected_ce, rtol=1e-5, atol=1e-6)
    assert losses["loss_bbox"].item() == pytest.approx(l1 / num_boxes, rel=1e-5)
    assert losses["loss_giou"].item() == pytest.approx(giou / num_boxes, rel=1e-5)


def test_every_layer_and_class_error_match_the_published_formulas_with_more_targets_than_queries(gen):
    """Three decoder layers, one image with more targets than queries (its layers match fewer pairs than there are
    targets, so each layer's block of pairs holds padding): every layer's losses and the final layer's class error
    against a computation by hand from the matcher's pairs."""
    targets = rand_targets([9, 2], gen)
    Q = 6
    layers = [rand_outputs(2, Q, gen) for _ in range(3)]
    outputs = {**layers[-1], "aux_outputs": layers[:-1]}
    losses = make_criterion(dec_layers=3)(outputs, targets)
    num_boxes = 11.0
    for suffix, layer in zip(("_0", "_1", ""), layers):
        indices = make_criterion(aux_loss=False).matcher(layer, targets)
        onehot = torch.zeros(2, Q, K)
        l1, giou, correct, pairs = 0.0, 0.0, 0, 0
        for b, (rows, cols) in enumerate(indices):
            for q, t in zip(rows.tolist(), cols.tolist()):
                label = targets[b]["labels"][t]
                onehot[b, q, label] = 1.0
                pred, tgt = layer["pred_boxes"][b, q], targets[b]["boxes"][t]
                l1 += (pred - tgt).abs().sum().item()
                giou += 1 - scalar_giou(pred.tolist(), tgt.tolist())
                correct += int(layer["pred_logits"][b, q].argmax() == label)
                pairs += 1
        assert pairs == Q + 2  # the first image's 9 targets got the 6 queries
        expected_ce = focal_by_hand(layer["pred_logits"], onehot).mean(1).sum() / num_boxes * Q
        torch.testing.assert_close(losses["loss_ce" + suffix], expected_ce, rtol=1e-5, atol=1e-6)
        assert losses["loss_bbox" + suffix].item() == pytest.approx(l1 / num_boxes, rel=1e-5)
        assert losses["loss_giou" + suffix].item() == pytest.approx(giou / num_boxes, rel=1e-5)
    assert losses["class_error"].item() == pytest.approx(100 - 100 * correct / pairs, rel=1e-5)


def test_padding_pairs_and_targets_add_nothing_to_the_losses_or_their_gradients(gen):
    """stacked_losses on exactly the matched pairs, and on the same pairs padded by hand as SetCriterion pads them
    (padding targets after the real ones, padding pairs with query Q at the end of each layer's block): the same
    sums and the same gradients of logits and boxes."""
    criterion = make_criterion(dec_layers=3)
    G, B, Q = 3, 2, 7
    logits = torch.randn(G, B, Q, K, generator=gen, requires_grad=True)
    boxes = rand_boxes(G * B * Q, gen).view(G, B, Q, 4).requires_grad_(True)
    T, S = 5, target_slots(5)
    labels, tgt_boxes = torch.randint(0, K, (T,), generator=gen), rand_boxes(T, gen)
    per_layer = [5, 4, 5]  # pairs of each layer: (batch, query, target)
    pairs = [
        [
            (b, q, t)
            for b, q, t in zip(
                torch.randint(0, B, (n,), generator=gen).tolist(),
                torch.randperm(Q, generator=gen)[:n].tolist(),
                range(n),
            )
        ]
        for n in per_layer
    ]

    def indices(padded: bool):
        rows = []
        for g, layer_pairs in enumerate(pairs):
            rows += [(g, *p) for p in layer_pairs] + ([(g, 0, Q, T)] * (S - len(layer_pairs)) if padded else [])
        return [torch.tensor(column) for column in zip(*rows)]

    tgt_lengths = torch.tensor([3, 2])
    exact = criterion.stacked_losses(logits, boxes, labels, tgt_boxes, *indices(False), tgt_lengths)
    padded_labels = torch.cat([labels, torch.zeros(S - T, dtype=torch.int64)])
    padded_boxes = torch.cat([tgt_boxes, torch.full((S - T, 4), 0.5)])
    padded = criterion.stacked_losses(logits, boxes, padded_labels, padded_boxes, *indices(True), tgt_lengths)
    assert set(padded) == set(exact) == {"loss_ce", "loss_bbox", "loss_giou", "cardinality_error"}
    for name in exact:
        torch.testing.assert_close(padded[name], exact[name], rtol=1e-6, atol=1e-7, msg=name)
    weights = torch.rand(3, G, generator=gen)

    def gradients(sums):
        total = sum((w * sums[name]).sum() for w, name in zip(weights, ("loss_ce", "loss_bbox", "loss_giou")))
        return torch.autograd.grad(total, (logits, boxes))

    for got, expected in zip(gradients(padded), gradients(exact)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_target_slots_leave_room_for_a_padding_target_and_few_sizes():
    slots = [target_slots(n) for n in range(2000)]
    assert all(s > n and s >= 8 and s & (s - 1) == 0 for n, s in enumerate(slots))
    assert all(s <= max(8, 2 * n) for n, s in enumerate(slots) if n)
    assert len(set(slots[:256])) == 6  # 8 ... 256 for fewer than 256 targets per batch


def test_paired_giou_is_the_diagonal_of_the_pairwise_giou(gen):
    a, b = rand_boxes(40, gen), rand_boxes(40, gen)
    b[:5] = a[:5]  # identical boxes
    b[5:10, :2] = a[5:10, :2] + 1.0  # far apart: negative GIoU
    b[10:15] = a[10:15] * torch.tensor([1.0, 1.0, 0.5, 0.5])  # contained
    a, b = box_convert(a, "cxcywh", "xyxy"), box_convert(b, "cxcywh", "xyxy")
    paired = paired_generalized_box_iou(a, b)
    torch.testing.assert_close(paired, torch.diag(generalized_box_iou(a, b)), rtol=0, atol=0)
    assert (paired[:5] == 1).all() and (paired[5:10] < 0).all()


@pytest.mark.parametrize("sizes", [[0], [0, 0], [0, 4]])
def test_images_without_targets_give_finite_losses_and_gradients(gen, sizes):
    criterion = make_criterion(dec_layers=3, two_stage=True)
    outputs = rand_outputs(len(sizes), 7, gen)
    outputs["aux_outputs"] = [rand_outputs(len(sizes), 7, gen) for _ in range(2)]
    outputs["enc_outputs"] = rand_outputs(len(sizes), 7, gen)
    leaves = [outputs["pred_logits"].requires_grad_(), outputs["pred_boxes"].requires_grad_()]
    losses = criterion(outputs, rand_targets(sizes, gen))
    assert all(torch.isfinite(v).all() for v in losses.values()), losses
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items())
    total.backward()
    assert torch.isfinite(leaves[0].grad).all() and leaves[0].grad.abs().sum() > 0
    if sum(sizes) == 0:
        assert losses["loss_bbox"].item() == 0.0 and losses["loss_giou"].item() == 0.0


@pytest.mark.parametrize("n_aux, two_stage", [(0, False), (1, False), (5, False), (5, True), (0, True)])
def test_loss_keys_for_aux_and_enc_outputs(gen, n_aux, two_stage):
    outputs = rand_outputs(2, 6, gen)
    if n_aux:
        outputs["aux_outputs"] = [rand_outputs(2, 6, gen) for _ in range(n_aux)]
    if two_stage:
        outputs["enc_outputs"] = rand_outputs(2, 6, gen)
    losses = make_criterion()(outputs, rand_targets([2, 1], gen))
    per_layer = {"loss_ce", "loss_bbox", "loss_giou", "cardinality_error"}
    expected = per_layer | {"class_error"}
    for suffix in [f"_{i}" for i in range(n_aux)] + (["_enc"] if two_stage else []):
        expected |= {k + suffix for k in per_layer}
    assert set(losses) == expected


def test_enc_losses_use_class_agnostic_targets(gen):
    targets = rand_targets([3, 2], gen)
    for t in targets:
        t["labels"] = t["labels"].clamp(min=1)  # make sure no target is already class 0
    outputs = rand_outputs(2, 6, gen)
    outputs["enc_outputs"] = {k: v.clone() for k, v in outputs.items()}
    criterion = make_criterion(two_stage=True)
    losses = criterion(outputs, targets)
    zeroed = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]
    as_class0 = criterion({k: v for k, v in outputs.items() if k != "enc_outputs"}, zeroed)
    torch.testing.assert_close(losses["loss_ce_enc"], as_class0["loss_ce"])
    assert not torch.allclose(losses["loss_ce_enc"], losses["loss_ce"])


def test_num_boxes_normalization(gen):
    criterion = make_criterion(aux_loss=False)
    targets = rand_targets([4], gen)
    outputs = rand_outputs(1, 8, gen)
    single = criterion(outputs, targets)
    # The same image twice: sums double and so does num_boxes, so every loss is unchanged.
    doubled = criterion({k: v.repeat(2, 1, 1) for k, v in outputs.items()}, targets * 2)
    for key in ("loss_ce", "loss_bbox", "loss_giou"):
        torch.testing.assert_close(doubled[key], single[key], rtol=1e-5, atol=1e-6)
    # With no targets num_boxes is clamped to 1 (not 0).
    empty = criterion(outputs, rand_targets([0], gen))
    expected = focal_by_hand(outputs["pred_logits"], torch.zeros(1, 8, K)).mean(1).sum() * 8
    torch.testing.assert_close(empty["loss_ce"], expected, rtol=1e-5, atol=1e-6)


def test_num_boxes_given_by_the_trainer_normalizes_every_loss(gen):
    """A 2-process job whose other rank holds 8 boxes passes num_boxes = (4 + 8) / 2 = 6, as a tensor."""
    criterion = make_criterion(aux_loss=False)
    targets, outputs = rand_targets([4], gen), rand_outputs(1, 8, gen)
    local = criterion(outputs, targets)  # normalized by 4
    for num_boxes in (6.0, torch.tensor(6.0)):
        distributed = criterion(outputs, targets, num_boxes=num_boxes)
        for key in ("loss_ce", "loss_bbox", "loss_giou"):
            torch.testing.assert_close(distributed[key], local[key] * 4 / 6, rtol=1e-5, atol=1e-6)


def test_num_boxes_given_as_a_function_is_asked_for_once_after_the_matching(gen):
    """The trainer's all-reduce of num_boxes may still run during the matching: the value is asked for later."""
    criterion = make_criterion(aux_loss=False)
    targets, outputs = rand_targets([4], gen), rand_outputs(1, 8, gen)
    events = []
    match_groups = criterion.matcher.match_groups
    criterion.matcher.match_groups = lambda groups: events.append("matching") or match_groups(groups)

    def num_boxes():
        events.append("num_boxes")
        return torch.tensor(6.0)

    given = criterion(outputs, targets, num_boxes=num_boxes)
    assert events == ["matching", "num_boxes"]
    expected = criterion(outputs, targets, num_boxes=6.0)
    for key in ("loss_ce", "loss_bbox", "loss_giou"):
        torch.testing.assert_close(given[key], expected[key], rtol=0, atol=0)


def test_losses_of_all_layers_at_once_equal_each_layer_alone(gen):
    """The decoder layers are matched and scored together; each equals its own single-layer criterion. The
    two-stage proposals outnumber the queries (one per encoder token): their padding is their own."""
    targets = rand_targets([3, 0, 2], gen)
    layers = [rand_outputs(3, 7, gen) for _ in range(3)]
    outputs = {**layers[-1], "aux_outputs": layers[:-1], "enc_outputs": rand_outputs(3, 20, gen)}
    losses = make_criterion(dec_layers=3, two_stage=True)(outputs, targets)
    single = make_criterion(aux_loss=False)
    bin_targets = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]
    for suffix, layer, layer_targets in [
        ("_0", layers[0], targets),
        ("_1", layers[1], targets),
        ("", layers[2], targets),
        ("_enc", outputs["enc_outputs"], bin_targets),
    ]:
        alone = single(layer, layer_targets, num_boxes=5.0)
        for key in ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error"):
            torch.testing.assert_close(losses[key + suffix], alone[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(losses["class_error"], single(layers[2], targets)["class_error"])


# -- build_criterion --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dec_layers, aux_loss, two_stage, n_keys",
    [
        (6, True, False, 3 * 6),
        (6, False, False, 3),
        (6, True, True, 3 * 7),
        (1, True, False, 3),
        (2, False, True, 6),
    ],
)
def test_weight_dict_keys(dec_layers, aux_loss, two_stage, n_keys):
    criterion, postprocess = build_criterion(
        criterion_cfg(dec_layers=dec_layers, aux_loss=aux_loss, two_stage=two_stage)
    )
    expected = {"loss_ce": 2.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    suffixes = [f"_{i}" for i in range(dec_layers - 1)] if aux_loss else []
    suffixes += ["_enc"] if two_stage else []
    for s in suffixes:
        expected.update({"loss_ce" + s: 2.0, "loss_bbox" + s: 5.0, "loss_giou" + s: 2.0})
    assert criterion.weight_dict == expected and len(expected) == n_keys
    assert isinstance(criterion, SetCriterion) and isinstance(postprocess, PostProcess)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_classes": 0}, "num_classes must be an integer >= 1"),
        (
            {"num_classes": 2.5},
            r"'2.5' of type 'float' could not be converted to Integer\s+full_key: model\.num_classes",
        ),
        ({"dec_layers": 0}, "dec_layers must be an integer >= 1"),
        ({"cls_loss_coef": -1.0}, "cls_loss_coef must be a finite number >= 0"),
        ({"giou_loss_coef": float("nan")}, "giou_loss_coef must be a finite number >= 0"),
        ({"set_cost_bbox": -0.5}, "set_cost_bbox must be a finite number >= 0"),
        ({"set_cost_class": 0, "set_cost_bbox": 0, "set_cost_giou": 0}, "all 0"),
        ({"focal_alpha": 2.0}, "focal_alpha must be in"),
        ({"aux_loss": "maybe"}, r"'maybe' is not a valid bool \(type str\)\s+full_key: model\.aux_loss"),
    ],
)
def test_bad_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_criterion(criterion_cfg(**overrides))


def test_missing_config_key_raises():
    cfg = OmegaConf.to_container(criterion_cfg())
    del cfg["focal_alpha"]
    with pytest.raises(MissingMandatoryValue, match=r"full_key: model\.focal_alpha"):
        build_criterion(cfg)


# -- postprocess ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, Q, num_classes, k", [(2, 30, 5, 100), (1, 300, 91, 100), (3, 4, 5, 20), (1, 1, 1, 1)])
def test_postprocess_shapes_and_top_k(gen, B, Q, num_classes, k):
    outputs = rand_outputs(B, Q, gen, num_classes=num_classes)
    results = PostProcess()(outputs, torch.tensor([[480, 640]] * B))
    assert len(results) == B
    for b, r in enumerate(results):
        assert r["scores"].shape == (k,) and r["labels"].shape == (k,) and r["boxes"].shape == (k, 4)
        assert r["labels"].dtype == torch.int64
        assert torch.all(r["scores"][:-1] >= r["scores"][1:])
        # The kept scores are exactly the k largest probabilities of this image.
        expected = outputs["pred_logits"][b].sigmoid().flatten().sort(descending=True).values[:k]
        torch.testing.assert_close(r["scores"], expected)


def test_postprocess_hand_made_example():
    logits = torch.full((1, 2, 3), -5.0)
    logits[0, 1, 2] = 3.0  # best: query 1, class 2
    logits[0, 0, 1] = 1.0  # second: query 0, class 1
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.25, 0.75, 0.5, 0.5]]])
    (r,) = PostProcess()({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]))  # h=100, w=200
    assert r["labels"][:2].tolist() == [2, 1]
    torch.testing.assert_close(r["scores"][:2], torch.tensor([3.0, 1.0]).sigmoid())
    # query 1: x 0..0.5 -> 0..100 px, y 0.5..1 -> 50..100 px; query 0: x 0.4..0.6, y 0.3..0.7.
    torch.testing.assert_close(r["boxes"][:2], torch.tensor([[0.0, 50.0, 100.0, 100.0], [80.0, 30.0, 120.0, 70.0]]))


def test_bf16_outputs_give_fp32_losses_close_to_fp32(gen):
    """Under bf16 autocast the heads emit bf16; losses are computed in fp32 and gradients reach bf16."""
    criterion = make_criterion(aux_loss=False)
    targets = rand_targets([3, 2], gen)
    outputs = rand_outputs(2, 10, gen)
    ref = criterion(outputs, targets)
    low = {k: v.bfloat16().requires_grad_() for k, v in outputs.items()}
    losses = criterion(low, targets)
    for key in ("loss_ce", "loss_bbox", "loss_giou"):
        assert losses[key].dtype == torch.float32
        torch.testing.assert_close(losses[key], ref[key], rtol=2e-2, atol=2e-2)
    (losses["loss_ce"] + losses["loss_bbox"]).backward()
    assert low["pred_logits"].grad.dtype == torch.bfloat16 and low["pred_boxes"].grad.abs().sum() > 0


def _outputs_with_aux(B, Q, gen, n_aux, requires_grad=True):
    outputs = rand_outputs(B, Q, gen)
    outputs["aux_outputs"] = [rand_outputs(B, Q, gen) for _ in range(n_aux)]
    leaves = [outputs["pred_logits"], outputs["pred_boxes"]] + [
        t for aux in outputs["aux_outputs"] for t in (aux["pred_logits"], aux["pred_boxes"])
    ]
    for t in leaves:
        t.requires_grad_(requires_grad)
    return outputs, leaves


def test_compiled_losses_equal_eager_for_every_number_of_matches_without_recompiling(gen):
    """engine.compile compiles stacked_losses once (dynamic shapes): the padded number of matched pairs changes
    from batch to batch."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = make_criterion()
    compiled = make_criterion()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.stacked_losses = torch.compile(compiled.stacked_losses, dynamic=True, backend=counter, fullgraph=True)
    frames = []
    for sizes in ([3, 5], [2, 1], [10, 12], [20, 30]):  # 8, 3, 22 and 50 targets: 16, 8, 32 and 64 slots
        outputs, leaves = _outputs_with_aux(2, 12, gen, n_aux=5)
        targets = rand_targets(sizes, gen)
        expected = eager(outputs, targets)
        got = compiled(outputs, targets)
        assert set(got) == set(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-6, msg=name)
        total = sum(v * eager.weight_dict[k] for k, v in expected.items() if k in eager.weight_dict)
        total_compiled = sum(v * eager.weight_dict[k] for k, v in got.items() if k in eager.weight_dict)
        grads = torch.autograd.grad(total, leaves)
        grads_compiled = torch.autograd.grad(total_compiled, leaves)
        for g, g_compiled in zip(grads, grads_compiled):
            torch.testing.assert_close(g_compiled, g, rtol=1e-5, atol=1e-7)
        frames.append(counter.frame_count)
    assert frames[0] == 1 and frames[-1] <= 2, frames  # at most one recompile, when a size first becomes symbolic
