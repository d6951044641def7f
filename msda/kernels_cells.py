"""Triton kernels of the cell-partials scheme of grad_value: deterministic, without atomics, each sample read once.

The gather kernel (msda/kernels.py) sums every value row over the four cells that reach it, so each sample's
upstream-gradient row is read four times, once per corner row. Here the work is split in two passes over the
samples grouped by cell (a stable sort by the cell of their top-left corner, as the gather scheme's, or its
atomic bucket fill, whose order inside a cell varies run to run):

    cells  one lane group per cell walks its samples in order and sums, for each of the cell's four corners
           (dy, dx), a * wy * wx * g into partial[cell, 2*dy + dx, :]: one read of every sample
    rows   every value row adds the four partials that reach it, cell (y - dy, x - dx)'s corner (dy, dx), in a
           fixed order, and writes the row once in value's dtype

After the sort both passes sum in an order fixed by it and the launch configuration, so grad_value is bitwise
identical run to run. Tiles are (CH, rows or cells, lanes, BLOCK_C), channels in groups as in msda/kernels_grouped.py.

Layouts: partial (N*M*C, 4, D) fp32 (fp64 for fp64 value); cells of (n, m) as in msda/kernels.py: level l owns
(H_l + 1) * (W_l + 1) cells, the top-left corners -1..H-1, -1..W-1; cell index (y0 + 1) * (W + 1) + (x0 + 1).
"""

import triton
import triton.language as tl

from .kernels import _DYNAMIC, _layout_totals, _level_shape, _levels_of, _load_softmax_stats, _pixel, _softmax_weight
from .kernels_grouped import _widen


@triton.jit
def _level_of(index, levels01, levels23, levels45, levels67, L: tl.constexpr, CELLS: tl.constexpr):
    """Level of each row index (CELLS=False: s in 0..S) or cell index (CELLS=True: 0..C) of one (n, m)."""
    level = tl.zeros_like(index).to(tl.int32)
    first = tl.zeros((), dtype=tl.int64)
    for l in tl.static_range(1, L):
        H, W = _level_shape(levels01, levels23, levels45, levels67, l - 1)
        first += (H + 1).to(tl.int64) * (W + 1) if CELLS else H.to(tl.int64) * W
        level = tl.where(index >= first, l, level)
    return level


@triton.jit(do_not_specialize=_DYNAMIC + ["c_begin", "c_end"])
def msda_cell_partials_kernel(
    grad_out_ptr,  # (N, Lq, M, D)
    loc_ptr,  # (N, Lq, M, L, P, 2)
    weight_ptr,  # (N, Lq, M, L, P) weights, or their logits (LOGITS)
    bounds_ptr,  # (N*M*C + 1,) cell bounds: ends of the runs (FILLED=False) or their starts (FILLED=True)
    perm_ptr,  # (N*Lq*M*L*P,) sample ids grouped by cell, ascending inside a cell
    partial_ptr,  # (N*M*C, 4, D) out: every cell of [c_begin, c_end) of every (n, m) written once
    stats_ptr,  # (N, Lq, M, 2) the forward's softmax stats; LOGITS only (msda/kernels.py)
    Lq,
    c_begin,
    c_end,
    levels01,
    levels23,
    levels45,
    levels67,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    FILLED: tl.constexpr,
    LOGITS: tl.constexpr,
):
    """A program owns BLOCK_K cells of one (n, m) and walks their runs BLOCK_E samples at a time."""
    pid_nm = tl.program_id(1)
    _S, C = _layout_totals(levels01, levels23, levels45, levels67, L)
    cell = c_begin + tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,) cells of (n, m)
    k_in = cell < c_end
    key = pid_nm * C + cell  # (BLOCK_K,) int64 global cell
    H, W, _row0, cell0 = _levels_of(
        _level_of(cell, levels01, levels23, levels45, levels67, L, True), levels01, levels23, levels45, levels67, L
    )
    local = cell - cell0
    x0 = (local % (W + 1) - 1).to(COMPUTE_DTYPE)  # the top-left corner every sample of the cell shares
    y0 = (local // (W + 1) - 1).to(COMPUTE_DTYPE)
    if FILLED:  # after the bucket fill, bounds holds the start of every cell
        begin = tl.load(bounds_ptr + key, mask=k_in, other=0).to(tl.int64)
        count = tl.load(bounds_ptr + key + 1, mask=k_in, other=0).to(tl.int64) - begin  # (BLOCK_K,)
    else:  # inclusive prefix sums: the end of every cell
        begin = tl.load(bounds_ptr + key - 1, mask=k_in & (key > 0), other=0).to(tl.int64)
        count = tl.load(bounds_ptr + key, mask=k_in, other=0).to(tl.int64) - begin
    h = tl.arange(0, CH)
    c = tl.arange(0, BLOCK_C)
    chan = (h * BLOCK_C)[:, None, None] + c[None, None, :]  # (CH, 1, BLOCK_C)
    chan4 = chan[:, :, None, :]  # (CH, 1, 1, BLOCK_C)

    acc00 = tl.zeros((CH, BLOCK_K, BLOCK_E, BLOCK_C), dtype=COMPUTE_DTYPE)
    acc01 = tl.zeros((CH, BLOCK_K, BLOCK_E, BLOCK_C), dtype=COMPUTE_DTYPE)
    acc10 = tl.zeros((CH, BLOCK_K, BLOCK_E, BLOCK_C), dtype=COMPUTE_DTYPE)
    acc11 = tl.zeros((CH, BLOCK_K, BLOCK_E, BLOCK_C), dtype=COMPUTE_DTYPE)
    e = tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    for j in range(0, tl.max(count, axis=0), BLOCK_E):
        # ---- load: lane e of each cell takes entry j + e of its run, its sample and the query's gradient
        ok = (j + e)[None, :] < count[:, None]  # (BLOCK_K, BLOCK_E)
        sample = tl.load(perm_ptr + begin[:, None] + j + e[None, :], mask=ok, other=0).to(tl.int64)
        loc_x = tl.load(loc_ptr + 2 * sample, mask=ok, other=0.0)
        loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=ok, other=0.0)
        attn = tl.load(weight_ptr + sample, mask=ok, other=0.0).to(COMPUTE_DTYPE)
        query_row = sample // (L * P)  # (BLOCK_K, BLOCK_E) row (n, q, m) of grad_out
        if LOGITS:
            sm_max, sm_sum = _load_softmax_stats(stats_ptr, query_row, ok)
            attn = _softmax_weight(attn, sm_max, sm_sum, ok)
        g = _widen(
            tl.load(
                grad_out_ptr + (query_row * D)[:, :, None][None, :, :, :] + chan4,
                mask=ok[:, :, None][None, :, :, :] & (chan4 < D),
                other=0.0,
            ),
            COMPUTE_DTYPE,
        )
        # ---- compute: the sample's fractions inside its cell, and its weight on each corner
        lx = _pixel(loc_x, W[:, None], COMPUTE_DTYPE) - x0[:, None]
        ly = _pixel(loc_y, H[:, None], COMPUTE_DTYPE) - y0[:, None]
        a_top = tl.where(ok, attn * (1 - ly), 0.0)
        a_bottom = tl.where(ok, attn * ly, 0.0)
        acc00 += (a_top * (1 - lx))[:, :, None][None, :, :, :] * g
        acc01 += (a_top * lx)[:, :, None][None, :, :, :] * g
        acc10 += (a_bottom * (1 - lx))[:, :, None][None, :, :, :] * g
        acc11 += (a_bottom * lx)[:, :, None][None, :, :, :] * g

    # ---- store: the four corner sums of every cell, zeros for an empty cell
    out = partial_ptr + (key * 4 * D)[None, :, None] + chan  # (CH, BLOCK_K, BLOCK_C)
    mask = k_in[None, :, None] & (chan < D)
    tl.store(out, tl.sum(acc00, axis=2).to(partial_ptr.dtype.element_ty), mask=mask)
    tl.store(out + D, tl.sum(acc01, axis=2).to(partial_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 2 * D, tl.sum(acc10, axis=2).to(partial_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 3 * D, tl.sum(acc11, axis=2).to(partial_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_DYNAMIC)
def msda_cell_rows_kernel(
    partial_ptr,  # (N*M*C, 4, D)
    grad_value_ptr,  # (N, S, M, D) out, in value's dtype: every row written once
    levels01,
    levels23,
    levels45,
    levels67,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """Row (n, s, m) = the sum over (dy, dx) in order 00 01 10 11 of partial[cell (y - dy, x - dx), corner (dy, dx)]:
    the four cells whose corners include pixel (y, x) of s."""
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M
    S, C = _layout_totals(levels01, levels23, levels45, levels67, L)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) value rows of (n, m)
    s_in = s < S
    _H, W, row0, cell0 = _levels_of(
        _level_of(s, levels01, levels23, levels45, levels67, L, False), levels01, levels23, levels45, levels67, L
    )
    pixel = s - row0
    y = pixel // W
    x = pixel - y * W
    h = tl.arange(0, CH)
    c = tl.arange(0, BLOCK_C)
    chan = (h * BLOCK_C)[:, None, None] + c[None, None, :]  # (CH, 1, BLOCK_C)
    mask = s_in[None, :, None] & (chan < D)

    acc = tl.zeros((CH, BLOCK_S, BLOCK_C), dtype=COMPUTE_DTYPE)
    for corner in tl.static_range(4):
        # ---- load: corner (dy, dx) of the cell whose top-left is (y - dy, x - dx): cell (y - dy + 1, x - dx + 1)
        cell = pid_nm * C + cell0 + (y + 1 - corner // 2).to(tl.int64) * (W + 1) + (x + 1 - corner % 2)
        part = tl.load(partial_ptr + ((cell * 4 + corner) * D)[None, :, None] + chan, mask=mask, other=0.0)
        acc += part.to(COMPUTE_DTYPE)

    # ---- store: each row once, in the output dtype
    out_rows = (n.to(tl.int64) * S + s) * M + m  # (BLOCK_S,)
    tl.store(grad_value_ptr + (out_rows * D)[None, :, None] + chan, acc.to(grad_value_ptr.dtype.element_ty), mask=mask)
