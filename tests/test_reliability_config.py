"""Typed configs: a bad override fails when Hydra composes (types, enumerations, unknown keys) or in
check_config (ranges, rules between keys), always naming the key; checkpoints keep loading."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, compose_train, tiny_overrides
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from engine.checkpoint.io import load_checkpoint, save_checkpoint
from engine.config.registry import check_config, plain_config
from engine.errors import CheckpointError


@pytest.mark.parametrize(
    "overrides, cause",
    [
        (["optim.lr=fast"], r"Value 'fast' of type 'str' could not be converted to Float\s+full_key: optim\.lr"),
        (["optim.lr_drop=4.5"], r"could not be converted to Integer\s+full_key: optim\.lr_drop"),
        (["model.nheads=eight"], r"could not be converted to Integer\s+full_key: model\.nheads"),
        (
            ["model.msda=cuda"],
            r"Invalid value 'cuda', expected one of \[triton, pytorch, auto\]\s+full_key: model\.msda",
        ),
        (
            ["compile.regions=model"],
            r"Invalid value 'model', expected one of \[layers, transformer\]\s+full_key: "
            r"compile\.regions",
        ),
        (
            ["compile.backbone=symbolic"],
            r"Invalid value 'symbolic', expected one of \[dynamic, static, eager\]\s+"
            r"full_key: compile\.backbone",
        ),
        (
            ["compile.mode=fast"],
            r"Invalid value 'fast', expected one of \[auto, eager, graphs, default, reduce-overhead\]\s+"
            r"full_key: compile\.mode",
        ),
        # The settings of older versions are gone: each names its key.
        (["compile=true"], r"full_key: compile"),
        (["compile_mode=reduce-overhead"], r"Key 'compile_mode' not in 'TrainConfig'"),
        (
            ["model.backbone=vgg16"],
            r"Invalid value 'vgg16', expected one of \[resnet18, .*\]\s+full_key: model\.backbone",
        ),
        (["model.position_embedding=rope"], r"full_key: model\.position_embedding"),
        (["model.with_box_refine=sometimes"], r"'sometimes' is not a valid bool .*\s+full_key: model\.with_box_refine"),
        (["dataset.num_train=many"], r"could not be converted to Integer\s+full_key: dataset\.num_train"),
        (
            ["dataset=coco", "dataset.num_train=10"],
            r"Key 'num_train' not in 'CocoDatasetConfig'\s+full_key: "
            r"dataset\.num_train",
        ),
        (["dataset=custom", "dataset.root=/data"], r"Key 'root' not in 'CustomDatasetConfig'"),
        (["model.nhead=4"], r"Key 'nhead' not in 'ModelConfig'\s+full_key: model\.nhead"),
        (["resume=[1,2]"], r"full_key: resume"),
    ],
)
def test_a_bad_override_fails_at_compose_naming_the_key(overrides, cause):
    with pytest.raises(ConfigCompositionException) as error:
        compose_train(*overrides)
    assert re.search(cause, str(error.value.__cause__)), str(error.value.__cause__)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lr=-1"], r"optim\.lr must be a finite number > 0, got -1\.0"),
        (["optim.lr=nan"], r"optim\.lr must be a finite number > 0, got nan"),
        (["optim.lr_drop=0"], r"optim\.lr_drop must be an integer >= 1"),
        (["optim.clip_max_norm=-0.1"], r"optim\.clip_max_norm must be a finite number >= 0"),
        (["model.two_stage=true"], r"model\.two_stage=true needs model\.with_box_refine=true"),
        (["model.dropout=1.5"], r"model\.dropout must be a number in \[0, 1\), got 1\.5"),
        (["model.hidden_dim=48", "model.nheads=5"], r"model\.hidden_dim must be divisible by model\.nheads"),
        (["model.num_classes=0"], r"model\.num_classes must be an integer >= 1 or null"),
        (["model.one_to_many=hybrid", "model.k_one2many=0"], r"model\.k_one2many must be an integer >= 1"),
        (["device=gpu"], r"device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["epochs=0", "batch_size=0"], r"epochs must be an integer >= 1, got 0; batch_size must be an integer >= 1"),
        (["dataset.image_size=8"], r"dataset\.image_size must be at least 16 pixels"),
        (["dataset.crop_min_size=700"], r"dataset\.crop_min_size \(700\) must not exceed dataset\.crop_max_size"),
        (
            ["dataset.name=coco"],
            r"dataset\.name is coco in the synthetic dataset config: choose the set with dataset=coco",
        ),
        (["dataset.pad_to_multiple=0"], r"dataset\.pad_to_multiple must be"),
        (
            ["compile.mode=default", "compile.backend=123", "dist_timeout_s=0"],
            r"dist_timeout_s must be > 0 seconds, got 0\.0",
        ),
        (["eval_images=-1"], r"eval_images must be an integer >= 0, got -1"),
        (
            ["profile_steps=[5,4]"],
            r"profile_steps must be null or \[FIRST,LAST\], optimizer steps counted from 1 with "
            r"FIRST <= LAST, got \[5, 4\]",
        ),
        (["profile_steps=[0,3]"], r"profile_steps must be null or \[FIRST,LAST\].*got \[0, 3\]"),
        (["profile_steps=[7]"], r"profile_steps must be null or \[FIRST,LAST\].*got \[7\]"),
        (
            ["compile.mode=reduce-overhead", "compile.backend=aot_eager"],
            r"compile\.mode=reduce-overhead replays CUDA graphs, which need compile\.backend=inductor; got "
            r"compile\.backend=aot_eager",
        ),
        (
            ["compile.mode=eager", "compile.backbone=static"],
            r"compile\.backbone=static does nothing with compile\.mode=eager",
        ),
        (["dataset.size_buckets=1"], r"dataset\.size_buckets must be 0 \(no buckets\) or at least 2"),
        # Hydra's own hint after a typo is '+key=value', which adds a key that nothing reads.
        (["+optim.lrr=1e-4"], r"unknown settings .*: optim\.lrr is not a setting \(did you mean optim\.lr\?\)"),
        (
            ["+epoch=3", "+dataset.size_bucket=2"],
            r"dataset\.size_bucket is not a setting \(did you mean "
            r"dataset\.size_buckets\?\); epoch is not a setting \(did you mean epochs\?\)",
        ),
        (["+compile.modes=eager"], r"compile\.modes is not a setting \(did you mean compile\.mode\?\)"),
    ],
)
def test_out_of_range_values_and_broken_rules_are_caught_before_the_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose_train(*overrides))


@pytest.mark.parametrize(
    "overrides", [[], ["dataset=coco"], ["dataset=custom"], ["experiment=two_stage"], ["experiment=coco_gpu"]]
)
def test_the_shipped_configs_pass(overrides):
    cfg = check_config(compose_train(*overrides))
    assert OmegaConf.get_type(cfg.dataset).__name__.lower().startswith(cfg.dataset.name)


def test_a_config_composed_without_the_schemas_is_refused():
    untyped = OmegaConf.create(OmegaConf.to_container(compose_train()))
    with pytest.raises(
        TypeError, match=r"composed without its schemas: call engine\.config\.registry\.register_configs\(\)"
    ):
        check_config(untyped)


SMALL_SET = ("dataset.num_train=4", "dataset.num_val=2", "device=cpu", "num_workers=0")


@pytest.fixture
def one_check(monkeypatch):
    """Every config the run checks through engine/train/settle.py, as it looked when checked, and whether it was
    read-only once the check returned."""
    import engine.train.settle

    checked, check = [], engine.train.settle.check_and_freeze

    def recording(cfg, *args):
        before = OmegaConf.to_container(cfg)
        typed = check(cfg, *args)  # raises for a refused config
        checked.append((before, OmegaConf.is_readonly(cfg)))
        return typed

    monkeypatch.setattr(engine.train.settle, "check_and_freeze", recording)
    return checked


def _settle(cfg, tmp_path):
    from engine.runtime.distributed import DistContext
    from engine.train.settle import settle_training

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return settle_training(cfg, ctx, tmp_path / "run")


def _resumable(path: Path, cfg, **model) -> Path:
    """A checkpoint whose training state is all a resume reads before the config's check, its config ``cfg``'s with
    ``model`` put in (as another version, or a hand-edited file, may record it)."""
    config = plain_config(cfg)
    config["model"].update(model)
    state = {key: {} for key in ("optimizer", "lr_scheduler", "grad_scaler", "rng")}
    return save_checkpoint({"model": {}, "config": config, "epoch": 1, "steps_in_epoch": 0, "step": 2, **state}, path)


def test_a_run_settles_its_config_then_checks_it_once_then_freezes_it(tmp_path, one_check):
    """The classes come from the data where model.num_classes is null, into the run's own copy; the one check sees
    the settled value, and nothing changes the config after it; the caller's is left as it was."""
    from omegaconf.errors import ReadonlyConfigError

    cfg = compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET, "model.num_classes=null")
    settled = _settle(cfg, tmp_path)
    assert settled.cfg.model.num_classes == 7 and cfg.model.num_classes is None and settled.init.path is None
    assert len(one_check) == 1 and one_check[0][0]["model"]["num_classes"] == 7 and one_check[0][1]
    assert settled.checked.model.num_classes == 7  # the typed config the model is built from
    with pytest.raises(ReadonlyConfigError):
        settled.cfg.model.num_classes = 3


def test_a_resumed_checkpoints_model_is_checked_with_the_run(tmp_path, one_check):
    """A model the check refuses (hidden_dim not a multiple of 32) recorded by the checkpoint: refused by the run's
    one check, naming the key, before anything is built."""
    cfg = compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET)
    checkpoint = _resumable(tmp_path / "old.pth", cfg, hidden_dim=48)
    with pytest.raises(ValueError, match=r"model\.hidden_dim must be a multiple of 32 .*, got 48"):
        _settle(compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET, f"resume={checkpoint}"), tmp_path)
    assert one_check == []  # refused by that check, which never returned


def test_init_froms_variant_is_checked_with_the_run(tmp_path, one_check):
    """model.init_from takes the checkpoint's variant: one that cannot work (two-stage without box refinement) is
    refused by the run's check, naming the keys."""
    cfg = compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET)
    checkpoint = _resumable(tmp_path / "odd.pth", cfg, two_stage=True, with_box_refine=False)
    with pytest.raises(ValueError, match=r"model\.two_stage=true needs model\.with_box_refine=true"):
        _settle(
            compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET, f"model.init_from={checkpoint}"), tmp_path
        )
    assert one_check == []


def test_an_evaluated_checkpoints_model_is_checked_then_frozen(tmp_path, one_check):
    from datasets import build_dataset
    from engine.checkpoint.trained_model import checkpoint_model
    from engine.train.settle import settle_evaluation

    cfg = compose_train(f"dataset.root={tmp_path / 'data'}", *SMALL_SET, "eval_only=true")
    val_set = build_dataset("val", cfg.dataset)
    for hidden_dim, refused in ((64, False), (48, True)):
        path = _resumable(tmp_path / f"{hidden_dim}.pth", cfg, hidden_dim=hidden_dim)
        source = checkpoint_model(path, cfg.model)
        if refused:
            with pytest.raises(ValueError, match=r"model\.hidden_dim must be a multiple of 32 .*, got 48"):
                settle_evaluation(cfg, source, val_set)
            continue
        settled, checked = settle_evaluation(cfg, source, val_set)
        assert settled.model.hidden_dim == checked.model.hidden_dim == 64 and OmegaConf.is_readonly(settled)
    assert [(recorded["model"]["hidden_dim"], frozen) for recorded, frozen in one_check] == [(64, True)]


def test_checkpoints_record_the_config_as_plain_values(tmp_path):
    cfg = compose_train("model.msda=pytorch")
    path = save_checkpoint({"model": {}, "config": plain_config(cfg)}, tmp_path / "ok.pth")
    recorded = load_checkpoint(path)["config"]
    assert recorded["model"]["msda"] == "pytorch" and type(recorded["model"]["msda"]) is str
    assert recorded["amp"] == "bf16" and type(recorded["amp"]) is str
    # Why plain_config: the enumerations themselves are refused by weights_only loading.
    torch_save_with_enums = save_checkpoint({"model": {}, "config": OmegaConf.to_container(cfg)}, tmp_path / "e.pth")
    with pytest.raises(CheckpointError, match=r"Unsupported global"):
        load_checkpoint(torch_save_with_enums)


@pytest.mark.slow
def test_the_command_line_names_the_bad_key_and_starts_nothing(tmp_path):
    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "optim.lr=fast"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Error merging override optim.lr=fast" in proc.stderr and "full_key: optim.lr" in proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "data").exists()


def config_groups() -> list[str]:
    """The config groups of configs/train.yaml that a command line chooses from (configs/<group>/*.yaml)."""
    return sorted(p.name for p in (ROOT / "configs").iterdir() if p.is_dir() and list(p.glob("*.yaml")))


@pytest.mark.parametrize("group", config_groups())
def test_a_misspelt_choice_of_any_group_is_refused_naming_the_choices(group):
    from hydra.errors import MissingConfigException

    choices = sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml"))
    with pytest.raises(MissingConfigException) as error:
        compose_train(f"{group}={choices[0]}x")
    assert f"Could not find '{group}/{choices[0]}x'" in str(error.value)
    assert all(choice in str(error.value) for choice in choices)


@pytest.mark.slow
def test_a_misspelt_experiment_stops_the_command_naming_the_experiments(tmp_path):
    """`experiment` may be left out, but a name that is not in configs/experiment/ is refused like a misspelt
    model, never run as the base model."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_overrides(tmp_path / "data"), "epochs=1", "experiment=two_stag"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Could not find 'experiment/two_stag'" in out and "Traceback" not in out
    assert all(name in out for name in ("box_refine", "coco_gpu", "two_stage"))
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "data").exists()


@pytest.mark.slow
def test_triton_attention_on_a_machine_without_a_gpu_is_refused_with_the_settings(tmp_path):
    """model.msda=triton on the CPU, without Triton's interpreter: one message naming model.msda before anything is
    trained, and no run directory left behind (not the operator's error at the first forward)."""
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_overrides(tmp_path / "data"), "epochs=1", "model.msda=triton"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert out.count("model.msda=triton runs the Triton kernels, which need a GPU, but this run is on cpu") == 1, out
    assert "impl='triton'" not in out and "epoch 1/1" not in out
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "data").exists()  # refused before the data is read
