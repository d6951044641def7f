"""Hybrid matching (H-DETR; model.one_to_many=hybrid): off, a training step computes bit for bit what it computed
before the one-to-many options existed; on, the one-to-one queries compute what the model without the one-to-many
queries computes, the one-to-many losses are the criterion's on the targets repeated k_one2many times, and
checkpoints load, evaluate and export across the option (CPU, tiny configs)."""

from __future__ import annotations

import argparse
import json
import logging
import lzma
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    VARIANTS,
    fingerprint_environment,
    image_batch,
    make_criterion,
    make_step,
    model_cfg,
    output_loss,
    rand_outputs,
    rand_targets,
    tiny_cfg,
    training_fingerprint,
    write_checkpoint,
)
from omegaconf import OmegaConf

from engine.checkpoint.contents import load_model_weights
from engine.checkpoint.init_from import prepare_init_from
from models import build_deformable_detr, build_model
from models.criterion import AUX_SUFFIX, combination_over_passes

FINGERPRINTS = ROOT / "tests" / "data" / "training_fingerprints.json"
OFFICIAL_TSV = ROOT / "tests" / "data" / "official_state_dict.tsv"
EARLIER_CHECKPOINT = ROOT / "tests" / "data" / "checkpoint_of_9f3f177.pth.xz"  # model=tiny, written before the option
# 10 one-to-one queries (tiny_cfg), 12 one-to-many, targets repeated 3 times.
HYBRID = {"one_to_many": "hybrid", "num_queries_one2many": 12, "k_one2many": 3}
ONE2MANY_PARAMETERS = {"query_embed_one2many.weight"}  # the hybrid one-stage model's training-only tensors
Q, Q2 = 10, 12


def plain_and_hybrid(variant: str, **overrides):
    """The SMALL model of ``variant`` without and with hybrid matching, holding the same weights (the hybrid one's
    one-to-many query embeddings apart, which the plain one has not)."""
    torch.manual_seed(0)
    plain = build_deformable_detr(tiny_cfg(variant, **overrides))
    torch.manual_seed(1)
    hybrid = build_deformable_detr(tiny_cfg(variant, **HYBRID, **overrides))
    loaded = hybrid.load_state_dict(plain.state_dict(), strict=False)
    assert set(loaded.missing_keys) == (set() if variant == "two_stage" else ONE2MANY_PARAMETERS)
    assert not loaded.unexpected_keys
    return plain, hybrid


def one2one_outputs(outputs: dict) -> dict:
    return {k: v for k, v in outputs.items() if k != "one2many_outputs"}


def assert_same_outputs(got: dict, expected: dict, **tolerance) -> None:
    assert set(got) == set(expected)
    flat_got, flat_expected = torch.utils._pytree.tree_flatten(got)[0], torch.utils._pytree.tree_flatten(expected)[0]
    for g, e in zip(flat_got, flat_expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance)


# ----------------------------------------------------------------------------------------------------
# the option off
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_with_the_option_off_a_training_step_computes_what_it_computed_before_the_option(variant):
    """The outputs, losses and gradients of one training step against those the code before hybrid matching
    computed (tests/data/training_fingerprints.json), the option's other keys set away from their defaults: bit for
    bit where the reference's torch release and CPU instruction set are this machine's, else to their rounding."""
    reference = json.loads(FINGERPRINTS.read_text())
    expected = reference["variants"][variant]
    got = training_fingerprint(
        variant,
        one_to_many="none",
        num_queries_one2many=5,
        k_one2many=2,
        lambda_one2many=0.5,
        cls_loss_coef_one2many=3.0,
        mixed_selection=False,
        look_forward_twice=False,
        cross_attention_first=False,
    )
    for part in ("outputs", "losses", "gradients"):
        assert set(got[part]["sums"]) == set(expected[part]["sums"]), part
        if fingerprint_environment() == reference["environment"]:
            assert got[part]["sums"] == expected[part]["sums"], part
            assert got[part]["sha256"] == expected[part]["sha256"], part
        else:
            # Another torch's kernels and another CPU's vector width round otherwise; a change of what is computed
            # moves a sum by far more.
            for name, (total, magnitude) in expected[part]["sums"].items():
                assert got[part]["sums"][name] == pytest.approx([total, magnitude], abs=5e-4 * magnitude + 1e-6), (
                    f"{part} {name}"
                )


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_one_to_one_queries_compute_what_the_model_without_the_others_computes(variant):
    """Neither group of queries attends to the other: the hybrid model's one-to-one outputs, and the gradients a
    loss on them gives the shared weights, are those of the model without one-to-many queries, to fp32 rounding."""
    plain, hybrid = plain_and_hybrid(variant)
    images, mask = image_batch(pad_w=16)
    expected, got = plain(images, mask), hybrid(images, mask)
    assert_same_outputs(one2one_outputs(got), expected, rtol=1e-5, atol=1e-5)
    many = got["one2many_outputs"]
    assert set(many) == {"pred_logits", "pred_boxes", "aux_outputs"}
    assert many["pred_logits"].shape == (2, Q2, 5) and many["pred_boxes"].shape == (2, Q2, 4)
    assert [tuple(a["pred_boxes"].shape) for a in many["aux_outputs"]] == [(2, Q2, 4)]  # dec_layers - 1

    output_loss(expected).backward()
    output_loss(one2one_outputs(got)).backward()
    shared = dict(plain.named_parameters())
    for name, p in hybrid.named_parameters():
        if name in ONE2MANY_PARAMETERS:
            assert p.grad is None or not p.grad.any(), name  # no one-to-one output depends on them
        elif p.requires_grad:
            torch.testing.assert_close(
                p.grad, shared[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.parametrize("variant", ["base", "box_refine"])
def test_the_one_to_many_queries_see_nothing_of_the_one_to_one_queries(variant):
    """The mask's other half: a loss on the one-to-many outputs gives the one-to-one query embeddings no gradient."""
    _, hybrid = plain_and_hybrid(variant)
    output_loss(hybrid(*image_batch(pad_w=16))["one2many_outputs"]).backward()
    assert hybrid.query_embed_one2many.weight.grad.abs().sum() > 0
    assert not hybrid.query_embed.weight.grad.any()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_detect_gives_the_detections_of_the_model_without_the_option(variant):
    plain, hybrid = plain_and_hybrid(variant)
    plain.eval()
    hybrid.eval()
    images, mask = image_batch(pad_w=16, pixels=True)
    with torch.no_grad():
        expected, got = plain.detect(images, mask), hybrid.detect(images, mask)
    assert "one2many_outputs" not in got and got["pred_logits"].shape == (2, Q, 5)
    assert_same_outputs(got, expected, rtol=1e-5, atol=1e-5)


def test_two_stage_needs_room_for_both_groups_of_proposals():
    model = build_deformable_detr(tiny_cfg("two_stage", **{**HYBRID, "num_queries_one2many": 80}))
    with pytest.raises(
        ValueError,
        match=r"selects 90 proposals \(num_queries \+ num_queries_one2many\) but the "
        r"feature maps have only 84 positions",
    ):
        model(*image_batch())
    with torch.no_grad():
        assert model.eval().detect(*image_batch())["pred_logits"].shape == (2, Q, 5)  # inference needs Q alone


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"k_one2many": 0}, r"model\.k_one2many must be an integer >= 1 .*got 0"),
        ({"lambda_one2many": -1.0}, r"model\.lambda_one2many must be a finite number >= 0, got -1\.0"),
        ({"lambda_one2many": float("inf")}, r"model\.lambda_one2many must be a finite number >= 0, got inf"),
        ({"num_queries_one2many": 0}, r"model\.num_queries_one2many must be an integer >= 1, got 0"),
        (
            {"one_to_many": "sometimes"},
            r"Invalid value 'sometimes', expected one of \[none, hybrid, mixed\]\s+full_key: model\.one_to_many",
        ),
        ({"k_one2many": 2.5}, r"could not be converted to Integer\s+full_key: model\.k_one2many"),
    ],
)
def test_bad_hybrid_matching_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(tiny_cfg(**{**HYBRID, **overrides}))


def test_the_shipped_configs_keep_the_option_off_with_h_detrs_settings():
    from helpers import compose_train

    full, tiny = OmegaConf.load(ROOT / "configs" / "model" / "deformable_detr.yaml"), compose_train("model=tiny").model
    assert (full.one_to_many, full.num_queries_one2many, full.k_one2many, full.lambda_one2many) == (
        "none",
        1500,
        6,
        1.0,
    )
    assert (tiny.one_to_many, tiny.num_queries_one2many, tiny.k_one2many) == ("none", 5 * tiny.num_queries, 6)


# ----------------------------------------------------------------------------------------------------
# the losses
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[3, 1], [0, 2], [5, 4]])  # [5, 4]: more repeated targets than queries
@pytest.mark.parametrize("num_boxes", [None, 6.0, "tensor"])
def test_one_to_many_losses_are_the_criterions_on_the_targets_repeated_k_times(sizes, num_boxes):
    """H-DETR's reference: the plain criterion on the one-to-many outputs (no encoder proposals: their loss is counted
    once) against each image's targets repeated k times, divided by k times the box count; the one-to-one losses
    are the plain criterion's."""
    gen = torch.Generator().manual_seed(sum(sizes))
    k = 3
    layers, many = [rand_outputs(2, 6, gen) for _ in range(3)], [rand_outputs(2, 10, gen) for _ in range(3)]
    one2many = {**many[-1], "aux_outputs": many[:-1]}
    outputs = {
        **layers[-1],
        "aux_outputs": layers[:-1],
        "enc_outputs": rand_outputs(2, 20, gen),
        "one2many_outputs": one2many,
    }
    targets = rand_targets(sizes, gen)
    given = torch.tensor(6.0) if num_boxes == "tensor" else num_boxes
    count = 6.0 if num_boxes is not None else max(1.0, float(sum(sizes)))
    hybrid = make_criterion(dec_layers=3, two_stage=True, one_to_many="hybrid", k_one2many=k)
    plain = make_criterion(dec_layers=3, two_stage=True)
    losses = hybrid(outputs, targets, num_boxes=given)

    repeated = [{**t, "labels": t["labels"].repeat(k), "boxes": t["boxes"].repeat(k, 1)} for t in targets]
    reference = plain(one2many, repeated, num_boxes=k * count)
    one2one = plain(one2one_outputs(outputs), targets, num_boxes=count)
    assert set(losses) == set(one2one) | {name + "_one2many" for name in reference}
    assert "loss_ce_enc_one2many" not in losses
    for name, value in reference.items():
        torch.testing.assert_close(
            losses[name + "_one2many"], value, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    for name, value in one2one.items():
        torch.testing.assert_close(losses[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_matching_repeated_targets_copies_their_costs_and_gives_the_pairs_of_the_repeated_targets():
    gen = torch.Generator().manual_seed(3)
    criterion = make_criterion()
    outputs, targets = rand_outputs(3, 9, gen), rand_targets([2, 0, 4], gen)
    groups = [(outputs["pred_logits"][None], outputs["pred_boxes"][None], targets)]
    repeated = [{**t, "boxes": t["boxes"].repeat(3, 1), "labels": t["labels"].repeat(3)} for t in targets]
    got = criterion.matcher.match_groups([(*groups[0], 3)])[0][0]
    expected = criterion.matcher.match_groups([(*groups[0][:2], repeated)])[0][0]
    assert [len(i) for i, _ in got] == [6, 0, 9]  # min(Q, 3 n)
    for (gi, gj), (ei, ej) in zip(got, expected):
        assert torch.equal(gi, ei) and torch.equal(gj, ej)
    with pytest.raises(ValueError, match=r"a group's repeats must be an integer >= 1, got 0"):
        criterion.matcher.match_groups([(*groups[0], 0)])


def test_many_blocks_are_solved_on_threads_with_the_pairs_of_one_thread(monkeypatch):
    import models.matcher as matcher_module

    gen = torch.Generator().manual_seed(11)
    criterion = make_criterion()
    sizes = torch.randint(0, 6, (8,), generator=gen).tolist()
    targets = rand_targets(sizes, gen)
    groups = [
        (torch.randn(G, 8, Q, 5, generator=gen), torch.rand(G, 8, Q, 4, generator=gen), targets, r)
        for G, Q, r in ((3, 7, 1), (3, 40, 4))
    ]
    pools = []

    class CountedPool(matcher_module.ThreadPoolExecutor):
        def __init__(self, threads):
            pools.append(threads)
            super().__init__(threads)

    assert matcher_module._solver_threads(999_999) == 0  # small calls stay on one thread
    monkeypatch.setattr(matcher_module, "ThreadPoolExecutor", CountedPool)
    monkeypatch.setattr(matcher_module, "_solver_threads", lambda costs: 1)
    alone = criterion.matcher.match_groups(groups)
    monkeypatch.setattr(matcher_module, "_solver_threads", lambda costs: 4)
    threaded = criterion.matcher.match_groups(groups)
    assert pools == [4]
    for (G, Q, r), layers_alone, layers_threaded in zip(((3, 7, 1), (3, 40, 4)), alone, threaded):
        assert len(layers_threaded) == G
        for images_alone, images_threaded in zip(layers_alone, layers_threaded):
            assert [len(i) for i, _ in images_threaded] == [min(Q, n * r) for n in sizes]
            for (ai, aj), (ti, tj) in zip(images_alone, images_threaded, strict=True):
                assert torch.equal(ai, ti) and torch.equal(aj, tj)


def test_weights_names_and_their_combination_over_passes():
    criterion = make_criterion(dec_layers=3, two_stage=True, one_to_many="hybrid", k_one2many=2, lambda_one2many=0.5)
    plain = make_criterion(dec_layers=3, two_stage=True)
    decoder = {k: v for k, v in plain.weight_dict.items() if not k.endswith("_enc")}
    assert criterion.weight_dict == {**plain.weight_dict, **{k + "_one2many": 0.5 * v for k, v in decoder.items()}}
    assert [r.name for r in criterion.compile_regions(graphs=True)] == [
        "stacked_losses",
        "stacked_proposal_losses",
        "stacked_one2many_losses",
    ]
    assert all(r.training for r in criterion.compile_regions(graphs=True))
    assert [r.name for r in plain.compile_regions()] == ["stacked_losses", "stacked_proposal_losses"]
    # Per-layer copies are left out of the logged totals; the last layer's one-to-many losses are not.
    assert [bool(AUX_SUFFIX.search(n)) for n in ("loss_ce_one2many", "loss_ce_0_one2many", "loss_ce_enc")] == [
        False,
        True,
        True,
    ]
    assert [
        combination_over_passes(n)
        for n in ("loss_giou_one2many", "loss_bbox_1_one2many", "class_error_one2many", "cardinality_error_0_one2many")
    ] == ["sum", "sum", "boxes", "images"]


def test_a_criterion_and_outputs_of_other_one_to_many_settings_are_refused():
    gen = torch.Generator().manual_seed(0)
    outputs = {**rand_outputs(1, 4, gen), "one2many_outputs": rand_outputs(1, 6, gen)}
    with pytest.raises(ValueError, match=r"the outputs have one2many_outputs but the criterion's one_to_many is none"):
        make_criterion(aux_loss=False)(outputs, rand_targets([2], gen))
    with pytest.raises(ValueError, match=r"the outputs have no one2many_outputs but the criterion's one_to_many is"):
        make_criterion(aux_loss=False, one_to_many="mixed")(rand_outputs(1, 4, gen), rand_targets([2], gen))


@pytest.mark.parametrize("variant", ["base", "two_stage"])
def test_a_step_in_passes_adds_up_to_the_step_in_one_pass(variant):
    """Gradient accumulation: the one-to-many losses are divided by the whole step's (repeated) box count, so the
    passes' losses and gradients add up to the one pass's."""
    whole, passes = (make_step(variant, dropout=0.0, **HYBRID) for _ in range(2))
    passes.model.load_state_dict(whole.model.state_dict())
    passes.images_per_pass = 1
    images, mask = image_batch(pad_w=16)
    targets = rand_targets([3, 1], torch.Generator().manual_seed(0))
    expected, got = whole(images, mask, targets), passes(images, mask, targets)
    assert "loss_ce_one2many" in whole.value_names and "loss_bbox_0_one2many" in whole.value_names
    # [total, gradient norm, losses...]: the norm sums every gradient's square, each gradient as close as below.
    torch.testing.assert_close(got[1], expected[1], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(got[[0, *range(2, len(got))]], expected[[0, *range(2, len(got))]], rtol=1e-4, atol=1e-5)
    for (name, e), g in zip(whole.model.named_parameters(), passes.model.parameters()):
        if e.grad is not None:
            torch.testing.assert_close(g.grad, e.grad, rtol=1e-3, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------
def test_official_layout_weights_start_a_hybrid_model_with_fresh_one_to_many_queries(tmp_path, caplog):
    shapes = {}
    for line in OFFICIAL_TSV.read_text().splitlines():
        if line.startswith("base\t"):
            _, name, shape = line.split("\t")
            shapes[name] = tuple(int(d) for d in shape.split("x"))
    generator = torch.Generator().manual_seed(7)
    state = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    args = argparse.Namespace(with_box_refine=False, two_stage=False, hidden_dim=256, num_queries=300)
    torch.save({"model": state, "args": args}, tmp_path / "r50.pth")
    cfg = model_cfg(msda="pytorch", one_to_many="hybrid", init_from=str(tmp_path / "r50.pth"))
    init = prepare_init_from(cfg)
    torch.manual_seed(0)
    model = build_deformable_detr(cfg)
    fresh = model.query_embed_one2many.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        report = init.load_into(model)
    assert sorted(report.loaded) == sorted(state) and report.not_in_checkpoint == sorted(ONE2MANY_PARAMETERS)
    assert model.query_embed_one2many.weight.shape == (1500, 512)
    assert torch.equal(model.query_embed_one2many.weight, fresh)
    assert torch.equal(model.query_embed.weight, state["query_embed.weight"])
    assert (
        "1 model tensors not in the checkpoint keep their initialization (query_embed_one2many.weight)" in caplog.text
    )


def earlier_checkpoint(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "earlier.pth"
    path.write_bytes(lzma.decompress(EARLIER_CHECKPOINT.read_bytes()))
    return path, torch.load(path, map_location="cpu", weights_only=False)


def test_an_earlier_checkpoint_of_ours_starts_a_hybrid_model_and_evaluates_in_one(tmp_path, caplog):
    path, ckpt = earlier_checkpoint(tmp_path)
    recorded = {**ckpt["config"]["model"], "one_to_many": "hybrid"}
    cfg = model_cfg(**{**recorded, "init_from": str(path)})
    init = prepare_init_from(cfg)
    model = build_deformable_detr(cfg)
    report = init.load_into(model)
    assert report.not_in_checkpoint == sorted(ONE2MANY_PARAMETERS) and len(report.loaded) == len(ckpt["model"])
    evaluated = build_deformable_detr(model_cfg(**recorded))  # eval_only with model.one_to_many=hybrid
    with caplog.at_level(logging.INFO):
        load_model_weights(evaluated, ckpt, path=path)
    assert "has none of this model's 1 tensors of one-to-many supervision's training (query_embed_one2many.weight)" in (
        caplog.text
    )
    assert torch.equal(evaluated.query_embed.weight, ckpt["model"]["query_embed.weight"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_hybrid_checkpoint_evaluates_in_a_model_without_the_option(tmp_path, caplog, variant):
    plain, hybrid = plain_and_hybrid(variant)
    torch.manual_seed(2)
    evaluated = build_deformable_detr(tiny_cfg(variant))
    with caplog.at_level(logging.INFO):
        load_model_weights(evaluated, {"model": hybrid.state_dict()}, path=tmp_path / "hybrid.pth")
    assert ("holds 1 tensors of one-to-many supervision's training (query_embed_one2many.weight)" in caplog.text) == (
        variant != "two_stage"
    )  # two-stage's one-to-many queries are proposals: no parameters
    for (name, e), g in zip(plain.state_dict().items(), evaluated.state_dict().values(), strict=True):
        assert torch.equal(g, e), name


def test_a_hybrid_checkpoint_predicts_and_exports_as_the_model_without_the_option(tmp_path):
    """load_trained_model (predict.py, export.py) builds the model without the option, so the exported program is
    that model's; the ONNX export of the hybrid checkpoint passes its parity check."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx
    from hydra import compose, initialize_config_dir

    import export as exporter
    from engine.checkpoint.trained_model import load_trained_model
    from engine.export.exportable import ExportableDetector, trace

    for folder in ("hybrid", "plain"):
        (tmp_path / folder).mkdir()
    hybrid_path = write_checkpoint(
        tmp_path / "hybrid" / "checkpoint.pth",
        extra=("model.dec_layers=1", "model.one_to_many=hybrid", "model.num_queries_one2many=24"),
    )
    ckpt = torch.load(hybrid_path, weights_only=False)
    assert "query_embed_one2many.weight" in ckpt["model"]
    plain_path = tmp_path / "plain" / "checkpoint.pth"
    torch.save(
        {
            **ckpt,
            "model": {k: v for k, v in ckpt["model"].items() if k not in ONE2MANY_PARAMETERS},
            "config": {**ckpt["config"], "model": {**ckpt["config"]["model"], "one_to_many": "none"}},
        },
        plain_path,
    )
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="export", overrides=["device=cpu", f"checkpoint={hybrid_path}", "dynamic=false"])
    cpu = torch.device("cpu")
    trained, plain = (load_trained_model(p, cfg.model, device=cpu, msda="pytorch") for p in (hybrid_path, plain_path))
    assert trained.model.num_queries_one2many == 0 and set(trained.model.state_dict()) == set(plain.model.state_dict())
    images, mask = image_batch(B=1, H=96, W=128)
    programs = [trace(ExportableDetector(t.model).eval(), (images, mask), dynamic=False) for t in (trained, plain)]
    assert str(programs[0].graph) == str(programs[1].graph)
    for (name, e), g in zip(programs[1].state_dict.items(), programs[0].state_dict.values(), strict=True):
        assert torch.equal(g, e), name

    exported = exporter.export(cfg)  # raises ExportParityError when the file's outputs are not the model's
    graph = onnx.load(exported["output"]).graph
    assert not [i.name for i in graph.initializer if "one2many" in i.name]
    assert [i.name for i in graph.output] == ["pred_logits", "pred_boxes"]
    assert graph.output[0].type.tensor_type.shape.dim[1].dim_value == 10  # model.num_queries of write_checkpoint


# ----------------------------------------------------------------------------------------------------
# train.py
# ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_hybrid_run_logs_its_losses_resumes_exactly_and_evaluates_with_or_without_the_option(tmp_path):
    """The tiny run (2 epochs of 3 steps) with hybrid matching, each step in 2 passes; resumed from its first epoch it
    computes the same losses; its checkpoint evaluates to the run's own figures with the option off on the command
    line."""
    from helpers import compose_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import train as trainer
    from engine.checkpoint.io import load_checkpoint

    data_root = tmp_path / "data"
    hybrid = (
        "model.one_to_many=hybrid",
        "model.num_queries_one2many=20",
        "model.k_one2many=2",
        "total_batch_size=4",
        "batch_size=2",
    )
    run = trainer.train(compose_run(data_root, tmp_path / "run", *hybrid))
    run_dir = run["output_dir"]
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss_ce_one2many", "train/loss_giou_one2many_unscaled", "train/loss_ce"} <= tags
    assert not [t for t in tags if "_0" in t]  # per-layer copies are not logged
    assert load_checkpoint(run_dir / "checkpoint.pth")["config"]["model"]["one_to_many"] == "hybrid"

    resumed = trainer.train(
        compose_run(data_root, tmp_path / "resumed", *hybrid, f"resume={run_dir / 'checkpoint_epoch0001.pth'}")
    )
    assert resumed["losses"] == pytest.approx(run["losses"][3:], rel=1e-5)

    evaluated = trainer.evaluate_checkpoint(
        compose_run(
            data_root,
            tmp_path / "eval",
            "eval_only=true",
            f"checkpoint={run_dir / 'checkpoint.pth'}",
            "model.one_to_many=none",
        )
    )
    assert evaluated["eval"] == pytest.approx(run["eval"], abs=1e-12)


@pytest.mark.slow
def test_two_stage_queries_a_size_bucket_cannot_hold_are_refused_before_the_first_step(tmp_path):
    """The tiny run's training buckets (sides of 64 to 80 pixels, 3 levels) have about a hundred encoder tokens: 10 +
    200 queries to select is refused with the settings, naming the keys and the bucket, before anything is trained or
    saved."""
    from helpers import compose_run

    import train as trainer
    from engine.errors import SettingsError

    two_stage = ("model.with_box_refine=true", "model.two_stage=true", "model.one_to_many=hybrid")
    with pytest.raises(
        SettingsError,
        match=r"model\.two_stage=true selects 210 queries \(model\.num_queries=10 \+ model\.num_queries_one2many=200\) "
        r"among the encoder's tokens, but the smallest training size bucket, \d+x\d+, has only \d+: lower "
        r"model\.num_queries_one2many or model\.num_queries",
    ):
        trainer.train(compose_run(tmp_path / "data", tmp_path / "run", *two_stage, "model.num_queries_one2many=200"))
    assert not (tmp_path / "run" / "checkpoint.pth").exists() and not (tmp_path / "run" / "tensorboard").exists()
