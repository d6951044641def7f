"""``python train.py`` runs started by a benchmark: bench/ttr.py, bench/throughput.py and, several at once,
bench/parity.py and bench/recipe.py; and train.py's config, for the benchmarks that build the model themselves.

``CHILDREN`` keeps the processes so that stopping the benchmark (Ctrl-C, a time limit's SIGTERM) stops them too
instead of leaving them running; ``run_train_py`` runs one, its output into a log; ``train_run`` runs one into its own
directory, its log beside it, and reads back its evaluations and TensorBoard curves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Children:
    """The train.py processes this benchmark started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[subprocess.Popen] = []
        self.stopping = False

    def run(self, cmd: list[str], *, timeout: float | None = None, **kwargs) -> int | None:
        """``cmd`` to its end: its exit status, or None when it ran past ``timeout`` seconds and was killed with the
        processes it started (its session: a run's loader workers)."""
        with self._lock:
            if self.stopping:
                return -int(signal.SIGTERM)
            proc = subprocess.Popen(cmd, start_new_session=timeout is not None, **kwargs)
            self._running.append(proc)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None

    def stop(self) -> None:
        """SIGTERM to every run still going: train.py saves its step and exits (143)."""
        with self._lock:
            self.stopping = True
            for proc in self._running:
                if proc.poll() is None:
                    proc.terminate()


CHILDREN = Children()


def run_all(run_one: Callable[..., dict], runs: list[tuple], *, parallel: int, lockstep: bool = False) -> list[dict]:
    """``run_one(*run)`` for every run, ``parallel`` at once, in order; with ``lockstep``, in groups of ``parallel``
    started together, each group ended before the next starts (runs whose times are compared then share the machine
    alike). Stopping the benchmark (Ctrl-C, a time limit's SIGTERM) stops the runs too."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    groups = [runs[i : i + parallel] for i in range(0, len(runs), parallel)] if lockstep else [runs]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        try:
            return [row for group in groups for row in pool.map(lambda run: run_one(*run), group)]
        except BaseException:
            CHILDREN.stop()
            raise


def compose_config(overrides: list[str]):
    """configs/train.yaml composed with ``overrides`` and checked, as train.py composes it, for a benchmark that builds
    the model in its own process."""
    from hydra import compose, initialize_config_dir

    from engine.config.registry import check_config, register_configs

    register_configs()  # the typed schemas configs/*.yaml name
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return check_config(compose(config_name="train", overrides=overrides))


def run_train_py(
    overrides: list[str],
    *,
    log: Path,
    env: dict | None = None,
    gpus: int = 1,
    timeout: float | None = None,
    checkout: Path = ROOT,
) -> int | None:
    """``python train.py OVERRIDES`` of ``checkout`` (this one unless another commit's is compared) under torchrun on
    more than one GPU, its output into ``log``: its exit status, or None when it ran past ``timeout`` seconds and was
    stopped."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 else []
    with open(log, "w") as out:
        return CHILDREN.run(
            [sys.executable, *launcher, str(checkout / "train.py"), *overrides],
            timeout=timeout,
            cwd=checkout,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def environment_without_cache_choice() -> dict:
    """This environment, less the variables that would move a run's compile caches out of its compile.cache_dir
    (bench/h200_run.sh sets one): for the benchmarks that time compilation into a cache of their own."""
    from engine.compile.cache import CACHE_VARIABLES

    return {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}


def train_run(overrides: list[str], *, run_dir: Path, parallel: int) -> dict:
    """One `python train.py OVERRIDES output_dir=RUN_DIR`, its output in RUN_DIR.log: {"command", "wall_s",
    "evaluations" (each eval_epochNNNN.json, in order), "loss", "ap_curve"}, or with "failed" saying why.
    ``parallel``: the runs going at once, which share the host's cores."""
    overrides = [*overrides, f"output_dir={run_dir}"]
    env = dict(os.environ)
    # Each run gets its part of the cores, rather than every process starting a thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // parallel)))
    row = {"command": "python train.py " + " ".join(overrides)}
    started = time.perf_counter()
    log = run_dir.with_name(run_dir.name + ".log")
    returncode = run_train_py(overrides, log=log, env=env)
    row["wall_s"] = time.perf_counter() - started
    evaluations = sorted(run_dir.glob("eval_epoch*.json"))
    if returncode != 0 or not evaluations:
        row["failed"] = f"exit {returncode}, {len(evaluations)} evaluations; see {log}"
        return row
    row["evaluations"] = [json.loads(path.read_text()) for path in evaluations]
    row["loss"], row["ap_curve"] = tensorboard_scalar(run_dir, "train/loss"), tensorboard_scalar(run_dir, "eval/AP")
    return row


def tensorboard_scalar(run_dir: Path, tag: str) -> dict[str, list]:
    """{"steps", "values"} of one scalar from a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: every point
    events.Reload()
    scalars = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    return {"steps": [e.step for e in scalars], "values": [e.value for e in scalars]}
