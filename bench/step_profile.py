"""What a training step does on the GPU, from torch.profiler: kernel time, launches, host syncs, and where it idles.

Shared by bench/e2e.py and bench/ddp.py; the analysis of a profile is engine/reporting/gpu_profile.py's, which
train.py's profile_steps uses too.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from engine.reporting.gpu_profile import device_activity, device_us, idle_by_phase, is_device_work, step_phases


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
        us = device_us(event)
        kernel_us += us
        attention_us += us if any(name in event.key for name in attention_names) else 0.0
        nccl_us += us if "nccl" in event.key.lower() else 0.0
    events = prof.events()
    idle = idle_by_phase(device_activity(events), step_phases(events)) if cuda else {}
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
