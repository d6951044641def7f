"""What a training step does on the GPU, from torch.profiler: kernel time, launches, host syncs, and where it idles.

Shared by bench/e2e.py, bench/ddp.py and bench/throughput.py. train.py's profile_steps (engine/train/hooks/profiling.py)
gives a run's busy share and trace; the analysis of where the GPU idles is here.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
import warnings

import torch

from engine.train.hooks.profiling import busy_time, device_activity, is_device_work

# The prefix of the training step's phases as engine.train and models.criterion name them for the profiler.
STEP_PHASES = "step."


def device_us(event) -> float:
    """A profiler event's own device time in microseconds (the attribute was renamed from *cuda* to *device*)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def step_phases(events) -> list[tuple[str, float, float]]:
    """(name, start, end) of the host's ranges named for the step's phases."""
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith(STEP_PHASES) and not str(e.device_type).endswith("CUDA")
    ]


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
    for a, b in itertools.pairwise(bounds):
        while following < len(ordered) and ordered[following][1] <= a:
            name, _, end = ordered[following]
            heapq.heappush(open_phases, (-following, end, name))
            following += 1
        while open_phases and open_phases[0][1] <= a:
            heapq.heappop(open_phases)  # the innermost has ended; an outer one may go on
        if open_phases:
            pieces.append((open_phases[0][2], a, b))
    return pieces


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
    return {
        "gpu_kernel_ms": kernel_us / steps / 1e3,
        "launches": launches / steps,
        "attention_share": attention_us / max(kernel_us, 1e-9),
        "nccl_kernel_ms": nccl_us / steps / 1e3,
        **(
            {
                "gpu_idle_ms": sum(idle.values()) / steps / 1e3,
                "gpu_idle_by_phase_ms": {k: v / steps / 1e3 for k, v in sorted(idle.items())},
            }
            if idle
            else {}
        ),
    }


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


# The parts of a training step that gpu_time_by_part charges the GPU's time to, in the report's order.
PARTS = (
    "backbone",
    "encoder attention",
    "encoder rest",
    "decoder attention",
    "decoder rest",
    "matching and losses",
    "update",
    "copies",
    "idle",
)


def gpu_time_by_part(trace: dict, *, steps: int) -> dict[str, float]:
    """Milliseconds per step of the GPU's time in each of PARTS, from a profile (a chrome trace, as train.py's
    profile_steps writes it) of ``steps`` training steps that recorded the GPU's activity alone.

    Without the host's ranges, each piece of GPU work is placed by what it is and where it falls in its step. The work
    of one CUDA-graph replay (one correlation id) stays together, its attention kernels apart from the rest of its
    layer. The attention's kernels (msda) are the encoder's or the decoder's by their grid, the encoder's queries
    being every pixel of the feature maps (a far larger grid); the optimizer's and the EMA's kernels (fused AdamW,
    foreach) are the update; copies and memsets are copies. The rest falls between those anchors in the step's order:
    before the encoder's first attention the backbone, up to the decoder's first attention the encoder, up to the
    matching's copy to the host the decoder, then the matching and losses up to the decoder's first attention
    backward, the decoder's backward up to the encoder's, the encoder's up to its last attention backward, and the
    backbone's backward after it. A layer's first and last kernels around its attention can fall to its neighbour:
    the figures are the parts' sizes, not an exact account. Idle: the time in the profiled work's span in which the GPU
    ran nothing.
    """
    work = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
        key=lambda e: e["ts"],
    )
    if not work or steps < 1:
        return {}
    totals = dict.fromkeys(PARTS, 0.0)
    # The encoder's and the decoder's calls of each attention kernel (forward, backward) apart, by its grid.
    split = {
        name: _largest_gap(sorted({_grid(e) for e in work if e["name"] == name}))
        for name in {e["name"] for e in work if _is_attention(e)}
    }
    for step in _steps(work):
        for part, events in _parts_of_step(step, split).items():
            totals[part] += _union_us(events)
    start, end = work[0]["ts"], max(e["ts"] + e["dur"] for e in work)
    totals["idle"] = max(0.0, (end - start) - _union_us(work))
    return {part: us / steps / 1e3 for part, us in totals.items()}


# The chrome trace's categories of GPU work: kernels, copies, memsets.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _is_attention(event) -> bool:
    return event.get("cat") == "kernel" and "msda" in event["name"]


# The foreach kernels of the update: the gradient norm and its clipping, fused AdamW, the EMA's lerp.
UPDATE_FUNCTORS = ("LpNormFunctor", "BinaryOpScalarTensorFunctor", "FusedAdamMathFunctor", "TernaryOpScalarFunctor")


def _is_update(event) -> bool:
    return (
        event.get("cat") == "kernel"
        and "multi_tensor_apply" in event["name"]
        and any(functor in event["name"] for functor in UPDATE_FUNCTORS)
    )


def _is_optimizer(event) -> bool:
    return event.get("cat") == "kernel" and "FusedAdamMathFunctor" in event["name"]


def _grid(event) -> int:
    grid = event.get("args", {}).get("grid", [1])
    return math.prod(grid) if isinstance(grid, list) else int(grid)


def _largest_gap(values: list[int]) -> float:
    """The grid size that splits the attention's calls into the decoder's (below) and the encoder's (from it)."""
    if len(values) < 2:
        return 0.0
    logs = [math.log(v) for v in values]
    gap = max(range(1, len(logs)), key=lambda i: logs[i] - logs[i - 1])
    return math.sqrt(values[gap - 1] * values[gap])


def _steps(work: list[dict]) -> list[list[dict]]:
    """The work cut after each optimizer step's update kernels (fused AdamW, then the EMA's)."""
    steps, current, updating = [], [], False
    for event in work:
        if updating and event.get("cat") == "kernel" and "multi_tensor_apply" not in event["name"]:
            steps.append(current)
            current, updating = [], False
        current.append(event)
        updating = updating or _is_optimizer(event)
    return steps + ([current] if current else [])


def _parts_of_step(step: list[dict], split: dict[str, float]) -> dict[str, list[dict]]:
    units = _units(step)
    kinds = [_unit_kind(unit, split) for unit in units]
    decoder = [i for i, kind in enumerate(kinds) if kind == "decoder attention"]
    # The matching's copy to the host ends the forward: the first after the decoder's first attention.
    matching = next((i for i, kind in enumerate(kinds) if kind == "to host" and decoder and i > decoder[0]), len(units))
    backward_encoder = [i for i, kind in enumerate(kinds) if kind == "encoder attention" and i > matching]
    backward_decoder = [i for i in decoder if i > matching]
    parts = {part: [] for part in PARTS}
    latest = None  # the forward's latest attention kind met
    # The update begins with the gradient norm; every foreach kernel from there on is the update's.
    first_update = next((i for i, kind in enumerate(kinds) if kind == "update"), len(units))
    kinds = [
        ("update" if i > first_update and all("multi_tensor_apply" in e["name"] for e in unit) else kind)
        for i, (unit, kind) in enumerate(zip(units, kinds))
    ]
    for i, (unit, kind) in enumerate(zip(units, kinds)):
        if kind.endswith("attention") and i < matching:
            latest = kind
        if kind in ("update", "copies") or (kind == "to host" and i != matching):
            parts["copies" if kind == "to host" else kind] += unit
            continue
        if kind.endswith("attention"):  # a replay's attention kernels; its others are its layer's rest
            parts[kind] += [e for e in unit if _is_attention(e)]
            unit = [e for e in unit if not _is_attention(e)]
        if i < matching:
            part = {None: "backbone", "encoder attention": "encoder rest", "decoder attention": "decoder rest"}[latest]
        elif not backward_decoder or i < backward_decoder[0]:
            part = "matching and losses"
        elif not backward_encoder or i < backward_encoder[0]:
            part = "decoder rest"
        elif i <= backward_encoder[-1]:
            part = "encoder rest"
        else:
            part = "backbone"
        parts[part] += unit
    return parts


def _units(step: list[dict]) -> list[list[dict]]:
    """The step's work in order, the kernels of one CUDA-graph replay (one correlation id) kept together."""
    units, by_correlation = [], {}
    for event in step:
        correlation = event.get("args", {}).get("correlation")
        if correlation is not None and correlation in by_correlation:
            by_correlation[correlation].append(event)
            continue
        unit = [event]
        units.append(unit)
        if correlation is not None:
            by_correlation[correlation] = unit
    return units


def _unit_kind(unit: list[dict], split: dict[str, float]) -> str:
    attention = [e for e in unit if _is_attention(e)]
    if attention:
        return "encoder attention" if any(_grid(e) >= split[e["name"]] for e in attention) else "decoder attention"
    if all(_is_update(e) for e in unit):
        return "update"
    if all(e.get("cat") != "kernel" for e in unit):
        return (
            "to host"
            if any(
                "DtoH" in e["name"] or "Device -> Pageable" in e["name"] or "Device -> Pinned" in e["name"]
                for e in unit
            )
            else "copies"
        )
    return "other"


def _union_us(events: list[dict]) -> float:
    """The time in which at least one of the trace's ``events`` ran."""
    return busy_time([(e["ts"], e["ts"] + e["dur"]) for e in events], -math.inf, math.inf)
