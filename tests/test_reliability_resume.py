"""Honest resume (engine/train/resume.py): resume=auto takes only this run's checkpoint, the settings rule, the
warning that lists what differs, and a changed lr schedule applied to the restored optimizer."""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import compose_train

from engine.checkpoint.io import save_checkpoint
from engine.config.registry import plain_config
from engine.config.train_schema import upgrade_recorded_config
from engine.errors import CheckpointError
from engine.train.optim import build_lr_scheduler, build_optimizer
from engine.train.resume import config_for_resume, find_resume_checkpoint, restore_training_state

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The tiny run's (helpers.tiny_overrides) steps per epoch at 4 images a step: 16 images in two orientations' size
# buckets, whose leftovers wait for no one (datasets/batch_plan.py).
STEPS_PER_EPOCH_OF_4 = 3


@pytest.fixture(scope="module")
def base_config():
    return plain_config(compose_train())


def with_changes(config: dict, **dotted) -> dict:
    """``config`` with dotted keys set, e.g. with_changes(c, **{"model.hidden_dim": 32})."""
    config = copy.deepcopy(config)
    for key, value in dotted.items():
        node = config
        *parents, last = key.split(".")
        for parent in parents:
            node = node[parent]
        node[last] = value
    return config


def write_run(outputs: Path, name: str, config: dict, age_s: float = 0) -> Path:
    path = save_checkpoint({"model": {}, "config": config}, outputs / "2026-01-01" / name / "checkpoint.pth")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


# --------------------------------------------------------------------------------------------- resume=auto


def test_auto_skips_newer_runs_of_another_model_and_says_which_it_took(tmp_path, base_config, caplog):
    outputs = tmp_path / "outputs"
    same = write_run(outputs, "09-00-00", base_config, age_s=300)
    write_run(outputs, "10-00-00", with_changes(base_config, **{"model.hidden_dim": 128}), age_s=200)
    write_run(outputs, "11-00-00", with_changes(base_config, **{"dataset.num_train": 32}), age_s=100)
    write_run(outputs, "11-30-00", with_changes(base_config, **{"optim.lr": 1e-3}), age_s=50)
    write_run(outputs, "11-40-00", with_changes(base_config, **{"seed": 7}), age_s=40)
    (outputs / "2026-01-01" / "12-00-00").mkdir()
    (outputs / "2026-01-01" / "12-00-00" / "checkpoint.pth").write_text("garbage")
    # What may differ: a longer schedule and how to run.
    current = with_changes(
        base_config,
        **{"epochs": 99, "max_steps": 1000, "model.msda": "pytorch", "num_workers": 4, "amp": "none", "log_every": 1},
    )
    with caplog.at_level(logging.WARNING, logger="engine"):
        found = find_resume_checkpoint(
            "auto", output_dir=outputs / "2026-01-02" / "08-00-00", search_root=outputs, config=current
        )
    assert found == same
    assert f"resume=auto: continuing {same}" in caplog.text
    assert "12-00-00/checkpoint.pth, which cannot be read" in caplog.text


def test_auto_starts_afresh_when_only_other_runs_exist(tmp_path, base_config, caplog):
    outputs = tmp_path / "outputs"
    write_run(outputs, "10-00-00", with_changes(base_config, **{"model.hidden_dim": 128, "model.num_queries": 10}))
    with caplog.at_level(logging.WARNING, logger="engine"):
        found = find_resume_checkpoint("auto", output_dir=tmp_path / "new", search_root=outputs, config=base_config)
    assert found is None
    assert "starting from scratch; the 1 checkpoints under" in caplog.text
    assert "model.hidden_dim, model.num_queries differ" in caplog.text


def test_auto_takes_the_run_directorys_own_checkpoint_first(tmp_path, base_config):
    outputs, own_dir = tmp_path / "outputs", tmp_path / "fixed_run_dir"
    write_run(outputs, "10-00-00", base_config)
    own = save_checkpoint(
        {"model": {}, "config": with_changes(base_config, **{"model.hidden_dim": 128})}, own_dir / "checkpoint.pth"
    )
    assert find_resume_checkpoint("auto", output_dir=own_dir, search_root=outputs, config=base_config) == own


def test_auto_with_null_num_classes_matches_a_run_that_took_it_from_the_data(tmp_path, base_config):
    outputs = tmp_path / "outputs"
    taken = write_run(outputs, "10-00-00", with_changes(base_config, **{"model.num_classes": 12}))
    current = with_changes(base_config, **{"model.num_classes": None})
    assert find_resume_checkpoint("auto", output_dir=tmp_path / "new", search_root=outputs, config=current) == taken


def test_auto_takes_a_run_whose_total_batch_was_split_into_other_passes(tmp_path, base_config):
    """batch_size under the same total_batch_size only says how many images go through the model at once (memory):
    the same run. Without total_batch_size it is the step's batch, and another value another run."""
    outputs = tmp_path / "outputs"
    split = write_run(outputs, "10-00-00", with_changes(base_config, total_batch_size=8, batch_size=8))
    current = with_changes(base_config, total_batch_size=8, batch_size=2)
    assert find_resume_checkpoint("auto", output_dir=tmp_path / "new", search_root=outputs, config=current) == split
    assert (
        find_resume_checkpoint(
            "auto",
            output_dir=tmp_path / "new",
            search_root=outputs,
            config=with_changes(base_config, total_batch_size=16, batch_size=8),
        )
        is None
    )
    other = tmp_path / "other"
    write_run(other, "10-00-00", with_changes(base_config, batch_size=8))
    assert (
        find_resume_checkpoint(
            "auto", output_dir=tmp_path / "new", search_root=other, config=with_changes(base_config, batch_size=2)
        )
        is None
    )


def test_auto_names_what_differs_in_plain_words(tmp_path, base_config, caplog):
    outputs = tmp_path / "outputs"
    write_run(outputs, "10-00-00", with_changes(base_config, seed=7))
    with caplog.at_level(logging.WARNING, logger="engine"):
        find_resume_checkpoint("auto", output_dir=tmp_path / "new", search_root=outputs, config=base_config)
    assert "(seed differs)" in caplog.text


@pytest.mark.parametrize(
    "old_images, resumed, steps_per_epoch, expected",
    [
        (4, dict(epoch=1, step=4, steps_in_epoch=1), 3, (4, 1, False)),  # unchanged: the checkpoint's own count
        (2, dict(epoch=1, step=9, steps_in_epoch=2), 3, (4, 1, True)),  # 4 images done: 1 step of 4, the next retrains
        (8, dict(epoch=0, step=1, steps_in_epoch=1), 6, (2, 2, True)),  # 8 images done: 2 steps of 4
        (2, dict(epoch=2, step=14, steps_in_epoch=0), 3, (6, 0, True)),  # an epoch's end: epochs times this run's steps
        (1, dict(epoch=0, step=7, steps_in_epoch=7), 3, (1, 1, True)),
        (4, dict(epoch=0, step=3, steps_in_epoch=3), 3, (3, 3, False)),  # a whole epoch not yet closed
        (8, dict(epoch=0, step=2, steps_in_epoch=2), 3, (3, 3, True)),  # never more than the epoch's steps
    ],
)
def test_a_resume_counts_the_steps_done_in_this_runs_steps(old_images, resumed, steps_per_epoch, expected):
    from engine.train.resume import position_in_this_run
    from engine.train.run_plan import Position

    position, note = position_in_this_run(
        Position(**resumed), steps_per_epoch=steps_per_epoch, step_images=4, checkpoint_step_images=old_images
    )
    assert (position.step, position.steps_in_epoch, note is not None) == expected
    assert position.epoch == resumed["epoch"]


def test_a_checkpoints_step_images_are_recorded_else_read_off_its_batch_settings(base_config):
    from engine.train.resume import checkpoint_step_images

    assert checkpoint_step_images({"step_images": 32, "config": base_config}) == 32
    assert checkpoint_step_images({"config": with_changes(base_config, total_batch_size=16, batch_size=4)}) == 16
    assert checkpoint_step_images({"config": with_changes(base_config, batch_size=4)}) == 4


@pytest.mark.slow
def test_a_resume_with_another_total_batch_says_how_it_counts_and_trains_its_epochs(tmp_path, caplog):
    """Stopped mid-epoch at steps of 2 images, resumed at steps of 4: the epoch goes on after the images it had
    trained, the step count is this run's (said once, with both sizes), and the run trains its 2 epochs."""
    from helpers import compose_run

    import train as trainer
    from engine.checkpoint.io import load_checkpoint

    data, run_dir = tmp_path / "data", tmp_path / "run"
    common = ("eval_images=0", "eval_every=5", "epochs=2")
    trainer.train(compose_run(data, run_dir, *common, "batch_size=2", "max_steps=9"))
    stopped = load_checkpoint(run_dir / "checkpoint.pth")
    assert stopped["step"] == 9 and stopped["step_images"] == 2 and stopped["steps_in_epoch"] > 0
    with caplog.at_level(logging.INFO, logger="engine"):
        resumed = trainer.train(
            compose_run(data, run_dir, *common, "batch_size=2", "total_batch_size=4", "resume=auto")
        )
    steps_in_epoch = stopped["steps_in_epoch"] * 2 // 4
    step = stopped["epoch"] * STEPS_PER_EPOCH_OF_4 + steps_in_epoch
    assert (
        "the checkpoint's optimizer steps took 2 images and this run's take 4, so steps are counted in this "
        f"run's: its {stopped['steps_in_epoch']} steps of the epoch in progress ({stopped['steps_in_epoch'] * 2} "
        f"images) count as {steps_in_epoch} of 4 images, and its step 9 is step {step} here"
    ) in caplog.text
    assert (
        f"at step {step}: epoch {stopped['epoch'] + 1}/2, {steps_in_epoch} of its {STEPS_PER_EPOCH_OF_4} steps "
        "of 4 images done"
    ) in caplog.text
    assert resumed["step"] == 2 * STEPS_PER_EPOCH_OF_4
    assert load_checkpoint(run_dir / "checkpoint.pth")["step_images"] == 4


# ------------------------------------------------------------------------------------- which settings win


def checkpoint_of(config: dict, *, epoch=1, step=4) -> dict:
    """A checkpoint recording ``config`` as a resume reads it (engine/train/resume.py, load_resumed_checkpoint): the
    config in this version's layout."""
    config = upgrade_recorded_config(config)
    return {"model": {}, "config": config, "epoch": epoch, "step": step, "steps_in_epoch": 0}


def test_the_model_is_the_checkpoints_and_the_rest_the_command_lines(base_config, caplog):
    recorded = with_changes(
        base_config, **{"model.hidden_dim": 32, "model.msda": "triton", "optim.lr": 1e-3, "optim.lr_drop": 5}
    )
    cfg = compose_train(
        "model.hidden_dim=64",
        "model.msda=pytorch",
        "optim.lr=5e-4",
        "epochs=30",
        "resume=run/checkpoint.pth",
        "output_dir=elsewhere",
    )
    with caplog.at_level(logging.WARNING, logger="engine"):
        effective = config_for_resume(cfg, checkpoint_of(recorded), path="run/checkpoint.pth")
    assert effective.model.hidden_dim == 32  # architecture: the checkpoint's
    assert effective.model.msda == "pytorch"  # how to run: the command line's
    assert effective.optim.lr == 5e-4 and effective.optim.lr_drop == 20 and effective.epochs == 30
    assert cfg.model.hidden_dim == 64  # the caller's config is left alone
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0]
    assert message.startswith("resuming run/checkpoint.pth with settings that differ from the checkpoint's:")
    assert "model.hidden_dim: 32 kept from the checkpoint, not 64" in message
    assert "model.msda: 'pytorch' from the command line, applied (the checkpoint had 'triton')" in message
    assert "optim.lr: 0.0005 from the command line, applied (the checkpoint had 0.001)" in message
    assert "optim.lr_drop: 20 from the command line, applied (the checkpoint had 5)" in message
    assert "epochs: 30 from the command line" in message
    assert "  resume:" not in message and "  output_dir:" not in message  # about this command, not the run


def test_no_warning_when_nothing_differs(base_config, caplog):
    cfg = compose_train()
    with caplog.at_level(logging.WARNING, logger="engine"):
        config_for_resume(cfg, checkpoint_of(plain_config(cfg)), path="x")
    assert not caplog.records


@pytest.mark.parametrize(
    "overrides, ckpt, message",
    [
        (
            ["epochs=6"],
            dict(epoch=6, step=24),
            r"checkpoint run\.pth has completed 6 epochs and epochs=6: nothing is left",
        ),
        (["max_steps=24"], dict(epoch=3, step=24), r"is at step 24 and max_steps=24: nothing is left to train"),
    ],
)
def test_a_resume_with_nothing_left_to_train_is_an_error(base_config, overrides, ckpt, message):
    with pytest.raises(ValueError, match=message):
        config_for_resume(compose_train(*overrides), checkpoint_of(base_config, **ckpt), path="run.pth")


# ------------------------------------------------------------------------------ restoring the lr schedule


class Tiny(torch.nn.Module):
    """Parameters in all three published groups (engine/train/optim.py)."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        self.sampling_offsets = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 2)


def trained_state(cfg_optim, *, epochs: int) -> dict:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = build_optimizer(model, cfg_optim)
    scheduler = build_lr_scheduler(optimizer, cfg_optim)
    for _ in range(epochs):
        optimizer.zero_grad()
        sum(p.sum() for p in model.parameters()).backward()
        optimizer.step()
        scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "grad_scaler": {},
        "epoch": epochs,
        "step": epochs,
        "steps_in_epoch": 0,
        "rng": {},
        "config": {"optim": plain_config(cfg_optim)},
    }


def restored(ckpt, cfg_optim):
    model = Tiny()
    optimizer = build_optimizer(model, cfg_optim)
    scheduler = build_lr_scheduler(optimizer, cfg_optim)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    restore_training_state(
        ckpt, model=model, optimizer=optimizer, lr_scheduler=scheduler, scaler=scaler, cfg_optim=cfg_optim, path="c.pth"
    )
    return optimizer, scheduler


def lrs(optimizer) -> dict[str, float]:
    return {g["name"]: g["lr"] for g in optimizer.param_groups}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_new_lr_and_lr_drop_are_applied_from_the_epoch_reached():
    old = compose_train("optim.lr=1e-3", "optim.lr_backbone=1e-4", "optim.lr_drop=2").optim
    ckpt = trained_state(old, epochs=3)  # one drop so far: rest 1e-4
    optimizer, scheduler = restored(ckpt, old)
    assert lrs(optimizer) == pytest.approx({"rest": 1e-4, "backbone": 1e-5, "linear_proj": 1e-5})

    new = compose_train("optim.lr=4e-3", "optim.lr_backbone=1e-4", "optim.lr_drop=4", "optim.weight_decay=0.5").optim
    optimizer, scheduler = restored(ckpt, new)
    # 3 epochs done, lr_drop 4: no drop yet under the new schedule
    assert lrs(optimizer) == pytest.approx({"rest": 4e-3, "backbone": 1e-4, "linear_proj": 4e-4})
    assert all(g["weight_decay"] == 0.5 for g in optimizer.param_groups)
    assert scheduler.get_last_lr() == pytest.approx([g["lr"] for g in optimizer.param_groups])
    scheduler.step()  # the 4th epoch ends: the new drop happens
    assert lrs(optimizer) == pytest.approx({"rest": 4e-4, "backbone": 1e-5, "linear_proj": 4e-5})


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_an_unchanged_schedule_restores_the_state_exactly():
    cfg_optim = compose_train("optim.lr=1e-3", "optim.lr_drop=1").optim
    ckpt = trained_state(cfg_optim, epochs=3)
    optimizer, scheduler = restored(ckpt, cfg_optim)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
    assert scheduler.state_dict() == ckpt["lr_scheduler"]


def test_an_optimizer_state_of_other_groups_is_a_checkpoint_error():
    cfg_optim = compose_train().optim
    ckpt = trained_state(cfg_optim, epochs=1)
    ckpt["optimizer"]["param_groups"] = ckpt["optimizer"]["param_groups"][:1]
    with pytest.raises(CheckpointError, match=r"checkpoint c\.pth: its optimizer or scheduler state does not fit"):
        restored(ckpt, cfg_optim)


def test_a_recorded_model_setting_this_version_refuses_names_the_checkpoint(base_config):
    recorded = with_changes(base_config, **{"model.backbone": "resnet152"})
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint old\.pth records model\.backbone='resnet152', which this "
        r"version does not accept \(Invalid value 'resnet152'",
    ):
        config_for_resume(compose_train(), checkpoint_of(recorded), path="old.pth")


# ----------------------------------------------------------------------------------- roles and old checkpoints


def test_what_a_resume_may_change_comes_from_the_schemas_roles():
    from engine.checkpoint.contents import model_config_for_checkpoint
    from engine.config.train_schema import HOW_TO_RUN, role_of
    from engine.train.resume import flatten, resumable_change

    keys = flatten(plain_config(compose_train()))
    may_change = {key for key in keys if resumable_change(key)}
    assert {
        "epochs",
        "max_steps",
        "device",
        "amp",
        "num_workers",
        "log_every",
        "compile.mode",
        "compile.regions",
        "compile.backbone",
        "compile.cache_dir",
        "model.msda",
        "model.pretrained",
        "dataset.verify",
    } <= may_change
    assert not may_change & {
        "seed",
        "batch_size",
        "optim.lr",
        "model.hidden_dim",
        "model.num_classes",
        "dataset.root",
        "dataset.train_scales",
        "dataset.size_buckets",
        "resume",
    }
    # An evaluated checkpoint imposes its model but never how to run it: the same keys, from the same roles.
    how_to_run_model = {
        key.partition(".")[2] for key in keys if key.startswith("model.") and role_of(key) == HOW_TO_RUN
    }
    recorded = {k: "from the checkpoint" for k in ("msda", "pretrained", "init_from", "hidden_dim")}
    merged = model_config_for_checkpoint(
        {k: "from the config" for k in recorded}, {"model": {}, "config": {"model": recorded}}, path="x"
    )
    assert {k for k, v in merged.items() if v != "from the checkpoint"} == how_to_run_model


def legacy(config: dict, **old) -> dict:
    """A config as versions before the compile group recorded it."""
    config = {k: v for k, v in copy.deepcopy(config).items() if k != "compile"}
    return {**config, **old}


def test_a_checkpoint_with_the_old_compile_keys_resumes_and_reports_them_in_the_new_layout(base_config, caplog):
    recorded = legacy(
        base_config,
        compile=True,
        compile_mode="reduce-overhead",
        compile_regions="layers",
        compile_backbone="eager",
        compile_backend="inductor",
    )
    cfg = compose_train("epochs=30", "compile.mode=eager")
    with caplog.at_level(logging.WARNING, logger="engine"):
        effective = config_for_resume(cfg, checkpoint_of(recorded), path="old/checkpoint.pth")
    assert effective.compile.mode == "eager"  # how to run: the command line's
    message = caplog.records[0].getMessage()
    assert "compile.mode: 'eager' from the command line, applied (the checkpoint had 'reduce-overhead')" in message
    assert "compile_mode" not in message


def test_resume_auto_takes_a_checkpoint_with_the_old_compile_keys(tmp_path, base_config):
    outputs = tmp_path / "outputs"
    old = write_run(
        outputs,
        "10-00-00",
        legacy(
            base_config,
            compile=False,
            compile_mode="default",
            compile_backend="inductor",
            compile_regions="transformer",
            compile_backbone="eager",
        ),
    )
    assert find_resume_checkpoint("auto", output_dir=tmp_path / "new", search_root=outputs, config=base_config) == old


NEW_MODEL_KEYS = (
    "one_to_many",
    "num_queries_one2many",
    "k_one2many",
    "lambda_one2many",
    "cls_loss_coef_one2many",
    "mixed_selection",
    "look_forward_twice",
    "cross_attention_first",
)


@pytest.mark.parametrize(
    "option", ["model.one_to_many=hybrid", "model.one_to_many=mixed", "model.mixed_selection=true"]
)
def test_a_checkpoint_from_before_the_one_to_many_options_resumes_without_them_and_is_another_run(
    tmp_path, base_config, option
):
    """A model recorded before the one-to-many options and Deformable-DETR++'s changes trained without them: a resume
    keeps them off (for two-stage nothing else would tell), and resume=auto does not take it for a run with one on."""
    before = copy.deepcopy(base_config)
    for key in NEW_MODEL_KEYS:
        del before["model"][key]
    two_stage = ("model.with_box_refine=true", "model.two_stage=true")
    before["model"].update(with_box_refine=True, two_stage=True)
    effective = config_for_resume(compose_train("epochs=30", *two_stage, option), checkpoint_of(before), path="old.pth")
    assert (effective.model.one_to_many, effective.model.mixed_selection) == ("none", False)
    outputs = tmp_path / "outputs"
    old = write_run(outputs, "10-00-00", before)
    key, value = option.split("=")
    changed = with_changes(base_config, **{"model.with_box_refine": True, "model.two_stage": True, key: value})
    plain = with_changes(base_config, **{"model.with_box_refine": True, "model.two_stage": True})
    assert find_resume_checkpoint("auto", output_dir=tmp_path / "a", search_root=outputs, config=changed) is None
    assert find_resume_checkpoint("auto", output_dir=tmp_path / "b", search_root=outputs, config=plain) == old


def test_a_checkpoint_recording_hybrid_matching_resumes_with_one_to_many_hybrid(base_config):
    """The setting's earlier name, model.hybrid_matching, as a checkpoint of that version records it."""
    recorded = copy.deepcopy(base_config)
    del recorded["model"]["one_to_many"]
    recorded["model"]["hybrid_matching"] = True
    effective = config_for_resume(compose_train("epochs=30"), checkpoint_of(recorded), path="old.pth")
    assert effective.model.one_to_many == "hybrid"


class TinyConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.ModuleList([torch.nn.Conv2d(3, 4, 3)])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone[0](x).mean((2, 3))).square().sum()


def _steps(model, optimizer, *, steps: int, seed: int) -> None:
    inputs = torch.randn(steps, 2, 3, 5, 5, generator=torch.Generator().manual_seed(seed))
    for x in inputs:
        optimizer.zero_grad()
        model(x.contiguous(memory_format=torch.channels_last)).backward()
        optimizer.step()


@pytest.mark.parametrize("channels_last_after", [True, False])
def test_a_resume_into_the_other_memory_layout_continues_the_same_run(channels_last_after):
    """A GPU run's backbone is channels_last, a CPU run's is not, and each can resume the other's checkpoint: the
    fused AdamW pairs a parameter's elements with its moments' by their place in memory, so the restored moments
    must take the parameter's layout, or the resumed run updates each weight with another's moments."""
    cfg_optim = compose_train().optim

    def build(channels_last: bool):
        torch.manual_seed(0)
        model = TinyConv()
        if channels_last:
            model.backbone.to(memory_format=torch.channels_last)
        optimizer = build_optimizer(model, cfg_optim)
        return model, optimizer, build_lr_scheduler(optimizer, cfg_optim)

    model, optimizer, scheduler = build(not channels_last_after)
    _steps(model, optimizer, steps=3, seed=1)
    ckpt = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "grad_scaler": {},
            "epoch": 0,
            "step": 3,
            "steps_in_epoch": 3,
            "rng": {},
            "config": {"optim": plain_config(cfg_optim)},
        }
    )
    _steps(model, optimizer, steps=2, seed=2)  # the uninterrupted run

    resumed, resumed_optimizer, resumed_scheduler = build(channels_last_after)
    restore_training_state(
        ckpt,
        model=resumed,
        optimizer=resumed_optimizer,
        lr_scheduler=resumed_scheduler,
        scaler=torch.amp.GradScaler("cuda", enabled=False),
        cfg_optim=cfg_optim,
        path="c.pth",
    )
    for p in resumed.parameters():
        for key, value in resumed_optimizer.state[p].items():
            if value.shape == p.shape:
                assert value.stride() == p.stride(), key
    _steps(resumed, resumed_optimizer, steps=2, seed=2)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
