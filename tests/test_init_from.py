"""engine/checkpoint/init_from.py: model.init_from across a num_classes change, from official-layout weights, and
errors."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from helpers import ROOT, VARIANTS, model_cfg, tiny_cfg
from omegaconf import OmegaConf

from engine.checkpoint.init_from import CLASS_HEAD, prepare_init_from
from engine.errors import CheckpointError
from models import build_deformable_detr

OFFICIAL_TSV = ROOT / "tests" / "data" / "official_state_dict.tsv"


def saved_model(path: Path, cfg, *, seed: int, **extra) -> dict:
    """A model of ``cfg`` with random weights (not the fresh init), saved as {"model", **extra}.

    Randomized per tensor of the model, so heads shared between layers stay shared in the state dict.
    """
    torch.manual_seed(seed)
    model = build_deformable_detr(cfg)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"model": state, **extra}, path)
    return state


def init_model(cfg, *, seed: int):
    init = prepare_init_from(cfg)
    torch.manual_seed(seed)
    model = build_deformable_detr(cfg)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = init.load_into(model)
    return model, fresh, report


def assert_loaded_except_class_heads(model, checkpoint_state, fresh, *, heads_expected: int):
    heads = [k for k in model.state_dict() if CLASS_HEAD.search(k)]
    assert len(heads) == heads_expected
    for name, value in model.state_dict().items():
        if name in heads:
            assert torch.equal(value, fresh[name]), f"{name} keeps its fresh initialization"
            assert value.shape != checkpoint_state[name].shape
        else:
            assert torch.equal(value, checkpoint_state[name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_num_classes_change_reinitializes_only_the_class_heads(tmp_path, variant, caplog):
    source = tiny_cfg(num_classes=7, **VARIANTS[variant])
    state = saved_model(
        tmp_path / "ours.pth", source, seed=3, config={"model": OmegaConf.to_container(source)}, epoch=24, step=1536
    )
    # The config asks for the base variant: the checkpoint's recorded one wins.
    cfg = tiny_cfg(num_classes=4, init_from=str(tmp_path / "ours.pth"))
    with caplog.at_level(logging.INFO, logger="engine"):
        model, fresh, report = init_model(cfg, seed=11)
    assert (cfg.with_box_refine, cfg.two_stage) == (
        VARIANTS[variant].get("with_box_refine", False),
        VARIANTS[variant].get("two_stage", False),
    )
    assert model.class_embed[0].out_features == 4
    # class_embed.0..K-1 (two-stage: + the encoder head, listed again under transformer.decoder) x weight, bias
    heads = {"base": 2 * 2, "box_refine": 2 * 2, "two_stage": 2 * 2 * 3}[variant]
    assert_loaded_except_class_heads(model, state, fresh, heads_expected=heads)
    assert len(report.reinitialized) == heads and report.num_classes == (7, 4)
    assert report.skipped == [] and report.not_in_checkpoint == []
    assert "num_classes 7 -> 4" in caplog.text and "skipped 0 checkpoint tensors" in caplog.text
    # The re-initialized heads start at the focal prior, as a model built from scratch does.
    assert torch.allclose(model.class_embed[0].bias, torch.full((4,), -4.59512), atol=1e-5)


def test_same_num_classes_loads_everything(tmp_path):
    cfg = tiny_cfg(num_classes=5)
    state = saved_model(tmp_path / "same.pth", cfg, seed=5)
    cfg.init_from = str(tmp_path / "same.pth")
    model, _, report = init_model(cfg, seed=6)
    assert report.reinitialized == [] and len(report.loaded) == len(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_official_layout_state_dict_with_args(tmp_path):
    """The official two-stage checkpoint's names and shapes (91 classes, ResNet-50) into a 3-class model."""
    shapes = {}
    for line in OFFICIAL_TSV.read_text().splitlines():
        if line.startswith("two_stage\t"):
            _, name, shape = line.split("\t")
            shapes[name] = tuple(int(d) for d in shape.split("x"))
    generator = torch.Generator().manual_seed(7)
    state = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    for name in state:  # the decoder's heads are the detector's, listed twice in the official file too
        if name.startswith(("transformer.decoder.bbox_embed.", "transformer.decoder.class_embed.")):
            state[name] = state[name[len("transformer.decoder.") :]]
    args = argparse.Namespace(
        with_box_refine=True,
        two_stage=True,
        hidden_dim=256,
        num_queries=300,
        lr=2e-4,
        dataset_file="coco",
        backbone="resnet50",
    )  # no num_classes, as the official args
    torch.save({"model": state, "args": args, "epoch": 49}, tmp_path / "r50_two_stage.pth")
    cfg = model_cfg(num_classes=3, msda="pytorch", pretrained="imagenet", init_from=str(tmp_path / "r50_two_stage.pth"))
    model, fresh, report = init_model(cfg, seed=2)
    assert cfg.two_stage and cfg.with_box_refine and cfg.pretrained == "none"
    # 7 heads (6 decoder layers + the encoder's), under class_embed and transformer.decoder.class_embed
    assert_loaded_except_class_heads(model, state, fresh, heads_expected=2 * 7 * 2)
    assert len(report.loaded) == len(state) - 2 * 7 * 2 and report.num_classes == (91, 3)


@pytest.mark.parametrize("variant", ["box_refine", "two_stage"])
def test_bare_state_dict_gives_its_variant_by_names(tmp_path, variant):
    source = tiny_cfg(num_classes=9, **VARIANTS[variant])
    state = saved_model(tmp_path / "bare.pth", source, seed=8)  # {"model": ...} only, nothing recorded
    cfg = tiny_cfg(num_classes=2, init_from=str(tmp_path / "bare.pth"))
    model, fresh, _ = init_model(cfg, seed=9)
    assert cfg.with_box_refine and cfg.two_stage == (variant == "two_stage")
    assert_loaded_except_class_heads(model, state, fresh, heads_expected=4 if variant == "box_refine" else 12)


def test_ddp_prefixed_checkpoint_loads(tmp_path):
    cfg = tiny_cfg(num_classes=5)
    state = saved_model(tmp_path / "plain.pth", cfg, seed=1)
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "ddp.pth")
    cfg.init_from = str(tmp_path / "ddp.pth")
    model, _, report = init_model(cfg, seed=4)
    assert len(report.loaded) == len(state) and torch.equal(model.query_embed.weight, state["query_embed.weight"])


def test_other_hidden_dim_is_an_error_naming_the_file_and_parameters(tmp_path):
    source = tiny_cfg(num_classes=5, hidden_dim=64)
    saved_model(tmp_path / "wide.pth", source, seed=1, config={"model": OmegaConf.to_container(source)})
    cfg = tiny_cfg(num_classes=5, hidden_dim=32, init_from=str(tmp_path / "wide.pth"))
    init = prepare_init_from(cfg)
    model = build_deformable_detr(cfg)
    with pytest.raises(
        CheckpointError,
        match=r"model\.init_from=.*wide\.pth: \d+ parameters have other shapes "
        r"than this model's \(transformer\.level_embed 3x64 in the checkpoint, "
        r"3x32 in the model; .*the checkpoint records hidden_dim=64 "
        r"\(config: 32\)",
    ):
        init.load_into(model)


def test_other_num_queries_is_an_error(tmp_path):
    saved_model(tmp_path / "q.pth", tiny_cfg(num_queries=6), seed=1)
    cfg = tiny_cfg(num_queries=10, init_from=str(tmp_path / "q.pth"))
    init = prepare_init_from(cfg)
    with pytest.raises(
        CheckpointError,
        match=r"q\.pth: 1 parameters .*query_embed\.weight 6x64 in the checkpoint, "
        r"10x64 in the model",
    ):
        init.load_into(build_deformable_detr(cfg))


def test_unrelated_or_missing_file_is_an_error(tmp_path):
    torch.save({"model": {"encoder.weight": torch.zeros(3)}}, tmp_path / "other.pth")
    cfg = tiny_cfg(init_from=str(tmp_path / "other.pth"))
    init = prepare_init_from(cfg)
    with pytest.raises(CheckpointError, match=r"other\.pth: none of its 1 tensors has a name of this model"):
        init.load_into(build_deformable_detr(cfg))
    with pytest.raises(CheckpointError, match=r"checkpoint .*absent\.pth does not exist"):
        prepare_init_from(tiny_cfg(init_from=str(tmp_path / "absent.pth")))
    with pytest.raises(ValueError, match=r"model\.init_from must be null or the path of a checkpoint, got 3"):
        prepare_init_from(tiny_cfg(init_from=3))


def test_unset_init_from_changes_nothing():
    cfg = tiny_cfg(with_box_refine=False)
    before = OmegaConf.to_container(cfg)
    init = prepare_init_from(cfg)
    torch.manual_seed(0)
    model = build_deformable_detr(cfg)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    assert init.load_into(model) is None
    assert OmegaConf.to_container(cfg) == before
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fresh.items())


def test_weights_are_released_after_loading(tmp_path):
    cfg = tiny_cfg()
    saved_model(tmp_path / "once.pth", cfg, seed=2)
    cfg.init_from = str(tmp_path / "once.pth")
    init = prepare_init_from(cfg)
    model = build_deformable_detr(cfg)
    init.load_into(model)
    assert init.state is None, "no second copy of the weights kept for the whole run"
    with pytest.raises(RuntimeError, match=r"once\.pth: load_into was already called"):
        init.load_into(model)


@pytest.mark.parametrize("weights", ["ema", "raw"])
def test_init_from_takes_a_checkpoints_ema_unless_asked_for_its_trained_weights(tmp_path, weights, caplog):
    """As eval_only, predict.py and export.py do: the model EMA a checkpoint holds, or with checkpoint_weights=raw
    its trained weights; the log says which."""
    path = tmp_path / "with_ema.pth"
    raw = saved_model(path, tiny_cfg(), seed=0)
    averaged = {name: value + 1.0 for name, value in raw.items() if value.is_floating_point()}
    torch.save({**torch.load(path), "ema": {"model": averaged, "updates": 10}}, path)
    with caplog.at_level(logging.INFO, logger="engine"):
        init = prepare_init_from(tiny_cfg(init_from=str(path)), weights=weights)
    model = build_deformable_detr(tiny_cfg())
    init.load_into(model)
    expected = {**raw, **averaged} if weights == "ema" else raw
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    assert ("the model EMA's weights" in caplog.text) == (weights == "ema")
