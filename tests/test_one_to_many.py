"""Mixed supervision (MS-DETR; model.one_to_many=mixed) and Deformable-DETR++'s training changes (mixed query
selection, look forward twice, the decoder's cross-attention first): the assignment against a plain loop, on the
device with nothing read back, the one-to-one matching untouched, the training-only parts absent at inference, and
what each training change feeds or lets a loss reach."""

from __future__ import annotations

import pytest
import torch
from helpers import VARIANTS, image_batch, make_criterion, output_loss, rand_boxes, rand_targets, tiny_cfg
from torchvision.ops import box_convert, box_iou

from models import build_deformable_detr, build_model
from models.one_to_many import (
    MAX_POSITIVE_SHARE,
    QUALITY_IOU_WEIGHT,
    QUALITY_THRESHOLD,
    assign_one_to_many,
    one_to_many_losses,
)

MIXED = {"one_to_many": "mixed"}
PLACEMENTS = {"cross_attention_first": {"cross_attention_first": True}, "layer_output": {}}


# ----------------------------------------------------------------------------------------------------
# the assignment
# ----------------------------------------------------------------------------------------------------
def reference_pairs(logits, boxes, labels, target_boxes, k) -> list[list[int]]:
    """MS-DETR's assignment of one layer's predictions for one image, a plain loop: each target's paired queries,
    best first (equal qualities: the lower query first)."""
    Q, T = len(boxes), len(labels)
    if T == 0:
        return []
    probability = logits.sigmoid()
    iou = box_iou(box_convert(target_boxes, "cxcywh", "xyxy"), box_convert(boxes, "cxcywh", "xyxy"))
    quality = [
        [
            QUALITY_IOU_WEIGHT * float(iou[t, q]) + (1 - QUALITY_IOU_WEIGHT) * float(probability[q, labels[t]])
            for q in range(Q)
        ]
        for t in range(T)
    ]
    best = [max(quality[t][q] for t in range(T)) for q in range(Q)]
    best_target = [min(t for t in range(T) if quality[t][q] == best[q]) for q in range(Q)]
    positive = {q for q in range(Q) if best[q] >= QUALITY_THRESHOLD}
    for t in range(T):  # each target's best query (the lowest of equal ones)
        positive.add(min(q for q in range(Q) if quality[t][q] == max(quality[t])))
    cap = max(1, int(MAX_POSITIVE_SHARE * Q))
    kept = sorted(positive, key=lambda q: (-best[q], q))[:cap]
    counts = [sum(1 for q in kept if best_target[q] == t) for t in range(T)]
    ranked = [sorted(range(Q), key=lambda q, t=t: (-quality[t][q], q)) for t in range(T)]
    return [ranked[t][: min(counts[t], k, Q)] for t in range(T)]


def padded(targets: list[dict], T: int):
    labels = torch.zeros(len(targets), T, dtype=torch.int64)
    boxes = torch.full((len(targets), T, 4), 0.5)
    real = torch.zeros(len(targets), T, dtype=torch.bool)
    for b, t in enumerate(targets):
        n = len(t["labels"])
        labels[b, :n], boxes[b, :n], real[b, :n] = t["labels"], t["boxes"], True
    return labels, boxes, real


@pytest.mark.parametrize(
    "sizes, Q, k",
    [
        ([3, 0, 5], 12, 6),  # an image without targets
        ([9, 2], 6, 6),  # more targets than queries
        ([4, 4], 20, 2),
        ([1], 1, 6),
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_the_assignment_is_ms_detrs_on_random_boxes(sizes, Q, k, ties):
    gen = torch.Generator().manual_seed(sum(sizes) * 31 + Q)
    G, B, K = 2, len(sizes), 5
    logits = torch.randn(G, B, Q, K, generator=gen) * 2
    boxes = rand_boxes(G * B * Q, gen).view(G, B, Q, 4)
    targets = rand_targets(sizes, gen, num_classes=K)
    if ties:  # queries predicting the same box and scores: equal qualities everywhere
        logits[:, :, 1::2] = logits[:, :, ::2][:, :, : logits[:, :, 1::2].shape[2]]
        boxes[:, :, 1::2] = boxes[:, :, ::2][:, :, : boxes[:, :, 1::2].shape[2]]
        for t in targets:
            if len(t["labels"]) > 1:
                t["boxes"][1], t["labels"][1] = t["boxes"][0], t["labels"][0]
    T = max(1, max(sizes))
    labels, target_boxes, real = padded(targets, T)
    queries, paired, quality = assign_one_to_many(logits, boxes, labels, target_boxes, real, k)
    for g in range(G):
        for b, t in enumerate(targets):
            expected = reference_pairs(logits[g, b], boxes[g, b], t["labels"], t["boxes"], k)
            got = [queries[g, b, i][paired[g, b, i]].tolist() for i in range(len(t["labels"]))]
            assert got == expected, (g, b)
            assert not paired[g, b, len(t["labels"]) :].any()  # padding targets get nothing
    assert (quality[paired] >= 0).all()


def test_the_assignment_and_its_losses_read_nothing_back_from_the_device():
    """On the meta device every tensor has a shape and no value: reading one (.item(), .tolist(), a Python if on a
    tensor) or making a tensor whose size depends on values (nonzero, a boolean mask) raises there. The assignment,
    the losses and their gradient run through."""
    G, B, Q, K, T = 3, 2, 12, 5, 8
    meta = torch.device("meta")
    logits = torch.empty(G, B, Q, K, device=meta, requires_grad=True)
    boxes = torch.empty(G, B, Q, 4, device=meta, requires_grad=True)
    labels = torch.empty(B, T, dtype=torch.int64, device=meta)
    target_boxes, real = torch.empty(B, T, 4, device=meta), torch.empty(B, T, dtype=torch.bool, device=meta)
    queries, paired, _ = assign_one_to_many(logits, boxes, labels, target_boxes, real, 6)
    assert queries.shape == paired.shape == (G, B, T, 6)
    losses = one_to_many_losses(logits, boxes, labels, target_boxes, real, k=6, focal_alpha=0.25)
    assert {name: tuple(v.shape) for name, v in losses.items()} == dict.fromkeys(
        ("loss_ce", "loss_bbox", "loss_giou"), (G,)
    )
    sum(v.sum() for v in losses.values()).backward()
    assert logits.grad.shape == logits.shape and boxes.grad.shape == boxes.shape


def test_the_losses_are_a_plain_sum_over_the_pairs_with_each_query_its_best_pairs_class():
    """Crowded targets, so that queries are paired with several: the classification target of such a query is its
    pair of best quality's class (the lower target of equal ones), and every pair counts in the box losses."""
    from models.losses import classification_loss, paired_generalized_box_iou

    gen = torch.Generator().manual_seed(7)
    G, B, Q, K, k = 2, 2, 24, 4, 4
    logits = 3 + torch.randn(G, B, Q, K, generator=gen)  # confident: quality is mostly IoU, many positives
    centre = 0.45 + 0.1 * torch.rand(G, B, Q, 2, generator=gen)
    boxes = torch.cat([centre, 0.2 + 0.1 * torch.rand(G, B, Q, 2, generator=gen)], -1)  # all near the middle
    targets = [
        {"labels": torch.randint(0, K, (n,), generator=gen), "boxes": rand_boxes(n, gen) * 0.2 + 0.4} for n in (5, 3)
    ]
    labels, target_boxes, real = padded(targets, 8)
    queries, paired, quality = assign_one_to_many(logits, boxes, labels, target_boxes, real, k)
    classes = torch.full((G, B, Q), K)
    l1, giou = torch.zeros(G), torch.zeros(G)
    duplicates = 0
    for g in range(G):
        for b, t in enumerate(targets):
            pairs = [
                (float(quality[g, b, i, j]), i, int(queries[g, b, i, j]))
                for i in range(len(t["labels"]))
                for j in range(queries.shape[3])
                if paired[g, b, i, j]
            ]
            by_query = {}
            for q_value, i, q in pairs:
                by_query.setdefault(q, []).append((-q_value, i))
            duplicates += sum(len(v) > 1 for v in by_query.values())
            for q, options in by_query.items():
                classes[g, b, q] = t["labels"][min(options)[1]]
            for _, i, q in pairs:
                l1[g] += (boxes[g, b, q] - t["boxes"][i]).abs().sum()
                xyxy = box_convert(torch.stack([boxes[g, b, q], t["boxes"][i]]), "cxcywh", "xyxy")
                giou[g] += 1 - paired_generalized_box_iou(xyxy[:1], xyxy[1:])[0]
    assert duplicates > 0  # the case this test is about happened
    losses = one_to_many_losses(logits, boxes, labels, target_boxes, real, k=k, focal_alpha=0.25)
    torch.testing.assert_close(losses["loss_ce"], classification_loss(logits, classes, alpha=0.25))
    torch.testing.assert_close(losses["loss_bbox"], l1)
    torch.testing.assert_close(losses["loss_giou"], giou)


# ----------------------------------------------------------------------------------------------------
# the criterion and the model
# ----------------------------------------------------------------------------------------------------
def test_the_one_to_one_losses_are_those_of_the_same_outputs_without_mixed_supervision():
    gen = torch.Generator().manual_seed(5)
    outputs = {
        "pred_logits": torch.randn(2, 10, 5, generator=gen),
        "pred_boxes": rand_boxes(20, gen).view(2, 10, 4),
        "aux_outputs": [
            {"pred_logits": torch.randn(2, 10, 5, generator=gen), "pred_boxes": rand_boxes(20, gen).view(2, 10, 4)}
        ],
    }
    one2many = {k: v.clone() if torch.is_tensor(v) else [dict(a) for a in v] for k, v in outputs.items()}
    targets = rand_targets([3, 0], gen)
    plain = make_criterion(dec_layers=2)(outputs, targets)
    mixed = make_criterion(dec_layers=2, **MIXED)({**outputs, "one2many_outputs": one2many}, targets)
    assert {k: v for k, v in mixed.items() if "one2many" not in k} == plain
    assert {k for k in mixed if "one2many" in k} == {
        f"{name}{layer}_one2many" for name in ("loss_ce", "loss_bbox", "loss_giou") for layer in ("_0", "")
    }


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_supervisions_parts_are_training_only_and_inference_is_the_model_without_them(variant, placement):
    """Built for inference (one_to_many=none, the order kept), the model has no training-only tensor, loads the
    trained one's others, and detects what the trained one detects; with the original order it is today's model."""
    torch.manual_seed(0)
    trained = build_deformable_detr(tiny_cfg(variant, **MIXED, **PLACEMENTS[placement])).eval()
    only = [name for name in trained.state_dict() if trained.is_training_only(name)]
    assert only and all(("aux_ffn" in name) == (placement == "cross_attention_first") for name in only)
    inference = build_deformable_detr(tiny_cfg(variant, **PLACEMENTS[placement])).eval()
    assert not [name for name in inference.state_dict() if inference.is_training_only(name)]
    state = {k: v for k, v in trained.state_dict().items() if k not in only}
    inference.load_state_dict(state, strict=True)
    images, mask = image_batch(pad_w=16, pixels=True)
    with torch.no_grad():
        got, expected = inference.detect(images, mask), trained.detect(images, mask)
        training = trained.train()(images, mask)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    assert training["one2many_outputs"]["pred_logits"].shape == training["pred_logits"].shape
    if placement == "layer_output":
        assert set(inference.state_dict()) == set(build_deformable_detr(tiny_cfg(variant)).state_dict())
        # the one-to-many boxes are the one-to-one ones
        assert torch.equal(training["one2many_outputs"]["pred_boxes"], training["pred_boxes"])


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_mixed_step_trains_every_part_and_its_losses_are_weighted_as_ms_detrs(placement):
    torch.manual_seed(0)
    cfg = tiny_cfg("two_stage", **MIXED, **PLACEMENTS[placement], cls_loss_coef=1, cls_loss_coef_one2many=2)
    model, criterion, _ = build_model(cfg)
    assert criterion.weight_dict["loss_ce"] == 1 and criterion.weight_dict["loss_ce_one2many"] == 2
    assert criterion.weight_dict["loss_ce_0_one2many"] == 2 and criterion.weight_dict["loss_bbox_one2many"] == 5
    assert criterion.weight_dict["loss_ce_enc"] == 1 and "loss_ce_enc_one2many" not in criterion.weight_dict
    gen = torch.Generator().manual_seed(1)
    losses = criterion(model(*image_batch()), rand_targets([3, 1], gen))
    sum(losses[k] * w for k, w in criterion.weight_dict.items()).backward()
    untrained = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    # The backbone's frozen stem aside, every parameter the one-to-one model trains, and the training-only ones.
    assert untrained == [n for n in untrained if n.startswith("backbone")] and all(
        p.grad is not None for n, p in model.named_parameters() if model.is_training_only(n)
    )


# ----------------------------------------------------------------------------------------------------
# Deformable-DETR++'s training changes
# ----------------------------------------------------------------------------------------------------
def _decoder_inputs(model, images, mask) -> dict:
    captured = {}
    forward = model.transformer.decoder.forward

    def capture(tgt, reference_points, src, spatial_shapes, valid_ratios, query_pos, *args, **kwargs):
        captured.update(tgt=tgt, reference_points=reference_points, query_pos=query_pos)
        return forward(tgt, reference_points, src, spatial_shapes, valid_ratios, query_pos, *args, **kwargs)

    model.transformer.decoder.forward = capture
    model(images, mask)
    return captured


def test_mixed_selection_takes_positions_from_the_proposals_and_content_from_its_embedding():
    torch.manual_seed(0)
    plain = build_deformable_detr(tiny_cfg("two_stage")).eval()
    mixed = build_deformable_detr(tiny_cfg("two_stage", mixed_selection=True)).eval()
    assert mixed.query_embed.weight.shape == (10, 32)  # (Q, C): one content row per proposal rank
    mixed.load_state_dict({**plain.state_dict(), "query_embed.weight": mixed.query_embed.weight}, strict=True)
    images, mask = image_batch()
    with torch.no_grad():
        without, with_ = _decoder_inputs(plain, images, mask), _decoder_inputs(mixed, images, mask)
    for key in ("reference_points", "query_pos"):  # the top proposals' boxes and position embeddings
        torch.testing.assert_close(with_[key], without[key], rtol=0, atol=0)
    assert torch.equal(with_["tgt"], mixed.query_embed.weight.expand(2, -1, -1))
    assert not torch.equal(without["tgt"][0], without["tgt"][1])  # without: each image's proposals' content


def test_look_forward_twice_lets_a_layers_box_loss_train_the_layer_before_and_changes_no_value():
    """The last layer's box loss reaches the previous layer's box head through the reference it refined; without
    the option it does not; the outputs are the same either way."""
    torch.manual_seed(0)
    cfg = dict(with_box_refine=True, dec_layers=3)
    plain = build_deformable_detr(tiny_cfg("base", **cfg))
    twice = build_deformable_detr(tiny_cfg("base", **cfg, look_forward_twice=True))
    twice.load_state_dict(plain.state_dict(), strict=True)
    images, mask = image_batch()
    reached = {}
    for name, model in (("plain", plain), ("twice", twice)):
        out = model(images, mask)
        out["pred_boxes"].square().sum().backward()  # the last layer's boxes alone
        # (the layers' boxes are stacked: the other layers' heads get zeros through the stack, where nothing reaches)
        reached[name] = [float(model.bbox_embed[i].layers[-1].weight.grad.abs().sum()) for i in range(3)]
        outputs = torch.stack([out["pred_boxes"], *[a["pred_boxes"] for a in out["aux_outputs"]]])
        reached[name + "_outputs"] = outputs.detach()
    assert reached["plain"][0] == 0 and reached["plain"][1] == 0 and reached["plain"][2] > 0
    assert reached["twice"][0] == 0 and reached["twice"][1] > 0 and reached["twice"][2] > 0
    torch.testing.assert_close(reached["twice_outputs"], reached["plain_outputs"], rtol=1e-6, atol=1e-6)


def test_cross_attention_first_runs_each_decoder_layer_in_ms_detrs_order_with_the_same_modules():
    torch.manual_seed(0)
    plain = build_deformable_detr(tiny_cfg("base"))
    reordered = build_deformable_detr(tiny_cfg("base", cross_attention_first=True))
    assert list(reordered.state_dict()) == list(plain.state_dict())  # the official names and shapes
    order = []
    layer = reordered.transformer.decoder.layers[0]
    for name in ("self_attn", "cross_attn", "linear1"):
        getattr(layer, name).register_forward_hook(lambda *a, name=name: order.append(name))
    output_loss(reordered(*image_batch()))
    assert order == ["cross_attn", "self_attn", "linear1"]


# ----------------------------------------------------------------------------------------------------
# checkpoints and train.py
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_mixed_checkpoint_predicts_and_exports_the_model_its_config_records_without_the_training_parts(
    tmp_path, placement
):
    """predict.py's and export.py's model (load_trained_model) is a model built fresh from the checkpoint's recorded
    config with one_to_many=none, holding the checkpoint's weights: the same detections; the ONNX export of it has no
    training-only tensor and passes its parity check."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx
    from helpers import ROOT, write_checkpoint
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import export as exporter
    from engine.checkpoint.trained_model import load_trained_model

    extra = ("model.one_to_many=mixed", *(f"model.{k}=true" for k in PLACEMENTS[placement]))
    path = write_checkpoint(tmp_path / "checkpoint.pth", extra=("model.dec_layers=1", *extra))
    ckpt = torch.load(path, weights_only=False)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="export", overrides=["device=cpu", f"checkpoint={path}", "dynamic=false"])
    trained = load_trained_model(path, cfg.model, device=torch.device("cpu"), msda="pytorch")
    assert not [name for name in trained.model.state_dict() if trained.model.is_training_only(name)]
    fresh = build_deformable_detr(OmegaConf.create({**ckpt["config"]["model"], "one_to_many": "none"})).eval()
    fresh.load_state_dict({k: v for k, v in ckpt["model"].items() if not fresh.is_training_only(k)}, strict=True)
    images, mask = image_batch(B=2, H=96, W=128, pad_w=16, pixels=True)
    with torch.no_grad():
        got, expected = trained.model.detect(images, mask), fresh.detect(images, mask)
    for key in ("pred_logits", "pred_boxes"):
        assert torch.equal(got[key], expected[key])
    exported = exporter.export(cfg)  # raises ExportParityError when the file's outputs are not the model's
    assert not [i.name for i in onnx.load(exported["output"]).graph.initializer if "one2many" in i.name]


@pytest.mark.slow
def test_a_mixed_run_logs_its_losses_resumes_exactly_and_its_checkpoint_evaluates_to_its_figures(tmp_path):
    """The tiny run (2 epochs of 3 steps) of experiment=mixed's model (two-stage with box refinement,
    Deformable-DETR++'s changes, cross-attention first, mixed supervision), each step in 2 passes; resumed from its
    first epoch it computes the same losses; eval_only of its checkpoint gives the run's own figures."""
    from helpers import compose_run, tensorboard_scalars

    import train as trainer
    from engine.checkpoint.io import load_checkpoint

    data_root = tmp_path / "data"
    mixed = (
        "model.with_box_refine=true",
        "model.two_stage=true",
        "model.mixed_selection=true",
        "model.look_forward_twice=true",
        "model.cross_attention_first=true",
        "model.one_to_many=mixed",
        "model.cls_loss_coef=1",
        "model.cls_loss_coef_one2many=2",
        "total_batch_size=4",
        "batch_size=2",
    )
    run = trainer.train(compose_run(data_root, tmp_path / "run", *mixed))
    run_dir = run["output_dir"]
    assert len(tensorboard_scalars(run_dir, "train/loss_ce_one2many")) == 6
    recorded = load_checkpoint(run_dir / "checkpoint.pth")["config"]["model"]
    assert (recorded["one_to_many"], recorded["cross_attention_first"], recorded["mixed_selection"]) == (
        "mixed",
        True,
        True,
    )
    resumed = trainer.train(
        compose_run(data_root, tmp_path / "resumed", *mixed, f"resume={run_dir / 'checkpoint_epoch0001.pth'}")
    )
    assert resumed["losses"] == pytest.approx(run["losses"][3:], rel=1e-5)
    evaluated = trainer.evaluate_checkpoint(
        compose_run(data_root, tmp_path / "eval", "eval_only=true", f"checkpoint={run_dir / 'checkpoint.pth'}")
    )
    assert evaluated["eval"] == pytest.approx(run["eval"], abs=1e-12)
