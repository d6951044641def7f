"""Where a run's wall time went, as the user waits for it: setup, compilation (engine/compile/clock.py, wherever it
happened), warm-up, training, evaluation. Warm-up is the rest of the first two steps at each new batch size: kernels
autotuned at their first run, cuDNN's plans, a CUDA graph recorded at the second. So "train" and "eval" are what the
run would have taken with every graph compiled and warm. The record goes to ``timing.json`` (which bench/ttr.py
reads) and into one log line. ``RunTiming`` is part of the run's shared state (engine/train/hooks/base.py): the step
timing hook (hooks/timing.py) times the steps, the evaluation and the saver add their time.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from datasets.json_file import write_json
from engine.compile.clock import CompileClock, CompileTotals, describe_graphs, describe_work
from engine.reporting.progress import format_duration
from engine.reporting.tensorboard import ScalarWriter

TIMING_FILE = "timing.json"
log = logging.getLogger(__name__)


@dataclass
class RunTiming:
    """Accumulates a run's times (seconds). ``started`` is the process's start on time.perf_counter's clock;
    ``report``: log a line for each step or evaluation that compiled (rank 0). ``profiling`` is set while
    profile_steps profiles (hooks/profiling.py): those steps are not steady ones."""

    started: float
    clock: CompileClock = field(default_factory=CompileClock.get)
    report: bool = False
    profiling: bool = False
    profile: dict | None = None  # profile_steps' summary, once the profile has ended
    compile_at_start: CompileTotals = field(init=False)
    setup_s: float | None = None
    first_step_s: float | None = None
    train_s: float = 0.0
    warmup_s: float = 0.0
    eval_s: float = 0.0
    evaluations: int = 0
    checkpoint_s: float = 0.0
    steps: int = 0
    steps_s: float = 0.0  # the wall time of this process's steps, compilation and warm-up included
    # The warm steps since the last graph compiled: (wall s, loader wait s, images, pixels per image, end, number)
    warm_steps: list[tuple[float, float, int, int, float, int]] = field(default_factory=list)
    _last_step_end: float | None = None
    _sizes_seen: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.compile_at_start = self.clock.totals()

    def pause(self) -> None:
        """What is not a step (evaluation, checkpoints) is timed apart: the next step's wall time starts now."""
        self._last_step_end = time.perf_counter()

    def report_compilation(self, compiled: CompileTotals, *, what: str, step: int, writer: ScalarWriter) -> None:
        """A line for a step or evaluation that compiled a graph or for 1 s or more; the run's totals in TensorBoard."""
        if not self.report or (not compiled.graphs and compiled.seconds < 1.0):
            return
        total = self.compile
        log.info(
            "%s: %s in %.1f s%s; %.1f s of compilation in this run so far",
            what,
            describe_work(compiled),
            compiled.seconds,
            f" ({parts})" if (parts := describe_graphs(compiled)) else "",
            total.seconds,
        )
        writer.add("compile", {"seconds": total.seconds, "graphs": total.graphs}, step)

    @property
    def compile(self) -> CompileTotals:
        """Compilation during this run."""
        return self.clock.totals().since(self.compile_at_start)

    def step_started(self) -> CompileTotals:
        """Call as a step (its data included) starts; pass the result to ``step_ended``."""
        now = time.perf_counter()
        if self.setup_s is None:
            self.setup_s = now - self.started
        if self._last_step_end is None:
            self._last_step_end = now
        return self.clock.totals()

    def step_ended(
        self, before: CompileTotals, *, size: tuple, data_s: float = 0.0, profiled: bool = False
    ) -> CompileTotals:
        """The compilation this step did (empty when none); the rest of its wall time counts as warm-up at one of
        the first two steps of batch ``size`` (B, C, H, W), else as training. ``data_s``: its wait for the
        loader. A ``profiled`` step (profile_steps) is not one of the steady steps: the profiler slows it."""
        now = time.perf_counter()
        compiled = self.clock.totals().since(before)
        wall = now - self._last_step_end
        self._last_step_end = now
        self.steps_s += wall
        if self.first_step_s is None:  # from the start of the process: what the user waits for a first step
            self.first_step_s = now - self.started
        if compiled.graphs and not profiled:
            # A new graph changes what a step runs: the warm steps before it are not what the run's steps are like
            # from now on. Not at a profiled step, left out of them anyway: a graph first recorded inside the profile
            # at a run's end (a batch size first met there) would otherwise leave the run without steady figures.
            self.warm_steps.clear()
        self._sizes_seen[size] += 1
        if self._sizes_seen[size] <= 2:  # warming up
            self.warmup_s += max(0.0, wall - compiled.seconds)
        else:
            self.train_s += max(0.0, wall - compiled.seconds)
            if not compiled.graphs and compiled.seconds < 1e-3 and not profiled:
                self.warm_steps.append((wall, data_s, size[0], size[-2] * size[-1], time.time(), self.steps + 1))
        self.steps += 1
        return compiled

    @property
    def not_training_s(self) -> float:
        """Compilation and warm-up so far: what the ETA leaves out."""
        return self.compile.seconds + self.warmup_s

    def add_evaluation(self, wall_s: float, compiled: CompileTotals) -> None:
        self.eval_s += max(0.0, wall_s - compiled.seconds)
        self.evaluations += 1

    @property
    def evaluation_s(self) -> float | None:
        """What an evaluation took on average, its compilation left out (None before the first)."""
        return self.eval_s / self.evaluations if self.evaluations else None

    def steady(self) -> dict | None:
        """The second half of the warm steps since the last graph compiled, what a long run's steps are like: their
        median wall time, images/s, share of time waiting for the loader, padded pixels per image, the wall-clock
        window they ran in (time.time()) and the first one's number."""
        late = self.warm_steps[len(self.warm_steps) // 2 :]
        if not late:
            return None
        walls, waits, images, pixels, ends, numbers = zip(*late)
        seconds = sum(walls)
        return {
            "steps": len(late),
            "step_ms": statistics.median(walls) * 1e3,
            "images_per_s": sum(images) / seconds,
            "data_wait_share": sum(waits) / seconds,
            "pixels_per_image": sum(p * n for p, n in zip(pixels, images)) / sum(images),
            "window": [ends[0] - walls[0], ends[-1]],
            "first_step": numbers[0],
        }

    def record(self, **extra) -> dict:
        compiled, steady = self.compile, self.steady()
        return {
            "total_s": time.perf_counter() - self.started,
            "setup_s": self.setup_s,
            "first_step_s": self.first_step_s,
            "compile_s": compiled.seconds,
            "warmup_s": self.warmup_s,
            "train_s": self.train_s,
            "eval_s": self.eval_s,
            "checkpoint_s": self.checkpoint_s,
            "steps": self.steps,
            "steady_step_ms": steady["step_ms"] if steady else None,
            "steady": steady,
            "graphs_compiled": compiled.graphs,
            "graphs_by_function": compiled.by_function,
            **({"profile": self.profile} if self.profile else {}),
            **extra,
        }

    def summary(self, record: dict) -> str:
        steady = f"{record['steady_step_ms']:.0f} ms" if record["steady_step_ms"] is not None else "-"
        parts = [
            f"setup {format_duration(record['setup_s'] or 0)}",
            f"compile {format_duration(record['compile_s'])}",
            f"warm-up {format_duration(record['warmup_s'])}",
            f"training {format_duration(record['train_s'])}",
            f"evaluation {format_duration(record['eval_s'])}",
        ]
        return (
            f"{record['steps']} steps in {format_duration(record['total_s'])} ({', '.join(parts)}); steady step "
            f"{steady}; {record['graphs_compiled']} graphs compiled"
        )

    def write(self, output_dir: str | os.PathLike, record: dict) -> Path:
        return write_json(Path(output_dir) / TIMING_FILE, record, indent=2)


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory of ``device`` this process's tensors held at once (None for the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
