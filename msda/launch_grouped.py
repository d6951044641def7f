"""Launchers for the channel-grouped kernels (msda/kernels_grouped.py): the forward, and the query-side backward
kernel that launch.py's grad_value schemes call (fused scatter, the gather's cell keys, hybrid); and the two
passes of the cell-partials scheme of grad_value (msda/kernels_cells.py).

A grouped configuration is (BLOCK_Q, CH, num_warps): BLOCK_Q queries per program, the head's BLOCK_D channels in
CH groups of BLOCK_D / CH per thread (launch_table.grouped_config explains the defaults). Inputs arrive validated
and contiguous; nothing here reads the device.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from .kernels_cells import msda_cell_partials_kernel, msda_cell_rows_kernel
from .kernels_grouped import msda_backward_grouped_kernel, msda_forward_grouped_kernel
from .launch_table import LARGE, cdiv, check_grid, launch_config, pack_levels, pow2

KERNELS = ("forward", "fused", "keys", "hybrid")
_FLAGS = {"fused": (True, False), "keys": (False, True), "hybrid": (True, True)}  # SCATTER, KEYS


def _check_powers(*, ch: int, block_d: int, D: int, **sizes):
    """Tile sizes are Triton aranges: powers of 2; CH groups must split the BLOCK_D padded channels."""
    for name, size in sizes.items():
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name.upper()} must be a power of 2, got {size}")
    if ch < 1 or ch & (ch - 1) or ch > block_d:
        raise ValueError(f"CH (channel groups) must be a power of 2 from 1 to {block_d} for D={D}, got {ch}")


@functools.lru_cache(maxsize=1024)
def plan(
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
    """(grid, trailing int arguments, keyword arguments) of one grouped launch, built once per shape."""
    check_grid(N, M)
    if kernel not in KERNELS:
        raise ValueError(f"grouped kernel must be one of {KERNELS}, got {kernel!r}")
    config = config or launch_config((f"grouped_{kernel}", D, dtype.itemsize, L, P, N * Lq * M >= LARGE))
    if len(config) != 3:
        raise ValueError(f"a grouped config is (BLOCK_Q, CH, num_warps), got {config}")
    block_q, ch, warps = config
    block_d = pow2(D)
    _check_powers(block_q=block_q, ch=ch, block_d=block_d, D=D)
    kwargs = dict(
        M=M,
        D=D,
        L=L,
        P=P,
        BLOCK_Q=block_q,
        BLOCK_P=pow2(P),
        CH=ch,
        BLOCK_C=block_d // ch,
        COMPUTE_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32,
        LOGITS=logits,
        num_warps=warps,
    )
    grid = (cdiv(Lq, block_q), N * M)
    if kernel == "forward":
        kwargs["BLOCK_LP"] = pow2(L * P)
        return grid, (Lq, *pack_levels(levels)), kwargs
    kwargs.update(zip(("SCATTER", "KEYS"), _FLAGS[kernel]))
    return grid, (Lq, gather_level, *pack_levels(levels)), kwargs


def forward(
    value,
    levels: tuple,
    sampling_locations,
    attention_weights,
    output,
    config: tuple | None = None,
    stats=None,
    logits: bool = False,
):
    """Fills output (N, Lq, M, D), in value's dtype, for N, Lq > 0; logits: attention_weights are logits, and their
    softmax stats fill ``stats`` (N, Lq, M, 2)."""
    N, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grid, args, kwargs = plan("forward", N, Lq, M, D, L, P, value.dtype, levels, config, logits=logits)
    stats = attention_weights if stats is None else stats  # any tensor when unused
    msda_forward_grouped_kernel[grid](value, sampling_locations, attention_weights, output, stats, *args, **kwargs)


def query_kernel(
    kernel: str,
    grad_output,
    value,
    levels: tuple,
    sampling_locations,
    attention_weights,
    grad_value,
    grad_loc,
    grad_weight,
    keys,
    counts,
    config: tuple | None = None,
    gather_level: int = 0,
    stats=None,
    output=None,
    logits: bool = False,
):
    """One backward pass over the queries: grad_loc and grad_weight always; for "fused" and "hybrid" the scatter
    into grad_value of the levels below gather_level; for "keys" and "hybrid" the cell keys and counts of the
    levels from gather_level on. logits: attention_weights are logits, with the forward's softmax ``stats`` and
    ``output``; grad_weight is the logits'. Buffers a kernel does not use may be any tensor."""
    N, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grid, args, kwargs = plan(kernel, N, Lq, M, D, L, P, value.dtype, levels, config, gather_level, logits)
    msda_backward_grouped_kernel[grid](
        grad_output,
        value,
        sampling_locations,
        attention_weights,
        grad_value,
        grad_loc,
        grad_weight,
        keys,
        counts,
        attention_weights if stats is None else stats,
        grad_output if output is None else output,
        *args,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------
# the cell-partials scheme of grad_value (msda/kernels_cells.py)
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def cell_groups(levels: tuple, Lq: int, P: int, lanes: int) -> list:
    """[(c_begin, c_end, BLOCK_E)]: the cells of one (n, m) cut into runs of levels that share a tile shape.

    A cell of level l holds about Lq*P / ((H+1)*(W+1)) samples. Sparse levels get one lane per cell and many
    cells per program; dense (coarse) ones put up to all lanes on few cells, each lane taking at least 4 samples,
    so that no program walks a long run alone at the end of the launch.
    """
    groups, start = [], 0
    for h, w in levels:
        cells = (h + 1) * (w + 1)
        block_e = 1
        while block_e < lanes and block_e * 4 * 4 <= Lq * P / cells:
            block_e *= 4
        block_e = min(block_e, lanes)
        if groups and groups[-1][2] == block_e:
            groups[-1] = (groups[-1][0], start + cells, block_e)
        else:
            groups.append((start, start + cells, block_e))
        start += cells
    return groups


@functools.lru_cache(maxsize=256)
def cell_plans(
    N: int,
    Lq: int,
    M: int,
    D: int,
    L: int,
    P: int,
    dtype: torch.dtype,
    levels: tuple,
    config: tuple | None,
    filled: bool,
    logits: bool = False,
) -> tuple:
    """((grid, trailing int arguments, keyword arguments) of each cell-pass launch, the same of the row pass,
    the partial buffer's shape and dtype), built once per shape."""
    lanes, ch, warps = config or launch_config(("cells", D, dtype.itemsize, L, P, N * Lq * M >= LARGE))
    block_d = pow2(D)
    _check_powers(lanes=lanes, ch=ch, block_d=block_d, D=D)
    fp64 = dtype == torch.float64
    common = dict(
        M=M, D=D, L=L, CH=ch, BLOCK_C=block_d // ch, num_warps=warps, COMPUTE_DTYPE=tl.float64 if fp64 else tl.float32
    )
    packed = pack_levels(levels)
    cells = []
    for c_begin, c_end, block_e in cell_groups(levels, Lq, P, lanes):
        block_k = max(1, lanes // block_e)
        cells.append(
            (
                (cdiv(c_end - c_begin, block_k), N * M),
                (Lq, c_begin, c_end, *packed),
                dict(P=P, BLOCK_K=block_k, BLOCK_E=block_e, FILLED=filled, LOGITS=logits, **common),
            )
        )
    partial_dtype = torch.float64 if fp64 else torch.float32
    # As many rows as make one chunk of CH channels per thread (fp32 partials: 16 bytes a thread's vector).
    block_s = max(1, 32 * warps // max(1, (block_d // ch) * partial_dtype.itemsize // 16))
    S = sum(h * w for h, w in levels)
    rows = ((cdiv(S, block_s), N * M), packed, dict(BLOCK_S=block_s, **common))
    C = sum((h + 1) * (w + 1) for h, w in levels)
    return cells, rows, (N * M * C, 4, D), partial_dtype


def cell_grad_value(
    grad_output,
    levels: tuple,
    sampling_locations,
    attention_weights,
    bounds,
    perm,
    grad_value,
    filled: bool,
    config: tuple | None = None,
    stats=None,
    logits: bool = False,
):
    """Fills grad_value (N, S, M, D), in its dtype, from the samples grouped by cell: perm the sample ids in cell
    order, bounds (N*M*C + 1,) the inclusive prefix sums of the samples per cell (the ends of their runs) or, when
    ``filled`` (after the bucket fill), the starts. config = (lanes, CH, num_warps) of the cell pass; the row
    pass takes as many rows as make one fp32 chunk of CH channels per thread. logits: attention_weights are
    logits, with the forward's softmax ``stats``."""
    N, _S, M, D = grad_value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    cells, rows, partial_shape, partial_dtype = cell_plans(
        N, Lq, M, D, L, P, grad_value.dtype, levels, config, filled, logits
    )
    partial = torch.empty(partial_shape, dtype=partial_dtype, device=grad_value.device)  # (N*M*C, 4, D)
    stats = attention_weights if stats is None else stats  # any tensor when unused
    for grid, args, kwargs in cells:
        msda_cell_partials_kernel[grid](
            grad_output, sampling_locations, attention_weights, bounds, perm, partial, stats, *args, **kwargs
        )
    grid, args, kwargs = rows
    msda_cell_rows_kernel[grid](partial, grad_value, *args, **kwargs)
