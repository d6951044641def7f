"""Every config group and experiment composes and builds; the defaults are what the README promises."""

import re
from pathlib import Path

import pytest
import torch
from helpers import compose_train
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf.errors import OmegaConfBaseException

from engine.config.registry import check_config
from engine.runtime.distributed import argv_for_rank
from engine.runtime.precision import Precision
from engine.train.optim import build_lr_scheduler, build_optimizer
from models import build_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# Every option of every group, each on top of the defaults; `pretrained=none` because building must not
# fetch ImageNet weights in CI.
CASES = (
    [[f"model={m}"] for m in options("model")]
    + [[f"dataset={d}"] for d in options("dataset")]
    + [[f"optim={o}"] for o in options("optim")]
    + [[f"experiment={e}"] for e in options("experiment")]
    + [["dataset=coco", "experiment=two_stage"], ["model=tiny", "experiment=two_stage"]]
)


def test_every_group_option_is_listed():
    assert set(options("model")) >= {"deformable_detr", "tiny"}
    assert set(options("dataset")) == {"synthetic", "synthetic_dense", "coco", "custom"}
    assert set(options("experiment")) >= {"box_refine", "two_stage", "coco_gpu", "hybrid", "mixed", "mixed_24"}


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(o))
def test_composes_and_builds(overrides):
    cfg = compose_train(*overrides, "model.pretrained=none")
    check_config(cfg)
    if cfg.model.num_classes is None:  # dataset=custom: the trainer takes it from the annotations
        cfg.model.num_classes = 3
    model, criterion, _postprocess = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert criterion.weight_dict
    optimizer = build_optimizer(model, cfg.optim)
    build_lr_scheduler(optimizer, cfg.optim)


def test_defaults_are_the_synthetic_cpu_run():
    cfg = compose_train()
    assert cfg.dataset.name == "synthetic"
    assert cfg.model.backbone == "resnet18" and cfg.model.pretrained == "none"
    assert cfg.model.num_classes == 7
    assert cfg.epochs < 50 and cfg.max_steps is None
    assert not cfg.eval_only and cfg.checkpoint is None and cfg.resume is None


def test_coco_keeps_the_published_recipe():
    cfg = compose_train("dataset=coco")
    m, o = cfg.model, cfg.optim
    assert (m.backbone, m.hidden_dim, m.nheads, m.enc_layers, m.dec_layers, m.num_queries) == (
        "resnet50",
        256,
        8,
        6,
        6,
        300,
    )
    assert (m.num_classes, m.focal_alpha, m.with_box_refine, m.two_stage) == (91, 0.25, False, False)
    assert (cfg.epochs, cfg.batch_size, o.lr_drop, o.lr, o.lr_backbone) == (50, 2, 40, 2e-4, 2e-5)
    assert (o.lr_linear_proj_mult, o.weight_decay, o.clip_max_norm) == (0.1, 1e-4, 0.1)
    assert cfg.dataset.val_size == 800 and cfg.dataset.max_size == 1333
    assert list(cfg.dataset.train_scales) == list(range(480, 801, 32))


@pytest.mark.parametrize(
    "experiment, refine, two_stage",
    [("box_refine", True, False), ("two_stage", True, True), ("coco_gpu", False, False)],
)
def test_experiments_select_the_variant(experiment, refine, two_stage):
    cfg = compose_train(f"experiment={experiment}")
    assert (cfg.model.with_box_refine, cfg.model.two_stage) == (refine, two_stage)


def test_coco_gpu_is_the_full_recipe_on_coco():
    cfg = compose_train("experiment=coco_gpu")
    assert cfg.dataset.name == "coco" and cfg.model.backbone == "resnet50" and cfg.model.hidden_dim == 256
    assert (cfg.epochs, cfg.optim.lr_drop, cfg.optim.lr, cfg.amp) == (50, 40, 2e-4, "bf16")
    assert cfg.total_batch_size == 32  # the original's total batch, whatever the number of GPUs


def test_the_coco_recipe_without_the_experiment_is_the_original_per_gpu_batch():
    cfg = compose_train("dataset=coco")
    assert (cfg.batch_size, cfg.total_batch_size) == (2, None)


def test_command_line_choice_wins_over_the_dataset_default():
    assert compose_train("model=deformable_detr").model.hidden_dim == 256
    assert compose_train("model.msda=pytorch").model.msda == "pytorch"


@pytest.mark.parametrize("overrides", [["model=nonexistent"], ["dataset=imagenet"], ["no_such_key=1"]])
def test_bad_overrides_fail_at_compose(overrides):
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_train(*overrides)


@pytest.mark.parametrize(
    "override, message",
    [
        ("epochs=abc", r"Value 'abc' of type 'str' could not be converted to Integer\s+full_key: epochs"),
        ("amp=fp8", r"Invalid value 'fp8', expected one of \[none, bf16, fp16\]\s+full_key: amp"),
        ("eval_only=maybe", r"'maybe' is not a valid bool \(type str\)\s+full_key: eval_only"),
        ("log_every=1.5", r"Value '1.5' of type 'float' could not be converted to Integer\s+full_key: log_every"),
    ],
)
def test_bad_run_settings_fail_at_compose_naming_the_key(override, message):
    with pytest.raises(ConfigCompositionException, match=f"override {re.escape(override)}") as error:
        compose_train(override)
    assert re.search(message, str(error.value.__cause__)), error.value.__cause__


@pytest.mark.parametrize(
    "override, message",
    [
        ("batch_size=0", "batch_size must be an integer >= 1, got 0"),
        ("max_steps=-3", "max_steps must be null or an integer >= 1"),
    ],
)
def test_out_of_range_run_settings_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose_train(override))
    check_config(compose_train())  # the defaults pass


def test_bad_amp_is_a_clear_error():
    with pytest.raises(ValueError, match="amp must be one of"):
        Precision(amp="fp8", device=torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_published_parameter_groups():
    cfg = compose_train("model.pretrained=none")
    model, _, _ = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    by_group = {g["name"]: g for g in optimizer.param_groups}
    assert by_group["rest"]["lr"] == pytest.approx(2e-4)
    assert by_group["backbone"]["lr"] == pytest.approx(2e-5)
    assert by_group["linear_proj"]["lr"] == pytest.approx(2e-5)
    assert all(g["weight_decay"] == pytest.approx(1e-4) for g in optimizer.param_groups)
    ids = {name: {id(p) for p in g["params"]} for name, g in by_group.items()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert all(id(p) not in s for s in ids.values())
        elif "backbone.0" in name:
            assert id(p) in ids["backbone"], name
        elif "sampling_offsets" in name or "reference_points" in name:
            assert id(p) in ids["linear_proj"], name
        else:
            assert id(p) in ids["rest"], name
    scheduler = build_lr_scheduler(optimizer, cfg.optim)
    for _ in range(cfg.optim.lr_drop):
        scheduler.step()
    assert by_group["rest"]["lr"] == pytest.approx(2e-5)


def test_only_rank_zero_keeps_hydras_run_directory():
    argv = ["train.py", "epochs=1", "hydra.run.dir=/x"]
    assert argv_for_rank(argv, 0) == argv
    other = argv_for_rank(argv, 1)
    assert "hydra.run.dir=/x" not in other and "hydra.run.dir=." in other and "epochs=1" in other
    assert "hydra.output_subdir=null" in other
