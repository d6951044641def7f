"""A run under faults, as a user meets them (CPU): preemption signals, one message per fault with the traceback
in train.log, a full disk found up front and a failed write named, one run per run directory, exit codes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, child_pids, compose_run, dead_pid, signal_at_call, tiny_overrides

import train as trainer
from datasets import build_dataset
from engine.checkpoint.io import load_checkpoint, save_checkpoint
from engine.errors import CheckpointWriteError, RunDirectoryInUse
from engine.runtime.distributed import DistContext
from engine.runtime.run_lock import LOCK_FILE
from engine.runtime.stop_request import StopRequest, TrainingStopped
from engine.train.hooks.base import ComputeSpan, StepDone
from engine.train.hooks.interval_report import StepLog
from engine.train.run_stop import RunStop

STEPS_PER_EPOCH = 3  # tests/test_train.py's tiny run

pytestmark = pytest.mark.slow


def quiet_run(data_root: Path, output_dir: Path, *extra: str):
    """The tiny run without the detection images, which a fault's checks do not need."""
    return compose_run(data_root, output_dir, "eval_images=0", *extra)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return {**trainer.train(quiet_run(data_root, run_dir)), "weights": load_checkpoint(run_dir / "checkpoint.pth")}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_the_exact_step_and_resume_continues_as_if_never_stopped(
    uninterrupted, data_root, tmp_path, monkeypatch, signum, caplog
):
    stop_at = STEPS_PER_EPOCH + 2  # inside the second epoch
    signal_at_call(monkeypatch, signum, stop_at)
    with pytest.raises(
        TrainingStopped,
        match=rf"stopped by {signal.Signals(signum).name} at epoch 2, step {stop_at}"
        r" of 6: .*checkpoint\.pth holds that step; continue with resume=auto",
    ) as stopped:
        trainer.train(quiet_run(data_root, tmp_path))
    assert stopped.value.exit_code == 128 + signum
    ckpt = load_checkpoint(tmp_path / "checkpoint.pth")
    assert (ckpt["epoch"], ckpt["steps_in_epoch"], ckpt["step"]) == (1, 2, stop_at)
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="engine"):
        resumed = trainer.train(quiet_run(data_root, tmp_path, "resume=auto"))
    # Epochs counted as the progress line and the stop message count them: this is epoch 2 of 2.
    assert f"at step {stop_at}: epoch 2/2, 2 of its {STEPS_PER_EPOCH} steps of 4 images done" in caplog.text
    assert resumed["step"] == 2 * STEPS_PER_EPOCH
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][stop_at:], rel=1e-5)
    final = load_checkpoint(tmp_path / "checkpoint.pth")["model"]
    for name, value in uninterrupted["weights"]["model"].items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert resumed["eval"] == pytest.approx(uninterrupted["eval"], abs=1e-4)


def test_checkpoints_are_written_mid_epoch_every_checkpoint_minutes(data_root, tmp_path, monkeypatch):
    import engine.checkpoint.writer

    saved = []
    save = engine.checkpoint.writer.save_checkpoint
    monkeypatch.setattr(
        engine.checkpoint.writer,
        "save_checkpoint",
        lambda state, path: saved.append((state["epoch"], state["steps_in_epoch"])) or save(state, path),
    )
    trainer.train(quiet_run(data_root, tmp_path, "epochs=1", "checkpoint_minutes=1e-6"))  # due at every log line
    assert saved == [(0, 1), (0, 2), (1, 0)]  # after steps 1 and 2, then the epoch's end


def test_every_rank_learns_of_a_stop_at_the_same_interval():
    """The request travels in the log interval's all-reduce: a rank that got no signal learns of the other's."""
    log_a, log_b = StepLog(), StepLog()
    for log in (log_a, log_b):
        log.add(
            StepDone(
                number=1,
                epoch=0,
                values=torch.tensor([1.0, 2.0]),
                names=("loss", "grad_norm"),
                size=(2, 3, 8, 8),
                images=2,
                data_s=0.0,
                compute=ComputeSpan(torch.device("cpu")).end(),
            )
        )
    flags = []

    def mean_with_the_other_rank(t):  # the other rank asked to stop: its flag row is 1
        other = t.clone()
        other[-1] = 1.0
        flags.append(t[-1].tolist())
        return (t + other) / 2

    interval = log_a.flush(("loss", "grad_norm"), mean_with_the_other_rank, stop=False)
    assert interval.stop_requested and flags == [[0.0, 0.0]] and interval.rows == [{"loss": 1.0, "grad_norm": 2.0}]
    assert not log_b.flush(("loss", "grad_norm"), lambda t: t, stop=False).stop_requested


class SignalInsideTheAnnouncement(StopRequest):
    """A SIGTERM that lands just after announce() looked for one: a loaded machine can pause the main thread there."""

    def announce(self, *, evaluating: bool = False) -> None:
        super().announce(evaluating=evaluating)
        if self.signum is None:
            self.signum = int(signal.SIGTERM)


@pytest.mark.parametrize(
    "decision, announced", [("due", "finishing this step"), ("during_evaluation", "stopping this evaluation")]
)
def test_a_stop_signal_landing_as_a_step_ends_is_announced_before_the_run_stops_on_it(decision, announced, caplog):
    control = RunStop(
        SignalInsideTheAnnouncement(), DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    )
    asks = {"due": control.due, "during_evaluation": lambda: control.during_evaluation(final=False)}[decision]
    with caplog.at_level(logging.WARNING, logger="engine"):
        stops = [asks() for _ in range(2)]
        assert stops == [False, True] and caplog.text.count(f"SIGTERM received: {announced}") == 1
        stopped = control.stopped(epoch=0, step=3, total_steps=9, latest=Path("checkpoint.pth"))
    assert stopped.exit_code == 128 + signal.SIGTERM and "stopped by SIGTERM at epoch 1, step 3 of 9" in caplog.text


def test_a_stop_signal_after_the_last_check_is_still_announced_before_its_stop_message(caplog):
    request = StopRequest()
    control = RunStop(request, DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu")))
    control.heard(True)  # another process asked; this one's own signal lands as the run stops
    request.signum = int(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="engine"):
        control.stopped(epoch=0, step=3, total_steps=9, latest=Path("checkpoint.pth"))
    assert caplog.text.index("SIGTERM received") < caplog.text.index("stopped by SIGTERM")


# ------------------------------------------------------------------------------------------------- disks
def test_a_disk_without_room_for_a_checkpoint_is_found_before_training(data_root, tmp_path, monkeypatch):
    import shutil

    import engine.checkpoint.io

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(engine.checkpoint.io.shutil, "disk_usage", lambda path: usage._replace(free=2**20))
    with pytest.raises(
        CheckpointWriteError,
        match=r"has 1 MB free, and a checkpoint of this run takes about \d+ MB: "
        r"free disk space or set output_dir to a disk with room",
    ):
        trainer.train(quiet_run(data_root, tmp_path))
    assert not (tmp_path / "checkpoint.pth").exists() and not list((tmp_path / "tensorboard").glob("*"))


def test_a_failed_write_names_the_file_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import engine.checkpoint.io

    path = save_checkpoint({"model": {"w": torch.ones(2)}, "step": 1}, tmp_path / "checkpoint.pth")

    def full_disk(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 24")

    monkeypatch.setattr(engine.checkpoint.io.torch, "save", full_disk)
    with pytest.raises(
        CheckpointWriteError,
        match=r"could not write checkpoint .*checkpoint\.pth \(the write stopped "
        r"short: the disk is probably full; \d+ MB free on its disk\); .*"
        r"checkpoint\.pth still holds the previous checkpoint",
    ):
        save_checkpoint({"model": {"w": torch.zeros(2)}, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_a_run_that_fails_while_a_checkpoint_is_written_finishes_the_file_first(data_root, tmp_path, monkeypatch):
    import time

    import engine.checkpoint.writer
    import engine.train.loop

    save = engine.checkpoint.writer.save_checkpoint
    monkeypatch.setattr(
        engine.checkpoint.writer, "save_checkpoint", lambda state, path: time.sleep(1.0) or save(state, path)
    )  # a slow disk
    train_epoch = engine.train.loop.TrainingLoop._train_epoch

    def fails_in_the_second_epoch(self, epoch):
        if epoch == 1:
            raise RuntimeError("a fault in the second epoch")
        return train_epoch(self, epoch)

    monkeypatch.setattr(engine.train.loop.TrainingLoop, "_train_epoch", fails_in_the_second_epoch)
    with pytest.raises(RuntimeError, match="a fault in the second epoch"):
        trainer.train(quiet_run(data_root, tmp_path, "epochs=2", "eval_every=5"))
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == STEPS_PER_EPOCH  # whole, when train() returns


def test_no_loader_worker_holds_a_checkpoint_file_open(data_root, tmp_path, monkeypatch):
    """Workers forked while a checkpoint is written would inherit its open file (and keep a replaced one's disk
    space): every worker, the validation loader's too, exists before the first write."""
    import time

    import engine.checkpoint.io
    import engine.evaluation.validation

    save = engine.checkpoint.io.torch.save
    monkeypatch.setattr(
        engine.checkpoint.io.torch,
        "save",  # the file open and in flight as evaluation starts
        lambda obj, f: time.sleep(1.0) or save(obj, f),
    )
    evaluate, held = engine.evaluation.validation.evaluate_coco, []

    def checking(**kwargs):
        result = evaluate(**kwargs)  # the loader's workers run (and, forked now, would be) here
        held.append(sorted(name for pid in child_pids() for name in open_files(pid) if "checkpoint" in name))
        return result

    monkeypatch.setattr(engine.evaluation.validation, "evaluate_coco", checking)
    trainer.train(quiet_run(data_root, tmp_path, "epochs=2", "num_workers=2"))
    assert held == [[], []]


def open_files(pid: int) -> list[str]:
    names = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            names.append(os.readlink(fd))
        except OSError:
            continue
    return names


def test_a_run_whose_checkpoint_write_fails_stops_with_that_error(data_root, tmp_path, monkeypatch):
    """The write happens in the background; the run still ends with its error, not with a result."""
    import engine.checkpoint.io

    def full_disk(obj, f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine.checkpoint.io.torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint .*checkpoint_epoch0001\.pth"):
        trainer.train(quiet_run(data_root, tmp_path, "epochs=2"))
    assert not list(tmp_path.glob("*.pth")) and not list(tmp_path.glob("eval_epoch0002.json"))


# ------------------------------------------------------------------------------------------ run directories
def test_a_second_run_in_a_directory_in_use_is_refused_naming_the_other(data_root, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(
            f'{{"pid": {sleeper.pid}, "host": "{os.uname().nodename}", "started": "2026-12-01 10:00:00", '
            f'"command": "train.py output_dir={tmp_path}"}}'
        )
        with pytest.raises(
            RunDirectoryInUse,
            match=rf"run directory .* is in use by process {sleeper.pid}, started "
            r"2026-12-01 10:00:00 \(train\.py output_dir=.*\)\. Wait for it",
        ):
            trainer.train(quiet_run(data_root, tmp_path))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (tmp_path / LOCK_FILE).exists()  # the other run's lock is left alone


def test_a_stale_lock_of_a_dead_run_is_taken_over_with_a_warning(data_root, tmp_path, caplog):
    pid = dead_pid()
    (tmp_path / LOCK_FILE).write_text(
        f'{{"pid": {pid}, "host": "{os.uname().nodename}", "started": "x", "command": ""}}'
    )
    with caplog.at_level(logging.WARNING, logger="engine"):
        result = trainer.train(quiet_run(data_root, tmp_path, "epochs=1"))
    assert result["step"] == STEPS_PER_EPOCH
    assert f"taking over the lock of process {pid}, which no longer runs" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end


# ------------------------------------------------------------------------------------- as a user runs it
def start_train(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=tmp_path,
        env=env or child_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_after_the_step_with_its_exit_code_and_no_traceback(data_root, tmp_path, signum):
    run_dir = tmp_path / "run"
    child = start_train(tmp_path, *tiny_overrides(data_root), "epochs=100", f"output_dir={run_dir}")
    lines = []
    for line in child.stdout:  # wait until it trains
        lines.append(line)
        if "epoch 2/100" in line:
            child.send_signal(signum)
            break
    out = "".join(lines) + child.stdout.read()
    assert child.wait(timeout=120) == 128 + signum, out
    name = signal.Signals(signum).name
    assert f"{name} received: finishing this step" in out and f"stopped by {name} at epoch" in out
    assert "Traceback" not in out
    ckpt = load_checkpoint(run_dir / "checkpoint.pth")
    assert ckpt["step"] > STEPS_PER_EPOCH
    # Everything of the run is in output_dir: its log and Hydra's record too, and nothing under ./outputs.
    assert (run_dir / "train.log").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists() and not (run_dir / LOCK_FILE).exists()


def test_a_fault_is_one_message_on_the_console_and_its_traceback_in_train_log(data_root, tmp_path):
    # A bad setting: the message once, no traceback, and no run directory left behind.
    child = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "optim.lr=-1"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 1 and out.count("optim.lr must be a finite number > 0") == 1, out
    assert "Traceback" not in out and not (tmp_path / "outputs").exists()
    # A text file given as a checkpoint: the clear error only, not the unpickler's KeyError behind it.
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    child = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *tiny_overrides(data_root), "eval_only=true", "checkpoint=notes.txt"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 1 and out.count("could not read checkpoint notes.txt") == 1, out
    assert "KeyError" not in out and "Traceback" not in out
    # A fault during training (damaged images, found as they are read): the console says which and where to go
    # on from, train.log also has the traceback.
    damaged = tmp_path / "damaged"
    build_dataset("train", quiet_run(data_root, tmp_path).dataset, check=False)  # written, whatever ran before
    shutil.copytree(data_root, damaged)
    for image in sorted((damaged / "train2017").glob("*.jpg"))[:6]:
        image.write_bytes(image.read_bytes()[:100])
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(damaged), "dataset.verify=false", f"output_dir={run_dir}"]
    child = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 1 and "Traceback" not in out and out.count("cannot read image ") == 1, out
    log_text = (run_dir / "train.log").read_text()
    assert "Traceback" in log_text and "cannot read image " in log_text
    # HYDRA_FULL_ERROR=1 puts the traceback on the console too.
    child = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "optim.lr=-1"],
        cwd=tmp_path,
        env=child_env(HYDRA_FULL_ERROR="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 1 and "Traceback" in child.stdout + child.stderr


def signal_in_evaluation(monkeypatch, signum: int, evaluation: int) -> None:
    """Send this process ``signum`` inside the first batch of its ``evaluation``-th evaluation (1-based)."""
    from engine.reporting.progress import EvaluationProgress

    init, seen = EvaluationProgress.__init__, {"n": 0}

    def starting(self, *args, **kwargs):
        seen["n"] += 1
        init(self, *args, **kwargs)
        if seen["n"] == evaluation:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(EvaluationProgress, "__init__", starting)


@pytest.mark.parametrize("evaluation, what", [(1, "an epoch's"), (2, "the final")])
def test_a_stop_signal_during_an_evaluation_stops_it_and_the_resume_runs_it(
    uninterrupted, data_root, tmp_path, monkeypatch, evaluation, what, caplog
):
    """SIGTERM during the evaluation after epoch 1 (of 2), or during the final one: the evaluation stops within a
    batch, checkpoint.pth holds the step with the evaluation pending, and the run exits 143; resume=auto evaluates
    first, then goes on as if never stopped."""
    signal_in_evaluation(monkeypatch, signal.SIGTERM, evaluation)
    with (
        pytest.raises(
            TrainingStopped,
            match=rf"stopped by SIGTERM during the evaluation after epoch {evaluation}, at "
            rf"step {evaluation * STEPS_PER_EPOCH} of 6: .*checkpoint\.pth holds "
            r"that step; .*which evaluates first",
        ) as stopped,
        caplog.at_level(logging.WARNING, logger="engine"),
    ):
        trainer.train(quiet_run(data_root, tmp_path))
    # Said as it is: the signal stops the evaluation; no step is being finished.
    assert caplog.text.count("SIGTERM received: stopping this evaluation") == 1
    assert "finishing this step" not in caplog.text
    assert stopped.value.exit_code == 143
    ckpt = load_checkpoint(tmp_path / "checkpoint.pth")
    assert ckpt["step"] == evaluation * STEPS_PER_EPOCH
    assert ckpt["pending_evaluation"] == {"epoch": evaluation, "epoch_complete": True}
    assert not (tmp_path / f"eval_epoch{evaluation:04d}.json").exists()
    monkeypatch.undo()
    resumed = trainer.train(quiet_run(data_root, tmp_path, "resume=auto"))
    assert (tmp_path / f"eval_epoch{evaluation:04d}.json").is_file() and resumed["step"] == 2 * STEPS_PER_EPOCH
    assert "pending_evaluation" not in load_checkpoint(tmp_path / "checkpoint.pth")
    assert resumed["eval"] == pytest.approx(uninterrupted["eval"], abs=1e-4)


def test_a_run_refused_by_the_lock_leaves_the_live_runs_files_as_they_were(data_root, tmp_path):
    """The lock is taken before Hydra writes .hydra/ and train.log: the refused command touches nothing there."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    live = {
        run_dir / ".hydra" / "config.yaml": "seed: 1\n",
        run_dir / ".hydra" / "overrides.yaml": "- seed=1\n",
        run_dir / "train.log": "[the live run's log]\n",
    }
    for path, text in live.items():
        path.write_text(text)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run_dir / LOCK_FILE).write_text(
            f'{{"pid": {sleeper.pid}, "host": "{os.uname().nodename}", "started": "2026-12-01 10:00:00", '
            f'"command": "train.py seed=1"}}'
        )
        before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
        child = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *tiny_overrides(data_root), "seed=2", f"output_dir={run_dir}"],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    out = child.stdout + child.stderr
    assert child.returncode == 1 and f"is in use by process {sleeper.pid}" in out and "Traceback" not in out, out
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert all(path.read_text() == text for path, text in live.items())


def test_a_cpu_runs_console_has_the_runs_lines_and_not_the_profilers(data_root, tmp_path):
    """profile_steps on a CPU: no line of torch's tracer (kineto) about the GPU there is not; '1 process'."""
    child = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *tiny_overrides(data_root),
            "epochs=1",
            "eval_images=0",
            "profile_steps=[1,1]",
            f"output_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 0, out
    assert (tmp_path / "run" / "profile_steps_1-1.json").is_file()
    assert "gpuGetDeviceCount" not in out and "profiler_start" not in out, out
    assert "| 1 process on cpu" in out and "1 processes" not in out


def test_one_ctrl_c_during_eval_only_says_the_evaluation_stopped_and_nothing_was_written(tmp_path):
    """train.py eval_only=true, its evaluation interrupted by one Ctrl-C: a message about the evaluation (nothing is
    written before its end), not the training run's about lost steps."""
    script = f"""
import os, runpy, signal, sys, time
sys.argv = ["train.py", "eval_only=true", "checkpoint=unused.pth", "output_dir={tmp_path / "eval"}", "device=cpu"]
import engine.train.eval_only

# Python's own Ctrl-C handler, as in a terminal: a shell without job control starts a background command (CI run with
# `&`, say) with SIGINT ignored, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)

def interrupted_evaluation(cfg):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)

# train.py imports it from there; run as a script, as `python train.py` runs it (Hydra finds configs/ beside it).
engine.train.eval_only.evaluate_checkpoint = interrupted_evaluation
runpy.run_path("train.py", run_name="__main__")
"""
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    out = child.stdout + child.stderr
    assert child.returncode == 130, out
    assert "stopped by Ctrl-C: the evaluation did not finish, and eval.json, written at its end, was not written" in out
    assert "steps since the last checkpoint" not in out and "Traceback" not in out
