"""What a training step does on the GPU, from torch.profiler: kernel time, launches, host syncs, and where it idles.

Shared by bench/e2e.py and bench/ddp.py; tests/test_step_profile.py checks the idle-time attribution.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

# The prefix of the training step's phases as engine.train.step and models.criterion name them for the profiler.
STEP_PHASES = "step."


def _on_device(event) -> bool:
    return str(event.device_type).endswith("CUDA")


def _device_us(event) -> float:
    # The attribute was renamed from *cuda* to *device* across torch releases.
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
    return _on_device(event) and not getattr(event, "is_user_annotation", False)


def idle_by_phase(busy: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> dict[str, float]:
    """Time the GPU idles while the host runs each phase: {phase name: microseconds}, summed over steps.

    busy    (start, end) of every GPU activity (kernels, copies, memsets), overlapping or not
    phases  (name, start, end) of the host's named ranges, possibly nested; an idle moment is charged to
            the innermost range around it (the latest-starting one), and idle time outside every range is
            not counted (before the first step, after the last)
    """
    if not phases:
        return {}
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
    ordered = sorted(phases, key=lambda p: (p[1], -p[2]))  # of ranges that start together, the outer first
    idle: dict[str, float] = {}
    for gap_start, gap_end in gaps:
        # Cut the gap where a phase starts or ends; each piece belongs to one innermost phase (or none).
        cuts = sorted({gap_start, gap_end, *(t for _, a, b in ordered for t in (a, b) if gap_start < t < gap_end)})
        for a, b in zip(cuts, cuts[1:]):
            inner = [p for p in ordered if p[1] <= (a + b) / 2 < p[2]]
            if inner:
                idle[inner[-1][0]] = idle.get(inner[-1][0], 0.0) + (b - a)
    return idle


def profile_steps(run_step, sync, attention_names: tuple[str, ...], *, cuda: bool, steps: int = 3) -> dict:
    """Per step: GPU kernel time and launches, the attention kernels' share of the kernel time, the time of NCCL's
    kernels (a collective's kernel also counts the time it waits for the other ranks), and the time the GPU idles,
    charged to the step's phases (idle_by_phase)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            run_step()
        sync()
    kernel_us = attention_us = nccl_us = 0.0
    launches = 0
    for event in prof.key_averages():
        if "LaunchKernel" in event.key:
            launches += event.count
        if not is_device_work(event):
            continue
        us = _device_us(event)
        kernel_us += us
        attention_us += us if any(name in event.key for name in attention_names) else 0.0
        nccl_us += us if "nccl" in event.key.lower() else 0.0
    events = prof.events()
    busy = [(e.time_range.start, e.time_range.end) for e in events
            if is_device_work(e) and e.time_range.end > e.time_range.start]
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith(STEP_PHASES) and not _on_device(e)]
    idle = idle_by_phase(busy, phases) if cuda else {}
    return {"gpu_kernel_ms": kernel_us / steps / 1e3, "launches": launches / steps,
            "attention_share": attention_us / max(kernel_us, 1e-9), "nccl_kernel_ms": nccl_us / steps / 1e3,
            **({"gpu_idle_ms": sum(idle.values()) / steps / 1e3,
                "gpu_idle_by_phase_ms": {k: v / steps / 1e3 for k, v in sorted(idle.items())}} if idle else {})}


def count_syncs(run_step) -> int:
    """Host syncs during one step: each synchronizing CUDA call warns once under sync debug mode "warn"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in caught)


def back_to_back_ms(run_step, sync, *, steps: int, blocks: int = 3) -> float:
    """Wall time per step of ``steps`` steps with no sync between them, as train.py runs them: the host queues a
    step while the GPU still runs the one before. The median of ``blocks`` such runs: one block of a dozen steps
    moves by tens of percent with a single slow step."""
    per_block = []
    for _ in range(blocks):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        sync()
        per_block.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(per_block)
