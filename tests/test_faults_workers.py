"""A run with loader workers that fails exits, as one without them does: rc 1 within seconds, one message on the
console (no traceback: train.log has it), naming the file or saying that a worker died, and where to resume from.

The workers ignore the stop signals (the main process acts on them), and multiprocessing's exit handler ends
its children with SIGTERM before it waits for them: a failing run that left them alive waited forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, child_env, child_pids, compose_run, tiny_overrides

from datasets import build_dataset

# A failing run must be gone this long after its message at most (its workers' own shutdown takes a second).
EXIT_WITHIN_S = 30.0
# How long a run may take to print its first line: starting Python, torch and the data on a machine that runs
# the suite's other processes too (-n 16 on 16 cores) is slow, and is not the exit being timed.
START_WITHIN_S = 300.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    with_cfg = compose_run(root, tmp_path_factory.mktemp("unused"), "eval_images=0")
    for split in ("train", "val"):
        build_dataset(split, with_cfg.dataset, check=False)  # written once, copied by the tests that damage it
    return root


class Run:
    """``python train.py`` in a child process, its console read line by line as it comes."""

    def __init__(self, cwd: Path, *overrides: str):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *overrides],
            cwd=cwd,
            env=child_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.console: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            self.console.append(line)
            if text in line:
                return
        pytest.fail(f"the run never printed {text!r}:\n{''.join(self.console)}")

    def finish(self) -> tuple[int | None, str, float]:
        """(exit code, or None if it had not exited EXIT_WITHIN_S after its last line, or START_WITHIN_S without a
        first one; the console; seconds from its first error line to its exit)."""
        errored = None
        while True:
            try:
                line = self.lines.get(timeout=EXIT_WITHIN_S if self.console else START_WITHIN_S)
            except queue.Empty:
                break
            if line is None:
                break
            self.console.append(line)
            if errored is None and "[ERROR]" in line:
                errored = time.monotonic()
        try:
            code = self.process.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.kill_all()
            code = None
        return code, "".join(self.console), time.monotonic() - (errored or time.monotonic())

    def kill_all(self) -> None:
        # A run stopped before it started its workers has none: the console then says where it was.
        for pid in [*child_pids(self.process.pid, expect_some=False), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


def assert_one_clean_exit(run_dir: Path, code, console: str, seconds: float, *, says: str) -> None:
    assert code == 1, f"exit {code} (None: still running {EXIT_WITHIN_S:g} s later):\n{console}"
    assert seconds < EXIT_WITHIN_S, console
    assert "Traceback" not in console and console.count(says) == 1, console
    assert "resume" in console or "start it again" in console or "start again" in console, console
    assert "Traceback" in (run_dir / "train.log").read_text()


def workers(*extra: str) -> list[str]:
    return ["num_workers=2", "eval_images=0", *extra]


def test_a_damaged_training_image_read_by_a_worker(data_root, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(data_root, damaged)
    for image in sorted((damaged / "train2017").glob("*.jpg"))[:6]:
        image.write_bytes(b"")  # zero bytes
    run_dir = tmp_path / "run"
    run = Run(tmp_path, *tiny_overrides(damaged), *workers("dataset.verify=false"), f"output_dir={run_dir}")
    code, console, seconds = run.finish()
    assert_one_clean_exit(run_dir, code, console, seconds, says="cannot read image ")
    assert "DataLoader worker process" not in console  # the image's message, not the worker's traceback


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="a run on a GPU pins its batches in a thread of the loader"
            ),
        ),
    ],
)
def test_a_killed_loader_worker(data_root, tmp_path, device):
    # On a GPU the loader's pin-memory thread, reading from the killed worker, can die with a traceback of its
    # own: train.log gets it, the console only the run's one message.
    run_dir = tmp_path / "run"
    run = Run(tmp_path, *tiny_overrides(data_root), *workers("epochs=200"), f"output_dir={run_dir}", f"device={device}")
    run.wait_for("epoch 2/200")
    for pid in child_pids(run.process.pid):  # the loaders' workers
        os.kill(pid, signal.SIGKILL)
    code, console, seconds = run.finish()
    assert_one_clean_exit(run_dir, code, console, seconds, says="a data loader worker process died")


def test_a_checkpoint_write_that_fails(data_root, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint.pth").mkdir(parents=True)  # in the way of the first checkpoint
    run = Run(tmp_path, *tiny_overrides(data_root), *workers("checkpoint_every=10"), f"output_dir={run_dir}")
    code, console, seconds = run.finish()
    assert_one_clean_exit(run_dir, code, console, seconds, says="could not write checkpoint")


def test_an_evaluation_that_fails(data_root, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(data_root, data)
    run_dir = tmp_path / "run"
    run = Run(tmp_path, *tiny_overrides(data), *workers("epochs=2"), f"output_dir={run_dir}")
    run.wait_for("evaluation after epoch 1")
    for image in sorted((data / "val2017").glob("*.jpg")):  # damaged after the start's checks
        image.write_bytes(b"")
    code, console, seconds = run.finish()
    assert_one_clean_exit(run_dir, code, console, seconds, says="cannot read image ")


def test_the_pin_memory_threads_traceback_goes_to_the_log_and_other_threads_print_theirs(monkeypatch, caplog):
    from torch.utils.data._utils.pin_memory import _pin_memory_loop

    from engine.runtime.console import (
        PIN_MEMORY_THREAD,
        loader_thread_tracebacks_to_log,
    )

    assert _pin_memory_loop.__name__ == PIN_MEMORY_THREAD  # the thread is named after its target
    printed = []  # what the hook in place before the run (Python's prints) was given
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(str(args.exc_value)))

    def fail(what: str) -> None:
        raise ConnectionResetError(what)

    def run_thread(name: str) -> None:
        thread = threading.Thread(target=fail, args=(name,), name=f"Thread-7 ({name})")
        thread.start()
        thread.join()

    log = logging.getLogger("test_pin_thread")
    with caplog.at_level(logging.ERROR, logger="test_pin_thread"), loader_thread_tracebacks_to_log(log):
        run_thread(PIN_MEMORY_THREAD)
        run_thread("another_loop")
    assert printed == ["another_loop"]
    [record] = caplog.records
    assert record.file_only and record.exc_info[1].args == (PIN_MEMORY_THREAD,)
    run_thread("after_the_run")  # the hook is gone with the run
    assert printed == ["another_loop", "after_the_run"]
