"""Training-step timing for bench/e2e.py: engine.train.step.OptimizerStep on the default model, eager or compiled.

For each configuration (a composed config: model.msda, amp, compile.*, batch_size) the step train.py runs,
built by the same engine.train.build.build_training, is timed on random batches of a fixed size (800x1333), then on
batches drawn from the COCO recipe's sizes (short side 480-800 in steps of 32, long side up to 1333, padded to
the batch's largest image). Per row:
    step_ms         median wall time of a step (synchronized after each)
    gpu_kernel_ms   device time of the CUDA kernels of one step (torch.profiler), and its share of step_ms
    launches        kernel launches per step (profiler)
    syncs_per_step  host syncs of one step, counted by torch.cuda.set_sync_debug_mode("warn")
    peak_gib        max GPU memory allocated since the model was built (warm-up and CUDA-graph recording included)
    attention_share share of the kernel time in the attention op
    compile_s       wall time of the first (compiling) step; recompiles: graphs compiled after it
"""

from __future__ import annotations

import os
import random
import statistics
import time
import warnings
from pathlib import Path

import torch

from datasets import padded_size
from engine.runtime.distributed import init_distributed
from engine.train.build import build_training

ATTENTION_KERNELS = {"triton": ("msda_",), "pytorch": ("grid_sampler",)}
COCO_SHORT_SIDES = tuple(range(480, 801, 32))
COCO_MAX_SIZE = 1333
COCO_TRAIN_IMAGES = 118_287  # train2017


def coco_recipe_size(rng: random.Random) -> tuple[int, int]:
    """(h, w) of one image as the COCO recipe resizes it: a random short side, the long side at most 1333,
    aspect ratios of COCO photographs (mostly 4:3, some square, either orientation)."""
    short = rng.choice(COCO_SHORT_SIDES)
    long = min(round(short * rng.uniform(1.0, 4 / 3)), COCO_MAX_SIZE)
    return (short, long) if rng.random() < 0.5 else (long, short)


def random_batch(sizes: list[tuple[int, int]], num_classes: int, device, gen: torch.Generator,
                 pad_to_multiple: int = 1):
    """Images padded as the data loader pads them (datasets.coco.padded_size), with their masks, and 6 random
    boxes per image."""
    H, W = padded_size(sizes, pad_to_multiple)
    images = torch.zeros(len(sizes), 3, H, W, device=device)
    masks = torch.ones(len(sizes), H, W, dtype=torch.bool, device=device)
    targets = []
    for i, (h, w) in enumerate(sizes):
        images[i, :, :h, :w] = torch.randn(3, h, w, device=device, generator=gen)
        masks[i, :h, :w] = False
        centres = torch.rand(6, 2, device=device, generator=gen) * 0.6 + 0.2
        box_sizes = torch.rand(6, 2, device=device, generator=gen) * 0.3 + 0.05
        labels = torch.randint(1, num_classes, (6,), device=device, generator=gen)
        targets.append({"labels": labels, "boxes": torch.cat([centres, box_sizes], -1)})
    return images, masks, targets


def shapes_per_epoch(batch: int, pad_to_multiple: int, *, seed: int = 0) -> int:
    """Distinct padded batch sizes in one COCO epoch of the recipe's sizes: how many new sizes (each a cuDNN
    plan build, and with CUDA graphs a recording) a long run meets before every size has been seen."""
    rng = random.Random(seed)
    return len({padded_size([coco_recipe_size(rng) for _ in range(batch)], pad_to_multiple)
                for _ in range(COCO_TRAIN_IMAGES // batch)})


def _device_us(event) -> float:
    # The attribute was renamed from *cuda* to *device* across torch releases.
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


# The training step's phases as engine.train.step and models.criterion name them for the profiler.
STEP_PHASES = "step."


def host_conditions() -> dict:
    """What the host offered the (host-bound) step when this was called: its usable cores, torch's CPU threads
    (torchrun sets OMP_NUM_THREADS=1 when it starts several processes, not for one) and the 1-minute load
    average (every process's demand on the cores), to tell a busy or smaller machine from a slower step."""
    return {"cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_avg_1min": os.getloadavg()[0]}


def back_to_back_blocks_ms(run_step, sync, *, steps: int, blocks: int = 3) -> list[float]:
    """Wall time per step of ``steps`` steps with no sync between them, as train.py runs them: the host queues
    a step while the GPU still runs the one before (the matching's host sync is the only wait). One figure per
    block of ``blocks``; report their median: one block of a dozen steps moves by tens of percent with a
    single slow step."""
    per_block = []
    for _ in range(blocks):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        sync()
        per_block.append((time.perf_counter() - t0) * 1e3 / steps)
    return per_block


def back_to_back_keys(blocks: list[float]) -> dict:
    """A result row's back-to-back keys: the median of the blocks, and every block."""
    return {"back_to_back_ms": statistics.median(blocks), "back_to_back_blocks_ms": blocks}


def profile_steps(run_step, sync, attention_names: tuple[str, ...], *, cuda: bool, steps: int = 3,
                  trace: Path | None = None) -> dict:
    """GPU kernel time and launches per step, the attention op's share of the kernel time, the time of
    NCCL's kernels (a collective's kernel also counts the time it waits for the other ranks), and the time
    the GPU idles per step, charged to the step's phases (see idle_by_phase); and the host operations with the
    most time of their own per step (where a host that waits, waits: a sync, a copy to the host, a launch into a
    full queue). ``trace``: also write the profile there as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            run_step()
        sync()
    if trace is not None:
        prof.export_chrome_trace(str(trace))  # torch gzips a path ending in .gz
    averages = prof.key_averages()  # aggregates every event: once
    kernel_us = attention_us = nccl_us = 0.0
    launches = 0
    for event in averages:
        if "LaunchKernel" in event.key:
            launches += event.count
        if not is_device_work(event):
            continue
        us = _device_us(event)
        kernel_us += us
        if any(name in event.key for name in attention_names):
            attention_us += us
        if "nccl" in event.key.lower():
            nccl_us += us
    host = sorted(((e.key, e.self_cpu_time_total) for e in averages if not _on_device(e)),
                  key=lambda kv: -kv[1])[:10]
    events = prof.events()
    gpu = [(e.time_range.start, e.time_range.end) for e in events
           if is_device_work(e) and e.time_range.end > e.time_range.start]
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith(STEP_PHASES) and not _on_device(e)]
    idle = idle_by_phase(gpu, phases) if cuda else {}
    return {"gpu_kernel_ms": kernel_us / steps / 1e3, "launches": launches / steps,
            "attention_share": attention_us / max(kernel_us, 1e-9), "nccl_kernel_ms": nccl_us / steps / 1e3,
            # Rows measured before this key existed also summed the GPU spans of annotated ranges.
            "kernel_time_excludes_annotations": True,
            "host_top_ms": {name[:80]: us / steps / 1e3 for name, us in host},
            **({"gpu_idle_ms": sum(idle.values()) / steps / 1e3,
                "gpu_idle_by_phase_ms": {k: v / steps / 1e3 for k, v in sorted(idle.items())}} if idle else {})}


def _on_device(event) -> bool:
    return str(event.device_type).endswith("CUDA")


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


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(*, cfg, height: int, width: int, warmup: int, steps: int, multishape_steps: int,
            pad_multiples=(1,), seed: int = 0, profile_shapes: int = 0, profile_fixed: int = 0) -> list[dict]:
    """One fixed-size row and, if multishape_steps, one COCO-recipe-sizes row per padding multiple for the
    configuration ``cfg`` (a composed config; its compile.* settings choose eager or compiled)."""
    torch._dynamo.reset()  # also frees the CUDA-graph trees of an earlier configuration
    ctx = init_distributed(device=cfg.device)
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # peaks include warm-up: CUDA graphs take their memory there
    training = build_training(cfg, ctx=ctx)
    training.model.train()
    step, plan = training.step, training.compile_plan
    impl, amp, batch = str(cfg.model.msda), str(cfg.amp), cfg.batch_size
    compile_mode = plan.mode if plan is not None else None
    gen = torch.Generator(device=device).manual_seed(seed)
    num_classes = cfg.model.num_classes

    cuda = device.type == "cuda"  # a CPU run only checks the bench itself

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def peak_gib() -> float:
        return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")

    def timed(batch_data) -> float:
        t0 = time.perf_counter()
        step(*batch_data)
        sync()
        return (time.perf_counter() - t0) * 1e3

    base = {"impl": impl, "amp": amp, "compile": plan is not None, "compile_mode": compile_mode, "batch": batch,
            **({"backbone_compiled": plan.backbone} if plan is not None and plan.inductor and plan.backbone != "eager"
               else {}),
            **({"compile_regions": plan.regions} if plan is not None and plan.inductor else {})}
    fixed = random_batch([(height, width)] * batch, num_classes, device, gen)
    host_before = host_conditions()
    graphs_before = _unique_graphs()
    first_ms = timed(fixed)
    for _ in range(warmup - 1):
        timed(fixed)
    times = [timed(fixed) for _ in range(steps)]
    row = {**base, "shapes": f"fixed {height}x{width}", "step_ms": statistics.median(times), "all_ms": times,
           **back_to_back_keys(back_to_back_blocks_ms(lambda: step(*fixed), sync, steps=steps)),
           "images_per_s": batch / statistics.median(times) * 1e3, "first_step_s": first_ms / 1e3,
           "peak_gib": peak_gib(), "syncs_per_step": count_syncs(lambda: step(*fixed)) if cuda else None,
           **profile_steps(lambda: step(*fixed), sync, ATTENTION_KERNELS[impl], cuda=cuda),
           "host": {"before": host_before, "after": host_conditions()}}
    row["kernel_share"] = row["gpu_kernel_ms"] / row["step_ms"]
    if profile_fixed:
        row["host_cprofile"] = python_profile(lambda: step(*fixed), sync, steps=profile_fixed)
        print(row["host_cprofile"], flush=True)
    rows = [row]
    for pad in pad_multiples if multishape_steps else ():
        # The same sequence of sizes several times: the first pass meets each size for the first time (cuDNN
        # plans per new size); the last is the steady state once they are known. CUDA graphs run a new size
        # once and record it at its second step, so they need a third pass to reach their replays.
        rng = random.Random(seed)
        sequence = [[coco_recipe_size(rng) for _ in range(batch)] for _ in range(multishape_steps)]
        graphs_fixed = _unique_graphs()
        passes = [[timed(random_batch(sizes, num_classes, device, gen, pad)) for sizes in sequence]
                  for _ in range(3 if compile_mode == "reduce-overhead" else 2)]
        rows.append({**base, "shapes": f"COCO recipe sizes, pad {pad}", "pad_to_multiple": pad,
                     "step_ms": statistics.median(passes[-1]), "first_pass_ms": statistics.median(passes[0]),
                     "passes": len(passes), "all_ms": [ms for one in passes for ms in one],
                     "images_per_s": batch / statistics.median(passes[-1]) * 1e3,
                     "distinct_shapes": len({padded_size(sizes, pad) for sizes in sequence}),
                     "shapes_per_epoch": shapes_per_epoch(batch, pad, seed=seed),
                     "recompiles": _unique_graphs() - graphs_fixed, "max_step_s": max(passes[0]) / 1e3,
                     "peak_gib": peak_gib()})
        if profile_shapes and pad == pad_multiples[0]:
            rows[-1]["host_profile"] = host_profile(
                lambda: step(*random_batch([coco_recipe_size(rng) for _ in range(batch)], num_classes, device, gen,
                                           pad)), sync, steps=profile_shapes)
            print(rows[-1]["host_profile"], flush=True)
    for r in rows:
        r["graphs_compiled"] = _unique_graphs() - graphs_before
    return rows


def python_profile(run_step, sync, *, steps: int) -> str:
    """The Python functions that take the most host time over ``steps`` steps (cProfile, own and cumulative)."""
    import cProfile
    import io
    import pstats

    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        run_step()
    sync()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    return text.getvalue()


def host_profile(run_step, sync, *, steps: int) -> str:
    """The host operations that take the most time over ``steps`` steps (each on a new image size)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run_step()
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
