"""Where a training step's GPU time goes, from the torch.profiler trace of train.py's profile_steps
(engine/train/hooks/profiling.py, which gives the busy share): bench/throughput.py's GPU time by part.
"""

from __future__ import annotations

import math

from engine.train.hooks.profiling import busy_time

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
    matching's copy to the host (or its solve on the device) the decoder, then the matching and losses up to the
    decoder's first attention backward, the decoder's backward up to the encoder's, the encoder's up to its last
    attention backward, and the backbone's backward after it. A layer's first and last kernels around its attention
    can fall to its neighbour: the figures are the parts' sizes, not an exact account. Idle: the time in the profiled
    work's span in which the GPU ran nothing.
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
# The matching's solve on the device (models/assignment.py), by its kernel's name.
ASSIGNMENT_KERNEL = "_assignment_kernel"


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
    # The matching ends the forward: its copy to the host, or its solve on the device, the first after the decoder's
    # first attention.
    matching = next(
        (i for i, kind in enumerate(kinds) if kind in ("to host", "assignment") and decoder and i > decoder[0]),
        len(units),
    )
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
    if any(ASSIGNMENT_KERNEL in e["name"] for e in unit):
        return "assignment"
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
