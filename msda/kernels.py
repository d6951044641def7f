"""Triton kernels for multi-scale deformable attention. Kernels and their jit helpers only: no launch logic.

Query kernels (forward, backward) run on a 2D grid (cdiv(Lq, BLOCK_Q), N*M): one program owns BLOCK_Q
consecutive queries of one (batch n, head m) pair and walks their L*P samples BLOCK_P at a time, so a step
works on (BLOCK_Q, BLOCK_P, BLOCK_D) tiles. BLOCK_P = 1 takes one sample per step; BLOCK_P = L*P loads
every location and weight of a query in one contiguous row and gathers all corners at once. The forward walks
its steps in a loop unrolled UNROLL times, not fully: Triton's compile time grows much faster than the code, and a
run with an empty cache waits for it in its first step.

grad_value has two mechanisms, which the backward kernel can mix by level (gather_level). Scatter: every
corner's contribution is added with fp32 atomics. Gather: the sample is filed under the cell of its top-left
corner (a key, and a count per cell); the samples are grouped by cell (an atomic bucket fill, or a stable
sort for a deterministic result); then msda_grad_value_gather_kernel gives every value row the sum over the
four cells that can reach it, in a fixed order, and writes it once.

LOGITS: the weights are the logits of the attention weights, softmaxed over each query's L*P samples inside the
kernels (msda/logits_op.py). The forward computes each query's softmax stats from its contiguous run of logits before
its samples and writes them; every other kernel turns a logit into its weight with them. The logit's gradient is
a * (dL/da - sum_j a_j dL/da_j), and that sum is the upstream gradient dotted with the forward's output of the
(query, head): sum_j a_j <g, val_j> = <g, sum_j a_j val_j>. So the backward reads the output row instead of
waiting for all L*P weight gradients, and writes each logit's gradient as soon as its sample's is known. With a
2-byte value the output is stored rounded to it, and that sum carries its rounding (relative 2^-8 for bf16 at most).

Layouts (all contiguous, element offsets in int64 because N*S*M*D passes 2^31 at encoder scale):
    value               (N, S, M, D)            row (n, s, m) is D contiguous channels
    sampling_locations  (N, Lq, M, L, P, 2)     (x, y) normalized; x*W - 0.5 is the pixel coordinate
    attention_weights   (N, Lq, M, L, P)
    output              (N, Lq, M, D)           viewed by the caller as (N, Lq, M*D)
    level layout        four int64 scalars, two levels each: bits 32k..32k+13 W, 32k+16..32k+29 H, bit 62 set
                        so that Triton always types them int64; passed by value, never as a device table.
    softmax stats       (N, Lq, M, 2) in the compute dtype, LOGITS only: the max of each query's L*P logits and the
                        sum of their exponentials after subtracting it, written by the forward, read by the backward
    cells               per (n, m), level l owns (H_l+1)*(W_l+1) cells: the top-left corners -1..H-1, -1..W-1
"""

import triton
import triton.language as tl

# Sizes and the level layout change with every image: specializing on them (==1, divisible by 16) would
# recompile the kernels for new image sizes.
_DYNAMIC = ["Lq", "levels01", "levels23", "levels45", "levels67"]


# ----------------------------------------------------------------------------------------------------
# shared helpers: level layout, program prologue, sample loads, bilinear corners
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _level_shape(levels01, levels23, levels45, levels67, l: tl.constexpr):
    """(H, W) of level l, unpacked from the scalar arguments (see the module docstring)."""
    if l // 2 == 0:
        pair = levels01
    elif l // 2 == 1:
        pair = levels23
    elif l // 2 == 2:
        pair = levels45
    else:
        pair = levels67
    field = pair >> (32 * (l % 2))
    H = ((field >> 16) & 0x3FFF).to(tl.int32)
    W = (field & 0x3FFF).to(tl.int32)
    return H, W


@triton.jit
def _layout_totals(levels01, levels23, levels45, levels67, L: tl.constexpr):
    """(S, C): value rows and corner cells of one (n, m) pair, both int64."""
    S = tl.zeros((), dtype=tl.int64)
    C = tl.zeros((), dtype=tl.int64)
    for l in tl.static_range(L):
        H, W = _level_shape(levels01, levels23, levels45, levels67, l)
        S += H.to(tl.int64) * W
        C += (H + 1).to(tl.int64) * (W + 1)
    return S, C


@triton.jit
def _levels_of(level, levels01, levels23, levels45, levels67, L: tl.constexpr):
    """Per element of ``level`` (any shape, int32): H, W, first value row and first cell of that level.

    Levels are compile-time unrolled; a level index >= L (padding lanes) gets H = W = 0, so every corner of
    it is outside the map.
    """
    H = tl.zeros_like(level)
    W = tl.zeros_like(level)
    row0 = tl.zeros_like(level).to(tl.int64)
    cell0 = tl.zeros_like(level).to(tl.int64)
    rows = tl.zeros((), dtype=tl.int64)
    cells = tl.zeros((), dtype=tl.int64)
    for l in tl.static_range(L):
        H_l, W_l = _level_shape(levels01, levels23, levels45, levels67, l)
        here = level == l
        H = tl.where(here, H_l, H)
        W = tl.where(here, W_l, W)
        row0 = tl.where(here, rows, row0)
        cell0 = tl.where(here, cells, cell0)
        rows += H_l.to(tl.int64) * W_l
        cells += (H_l + 1).to(tl.int64) * (W_l + 1)
    return H, W, row0, cell0


@triton.jit
def _query_block(Lq, M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Program prologue of the query kernels: (n, m), which queries, and their row (n, q, m) in loc/weight/out."""
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    q_in = q < Lq
    query_row = (n.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,)
    return pid_nm, n, m, q_in, query_row


@triton.jit
def _load_samples(
    loc_ptr,
    weight_ptr,
    query_row,
    q_in,
    step,
    levels01,
    levels23,
    levels45,
    levels67,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Samples step*BLOCK_P .. +BLOCK_P of every query: flat index, mask, level, level geometry, x, y, weight.

    A query's L*P locations are one contiguous run, so with BLOCK_P = L*P each query reads whole lines.
    """
    lp = step * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,) sample index l*P + p
    H, W, row0, cell0 = _levels_of(lp // P, levels01, levels23, levels45, levels67, L)
    sample = query_row[:, None] * (L * P) + lp[None, :]  # (BLOCK_Q, BLOCK_P)
    s_in = q_in[:, None] & (lp < L * P)[None, :]  # (BLOCK_Q, BLOCK_P)
    loc_x = tl.load(loc_ptr + 2 * sample, mask=s_in, other=0.0)
    loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=s_in, other=0.0)
    attn = tl.load(weight_ptr + sample, mask=s_in, other=0.0)
    return sample, s_in, lp // P, H[None, :], W[None, :], row0[None, :], cell0[None, :], loc_x, loc_y, attn


@triton.jit
def _softmax_stats(weight_ptr, query_row, q_in, LP: tl.constexpr, BLOCK_LP: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """(BLOCK_Q,) max and sum of exp(logit - max) over each query's LP logits, one contiguous run; 0 and 1 for
    queries past Lq (no infinities, so that no masked lane makes a NaN)."""
    j = tl.arange(0, BLOCK_LP)  # (BLOCK_LP,)
    mask = q_in[:, None] & (j < LP)[None, :]
    logit = tl.load(weight_ptr + query_row[:, None] * LP + j[None, :], mask=mask, other=float("-inf"))
    logit = logit.to(COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_LP)
    sm_max = tl.where(q_in, tl.max(logit, axis=1), 0.0)
    sm_sum = tl.sum(tl.exp(logit - sm_max[:, None]), axis=1)
    return sm_max, tl.where(q_in, sm_sum, 1.0)


@triton.jit
def _store_softmax_stats(stats_ptr, query_row, q_in, sm_max, sm_sum):
    tl.store(stats_ptr + 2 * query_row, sm_max.to(stats_ptr.dtype.element_ty), mask=q_in)
    tl.store(stats_ptr + 2 * query_row + 1, sm_sum.to(stats_ptr.dtype.element_ty), mask=q_in)


@triton.jit
def _load_softmax_stats(stats_ptr, query_row, mask):
    """The forward's (max, sum) of each query row (any shape), 0 and 1 where masked."""
    sm_max = tl.load(stats_ptr + 2 * query_row, mask=mask, other=0.0)
    sm_sum = tl.load(stats_ptr + 2 * query_row + 1, mask=mask, other=1.0)
    return sm_max, sm_sum


@triton.jit
def _softmax_weight(logit, sm_max, sm_sum, mask):
    """The attention weight of a logit, as torch.softmax computes it: exp(logit - max) / sum; 0 where masked."""
    return tl.where(mask, tl.exp(logit - sm_max) / sm_sum, 0.0)


@triton.jit
def _pixel(loc, size, COMPUTE_DTYPE: tl.constexpr):
    """grid_sample(align_corners=False) at 2*loc-1: pixel centres sit at (i + 0.5) / size."""
    return loc.to(COMPUTE_DTYPE) * size - 0.5


@triton.jit
def _corner(x0, y0, lx, ly, H, W, DY: tl.constexpr, DX: tl.constexpr):
    """Corner (y0 + DY, x0 + DX): its in-level row (int64, 0 when outside), inside mask and weights wy, wx.

    Validity comes from the float corner: converting a far-outside coordinate to int could overflow, and a
    NaN compares false everywhere, so a NaN location reads no memory; its NaN bilinear weights still make the
    output NaN, as grid_sample's does on the CPU (its CUDA kernel gives a finite value). No address is formed
    outside the level.
    """
    cx = x0 + DX
    cy = y0 + DY
    inside = (cx >= 0) & (cx <= W - 1) & (cy >= 0) & (cy <= H - 1)
    row = tl.where(inside, cy, 0.0).to(tl.int64) * W.to(tl.int64) + tl.where(inside, cx, 0.0).to(tl.int64)
    wx = lx if DX == 1 else 1 - lx
    wy = ly if DY == 1 else 1 - ly
    return row, inside, wy, wx


@triton.jit
def _channel_offsets(rows, m, M: tl.constexpr, D: tl.constexpr, d):
    """(BLOCK_Q, BLOCK_P) flat value rows -> (BLOCK_Q, BLOCK_P, BLOCK_D) element offsets of head m."""
    return ((rows * M + m) * D)[:, :, None] + d[None, None, :]


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_DYNAMIC)
def msda_forward_kernel(
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
    BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    UNROLL: tl.constexpr,
    LOGITS: tl.constexpr,
    BLOCK_LP: tl.constexpr,
):
    _pid_nm, n, m, q_in, query_row = _query_block(Lq, M, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_in = (d < D)[None, None, :]
    S, _C = _layout_totals(levels01, levels23, levels45, levels67, L)
    batch_row0 = n.to(tl.int64) * S  # first value row of batch n
    if LOGITS:
        # ---- softmax stats of every query's L*P logits, before its samples
        sm_max, sm_sum = _softmax_stats(weight_ptr, query_row, q_in, L * P, BLOCK_LP, COMPUTE_DTYPE)
        _store_softmax_stats(stats_ptr, query_row, q_in, sm_max, sm_sum)

    acc = tl.zeros((BLOCK_Q, BLOCK_P, BLOCK_D), dtype=COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_P, BLOCK_D)
    for step in tl.range(0, (L * P + BLOCK_P - 1) // BLOCK_P, loop_unroll_factor=UNROLL):
        # ---- load: locations and weights of BLOCK_P samples per query
        _sample, s_in, _level, H, W, row0, _cell0, loc_x, loc_y, attn = _load_samples(
            loc_ptr, weight_ptr, query_row, q_in, step, levels01, levels23, levels45, levels67, L, P, BLOCK_P
        )
        x = _pixel(loc_x, W, COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_P)
        y = _pixel(loc_y, H, COMPUTE_DTYPE)
        x0 = tl.floor(x)
        y0 = tl.floor(y)
        attn = attn.to(COMPUTE_DTYPE)
        if LOGITS:
            attn = _softmax_weight(attn, sm_max[:, None], sm_sum[:, None], s_in)
        for corner in tl.static_range(4):
            row, inside, wy, wx = _corner(x0, y0, x - x0, y - y0, H, W, corner // 2, corner % 2)
            # ---- gather: a (BLOCK_Q, BLOCK_P, BLOCK_D) tile of scattered D-channel rows
            offs = _channel_offsets(batch_row0 + row0 + row, m, M, D, d)
            v = tl.load(value_ptr + offs, mask=(inside & s_in)[:, :, None] & d_in, other=0.0)
            # ---- compute: bilinear weight fused with the attention weight
            acc += (attn * wy * wx)[:, :, None] * v.to(COMPUTE_DTYPE)

    # ---- store: one coalesced (BLOCK_Q, BLOCK_D) tile, cast to the output dtype
    out = tl.sum(acc, axis=1)  # (BLOCK_Q, BLOCK_D)
    out_ptrs = out_ptr + query_row[:, None] * D + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_in[:, None] & (d < D)[None, :])


# ----------------------------------------------------------------------------------------------------
# backward over queries: location / weight gradients, and the scatter or the cell keys of grad_value
# ----------------------------------------------------------------------------------------------------
# Gradient of one sample, with corners v_yx (v00 = (y0, x0), v01 = (y0, x1), v10 = (y1, x0), v11 = (y1, x1)),
# fractions lx = x - x0, ly = y - y0, hx = 1 - lx, hy = 1 - ly, attention weight a and upstream gradient g:
#
#   val          = hy*hx*v00 + hy*lx*v01 + ly*hx*v10 + ly*lx*v11          (per channel)
#   out         += a * val
#   dL/da        = sum_d g * val
#   dL/dv_yx    += a * w_yx * g                 (w_yx = wy*wx, the corner's bilinear weight)
#   dval/dlx     = hy*(v01 - v00) + ly*(v11 - v10)   = sum_corners (+-1 by corner x) * wy * v
#   dval/dly     = hx*(v10 - v00) + lx*(v11 - v01)   = sum_corners (+-1 by corner y) * wx * v
#   dL/dloc_x    = a * W * sum_d g * dval/dlx   (x = loc_x*W - 0.5, so dx/dloc_x = W)
#   dL/dloc_y    = a * H * sum_d g * dval/dly
#
# Per corner only t = sum_d g * v is needed for the first three, so each corner costs one channel reduction.
# Corners outside the map hold zeros in val and take no gradient, exactly as grid_sample's zero padding.
@triton.jit(do_not_specialize=_DYNAMIC + ["gather_level"])
def msda_backward_kernel(
    grad_out_ptr,  # (N, Lq, M, D)
    value_ptr,  # (N, S, M, D)
    loc_ptr,  # (N, Lq, M, L, P, 2)
    weight_ptr,  # (N, Lq, M, L, P) weights, or their logits (LOGITS)
    grad_value_ptr,  # (N, S, M, D) zeroed fp32 (fp64 for fp64 value) buffer; SCATTER only
    grad_loc_ptr,  # (N, Lq, M, L, P, 2) in sampling_locations' dtype; SAMPLE_GRADS only
    grad_weight_ptr,  # (N, Lq, M, L, P) in attention_weights' dtype (of the logits: LOGITS); SAMPLE_GRADS only
    keys_ptr,  # (N, Lq, M, L, P) int: cell of the top-left corner, N*M*C if none; KEYS only
    counts_ptr,  # (N*M*C + 1,) zeroed int: samples per cell; KEYS only
    stats_ptr,  # (N, Lq, M, 2) the forward's softmax stats; LOGITS only
    out_ptr,  # (N, Lq, M, D) the forward's output; LOGITS with SAMPLE_GRADS only
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
    BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    SAMPLE_GRADS: tl.constexpr,
    SCATTER: tl.constexpr,
    KEYS: tl.constexpr,
    LOGITS: tl.constexpr,
):
    pid_nm, n, m, q_in, query_row = _query_block(Lq, M, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_in = (d < D)[None, None, :]
    S, C = _layout_totals(levels01, levels23, levels45, levels67, L)
    batch_row0 = n.to(tl.int64) * S

    # ---- load: the upstream gradient of these queries, reused by every sample
    row_mask = q_in[:, None] & (d < D)[None, :]
    g = tl.load(grad_out_ptr + query_row[:, None] * D + d[None, :], mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
    if LOGITS:
        sm_max, sm_sum = _load_softmax_stats(stats_ptr, query_row, q_in)  # (BLOCK_Q,) each
        if SAMPLE_GRADS:
            # ---- sum_j a_j dL/da_j of each query: <g, output> (module docstring)
            out = tl.load(out_ptr + query_row[:, None] * D + d[None, :], mask=row_mask, other=0.0)
            weighted_grad = tl.sum(g * out.to(COMPUTE_DTYPE), axis=1)  # (BLOCK_Q,)
    g = g[:, None, :]  # (BLOCK_Q, 1, BLOCK_D)

    for step in tl.static_range((L * P + BLOCK_P - 1) // BLOCK_P):
        sample, s_in, level, H, W, row0, cell0, loc_x, loc_y, attn = _load_samples(
            loc_ptr, weight_ptr, query_row, q_in, step, levels01, levels23, levels45, levels67, L, P, BLOCK_P
        )
        # Levels from gather_level on are left to the gather (KEYS), the finer ones to the scatter.
        scattered = s_in & (level < gather_level)[None, :]  # (BLOCK_Q, BLOCK_P)
        x = _pixel(loc_x, W, COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_P)
        y = _pixel(loc_y, H, COMPUTE_DTYPE)
        x0 = tl.floor(x)
        y0 = tl.floor(y)
        attn = attn.to(COMPUTE_DTYPE)
        if LOGITS:
            attn = _softmax_weight(attn, sm_max[:, None], sm_sum[:, None], s_in)
        grad_attn = tl.zeros_like(x)  # (BLOCK_Q, BLOCK_P)
        grad_lx = tl.zeros_like(x)
        grad_ly = tl.zeros_like(x)
        for corner in tl.static_range(4):
            row, inside, wy, wx = _corner(x0, y0, x - x0, y - y0, H, W, corner // 2, corner % 2)
            offs = _channel_offsets(batch_row0 + row0 + row, m, M, D, d)  # (BLOCK_Q, BLOCK_P, BLOCK_D)
            c_in = (inside & s_in)[:, :, None] & d_in
            if SAMPLE_GRADS:
                # ---- gather one corner, reduce over channels inside the program
                v = tl.load(value_ptr + offs, mask=c_in, other=0.0).to(COMPUTE_DTYPE)
                t = tl.sum(g * v, axis=2)  # (BLOCK_Q, BLOCK_P)
                grad_attn += wy * wx * t
                grad_lx += (wy if corner % 2 == 1 else -wy) * t
                grad_ly += (wx if corner // 2 == 1 else -wx) * t
            if SCATTER:
                # ---- scatter: relaxed fp32 atomics, only the sums must be right
                tl.atomic_add(
                    grad_value_ptr + offs,
                    (attn * wy * wx)[:, :, None] * g,
                    mask=(inside & scattered)[:, :, None] & d_in,
                    sem="relaxed",
                )
        if SAMPLE_GRADS:
            # ---- store: one weight (or logit) and one (x, y) gradient per sample
            if LOGITS:
                grad_attn = attn * (grad_attn - weighted_grad[:, None])
            tl.store(grad_weight_ptr + sample, grad_attn.to(grad_weight_ptr.dtype.element_ty), mask=s_in)
            grad_x = attn * W * grad_lx
            grad_y = attn * H * grad_ly
            tl.store(grad_loc_ptr + 2 * sample, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=s_in)
            tl.store(grad_loc_ptr + 2 * sample + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=s_in)
        if KEYS:
            # ---- file the sample under its top-left corner's cell; none if no corner is in the map or if
            #      its level is scattered
            touches = s_in & ~scattered & (x0 >= -1) & (x0 <= W - 1) & (y0 >= -1) & (y0 <= H - 1)
            cell_x = tl.where(touches, x0 + 1, 0.0).to(tl.int64)
            cell_y = tl.where(touches, y0 + 1, 0.0).to(tl.int64)
            cell = pid_nm * C + cell0 + cell_y * (W + 1) + cell_x  # (BLOCK_Q, BLOCK_P)
            key = tl.where(touches, cell, tl.num_programs(1) * C)
            tl.store(keys_ptr + sample, key.to(keys_ptr.dtype.element_ty), mask=s_in)
            tl.atomic_add(counts_ptr + key, 1, mask=touches, sem="relaxed")


# ----------------------------------------------------------------------------------------------------
# gather scheme of grad_value: bucket fill, then one fixed-order sum per value row
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_samples", "num_cells"])
def msda_fill_cells_kernel(
    keys_ptr,  # (num_samples,) int cell per sample, num_cells if none
    counts_ptr,  # (num_cells + 1,) inclusive prefix sums of the counts: the end of every cell
    perm_ptr,  # (num_samples,) out: sample ids grouped by cell
    num_samples,
    num_cells,
    BLOCK: tl.constexpr,
):
    """Counting-sort fill: each sample takes a slot just below its cell's end. Afterwards counts[k] is the
    first slot of cell k. The order inside a cell depends on the atomics' timing: not deterministic."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    key = tl.load(keys_ptr + i, mask=i < num_samples, other=num_cells)
    filed = key < num_cells
    slot = tl.atomic_add(counts_ptr + key, -1, mask=filed, sem="relaxed") - 1
    tl.store(perm_ptr + slot, i.to(perm_ptr.dtype.element_ty), mask=filed)


@triton.jit
def _cell_bounds(counts_ptr, cell_base, y, x, W, s_in, DY: tl.constexpr, DX: tl.constexpr, FILLED: tl.constexpr):
    """(first entry, number of entries) of the cell whose corner (DY, DX) is pixel (y, x): top-left (y-DY, x-DX)."""
    cell = cell_base + (y + 1 - DY).to(tl.int64) * (W + 1) + (x + 1 - DX)  # (BLOCK_S,)
    if FILLED:  # after the bucket fill, counts holds the start of every cell
        begin = tl.load(counts_ptr + cell, mask=s_in, other=0)
        end = tl.load(counts_ptr + cell + 1, mask=s_in, other=0)
    else:  # inclusive prefix sums: the end of every cell
        begin = tl.load(counts_ptr + cell - 1, mask=s_in & (cell > 0), other=0)
        end = tl.load(counts_ptr + cell, mask=s_in, other=0)
    return begin, end - begin


@triton.jit(do_not_specialize=_DYNAMIC + ["s_begin", "s_end"])
def msda_grad_value_gather_kernel(
    grad_out_ptr,  # (N, Lq, M, D)
    loc_ptr,  # (N, Lq, M, L, P, 2)
    weight_ptr,  # (N, Lq, M, L, P) weights, or their logits (LOGITS)
    counts_ptr,  # (N*M*C + 1,) cell bounds: ends of cells (FILLED=False) or starts (FILLED=True)
    perm_ptr,  # sample ids grouped by cell, ascending inside a cell when sorted
    grad_value_ptr,  # (N, S, M, D) out, in value's dtype: every row in [s_begin, s_end) written once
    stats_ptr,  # (N, Lq, M, 2) the forward's softmax stats; LOGITS only
    Lq,
    s_begin,
    s_end,
    levels01,
    levels23,
    levels45,
    levels67,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    FILLED: tl.constexpr,
    LOGITS: tl.constexpr,
):
    """Row (n, s, m) of grad_value = sum over the samples in the four cells whose 2x2 corners include pixel
    (y, x) of s: cell (y - dy, x - dx) reaches it as corner (dy, dx), with weight a * wy * wx. A program owns
    BLOCK_S rows of one (n, m) and walks their concatenated entries BLOCK_E at a time; each row's sum runs in
    a fixed order (cell by cell, entry by entry), so a sorted perm gives bitwise-reproducible results.
    """
    # Coarse levels sit at the end of S and have the longest cells: start them first.
    pid_s = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M
    s = s_begin + pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) value rows of this program
    s_in = s < s_end
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_in = (d < D)[None, None, :]
    S, C = _layout_totals(levels01, levels23, levels45, levels67, L)

    # ---- where each row sits: level, pixel (y, x), and the bounds of its four source cells
    level = tl.zeros_like(s)
    rows = tl.zeros((), dtype=tl.int64)
    for l in tl.static_range(1, L):
        H_l, W_l = _level_shape(levels01, levels23, levels45, levels67, l - 1)
        rows += H_l.to(tl.int64) * W_l
        level = tl.where(s >= rows, l, level)
    H, W, row0, cell0 = _levels_of(level, levels01, levels23, levels45, levels67, L)  # (BLOCK_S,)
    pixel = s - row0
    y = pixel // W
    x = pixel - y * W
    cell_base = pid_nm * C + cell0
    begin0, count0 = _cell_bounds(counts_ptr, cell_base, y, x, W, s_in, 0, 0, FILLED)
    begin1, count1 = _cell_bounds(counts_ptr, cell_base, y, x, W, s_in, 0, 1, FILLED)
    begin2, count2 = _cell_bounds(counts_ptr, cell_base, y, x, W, s_in, 1, 0, FILLED)
    begin3, count3 = _cell_bounds(counts_ptr, cell_base, y, x, W, s_in, 1, 1, FILLED)
    n01 = count0 + count1
    n012 = n01 + count2
    total = n012 + count3  # (BLOCK_S,)

    # ---- walk the entries: lane e of step j takes entry j + e of its row, in cell order
    e = tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    acc = tl.zeros((BLOCK_S, BLOCK_E, BLOCK_D), dtype=COMPUTE_DTYPE)
    for j in range(0, tl.max(total, axis=0), BLOCK_E):
        k = j + e[None, :]  # (BLOCK_S, BLOCK_E)
        ok = k < total[:, None]
        in0 = k < count0[:, None]
        in1 = k < n01[:, None]
        in2 = k < n012[:, None]
        slot = tl.where(
            in0,
            begin0[:, None] + k,
            tl.where(
                in1,
                begin1[:, None] + k - count0[:, None],
                tl.where(in2, begin2[:, None] + k - n01[:, None], begin3[:, None] + k - n012[:, None]),
            ),
        )
        dx = tl.where(in0 | (~in1 & in2), 0, 1)  # corners in cell order: (0,0) (0,1) (1,0) (1,1)
        dy = tl.where(in1, 0, 1)
        # ---- load: the sample, its location and weight, and its query's upstream gradient
        sample = tl.load(perm_ptr + slot, mask=ok, other=0).to(tl.int64)
        loc_x = tl.load(loc_ptr + 2 * sample, mask=ok, other=0.0)
        loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=ok, other=0.0)
        attn = tl.load(weight_ptr + sample, mask=ok, other=0.0).to(COMPUTE_DTYPE)
        query_row = sample // (L * P)
        if LOGITS:
            sm_max, sm_sum = _load_softmax_stats(stats_ptr, query_row, ok)
            attn = _softmax_weight(attn, sm_max, sm_sum, ok)
        gq = tl.load(
            grad_out_ptr + (query_row * D)[:, :, None] + d[None, None, :], mask=ok[:, :, None] & d_in, other=0.0
        )
        # ---- compute: the sample's top-left corner is (y - dy, x - dx); its weight on this row is wy * wx
        lx = _pixel(loc_x, W[:, None], COMPUTE_DTYPE) - (x[:, None] - dx)
        ly = _pixel(loc_y, H[:, None], COMPUTE_DTYPE) - (y[:, None] - dy)
        wx = tl.where(dx == 1, lx, 1 - lx)
        wy = tl.where(dy == 1, ly, 1 - ly)
        coef = tl.where(ok, attn * wy * wx, 0.0)  # (BLOCK_S, BLOCK_E)
        acc += coef[:, :, None] * gq.to(COMPUTE_DTYPE)

    # ---- store: each row once, in the output dtype
    out = tl.sum(acc, axis=1)  # (BLOCK_S, BLOCK_D)
    out_rows = (n.to(tl.int64) * S + s) * M + m  # (BLOCK_S,)
    tl.store(
        grad_value_ptr + (out_rows * D)[:, None] + d[None, :],
        out.to(grad_value_ptr.dtype.element_ty),
        mask=s_in[:, None] & (d < D)[None, :],
    )
