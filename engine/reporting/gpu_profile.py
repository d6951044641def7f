"""How busy the GPU is during chosen training steps, and what the host was doing while it waited: torch.profiler.

``profile_steps=[FIRST,LAST]`` (configs/train.yaml) profiles those optimizer steps of a run, on a GPU in two parts.
Recording the host's operations costs the host time, and a GPU that waits for the host waits longer for it: the
first half of the steps records the GPU's activity alone (torch.profiler then records no operator on the host, only
CUPTI's records of the launches, which cost it less), for its busy share as an unprofiled run has it; the second
half records the host's named ranges too, to say what the host was doing while the GPU waited. A range of one step,
the CPU (no GPU to measure) or a torch without GPU tracing make one part. Each part starts with the GPU's queue
empty (a sync), so the time the host takes to queue its first step's work counts as idle: the share errs low. Each
part's trace goes to the run directory (open it in https://ui.perfetto.dev or chrome://tracing), and a summary goes
to the log and to timing.json:
    gpu_busy         the share of the first part's wall time (the host's clock) in which the GPU ran a kernel, copy
                     or memset (overlapping ones counted once); None on the CPU, or where the profiler recorded no
                     GPU activity (CUPTI unavailable), with a warning
    gpu_busy_steps   the steps gpu_busy, step_ms and gpu_work_ms come from: the first part's, or the last part's
                     where the first recorded no GPU activity (with a warning: those steps were slowed)
    step_ms          the first part's wall time per step
    gpu_work_ms      the GPU's busy time per step, in the first part
    gpu_idle_by_phase_ms  the GPU's idle time per step in the last part, charged to what the host was doing: the
                     innermost of the step's named ranges around it (STEP_PHASES: the loader, forward, matching,
                     losses, backward, update); "other" is idle time outside them (the loop's logging and
                     checkpoint checks)
    with_host_ranges the last part's own steps, step_ms, gpu_busy and gpu_work_ms, where there were two parts
    warming_steps    the profiled steps that compiled or recorded a graph, or met a new batch size (its first two
                     steps): unlike the steady steps, and in these figures
    trace            the trace file of the last part
The profiler costs the profiled steps some host time, so a run's steady step times leave them out (RunTiming).
The same analysis serves bench/e2e.py and bench/ddp.py (bench/step_profile.py).
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The prefix of the training step's phases as engine.train and models.criterion name them for the profiler.
STEP_PHASES = "step."
OTHER = "other"


def on_device(event) -> bool:
    return str(event.device_type).endswith("CUDA")


def device_us(event) -> float:
    """A profiler event's own device time in microseconds (the attribute was renamed from *cuda* to *device*)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def is_device_work(event) -> bool:
    """Whether a profiler event (FunctionEvent or its average) is work the GPU did: a kernel, copy or memset.

    Every named range on the host (record_function: the optimizer's step, DDP's forward, NCCL's calls, the
    step's own phases) also has a GPU-side twin spanning the kernels launched inside it; it is marked as a user
    annotation, and counting it would count those kernels again (torch's own tables leave it out too).
    """
    return on_device(event) and not getattr(event, "is_user_annotation", False)


def busy_time(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """The time within [start, end] covered by at least one of the ``busy`` intervals (start, end)."""
    covered, cursor = 0.0, start
    for a, b in sorted(busy):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return covered


def idle_by_phase(busy: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> dict[str, float]:
    """Time the GPU idles while the host runs each phase: {phase name: microseconds}, summed over steps.

    busy    (start, end) of every GPU activity (kernels, copies, memsets), overlapping or not
    phases  (name, start, end) of the host's named ranges, possibly nested; an idle moment is charged to
            the innermost range around it (the latest-starting one), and idle time outside every range is
            not counted (before the first step, after the last)
    """
    idle: dict[str, float] = {}
    gaps = iter(_gaps(busy, phases))
    gap = next(gaps, None)
    for name, a, b in _innermost_pieces(phases):
        while gap is not None and gap[1] <= a:
            gap = next(gaps, None)
        # Every gap that overlaps this piece: the pieces and the gaps are both sorted and disjoint.
        while gap is not None and gap[0] < b:
            overlap = min(b, gap[1]) - max(a, gap[0])
            if overlap > 0:
                idle[name] = idle.get(name, 0.0) + overlap
            if gap[1] > b:
                break  # the gap goes on into the next piece
            gap = next(gaps, None)
    return idle


def _gaps(busy: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """The disjoint intervals, sorted, between the phases' first start and last end in which no activity runs."""
    if not phases:
        return []
    window_start, window_end = min(p[1] for p in phases), max(p[2] for p in phases)
    gaps, cursor = [], window_start
    for start, end in sorted(busy):
        if start > cursor:
            gaps.append((cursor, min(start, window_end)))
        cursor = max(cursor, end)
        if cursor >= window_end:
            break
    if cursor < window_end:
        gaps.append((cursor, window_end))
    return [(a, b) for a, b in gaps if b > a]


def _innermost_pieces(phases: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The timeline cut at every phase's start and end, each piece with the innermost phase around it (the
    latest-starting; of ranges that start together, the shorter): (name, start, end), sorted, disjoint; pieces
    outside every phase are left out. One sweep: a profile holds thousands of ranges and kernels."""
    ordered = sorted(phases, key=lambda p: (p[1], -p[2]))
    bounds = sorted({t for _, a, b in phases for t in (a, b)})
    pieces, open_phases, following = [], [], 0  # open_phases: a heap of (-rank, end, name) of started phases
    for a, b in zip(bounds, bounds[1:]):
        while following < len(ordered) and ordered[following][1] <= a:
            name, _, end = ordered[following]
            heapq.heappush(open_phases, (-following, end, name))
            following += 1
        while open_phases and open_phases[0][1] <= a:
            heapq.heappop(open_phases)  # the innermost has ended; an outer one may go on
        if open_phases:
            pieces.append((open_phases[0][2], a, b))
    return pieces


def device_activity(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU activity among a profile's events."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if is_device_work(e) and e.time_range.end > e.time_range.start]


def step_phases(events) -> list[tuple[str, float, float]]:
    """(name, start, end) of the host's ranges named for the step's phases."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith(STEP_PHASES) and not on_device(e)]


def summarize(events, *, steps: int, cuda: bool, wall_us: float | None = None) -> dict:
    """The profiled steps' summary (the module docstring) from a profile's events; on the CPU only the wall time.
    ``wall_us``: the steps' wall time as the host's clock measured it; None takes the events' span."""
    events = list(events)
    if steps < 1 or (not events and wall_us is None):
        return {"steps": steps, "step_ms": None, "gpu_busy": None, "gpu_work_ms": None, "gpu_idle_by_phase_ms": {}}
    start = min((e.time_range.start for e in events), default=0.0)
    end = max((e.time_range.end for e in events), default=0.0)
    wall = max(end - start if wall_us is None else wall_us, 1e-9)
    summary = {"steps": steps, "step_ms": wall / steps / 1e3, "gpu_busy": None, "gpu_work_ms": None,
               "gpu_idle_by_phase_ms": {}}
    busy = device_activity(events) if cuda else []
    if busy:  # none where CUPTI records nothing (no permission, or not for CUDA graphs): unknown, not 0%
        work = busy_time(busy, start, end)
        idle = idle_by_phase(busy, step_phases(events))
        idle[OTHER] = max(0.0, (wall - work) - sum(idle.values()))
        summary.update(gpu_busy=work / wall, gpu_work_ms=work / steps / 1e3,
                       gpu_idle_by_phase_ms={name.removeprefix(STEP_PHASES): us / steps / 1e3
                                             for name, us in sorted(idle.items(), key=lambda kv: -kv[1])})
    return summary


# The parts of a profile: what each records (``profiled_parts``).
GPU_ONLY, WITH_HOST = "gpu", "gpu+host"


def profiled_parts(steps: tuple[int, int], *, gpu_traced: bool) -> list[tuple[str, int, int]]:
    """(what it records, first step, last step) of each part of a profile of ``steps``: where the GPU's activity
    is traced, the first half of the steps with the GPU's activity alone and the rest with the host's ranges too
    (a single step: that one only); elsewhere one part."""
    first, last = steps
    if not gpu_traced or last == first:
        return [(WITH_HOST, first, last)]
    middle = first + (last - first + 1) // 2
    return [(GPU_ONLY, first, middle - 1), (WITH_HOST, middle, last)]


def combine_parts(parts: dict[str, dict]) -> dict:
    """One summary of the parts that ran (``profiled_parts``: either or both, each a ``summarize`` with its
    ``profiled_steps`` and ``trace``): the busy share and step time of the part that records the GPU's activity
    alone where it ran, the idle time by phase and the trace of the part that records the host's ranges."""
    gpu, host = parts.get(GPU_ONLY), parts.get(WITH_HOST)
    first, last = (gpu or host)["profiled_steps"][0], (host or gpu)["profiled_steps"][1]
    timed = gpu if gpu is not None and gpu["gpu_busy"] is not None else host or gpu
    combined = {"profiled_steps": [first, last], "steps": sum(part["steps"] for part in parts.values()),
                **{key: timed[key] for key in ("step_ms", "gpu_busy", "gpu_work_ms")},
                "gpu_busy_steps": timed["profiled_steps"],
                "gpu_idle_by_phase_ms": host["gpu_idle_by_phase_ms"] if host else {},
                "warming_steps": sorted(step for part in parts.values() for step in part.get("warming_steps", [])),
                "trace": (host or gpu)["trace"]}
    if gpu is not None and host is not None:
        combined["with_host_ranges"] = {key: host[key] for key in
                                        ("profiled_steps", "steps", "step_ms", "gpu_busy", "gpu_work_ms")}
    return combined


def busy_from_host_part(summary: dict) -> bool:
    """Whether a two-part summary's busy share is the part's that recorded the host too (the other recorded no GPU
    activity)."""
    host = summary.get("with_host_ranges")
    return host is not None and summary["gpu_busy_steps"] == host["profiled_steps"]


def describe(summary: dict) -> str:
    """One log line's worth of a summary."""
    first, last = summary["profiled_steps"]
    text = f"profile of steps {first}-{last}: {summary['step_ms']:.1f} ms per step"
    if summary["gpu_busy"] is not None:
        text += f", GPU busy {summary['gpu_busy']:.1%} ({summary['gpu_work_ms']:.1f} ms of work)"
    host = summary.get("with_host_ranges")
    if busy_from_host_part(summary):
        text += (f" (steps {host['profiled_steps'][0]}-{host['profiled_steps'][1]}, with the host's ranges "
                 f"recorded: the steps before them recorded no GPU activity)")
    elif host is not None:
        text += (f" (steps {first}-{host['profiled_steps'][0] - 1}, the GPU's activity alone recorded); steps "
                 f"{host['profiled_steps'][0]}-{host['profiled_steps'][1]} with the host's ranges recorded too: "
                 f"{host['step_ms']:.1f} ms per step")
        if host["gpu_busy"] is not None:
            text += f", GPU busy {host['gpu_busy']:.1%}"
    if summary["gpu_idle_by_phase_ms"]:
        idle = ", ".join(f"{name} {ms:.1f}" for name, ms in summary["gpu_idle_by_phase_ms"].items() if ms >= 0.05)
        text += f"; GPU idle per step by what the host was doing (ms): {idle or 'none'}"
    if summary.get("warming_steps"):
        text += (f"; step(s) {', '.join(map(str, summary['warming_steps']))} compiled, recorded a graph or met a new "
                 f"batch size: not like the steady steps, and in these figures")
    return text + f"; trace {summary['trace']}"


class StepProfiler:
    """Profiles the optimizer steps numbered ``steps`` = (first, last), counted from 1 over the whole run (a
    resumed run goes on counting), in the parts ``profiled_parts`` gives; None profiles nothing. The loop calls
    ``plan`` with the steps the run will train, ``before_step`` and ``after_step`` with each step's number, and
    ``stop`` when its steps stop: at each epoch's end, so that the epoch's checkpoint and evaluation are never
    profiled (a range that crosses an epoch's end, or goes past the run's, is profiled up to there), and when the
    run ends or fails. A profiler that fails costs a warning, never the run."""

    def __init__(self, steps: tuple[int, int] | None, *, output_dir: Path, device: torch.device, rank: int = 0,
                 world_size: int = 1, report: bool = True):
        self.steps = tuple(steps) if steps is not None else None
        self.output_dir, self.device, self.report = Path(output_dir), device, report
        self.suffix = f".rank{rank}" if world_size > 1 else ""
        self.summary: dict | None = None
        self._cuda = device.type == "cuda"
        from torch.profiler import ProfilerActivity, supported_activities

        # A torch built without CUPTI cannot trace the GPU: its steps are profiled on the host alone, in one part.
        self._gpu_traced = self._cuda and ProfilerActivity.CUDA in supported_activities()
        self._parts = profiled_parts(self.steps, gpu_traced=self._gpu_traced) if self.steps is not None else []
        self._done: dict[str, dict] = {}  # the finished parts' summaries, by what they recorded
        self._profile = None
        self._part: tuple[str, int, int] | None = None  # the part running
        self._started = 0.0  # when it started, on the host's clock
        self._first_profiled: int | None = None
        self._last_profiled: int | None = None
        self._warming: list[int] = []  # the running part's steps that were not warm (after_step)

    @property
    def active(self) -> bool:
        return self._profile is not None

    def plan(self, first: int, last: int) -> None:
        """The run will train steps ``first`` to ``last``: a range outside them is said now, not found missing
        at the end."""
        if self.steps is None or not self.report or (first <= self.steps[1] and self.steps[0] <= last):
            return
        trains = f"steps {first} to {last}" if first <= last else "no step"
        log.warning("profile_steps=[%d,%d] will profile nothing: this run trains %s", *self.steps, trains)

    def before_step(self, number: int) -> bool:
        """Starts a part of the profile before step ``number`` where one is due; True when it did (the caller
        keeps the profiler's start out of the step's time)."""
        if self.active or self.summary is not None:
            return False
        part = next((p for p in self._parts if p[1] <= number <= p[2] and p[0] not in self._done), None)
        if part is None:
            return False
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if part[0] == GPU_ONLY else \
            [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._gpu_traced else [])
        try:
            if self._cuda:
                torch.cuda.synchronize(self.device)  # the steps before are not this profile's
            self._profile = profile(activities=activities)
            self._profile.__enter__()
        except Exception as error:  # noqa: BLE001 - a profiler that cannot start costs the run nothing
            self._give_up(f"torch.profiler could not start: {error}")
            return False
        self._part, self._started = part, time.perf_counter()
        self._first_profiled = self._last_profiled = number
        self._warming = []
        return True

    def after_step(self, number: int, *, warm: bool = True) -> bool:
        """Ends the part of the profile that ``number`` was the last step of; True when it did (the caller keeps
        the trace's export out of the next step's time). ``warm``: the step compiled nothing and its batch size
        was not new (RunTiming.last_step_warm); the summary names those that were not."""
        if not self.active:
            return False
        self._last_profiled = number
        if not warm:
            self._warming.append(number)
        if number < self._part[2]:
            return False
        self._finish_part()
        if self.summary is None and number >= self.steps[1]:  # the last part (a resumed run may start in it)
            self._combine()
        return True

    def stop(self) -> bool:
        """The steps stopped (an epoch's or the run's end, or a failure): a part running ends at the last step it
        saw, and the profile ends with the parts that ran. True when a part was running."""
        running = self.active
        if running:
            self._finish_part()
        if self._done and self.summary is None:
            self._combine()
        return running

    def _finish_part(self) -> None:
        profile, self._profile = self._profile, None
        recorded = self._part[0]
        first, last = self._first_profiled, self._last_profiled
        trace = self.output_dir / f"profile_steps_{first}-{last}{self.suffix}.json"
        try:
            if self._cuda:
                torch.cuda.synchronize(self.device)  # every kernel of the profiled steps inside the profile
            wall_us = (time.perf_counter() - self._started) * 1e6
            profile.__exit__(None, None, None)
            events = list(profile.events())
            if not events and recorded == WITH_HOST:  # the GPU's activity alone is none without CUPTI: not an error
                raise RuntimeError("torch.profiler recorded no events")
            summary = summarize(events, steps=last - first + 1, cuda=self._gpu_traced, wall_us=wall_us)
            partial = trace.with_name(trace.name + ".partial")
            profile.export_chrome_trace(str(partial))
            os.replace(partial, trace)
        except Exception as error:  # noqa: BLE001 - a failed profile costs the run nothing
            self._give_up(f"profiling steps {first}-{last} failed: {error}")
            return
        self._done[recorded] = {"profiled_steps": [first, last], **summary, "warming_steps": self._warming,
                                "trace": trace.name}

    def _combine(self) -> None:
        self.summary = combine_parts(self._done)
        if self.report:
            log.info("%s", describe(self.summary))
            first, last = self.summary["profiled_steps"]
            if self._cuda and self.summary["gpu_busy"] is None:
                log.warning("torch.profiler recorded no GPU activity in steps %d-%d (CUPTI unavailable, or not "
                            "allowed to trace): the GPU's busy share is unknown", first, last)
            elif busy_from_host_part(self.summary):
                log.warning("torch.profiler recorded no GPU activity in steps %d-%d, which recorded it alone: the "
                            "GPU's busy share is that of steps %d-%d, which recorded the host's operations too and "
                            "were slowed by it", *self._done[GPU_ONLY]["profiled_steps"],
                            *self.summary["gpu_busy_steps"])

    def _give_up(self, why: str) -> None:
        self._profile = None
        self.summary = {"profiled_steps": list(self.steps), "error": why}
        log.warning("%s; the run goes on unprofiled", why)
