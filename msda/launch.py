"""Launchers for the Triton kernels: pick the kernel family and launch configuration, allocate outputs, build the
grid, launch.

Two families of query kernels share the grad_value schemes: classic (msda/kernels.py) and grouped
(msda/kernels_grouped.py, launched through launch_grouped.py); the table (launch_table.py) picks one per pass,
and callers may name one. Inputs arrive validated and contiguous (see ops.py); ``levels`` is a tuple of (H, W)
Python ints. Imported lazily so that ``import msda`` works without triton and the reference path never touches
it. Nothing here reads the device or copies host memory to it: the level layout travels as four int64 kernel
arguments that Triton does not specialize on, so a new image size neither syncs nor recompiles, eagerly, under
torch.compile (inside a custom op) or during CUDA-graph capture.

Given a ``softmax_stats`` buffer, every launch takes the weights as logits (msda/kernels.py, LOGITS): the forward
fills the buffer, the backward reads it and the forward's output, and its weight gradient is the logits'.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from . import launch_grouped, launch_table
from .kernels import (
    msda_backward_kernel,
    msda_fill_cells_kernel,
    msda_forward_kernel,
    msda_grad_value_gather_kernel,
)
from .launch_table import (  # noqa: F401  (INTERPRET, MAX_LEVELS, MAX_SIDE, TUNED: this module's public names too)
    FAMILIES,
    INTERPRET,
    LARGE,
    MAX_LEVELS,
    MAX_SIDE,
    TUNED,
    cdiv,
    check_grid,
    device_guard,
    launch_config,
    levels_key,
    pack_levels,
    pow2,
)

SCHEMES = ("fused", "split", "gather", "hybrid", "cells")
DETERMINISTIC_SCHEMES = ("gather", "cells")
_FLAGS = {
    "fused": (True, True, False),
    "sample_grads": (True, False, False),
    "scatter": (False, True, False),
    "keys": (True, False, True),
    "hybrid": (True, True, True),
}  # SAMPLE_GRADS, SCATTER, KEYS


def update_table(entries: dict):
    """Merge measured entries into the table at run time (bench/msda.py does, after its sweep)."""
    launch_table.TUNED.update(entries)
    launch_config.cache_clear()
    _plan.cache_clear()
    launch_grouped.plan.cache_clear()
    launch_grouped.cell_plans.cache_clear()


def _family(kernels: str | None, pass_name: str, D: int, nbytes: int, L: int, P: int, large: bool) -> str:
    kernels = kernels or launch_config((f"{pass_name}_kernels", D, nbytes, L, P, large))
    if kernels not in FAMILIES:
        raise ValueError(f"kernels must be one of {FAMILIES}, got {kernels!r}")
    return kernels


@functools.lru_cache(maxsize=1024)
def _plan(
    kernel: str,
    N: int,
    Lq: int,
    M: int,
    D: int,
    L: int,
    P: int,
    dtype: torch.dtype,
    levels: tuple,
    config: tuple | None,
    gather_level: int = 0,
    logits: bool = False,
):
    """(grid, trailing int arguments, keyword arguments) of one query-kernel launch, built once per shape.

    The eager training step is host-bound: per call only a dict lookup remains of the configuration work.
    """
    check_grid(N, M)
    nbytes = dtype.itemsize
    config = config or launch_config((kernel, D, nbytes, L, P, N * Lq * M >= LARGE))
    block_q, block_p, warps = config[:3]
    kwargs = dict(
        M=M,
        D=D,
        L=L,
        P=P,
        BLOCK_D=pow2(D),
        COMPUTE_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32,
        BLOCK_Q=block_q,
        BLOCK_P=block_p,
        LOGITS=logits,
        num_warps=warps,
    )
    if kernel == "forward":
        if len(config) != 4:
            raise ValueError(f"a forward config is (BLOCK_Q, BLOCK_P, num_warps, UNROLL), got {config}")
        kwargs.update(UNROLL=config[3], BLOCK_LP=pow2(L * P))
        return (cdiv(Lq, block_q), N * M), (Lq, *pack_levels(levels)), kwargs
    kwargs.update(zip(("SAMPLE_GRADS", "SCATTER", "KEYS"), _FLAGS[kernel]))
    return (cdiv(Lq, block_q), N * M), (Lq, gather_level, *pack_levels(levels)), kwargs


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
def softmax_stats_buffer(value, sampling_locations) -> torch.Tensor:
    """(N, Lq, M, 2) buffer for the softmax stats of logits, in the kernels' compute dtype."""
    N, Lq, M = sampling_locations.shape[:3]
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    return torch.empty((N, Lq, M, 2), dtype=dtype, device=value.device)


def forward(
    value,
    levels,
    sampling_locations,
    attention_weights,
    *,
    config: tuple | None = None,
    kernels: str | None = None,
    softmax_stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns (N, Lq, M*D) in value's dtype. kernels = "classic" | "grouped" overrides the table's family; config
    overrides its block shape: (BLOCK_Q, BLOCK_P, num_warps, UNROLL) classic, (BLOCK_Q, CH, num_warps) grouped.
    softmax_stats (softmax_stats_buffer): attention_weights are logits, softmaxed over each query's L*P samples;
    the buffer is filled for the backward."""
    N, _, M, D = value.shape
    shape = sampling_locations.shape  # (N, Lq, M, L, P, 2)
    output = torch.empty((N, shape[1], M, D), dtype=value.dtype, device=value.device)  # (N, Lq, M, D)
    if N == 0 or shape[1] == 0:
        return output.view(N, shape[1], M * D)
    levels = levels_key(levels)
    family = _family(kernels, "forward", D, value.element_size(), shape[3], shape[4], N * shape[1] * M >= LARGE)
    logits = softmax_stats is not None
    stats = softmax_stats if logits else attention_weights  # any tensor when unused
    with device_guard(value):
        if family == "grouped":
            launch_grouped.forward(value, levels, sampling_locations, attention_weights, output, config, stats, logits)
        else:
            grid, args, kwargs = _plan(
                "forward", N, shape[1], M, D, shape[3], shape[4], value.dtype, levels, config, logits=logits
            )
            msda_forward_kernel[grid](value, sampling_locations, attention_weights, output, stats, *args, **kwargs)
    return output.view(N, shape[1], M * D)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
def backward(
    grad_output,
    value,
    levels,
    sampling_locations,
    attention_weights,
    *,
    deterministic: bool = False,
    scheme: str | None = None,
    configs: dict | None = None,
    kernels: str | None = None,
    softmax_stats: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
):
    """Returns (grad_value, grad_sampling_locations, grad_attention_weights), each in its input's dtype.

    deterministic=False: the scheme from the table. "fused" and "split" add grad_value with fp32 atomics
    (fp64 for fp64 value) into a zeroed buffer, cast once; "gather" buckets the samples by cell with atomics
    and sums every value row in registers; "hybrid" scatters the fine levels and gathers the dense coarse
    ones (their rows collect many entries, on which atomics would queue). Either way the last bits of
    grad_value vary run to run.
    "cells" buckets them too, sums each cell's samples per corner once, then every row over its four cells.
    deterministic=True: the gather or cells scheme (the table's "deterministic_scheme") over a stable sort of the
    samples by cell; every value row is summed in a fixed order, so all three gradients are bitwise identical run
    to run (the location and weight gradients never use atomics). scheme / configs (kernel name -> config tuple)
    override the table (benchmarks).
    kernels = "classic" | "grouped" picks the query kernels' family (the table's for this pass by default): the
    grouped family runs every scheme but split; its configs are named "grouped_" + kernel.
    softmax_stats and output (the forward's, with the stats it filled): attention_weights are logits, and the third
    gradient is theirs.
    """
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grad_loc = torch.empty_like(sampling_locations)  # (N, Lq, M, L, P, 2)
    grad_weight = torch.empty_like(attention_weights)  # (N, Lq, M, L, P)
    if N == 0 or Lq == 0:
        return torch.zeros_like(value), grad_loc, grad_weight
    levels = levels_key(levels)
    nbytes, large = value.element_size(), N * Lq * M >= LARGE
    if scheme is None:
        scheme = launch_config(("deterministic_scheme" if deterministic else "scheme", D, nbytes, L, P, large))
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if deterministic and scheme not in DETERMINISTIC_SCHEMES:
        raise ValueError(f"a deterministic backward takes scheme {' or '.join(DETERMINISTIC_SCHEMES)}, got {scheme!r}")
    configs = configs or {}
    logits = softmax_stats is not None
    if logits and output is None:
        raise ValueError("a backward of logits takes the forward's output with its softmax_stats")
    stats = softmax_stats if logits else attention_weights  # any tensors when unused
    output = output if logits else grad_output

    family = _family(kernels, "deterministic" if deterministic else "backward", D, nbytes, L, P, large)
    if family == "grouped" and scheme == "split":
        raise ValueError(
            "the grouped kernels have no split scheme (their pass always computes the location and "
            "weight gradients): use fused, gather or hybrid"
        )
    first_gathered = 0  # levels from this one on are summed by the gather kernel
    if scheme == "hybrid":
        threshold = configs.get("hybrid_split") or launch_config(("hybrid_split", D, nbytes, large))
        first_gathered = gather_from(levels, Lq, P, threshold)
        scheme = "fused" if first_gathered == L else scheme

    def query_kernel(name, grad_value, keys, counts):
        gather_level = L if name in ("fused", "scatter") else first_gathered
        if family == "grouped":
            launch_grouped.query_kernel(
                name,
                grad_output,
                value,
                levels,
                sampling_locations,
                attention_weights,
                grad_value,
                grad_loc,
                grad_weight,
                keys,
                counts,
                configs.get(f"grouped_{name}"),
                gather_level,
                stats,
                output,
                logits,
            )
            return
        grid, args, kwargs = _plan(
            name, N, Lq, M, D, L, P, value.dtype, levels, configs.get(name), gather_level, logits
        )
        msda_backward_kernel[grid](
            grad_output,
            value,
            sampling_locations,
            attention_weights,
            grad_value,
            grad_loc,
            grad_weight,
            keys,
            counts,
            stats,
            output,
            *args,
            **kwargs,
        )

    with device_guard(value):
        accum_dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
        if scheme in ("fused", "split"):
            grad_value = torch.zeros((N, S, M, D), dtype=accum_dtype, device=value.device)  # (N, S, M, D)
            if scheme == "fused":
                query_kernel("fused", grad_value, grad_weight, grad_weight)
            else:  # two passes: location/weight gradients without atomics, then the scatter alone
                query_kernel("sample_grads", grad_value, grad_weight, grad_weight)
                query_kernel("scatter", grad_value, grad_weight, grad_weight)
            return grad_value.to(value.dtype), grad_loc, grad_weight

        num_cells = N * M * sum((h + 1) * (w + 1) for h, w in levels)
        num_samples = N * Lq * M * L * P
        index_dtype = torch.int32 if max(num_cells + 1, num_samples) < 2**31 else torch.int64
        keys = torch.empty(num_samples, dtype=index_dtype, device=value.device)  # (N, Lq, M, L, P) flat
        counts = torch.zeros(num_cells + 1, dtype=index_dtype, device=value.device)  # last: no cell
        if scheme == "hybrid":  # the scatter's rows stay zero where the gather writes
            grad_value = torch.zeros((N, S, M, D), dtype=accum_dtype, device=value.device)  # (N, S, M, D)
            query_kernel("hybrid", grad_value, keys, counts)
        else:
            grad_value = torch.empty_like(value)  # (N, S, M, D): every row written once, in value's dtype
            query_kernel("keys", grad_loc, keys, counts)
        counts.cumsum_(0)  # inclusive: counts[k] is the end of cell k
        if deterministic:
            perm = torch.sort(keys, stable=True).indices  # ascending sample id inside every cell
        else:
            perm = torch.empty(num_samples, dtype=index_dtype, device=value.device)
            msda_fill_cells_kernel[(cdiv(num_samples, 1024),)](
                keys, counts, perm, num_samples, num_cells, BLOCK=1024, num_warps=4
            )
        if scheme == "cells":
            launch_grouped.cell_grad_value(
                grad_output,
                levels,
                sampling_locations,
                attention_weights,
                counts,
                perm,
                grad_value,
                not deterministic,
                configs.get("cells"),
                stats,
                logits,
            )
            return grad_value, grad_loc, grad_weight
        lanes, warps = configs.get("gather") or launch_config(("gather", D, nbytes, large))
        common = dict(
            M=M,
            D=D,
            L=L,
            P=P,
            BLOCK_D=pow2(D),
            FILLED=not deterministic,
            LOGITS=logits,
            num_warps=warps,
            COMPUTE_DTYPE=tl.float64 if value.dtype == torch.float64 else tl.float32,
        )
        s_first = sum(h * w for h, w in levels[:first_gathered])
        for s_begin, s_end, block_e in gather_groups(levels, Lq, P, lanes):
            s_begin = max(s_begin, s_first)
            if s_begin >= s_end:
                continue
            block_s = lanes // block_e
            msda_grad_value_gather_kernel[(cdiv(s_end - s_begin, block_s), N * M)](
                grad_output,
                sampling_locations,
                attention_weights,
                counts,
                perm,
                grad_value,
                stats,
                Lq,
                s_begin,
                s_end,
                *pack_levels(levels),
                BLOCK_S=block_s,
                BLOCK_E=block_e,
                **common,
            )
        return grad_value.to(value.dtype), grad_loc, grad_weight


def gather_from(levels: tuple, Lq: int, P: int, threshold: float) -> int:
    """First level of the coarse run whose value rows expect at least ``threshold`` entries (4*Lq*P / (H*W)
    per (n, m)); len(levels) if the coarsest level does not."""
    first = len(levels)
    while first > 0 and 4 * Lq * P >= threshold * levels[first - 1][0] * levels[first - 1][1]:
        first -= 1
    return first


@functools.lru_cache(maxsize=256)
def gather_groups(levels: tuple, Lq: int, P: int, lanes: int) -> list:
    """[(s_begin, s_end, BLOCK_E)]: value rows cut into runs of levels that share a gather tile shape.

    A value row of level l receives about 4*Lq*P / (H*W) entries per (n, m). Sparse levels get one entry
    lane per row and many rows per program; dense (coarse) levels put all lanes on few rows, so that no
    program walks a long cell alone at the end of the launch. Each lane takes about a quarter of its row's
    expected entries, so programs run a few steps.
    """
    groups, start = [], 0
    for h, w in levels:
        expected = 4 * Lq * P / (h * w)
        block_e = 1
        while block_e < lanes and block_e * 4 * 4 <= expected:
            block_e *= 4
        block_e = min(block_e, lanes)
        if groups and groups[-1][2] == block_e:
            groups[-1] = (groups[-1][0], start + h * w, block_e)
        else:
            groups.append((start, start + h * w, block_e))
        start += h * w
    return groups
