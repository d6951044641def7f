"""Channel-grouped Triton kernels: the forward and the query-side backward with little work per sample and thread.

Triton spreads a D-channel value row over D*bytes/16 threads (one 16-byte vector each), and every one of those
threads repeats the sample's arithmetic (pixel, floor, validity, four corner addresses and weights): 8 threads
per fp32 row of 32 channels, each redoing all of it for 4 channels. These kernels put the channels on a leading
tile axis of CH groups, (CH, BLOCK_Q, BLOCK_P, BLOCK_C) with BLOCK_C = BLOCK_D / CH: Triton assigns threads
from the innermost axis outwards, so a thread holds all CH groups of its row and a sample's arithmetic is
repeated only BLOCK_C*bytes/16 times. Each thread then issues CH vector loads (or atomics) per corner.

A program owns BLOCK_Q consecutive queries of one (n, m) pair and walks the levels in order, all P points of
a level at a time, so the level's geometry is a per-program scalar (no per-sample level lookup) and a query's
P locations of a level are one contiguous run. Corner validity is decided on the float coordinates and the
top-left corner's row once per sample; the other three corners are scalar offsets of it (+1, +W, +W+1).

Layouts as in msda/kernels.py: value (N, S, M, D), sampling_locations (N, Lq, M, L, P, 2), attention_weights
(N, Lq, M, L, P), output (N, Lq, M, D), softmax stats (N, Lq, M, 2); element offsets in int64. LOGITS: the weights
are logits, softmaxed inside the kernels as msda/kernels.py describes.
"""

import triton
import triton.language as tl

from .kernels import (
    _DYNAMIC,
    _layout_totals,
    _level_shape,
    _load_softmax_stats,
    _pixel,
    _softmax_stats,
    _softmax_weight,
    _store_softmax_stats,
)


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _channels(CH: tl.constexpr, BLOCK_C: tl.constexpr):
    """(CH, 1, BLOCK_C) channel index of every group lane: group h holds channels h*BLOCK_C .. +BLOCK_C."""
    h = tl.arange(0, CH)  # (CH,)
    c = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    return (h * BLOCK_C)[:, None, None] + c[None, None, :]  # (CH, 1, BLOCK_C)


@triton.jit
def _widen(v, COMPUTE_DTYPE: tl.constexpr):
    """v in COMPUTE_DTYPE. A bfloat16 is the upper half of its float32, so widening is a 16-bit shift: done on the
    bits, LLVM makes it one instruction per element (an AND or a shift of the packed pair), where its fpext of
    the upper element of a pair takes two (a byte permute and a shift)."""
    if v.dtype == tl.bfloat16 and tl.float32 == COMPUTE_DTYPE:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(COMPUTE_DTYPE)


@triton.jit
def _spread(x):
    """(BLOCK_Q, BLOCK_P) -> (1, BLOCK_Q, BLOCK_P, 1), expanded in the order that makes its layout the one a
    channel reduction of a (CH, BLOCK_Q, BLOCK_P, BLOCK_C) tile over axis 0, then the last axis, gives: the
    sample arithmetic then lives in one layout (Triton would otherwise keep and recompute a second copy)."""
    return x[:, :, None][None, :, :, :]


@triton.jit
def _level_samples(
    loc_ptr,
    weight_ptr,
    query_row,
    q_in,
    l,
    H,
    W,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """The P samples of level l of every query: index, mask, fractional pixel position and corner validity.

    Returns sample (BLOCK_Q, BLOCK_P) flat index l*P + p of each query, s_in, x0 / y0 (the top-left corner as
    floats), lx / ly (fractions), col0 / col1 (corner columns x0, x0+1 inside the map), row0 / row1 (likewise
    rows y0, y0+1) and attn. A NaN location fails every comparison, so it reads no memory; its NaN weights still
    make the output NaN, as grid_sample's.
    """
    p = tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    sample = (query_row[:, None] * L + l) * P + p[None, :]  # (BLOCK_Q, BLOCK_P)
    s_in = q_in[:, None] & (p < P)[None, :]
    loc_x = tl.load(loc_ptr + 2 * sample, mask=s_in, other=0.0)
    loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=s_in, other=0.0)
    attn = tl.load(weight_ptr + sample, mask=s_in, other=0.0).to(COMPUTE_DTYPE)
    x = _pixel(loc_x, W, COMPUTE_DTYPE)
    y = _pixel(loc_y, H, COMPUTE_DTYPE)
    x0 = tl.floor(x)
    y0 = tl.floor(y)
    col0 = (x0 >= 0) & (x0 <= W - 1)
    col1 = (x0 >= -1) & (x0 <= W - 2)
    row0 = s_in & (y0 >= 0) & (y0 <= H - 1)
    row1 = s_in & (y0 >= -1) & (y0 <= H - 2)
    return sample, s_in, x0, y0, x - x0, y - y0, col0, col1, row0, row1, attn


@triton.jit
def _top_left_offset(x0, y0, col0, col1, row0, row1, W, level_row0, MD: tl.constexpr):
    """(BLOCK_Q, BLOCK_P) int64 element offset of the top-left corner's row inside the (n, m) slice.

    Coordinates of samples with no corner in the map are replaced by 0 before the integer conversion, which a
    far-outside float would overflow; their loads are all masked off.
    """
    xi = tl.where(col0 | col1, x0, 0.0).to(tl.int32)
    yi = tl.where(row0 | row1, y0, 0.0).to(tl.int32)
    return (level_row0 + (yi * W + xi)) * MD


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_DYNAMIC)
def msda_forward_grouped_kernel(
    value_ptr,  # (N, S, M, D)
    loc_ptr,  # (N, Lq, M, L, P, 2)
    weight_ptr,  # (N, Lq, M, L, P) weights, or their logits (LOGITS)
    out_ptr,  # (N, Lq, M, D)
    stats_ptr,  # (N, Lq, M, 2) out: softmax stats; LOGITS only
    Lq,
    levels01,
    levels23,
    levels45,
    levels67,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    LOGITS: tl.constexpr,
    BLOCK_LP: tl.constexpr,
):
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    q_in = q < Lq
    query_row = (n.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,) row (n, q, m) of loc / weight / out
    chan = _channels(CH, BLOCK_C)  # (CH, 1, BLOCK_C)
    chan_in = chan < D
    S, _ = _layout_totals(levels01, levels23, levels45, levels67, L)
    value_nm = value_ptr + (n.to(tl.int64) * S * M + m) * D  # row (n, 0, m)
    if LOGITS:
        # ---- softmax stats of every query's L*P logits, before its samples
        sm_max, sm_sum = _softmax_stats(weight_ptr, query_row, q_in, L * P, BLOCK_LP, COMPUTE_DTYPE)
        _store_softmax_stats(stats_ptr, query_row, q_in, sm_max, sm_sum)

    acc = tl.zeros((CH, BLOCK_Q, BLOCK_P, BLOCK_C), dtype=COMPUTE_DTYPE)  # (CH, BLOCK_Q, BLOCK_P, BLOCK_C)
    level_row0 = tl.zeros((), dtype=tl.int64)  # first row of level l
    for l in tl.static_range(L):
        H, W = _level_shape(levels01, levels23, levels45, levels67, l)
        # ---- load: the P locations and weights of level l of every query, and the sample's geometry
        _, s_in, x0, y0, lx, ly, col0, col1, row0, row1, attn = _level_samples(
            loc_ptr, weight_ptr, query_row, q_in, l, H, W, L, P, BLOCK_P, COMPUTE_DTYPE
        )
        if LOGITS:
            attn = _softmax_weight(attn, sm_max[:, None], sm_sum[:, None], s_in)
        top_left = _top_left_offset(x0, y0, col0, col1, row0, row1, W, level_row0, M * D)  # (BLOCK_Q, BLOCK_P)
        ptrs = value_nm + _spread(top_left) + chan[:, :, None, :]  # (CH, BLOCK_Q, BLOCK_P, BLOCK_C)
        a_top = attn * (1 - ly)
        a_bottom = attn * ly
        for corner in tl.static_range(4):
            inside = (row1 if corner // 2 == 1 else row0) & (col1 if corner % 2 == 1 else col0)  # (BLOCK_Q, BLOCK_P)
            coef = (a_bottom if corner // 2 == 1 else a_top) * (lx if corner % 2 == 1 else 1 - lx)
            # ---- gather: CH vectors per thread of the corner's row
            step = ((corner // 2) * W + corner % 2).to(tl.int64) * (M * D)  # (0, 0) -> (DY, DX)
            v = tl.load(ptrs + step, mask=_spread(inside) & chan_in[:, :, None, :], other=0.0)
            # ---- compute: bilinear weight fused with the attention weight
            acc += _spread(coef) * _widen(v, COMPUTE_DTYPE)
        level_row0 += H * W

    # ---- store: (CH, BLOCK_Q, BLOCK_C) groups of each query's D channels, in the output dtype
    out = tl.sum(acc, axis=2)  # (CH, BLOCK_Q, BLOCK_C)
    out_ptrs = out_ptr + query_row[None, :, None] * D + chan
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_in[None, :, None] & chan_in)


# ----------------------------------------------------------------------------------------------------
# backward over queries: location / weight gradients, and the scatter or the cell keys of grad_value
# ----------------------------------------------------------------------------------------------------
# Gradient of one sample (msda/kernels.py states it in full): with corners v_yx, fractions lx, ly, hx = 1 - lx,
# hy = 1 - ly, attention weight a, upstream gradient g and t_yx = sum_d g * v_yx,
#
#   dL/da        = sum_corners wy * wx * t_yx
#   dL/dv_yx    += a * wy * wx * g
#   dL/dloc_x    = a * W * sum_corners (+1 if the corner is x0 + 1 else -1) * wy * t_yx
#   dL/dloc_y    = a * H * sum_corners (+1 if the corner is y0 + 1 else -1) * wx * t_yx
#
# t_yx sums over the CH groups inside the thread and over the few threads that share a row chunk.
@triton.jit(do_not_specialize=_DYNAMIC + ["gather_level"])
def msda_backward_grouped_kernel(
    grad_out_ptr,  # (N, Lq, M, D)
    value_ptr,  # (N, S, M, D)
    loc_ptr,  # (N, Lq, M, L, P, 2)
    weight_ptr,  # (N, Lq, M, L, P) weights, or their logits (LOGITS)
    grad_value_ptr,  # (N, S, M, D) zeroed fp32 (fp64 for fp64 value) buffer; SCATTER only
    grad_loc_ptr,  # (N, Lq, M, L, P, 2) in sampling_locations' dtype
    grad_weight_ptr,  # (N, Lq, M, L, P) in attention_weights' dtype (of the logits: LOGITS)
    keys_ptr,  # (N, Lq, M, L, P) int: cell of the top-left corner, N*M*C if none; KEYS only
    counts_ptr,  # (N*M*C + 1,) zeroed int: samples per cell; KEYS only
    stats_ptr,  # (N, Lq, M, 2) the forward's softmax stats; LOGITS only
    out_ptr,  # (N, Lq, M, D) the forward's output; LOGITS only
    Lq,
    gather_level,
    levels01,
    levels23,
    levels45,
    levels67,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    SCATTER: tl.constexpr,
    KEYS: tl.constexpr,
    LOGITS: tl.constexpr,
):
    """Levels below gather_level are scattered (SCATTER), the others filed under their cells (KEYS)."""
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    q_in = q < Lq
    query_row = (n.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,)
    chan = _channels(CH, BLOCK_C)  # (CH, 1, BLOCK_C)
    chan_in = chan < D
    S, C = _layout_totals(levels01, levels23, levels45, levels67, L)
    nm_offset = (n.to(tl.int64) * S * M + m) * D  # row (n, 0, m) of value and grad_value

    # ---- load: the upstream gradient of these queries, reused by every sample
    row_offsets = query_row[None, :, None] * D + chan  # (CH, BLOCK_Q, BLOCK_C)
    row_mask = q_in[None, :, None] & chan_in
    g = _widen(tl.load(grad_out_ptr + row_offsets, mask=row_mask, other=0.0), COMPUTE_DTYPE)
    if LOGITS:
        sm_max, sm_sum = _load_softmax_stats(stats_ptr, query_row, q_in)  # (BLOCK_Q,) each
        # ---- sum_j a_j dL/da_j of each query: <g, output> (msda/kernels.py)
        out = _widen(tl.load(out_ptr + row_offsets, mask=row_mask, other=0.0), COMPUTE_DTYPE)
        weighted_grad = tl.sum(tl.sum(g * out, axis=0), axis=1)  # (BLOCK_Q,)
    g = g[:, :, None, :]  # (CH, BLOCK_Q, 1, BLOCK_C)

    level_row0 = tl.zeros((), dtype=tl.int64)
    level_cell0 = tl.zeros((), dtype=tl.int64)
    for l in tl.static_range(L):
        H, W = _level_shape(levels01, levels23, levels45, levels67, l)
        sample, s_in, x0, y0, lx, ly, col0, col1, row0, row1, attn = _level_samples(
            loc_ptr, weight_ptr, query_row, q_in, l, H, W, L, P, BLOCK_P, COMPUTE_DTYPE
        )
        if LOGITS:
            attn = _softmax_weight(attn, sm_max[:, None], sm_sum[:, None], s_in)
        top_left = nm_offset + _top_left_offset(x0, y0, col0, col1, row0, row1, W, level_row0, M * D)
        offsets = _spread(top_left) + chan[:, :, None, :]  # (CH, BLOCK_Q, BLOCK_P, BLOCK_C)
        scattered = l < gather_level
        grad_attn = tl.zeros_like(lx)  # (BLOCK_Q, BLOCK_P)
        grad_lx = tl.zeros_like(lx)
        grad_ly = tl.zeros_like(lx)
        for corner in tl.static_range(4):
            inside = (row1 if corner // 2 == 1 else row0) & (col1 if corner % 2 == 1 else col0)
            wy = ly if corner // 2 == 1 else 1 - ly
            wx = lx if corner % 2 == 1 else 1 - lx
            corner_offsets = offsets + ((corner // 2) * W + corner % 2).to(tl.int64) * (M * D)
            c_in = _spread(inside) & chan_in[:, :, None, :]
            # ---- gather one corner; reduce over the thread's channels, then across the row's threads
            v = _widen(tl.load(value_ptr + corner_offsets, mask=c_in, other=0.0), COMPUTE_DTYPE)
            t = tl.sum(tl.sum(g * v, axis=0), axis=2)  # (BLOCK_Q, BLOCK_P)
            grad_attn += wy * wx * t
            grad_lx += (wy if corner % 2 == 1 else -wy) * t
            grad_ly += (wx if corner // 2 == 1 else -wx) * t
            if SCATTER:
                # ---- scatter: relaxed fp32 vector atomics, only the sums must be right
                tl.atomic_add(
                    grad_value_ptr + corner_offsets, _spread(attn * wy * wx) * g, mask=c_in & scattered, sem="relaxed"
                )
        # ---- store: one weight (or logit) and one (x, y) gradient per sample
        if LOGITS:
            grad_attn = attn * (grad_attn - weighted_grad[:, None])
        tl.store(grad_weight_ptr + sample, grad_attn.to(grad_weight_ptr.dtype.element_ty), mask=s_in)
        grad_xy = tl.join(attn * W * grad_lx, attn * H * grad_ly)  # (BLOCK_Q, BLOCK_P, 2)
        xy = tl.arange(0, 2)
        tl.store(
            grad_loc_ptr + 2 * sample[:, :, None] + xy[None, None, :],
            grad_xy.to(grad_loc_ptr.dtype.element_ty),
            mask=s_in[:, :, None],
        )
        if KEYS:
            # ---- file the sample under its top-left corner's cell; none if no corner is in the map or if
            #      its level is scattered
            touches = (row0 | row1) & (col0 | col1) & (l >= gather_level)
            cell_x = tl.where(touches, x0 + 1, 0.0).to(tl.int64)
            cell_y = tl.where(touches, y0 + 1, 0.0).to(tl.int64)
            cell = pid_nm * C + level_cell0 + cell_y * (W + 1) + cell_x  # (BLOCK_Q, BLOCK_P)
            key = tl.where(touches, cell, tl.num_programs(1) * C)
            tl.store(keys_ptr + sample, key.to(keys_ptr.dtype.element_ty), mask=s_in)
            tl.atomic_add(counts_ptr + key, 1, mask=touches, sem="relaxed")
        level_row0 += H * W
        level_cell0 += (H + 1) * (W + 1)
