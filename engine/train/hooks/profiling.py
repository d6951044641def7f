"""``profile_steps=[FIRST,LAST]``: torch.profiler over those optimizer steps, its trace in the run directory, the share
of their time the GPU was busy in the log and timing.json (bench/step_profile.py analyses such traces further).

On a GPU it records the GPU's activity alone: recording the host's too would slow the host, and a GPU waiting for it
would look idler than in an unprofiled run. The busy share is the time at least one GPU activity ran over the steps'
host wall time, the GPU's queue empty at both ends; on the CPU the trace holds the host's operations. A range that
crosses an epoch's end or the run's is profiled up to there (never the epoch's checkpoint and evaluation). Profiled
steps are left out of the steady step figures; a failing profiler costs a warning, never the run.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.compile.clock import CompileClock

from .base import Ending, EpochEnd, Hook, StepDone

log = logging.getLogger(__name__)
# KINETO_LOG_LEVEL above kineto's highest level (its USDT markers): it prints nothing.
QUIET_KINETO = "6"
# Compile-clock seconds inside a profile from which it says the profiled steps compiled or recorded graphs.
RECORDED_S = 0.01


def compiled_inside(summary: dict) -> bool:
    """Whether a profile's steps compiled or recorded graphs, from its summary (one written before ``compile_s``
    existed says so by its graph count alone)."""
    return bool(summary.get("graphs_compiled")) or summary.get("compile_s", 0.0) >= RECORDED_S


def is_device_work(event) -> bool:
    """Whether a profiler event is work the GPU did: a kernel, copy or memset. Every named range on the host also has
    a GPU-side twin spanning the kernels launched inside it, marked as a user annotation: counting it would count
    those kernels again."""
    return str(event.device_type).endswith("CUDA") and not getattr(event, "is_user_annotation", False)


def device_activity(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU activity among a profile's events."""
    return [
        (e.time_range.start, e.time_range.end)
        for e in events
        if is_device_work(e) and e.time_range.end > e.time_range.start
    ]


def busy_time(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """The time within [start, end] covered by at least one of the ``busy`` intervals (start, end)."""
    covered, cursor = 0.0, start
    for a, b in sorted(busy):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return covered


class StepProfiler(Hook):
    """Profiles the optimizer steps numbered ``steps`` = (first, last), counted from 1 over the whole run (a resumed run
    goes on counting), or nothing for None. ``summary`` holds the figures once the profile has ended; they also go
    to the run's ``timing.profile`` (timing.json), and ``timing.profiling`` is set while a profile records."""

    def __init__(self, steps: tuple[int, int] | None):
        self.steps = tuple(steps) if steps is not None else None
        self.summary: dict | None = None
        self._profile = self._compiled_before = None
        self._first = self._last = self._started = 0

    def start(self, run) -> None:
        first, last = run.plan.start_step + 1, run.plan.total_steps
        if self.steps is not None and run.ctx.is_main and not (first <= self.steps[1] and self.steps[0] <= last):
            trained = f"steps {first} to {last}" if first <= last else "no step"
            log.warning("profile_steps=[%d,%d] will profile nothing: this run trains %s", *self.steps, trained)

    def before_step(self, run, number: int) -> bool:
        if (
            self._profile is not None
            or self.summary is not None
            or self.steps is None
            or not self.steps[0] <= number <= self.steps[1]
        ):
            return False
        from torch.profiler import ProfilerActivity, profile

        cuda = run.ctx.device.type == "cuda"
        if not cuda:
            # On the CPU, Kineto (torch's tracer) only prints that there is no GPU ("gpuGetDeviceCount failed") and
            # that the trace started and stopped. It reads the level as it starts; a level the user set is kept.
            os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)
        try:
            if cuda:
                torch.cuda.synchronize(run.ctx.device)  # the steps before are not this profile's
            self._profile = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            self._profile.__enter__()
        except Exception as error:  # a profiler that cannot start costs the run nothing
            self._give_up(run, f"torch.profiler could not start: {error}")
            return False
        self._first = self._last = number
        self._started, self._compiled_before = time.perf_counter(), CompileClock.get().totals()
        run.timing.profiling = True
        return True

    def after_step(self, run, done: StepDone) -> bool:
        if self._profile is None:
            return False
        self._last = done.number
        return done.number >= self.steps[1] and self._finish(run)

    def epoch_end(self, run, end: EpochEnd) -> bool:
        return self._finish(run)

    def close(self, run, ending: Ending) -> None:
        self._finish(run)

    def _finish(self, run) -> bool:
        """End the profile, if one records; whether one did."""
        if self._profile is None:
            return False
        profile, self._profile = self._profile, None
        run.timing.profiling = False
        cuda, first, last = run.ctx.device.type == "cuda", self._first, self._last
        suffix = f".rank{run.ctx.rank}" if run.ctx.distributed else ""
        trace = run.output_dir / f"profile_steps_{first}-{last}{suffix}.json"
        try:
            if cuda:
                torch.cuda.synchronize(run.ctx.device)  # every kernel of the profiled steps inside the profile
            wall_us = (time.perf_counter() - self._started) * 1e6
            profile.__exit__(None, None, None)
            events = list(profile.events())
            partial = trace.with_name(trace.name + ".partial")
            profile.export_chrome_trace(str(partial))
            os.replace(partial, trace)
        except Exception as error:  # a failed profile costs the run nothing
            self._give_up(run, f"profiling steps {first}-{last} failed: {error}")
            return True
        steps = last - first + 1
        compiled = CompileClock.get().totals().since(self._compiled_before)
        busy = device_activity(events) if cuda else []
        work_us = busy_time(busy, min(a for a, _ in busy), max(b for _, b in busy)) if busy else None
        self.summary = {
            "profiled_steps": [first, last],
            "steps": steps,
            "step_ms": wall_us / steps / 1e3,
            "gpu_busy": None if work_us is None else min(1.0, work_us / wall_us),
            "gpu_work_ms": None if work_us is None else work_us / steps / 1e3,
            "graphs_compiled": compiled.graphs,
            # Inductor's CUDA-graph trees record a graph for each new size and call path without a new Dynamo graph:
            # they show here as seconds alone.
            "compile_s": compiled.seconds,
            "trace": trace.name,
        }
        run.timing.profile = self.summary
        if run.ctx.is_main:
            self._log(cuda)
        return True

    def _log(self, cuda: bool) -> None:
        summary = self.summary
        first, last = summary["profiled_steps"]
        text = f"profile of steps {first}-{last}: {summary['step_ms']:.1f} ms per step"
        if summary["gpu_busy"] is not None:
            text += f", GPU busy {summary['gpu_busy']:.1%} ({summary['gpu_work_ms']:.1f} ms of work)"
        if compiled_inside(summary):
            text += (
                f"; these steps compiled or recorded graphs for {summary['compile_s']:.1f} s, unlike the steady "
                "steps (a CUDA graph's recording waits for the GPU and empties the device's and the pinned-memory "
                "caches), and these figures include it"
            )
        log.info("%s; trace %s", text, summary["trace"])
        if cuda and summary["gpu_busy"] is None:
            log.warning(
                "torch.profiler recorded no GPU activity in steps %d-%d (CUPTI unavailable, or not allowed to "
                "trace): the GPU's busy share is unknown",
                first,
                last,
            )

    def _give_up(self, run, why: str) -> None:
        self._profile = None
        run.timing.profiling = False
        run.timing.profile = self.summary = {"profiled_steps": list(self.steps), "error": why}
        log.warning("%s; the run goes on unprofiled", why)
