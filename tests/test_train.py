"""The trainer end to end on a tiny synthetic run (CPU): outputs, eval_only, resume, 2 processes, failures.

One session-scoped run (2 epochs of 4 steps) is shared by most tests; the others start from its
checkpoints so that each adds only a few steps.
"""

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, compose_run, tensorboard_scalars, tiny_overrides, write_checkpoint
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train as trainer
from engine.checkpoint.io import load_checkpoint
from engine.errors import CheckpointError, NonFiniteLossError

# 16 training images, batch 4, wide and tall: an epoch's images left over in the two orientations' size buckets
# wait for no one (datasets/batch_plan.py), so one batch fewer than 16 // 4.
STEPS_PER_EPOCH = 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_root):
    """The reference run: 2 epochs, checkpoints after each, evaluation after each."""
    return trainer.train(compose_run(data_root, tmp_path_factory.mktemp("run")))


def scalars(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_run_writes_tensorboard_checkpoints_and_eval(tiny_run):
    run_dir = tiny_run["output_dir"]
    assert tiny_run["step"] == 2 * STEPS_PER_EPOCH and len(tiny_run["losses"]) == 2 * STEPS_PER_EPOCH
    tags = set(scalars(run_dir).Tags()["scalars"])
    for tag in (
        "train/step_time_ms",
        "train/data_time_ms",
        "train/images_per_s",
        "train/loss",
        "train/lr",
        "train/lr_backbone",
        "train/loss_ce",
        "train/loss_bbox_unscaled",
        "eval/AP",
        "eval/AP50",
    ):
        assert tag in tags, tag
    step_times = scalars(run_dir).Scalars("train/step_time_ms")
    assert [e.step for e in step_times] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert all(e.value > 0 for e in step_times)

    for name in ("checkpoint.pth", "checkpoint_epoch0001.pth", "checkpoint_epoch0002.pth"):
        assert (run_dir / name).is_file(), name
    timing = json.loads((run_dir / "timing.json").read_text())  # where the run's time went (engine/train/run_timing.py)
    assert timing == tiny_run["timing"] and timing["steps"] == 2 * STEPS_PER_EPOCH
    assert timing["compile_s"] == 0 and timing["graphs_compiled"] == 0  # the CPU runs eagerly
    assert 0 < timing["train_s"] < timing["total_s"] and 0 < timing["eval_s"] < timing["total_s"]
    assert timing["steady_step_ms"] > 0 and 0 <= timing["padding_waste"] < 0.5
    steady = timing["steady"]  # the second half of the warm steps: what bench/throughput.py reports
    assert steady["steps"] >= 1 and steady["images_per_s"] > 0 and 0 <= steady["data_wait_share"] < 1
    assert steady["window"][0] < steady["window"][1] and steady["pixels_per_image"] >= 64 * 64
    assert timing["peak_memory_gib"] is None  # on the CPU
    ckpt = load_checkpoint(run_dir / "checkpoint.pth")
    assert {"model", "optimizer", "lr_scheduler", "grad_scaler", "epoch", "step", "config", "rng"} <= set(ckpt)
    assert (ckpt["epoch"], ckpt["step"], ckpt["steps_in_epoch"]) == (2, 2 * STEPS_PER_EPOCH, 0)
    assert ckpt["config"]["model"]["hidden_dim"] == 32
    assert {"python", "numpy", "torch"} <= set(ckpt["rng"])

    evaluation = json.loads((run_dir / "eval_epoch0002.json").read_text())
    assert set(evaluation) >= {"AP", "AP50", "AP75", "APs", "APm", "APl", "epoch", "step", "per_class"}
    assert list(evaluation.pop("per_class")) == ["person", "bicycle", "car", "motorcycle", "airplane", "bus"]
    # the training steps' wall time so far: AP against seconds
    assert 0 < evaluation.pop("steps_s") <= timing["train_s"] + timing["warmup_s"] + timing["compile_s"] + 1e-3
    assert evaluation == pytest.approx(
        {
            **tiny_run["eval"],
            "epoch": 2,
            "step": 2 * STEPS_PER_EPOCH,
            "epoch_complete": True,
            "num_images": 8,
            "weights": "raw",
        }
    )
    assert all(-1.0 <= evaluation[k] <= 1.0 for k in ("AP", "AP50", "AP75"))


def test_eval_only_reproduces_the_final_evaluation(tiny_run, data_root, tmp_path):
    cfg = compose_run(
        data_root,
        tmp_path,
        "eval_only=true",
        f"checkpoint={tiny_run['output_dir'] / 'checkpoint.pth'}",
        # the architecture comes from the checkpoint's recorded config, not from these
        "model.hidden_dim=64",
        "model.num_queries=30",
    )
    result = trainer.evaluate_checkpoint(cfg)
    assert result["eval"] == pytest.approx(tiny_run["eval"], abs=1e-12)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["AP"] == pytest.approx(tiny_run["eval"]["AP"], abs=1e-12)
    assert "eval/AP" in scalars(tmp_path).Tags()["scalars"]


def test_eval_only_reads_the_variant_from_official_style_args(tiny_run, data_root, tmp_path):
    """An official checkpoint is {"model", "args": Namespace}; its args, not the config, set the sizes."""
    ours = load_checkpoint(tiny_run["output_dir"] / "checkpoint.pth")
    args = argparse.Namespace(**ours["config"]["model"], lr=1e-3, output_dir="exps/tiny", dataset_file="coco")
    del args.num_classes  # the official args do not record it (91, from the dataset)
    path = tmp_path / "official_style.pth"
    torch.save({"model": ours["model"], "args": args, "epoch": 1}, path)
    result = trainer.evaluate_checkpoint(
        compose_run(
            data_root, tmp_path, "eval_only=true", f"checkpoint={path}", "model.hidden_dim=64", "model.dec_layers=6"
        )
    )
    assert result["eval"] == pytest.approx(tiny_run["eval"], abs=1e-12)


def test_resume_at_an_epoch_boundary_continues_identically(tiny_run, data_root, tmp_path):
    ckpt = tiny_run["output_dir"] / "checkpoint_epoch0001.pth"
    result = trainer.train(compose_run(data_root, tmp_path, f"resume={ckpt}"))
    assert result["step"] == 2 * STEPS_PER_EPOCH
    assert result["losses"] == pytest.approx(tiny_run["losses"][STEPS_PER_EPOCH:], rel=1e-5)
    assert result["eval"] == pytest.approx(tiny_run["eval"], abs=1e-4)


def test_resume_mid_epoch_continues_identically(tiny_run, data_root, tmp_path):
    ckpt = tiny_run["output_dir"] / "checkpoint_epoch0001.pth"
    stop = STEPS_PER_EPOCH + 2
    first = trainer.train(compose_run(data_root, tmp_path / "a", f"resume={ckpt}", f"max_steps={stop}"))
    mid = load_checkpoint(tmp_path / "a" / "checkpoint.pth")
    assert (mid["epoch"], mid["steps_in_epoch"], mid["step"]) == (1, 2, stop)
    # resume=auto finds the run directory's own checkpoint.pth first
    second = trainer.train(compose_run(data_root, tmp_path / "a", "resume=auto"))
    assert first["losses"] + second["losses"] == pytest.approx(tiny_run["losses"][STEPS_PER_EPOCH:], rel=1e-5)


@pytest.mark.parametrize("regions,backbone", [("layers", "eager"), ("transformer", "eager"), ("transformer", "static")])
def test_compiled_run_trains_and_evaluates_as_the_eager_run(data_root, tmp_path, regions, backbone):
    """compile.mode=default: the model's regions, the losses and evaluation compiled (aot_eager traces them and
    runs the same kernels)."""
    torch._dynamo.reset()
    common = ("epochs=1", "model.dropout=0.0")  # dropout draws its mask in another order once traced
    eager = trainer.train(compose_run(data_root, tmp_path / "eager", *common))
    compiled = trainer.train(
        compose_run(
            data_root,
            tmp_path / "compiled",
            *common,
            "compile.mode=default",
            "compile.backend=aot_eager",
            f"compile.regions={regions}",
            f"compile.backbone={backbone}",
            "compile.evaluation=true",
        )
    )
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    # The tiny model scores AP 0 after one epoch either way: compare the trained weights instead (the
    # detections of compiled evaluation are compared in tests/test_compile.py).
    weights = load_checkpoint(tmp_path / "eager" / "checkpoint.pth")["model"]
    compiled_weights = load_checkpoint(tmp_path / "compiled" / "checkpoint.pth")["model"]
    assert set(compiled_weights) == set(weights)
    # AdamW moves every weight by up to lr (1e-3) per step, whatever its gradient's size; parameters whose
    # gradient is zero up to rounding (biases before a GroupNorm, attention key biases) follow that
    # rounding's sign, so they may differ by a fraction of a step: 1e-4 is a tenth of one.
    for name, value in weights.items():
        torch.testing.assert_close(compiled_weights[name], value, rtol=1e-4, atol=1e-4, msg=name)
    assert set(compiled["eval"]) == set(eager["eval"])  # the evaluation ran through the compiled regions
    timing, tags = compiled["timing"], set(scalars(tmp_path / "compiled").Tags()["scalars"])
    assert timing["compile_s"] > 0 and {"compile/seconds", "compile/graphs"} <= tags
    # Evaluation: one graph per evaluation size (at most two: wide and tall), no training region again.
    assert 1 <= timing["graphs_by_function"]["detect"] <= 2
    assert timing["graphs_by_function"].get("stacked_losses") == 1


def test_unreadable_checkpoint_is_a_clear_error(data_root, tmp_path):
    bad = tmp_path / "corrupt.pth"
    bad.write_bytes(b"\x80\x02 not a checkpoint")
    with pytest.raises(CheckpointError, match=r"could not read checkpoint .*corrupt\.pth"):
        trainer.evaluate_checkpoint(compose_run(data_root, tmp_path / "eval", "eval_only=true", f"checkpoint={bad}"))
    with pytest.raises(CheckpointError, match=r"corrupt\.pth"):
        trainer.train(compose_run(data_root, tmp_path / "resume", f"resume={bad}"))


def test_checkpoint_of_another_variant_is_a_clear_error(tiny_run, data_root, tmp_path):
    ckpt = load_checkpoint(tiny_run["output_dir"] / "checkpoint.pth")
    del ckpt["config"]  # as if it recorded nothing: the config's variant is then used, and does not fit
    path = tmp_path / "no_config.pth"
    torch.save(ckpt, path)
    cfg = compose_run(data_root, tmp_path, "eval_only=true", f"checkpoint={path}", "experiment=box_refine")
    with pytest.raises(CheckpointError, match=r"no_config\.pth does not fit the model.*with_box_refine"):
        trainer.evaluate_checkpoint(cfg)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_run, data_root, tmp_path, monkeypatch):
    import engine.compile.run_model

    calls = {"n": 0}
    build_model = engine.compile.run_model.build_model

    def build_model_with_nan_in_epoch_2(cfg_model):
        model, criterion, postprocess = build_model(cfg_model)
        forward = criterion.forward

        def nan_loss(outputs, targets, **kwargs):
            losses = forward(outputs, targets, **kwargs)
            calls["n"] += 1
            if calls["n"] == STEPS_PER_EPOCH + 2:
                losses["loss_bbox"] = losses["loss_bbox"] * float("nan")
            return losses

        criterion.forward = nan_loss
        return model, criterion, postprocess

    monkeypatch.setattr(engine.compile.run_model, "build_model", build_model_with_nan_in_epoch_2)
    with pytest.raises(
        NonFiniteLossError,
        match=rf"non-finite loss .* epoch 2, step {STEPS_PER_EPOCH + 2} "
        r".*loss_bbox=nan"
        r".*checkpoint\.pth, is kept",
    ):
        trainer.train(compose_run(data_root, tmp_path))
    kept = load_checkpoint(tmp_path / "checkpoint.pth")
    assert (kept["epoch"], kept["step"]) == (1, STEPS_PER_EPOCH)
    good = load_checkpoint(tiny_run["output_dir"] / "checkpoint_epoch0001.pth")
    assert all(torch.equal(kept["model"][k], good["model"][k]) for k in good["model"])
    assert all(torch.isfinite(v).all() for v in kept["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("gradient_sync", ["ddp", "allreduce"])
def test_two_processes_with_gloo_train_and_evaluate_over_both_ranks(tmp_path, gradient_sync):
    """torchrun, two CPU processes: one run directory, data-parallel steps, evaluation gathered from both ranks; each
    step is the step of one process holding the whole batch (its images, their padded sizes, its loss and gradient).

    Uneven on purpose: 18 training images (steps of 4: 3 batches, as left-overs in the size buckets wait for no one)
    and 7 validation images (4 and 3, rank 1's share padded with a repeat): nothing hangs, every image is scored.
    """
    data_root = tmp_path / "data"
    uneven = ["dataset.num_train=18", "dataset.num_val=7"]
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        *tiny_overrides(data_root),
        *uneven,
        "epochs=1",
        "batch_size=2",
        "dist_timeout_s=120",
        f"gradient_sync={gradient_sync}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1, run_dirs  # rank 1 did not make a directory of its own
    run_dir = run_dirs[0]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "checkpoint.pth").is_file()
    log_text = (run_dir / "train.log").read_text()
    assert "2 processes on cpu" in log_text
    ddp_eval = json.loads((run_dir / "eval_epoch0001.json").read_text())
    ckpt = load_checkpoint(run_dir / "checkpoint.pth")
    assert ckpt["step"] == 18 // 4 - 1  # 18 images in steps of 4 over both ranks, one step's worth left over

    one = trainer.train(compose_run(data_root, tmp_path / "one", *uneven, "epochs=1", "batch_size=4"))
    assert len(one["losses"]) == ckpt["step"]
    assert tensorboard_scalars(run_dir, "train/loss") == pytest.approx(one["losses"], rel=1e-5)
    assert tensorboard_scalars(run_dir, "train/grad_norm") == pytest.approx(
        tensorboard_scalars(one["output_dir"], "train/grad_norm"), rel=1e-4
    )

    # Scored on every validation image (each rank ran 4 of the 7), with the same figures as one process
    # evaluating the same weights.
    assert ddp_eval["num_images"] == 7
    single = trainer.evaluate_checkpoint(
        compose_run(
            data_root, tmp_path / "single", *uneven, "eval_only=true", f"checkpoint={run_dir / 'checkpoint.pth'}"
        )
    )
    assert {k: ddp_eval[k] for k in single["eval"]} == pytest.approx(single["eval"], abs=1e-12)


def test_missing_coco_annotations_is_a_clear_error(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "dataset=coco",
                f"dataset.root={tmp_path / 'coco'}",
                "model=tiny",
                f"output_dir={tmp_path / 'run'}",
                "device=cpu",
            ],
        )
    with pytest.raises(FileNotFoundError, match=r"annotation file not found: .*instances_train2017\.json"):
        trainer.train(cfg)


def test_a_run_without_size_buckets_is_warned_when_its_plan_builds_graphs_per_size(caplog):
    from omegaconf import OmegaConf

    from engine.compile.plan import CompilePlan
    from engine.train.run_setup import warn_unbounded_sizes

    cfg = OmegaConf.create({"compile": {"mode": "graphs"}, "dataset": {"pad_to_multiple": 32}})
    with caplog.at_level("WARNING", logger="engine"):
        warn_unbounded_sizes(cfg, None, CompilePlan(mode="graphs"), training=True)
        warn_unbounded_sizes(cfg, object(), CompilePlan(mode="graphs"), training=True)  # buckets: nothing
        warn_unbounded_sizes(cfg, None, None, training=True)  # eager: nothing
    assert len(caplog.records) == 1
    assert (
        "dataset.size_buckets=0 with compile.mode=graphs: each new padded batch size records CUDA graphs again"
        in caplog.text
        and "dataset.pad_to_multiple=32" in caplog.text
    )


# Written by train.py at commit 9f3f177, before engine/ became packages (`python train.py max_steps=2 epochs=1
# device=cpu`: the synthetic default, stopped mid-epoch), then its model and optimizer tensors filled with a constant
# (same shapes and dtypes) so that it compresses to a small file; every key, the config and the RNG states are as
# written.
FLAT_ENGINE_CHECKPOINT = ROOT / "tests" / "data" / "checkpoint_of_9f3f177.pth.xz"


def test_a_checkpoint_written_before_the_engine_packages_resumes_and_evaluates(data_root, tmp_path):
    import lzma

    checkpoint = tmp_path / "checkpoint_of_9f3f177.pth"
    checkpoint.write_bytes(lzma.decompress(FLAT_ENGINE_CHECKPOINT.read_bytes()))
    resumed = trainer.train(
        compose_run(data_root, tmp_path / "resumed", f"resume={checkpoint}", "max_steps=3", "epochs=1", "optim.lr=2e-4")
    )
    assert resumed["step"] == 3 and len(resumed["losses"]) == 1  # the two steps it held, then one more
    assert load_checkpoint(tmp_path / "resumed" / "checkpoint.pth")["config"]["model"]["backbone"] == "resnet18"
    evaluated = trainer.evaluate_checkpoint(
        compose_run(data_root, tmp_path / "evaluated", "eval_only=true", f"checkpoint={checkpoint}")
    )
    assert set(evaluated["eval"]) == {"AP", "AP50", "AP75", "APs", "APm", "APl"}


def test_a_resume_never_fetches_the_backbone_weights_its_checkpoint_replaces(
    tiny_run, data_root, tmp_path, monkeypatch
):
    import models.backbone

    monkeypatch.setattr(
        models.backbone,
        "_imagenet_state_dict",
        lambda name: pytest.fail("fetched ImageNet weights for a resumed model"),
    )
    epoch_one = tiny_run["output_dir"] / "checkpoint_epoch0001.pth"
    resumed = trainer.train(compose_run(data_root, tmp_path, f"resume={epoch_one}", "model.pretrained=imagenet"))
    assert resumed["step"] == 2 * STEPS_PER_EPOCH


def test_eval_only_takes_a_run_directory_for_its_checkpoint(tiny_run, data_root, tmp_path):
    result = trainer.evaluate_checkpoint(
        compose_run(data_root, tmp_path, "eval_only=true", f"checkpoint={tiny_run['output_dir']}")
    )
    assert result["eval"] == pytest.approx(tiny_run["eval"], abs=1e-4)


def _profiled_run(data_root: Path, run_dir: Path, *overrides: str) -> dict:
    result = trainer.train(compose_run(data_root, run_dir, *overrides))
    profile = result["timing"]["profile"]
    assert json.loads((run_dir / "timing.json").read_text())["profile"] == profile
    trace = json.loads((run_dir / profile["trace"]).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"step.data", "step.forward", "step.matching", "step.backward", "step.update"} <= names
    assert profile["step_ms"] > 0
    return profile


def test_profile_steps_writes_the_trace_and_summary_of_those_steps_up_to_the_epochs_end(
    data_root, tmp_path, monkeypatch
):
    """A range that crosses the end of an epoch is profiled up to there: never the epoch's checkpoint and
    evaluation, which would count as the steps' time."""
    from engine.train.hooks.evaluation import EpochEvaluation
    from engine.train.hooks.saving import CheckpointSaver

    for hook in (CheckpointSaver, EpochEvaluation):

        def unprofiled(self, run, end, _epoch_end=hook.epoch_end):
            assert not run.timing.profiling, "the epoch's checkpoint and evaluation ran inside the profile"
            return _epoch_end(self, run, end)

        monkeypatch.setattr(hook, "epoch_end", unprofiled)
    profile = _profiled_run(data_root, tmp_path, "epochs=2", f"profile_steps=[2,{STEPS_PER_EPOCH + 1}]")
    assert profile["profiled_steps"] == [2, STEPS_PER_EPOCH] and profile["steps"] == STEPS_PER_EPOCH - 1
    assert profile["trace"] == f"profile_steps_2-{STEPS_PER_EPOCH}.json"
    assert profile["gpu_busy"] is None  # no GPU
    assert profile["graphs_compiled"] == 0 and profile["compile_s"] == 0  # the CPU runs eagerly


def test_a_profile_says_when_its_steps_compiled_or_recorded_graphs(data_root, tmp_path, caplog):
    """A graph recorded inside the profiled steps makes them unlike the steady steps: the summary gives its seconds
    (Inductor's CUDA-graph trees record without a new Dynamo graph, so seconds are all they show) and the log says
    so. The recording here is one the compile clock is told of, as the eager model's CUDA graphs tell it."""
    from engine.compile.clock import CompileClock
    from engine.train.hooks.base import Hook

    class RecordsInStepTwo(Hook):
        def after_step(self, run, done):
            if done.number == 2:
                CompileClock.get().record_capture("graphed_probe", 0.25)

    with caplog.at_level(logging.INFO):
        result = trainer.train(compose_run(data_root, tmp_path, "profile_steps=[2,3]"), hooks=[RecordsInStepTwo()])
    profile = result["timing"]["profile"]
    assert profile["profiled_steps"] == [2, 3]
    assert profile["graphs_compiled"] == 1 and profile["compile_s"] == pytest.approx(0.25)
    assert "these steps compiled or recorded graphs for 0.2 s, unlike the steady steps" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_profile_steps_on_the_gpu_gives_its_busy_share(data_root, tmp_path):
    last = 2 * STEPS_PER_EPOCH
    result = trainer.train(
        compose_run(
            data_root, tmp_path, "device=cuda", "compile.mode=graphs", "epochs=2", f"profile_steps=[{last - 1},{last}]"
        )
    )
    profile = result["timing"]["profile"]
    assert profile["profiled_steps"] == [last - 1, last]
    assert 0 < profile["gpu_busy"] <= 1 and 0 < profile["gpu_work_ms"] <= profile["step_ms"]
    trace = json.loads((tmp_path / profile["trace"]).read_text())
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])  # the GPU's activity alone


def test_dead_workers_raising_into_the_cleanup_still_give_the_one_message(data_root, tmp_path, monkeypatch):
    """Each dead loader worker raises its error from a signal handler wherever the main thread is: with several, the
    second one can land in the cleanup of the first (its loaders' workers ended). The run still says what died."""
    import engine.train.loop as loop
    from engine.errors import LoaderWorkerDied
    from engine.train.step import OptimizerStep

    def death(pid):
        return RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: Killed. ")

    def step_meets_a_dead_worker(*args, **kwargs):
        raise death(101)

    raised_into = []
    stop_workers = loop.stop_workers

    def cleanup_meets_another(loader):
        if not raised_into:
            raised_into.append(loader)
            raise death(102)
        stop_workers(loader)

    monkeypatch.setattr(OptimizerStep, "__call__", step_meets_a_dead_worker)
    monkeypatch.setattr(loop, "stop_workers", cleanup_meets_another)
    with pytest.raises(LoaderWorkerDied, match=r"a data loader worker process died \(.*pid 101"):
        trainer.train(compose_run(data_root, tmp_path, "epochs=1"))
    assert raised_into


def test_eval_only_of_a_checkpoint_without_the_datas_classes_gives_advice_that_works(data_root, tmp_path):
    """A checkpoint of 4 classes (ids 0..3) on the synthetic set (ids 1..6): eval_only takes its classes from the
    checkpoint, so setting model.num_classes would change nothing; the message says what does (a run from its
    weights with model.init_from), and following it trains and evaluates on this data."""

    checkpoint = write_checkpoint(tmp_path / "four_classes.pth", extra=("model.num_queries=10",))
    child = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *tiny_overrides(data_root),
            "eval_only=true",
            f"checkpoint={checkpoint}",
            f"output_dir={tmp_path / 'eval'}",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 1 and "Traceback" not in out, out
    assert out.count("the checkpoint's class head (4 classes) covers ids 0..3 only") == 1, out
    assert f"model.init_from={checkpoint}" in out and "set model.num_classes" not in out
    fine_tuned = trainer.train(
        compose_run(
            data_root,
            tmp_path / "fine_tuned",
            f"model.init_from={checkpoint}",
            "epochs=1",
            "max_steps=1",
            "eval_images=0",
        )
    )
    assert fine_tuned["step"] == 1 and "AP" in fine_tuned["eval"]
