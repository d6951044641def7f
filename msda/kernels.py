"""Triton forward and backward kernels for multi-scale deformable attention. Kernels only: no launch logic.

Both kernels use the same decomposition: a 2D grid (cdiv(Lq, BLOCK_Q), N*M); one program owns BLOCK_Q
consecutive queries of one (batch n, head m) pair and all their L*P samples, unrolled at compile time.
Nothing is shared between programs except the atomic grad_value scatter in the backward.

Layouts (all contiguous, element offsets in int64 because N*S*M*D passes 2^31 at encoder scale):
    value               (N, S, M, D)            row (n, s, m) is D contiguous channels
    sampling_locations  (N, Lq, M, L, P, 2)     (x, y) normalized; x*W - 0.5 is the pixel coordinate
    attention_weights   (N, Lq, M, L, P)
    output              (N, Lq, M, D)           viewed by the caller as (N, Lq, M*D)
"""

import triton
import triton.language as tl


@triton.jit
def _bilinear_corners(loc_x, loc_y, H, W, COMPUTE_DTYPE: tl.constexpr):
    """Corner rows and weights of grid_sample(align_corners=False, padding_mode="zeros") at 2*loc-1.

    loc_x, loc_y: (BLOCK_Q,) normalized coordinates. Returns the pixel-space fractions (lx, ly), the
    in-map masks of the four corners and their flat in-level row offsets y*W + x (int64, 0 where the
    corner is outside, so no address is ever formed outside the level).
    """
    # align_corners=False: pixel centres sit at (i + 0.5) / W in normalized space.
    x = loc_x.to(COMPUTE_DTYPE) * W - 0.5  # (BLOCK_Q,)
    y = loc_y.to(COMPUTE_DTYPE) * H - 0.5
    x0 = tl.floor(x)
    y0 = tl.floor(y)
    lx = x - x0
    ly = y - y0
    # Validity from the float corners: converting a far-outside coordinate to int could overflow.
    # NaN compares false everywhere, so a NaN location samples zeros.
    x0_in = (x0 >= 0) & (x0 <= W - 1)
    x1_in = (x0 >= -1) & (x0 <= W - 2)
    y0_in = (y0 >= 0) & (y0 <= H - 1)
    y1_in = (y0 >= -1) & (y0 <= H - 2)
    x0_i = tl.where(x0_in, x0, 0.0).to(tl.int64)
    x1_i = tl.where(x1_in, x0 + 1, 0.0).to(tl.int64)
    y0_i = tl.where(y0_in, y0, 0.0).to(tl.int64)
    y1_i = tl.where(y1_in, y0 + 1, 0.0).to(tl.int64)
    W64 = W.to(tl.int64)
    row00 = y0_i * W64 + x0_i
    row01 = y0_i * W64 + x1_i
    row10 = y1_i * W64 + x0_i
    row11 = y1_i * W64 + x1_i
    in00 = y0_in & x0_in
    in01 = y0_in & x1_in
    in10 = y1_in & x0_in
    in11 = y1_in & x1_in
    return lx, ly, row00, row01, row10, row11, in00, in01, in10, in11


@triton.jit
def msda_forward_kernel(
    value_ptr,        # (N, S, M, D)
    levels_ptr,       # (L, 3) int64: H_l, W_l, first flat row of level l
    loc_ptr,          # (N, Lq, M, L, P, 2)
    weight_ptr,       # (N, Lq, M, L, P)
    out_ptr,          # (N, Lq, M, D)
    S,
    Lq,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M

    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    q_in = q < Lq
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_in = d < D
    query_row = (n.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,) row of (n, q, m) in loc/weight/out
    value_row0 = n.to(tl.int64) * S  # first value row of batch n

    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_D)
    for l in tl.static_range(L):
        H = tl.load(levels_ptr + 3 * l).to(tl.int32)
        W = tl.load(levels_ptr + 3 * l + 1).to(tl.int32)
        level_row0 = value_row0 + tl.load(levels_ptr + 3 * l + 2)
        for p in tl.static_range(P):
            # ---- load: one location and weight per query, through separate x / y / w pointers
            sample = query_row * (L * P) + (l * P + p)  # (BLOCK_Q,)
            loc_x = tl.load(loc_ptr + 2 * sample, mask=q_in, other=0.0)
            loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=q_in, other=0.0)
            attn = tl.load(weight_ptr + sample, mask=q_in, other=0.0).to(COMPUTE_DTYPE)
            lx, ly, r00, r01, r10, r11, in00, in01, in10, in11 = _bilinear_corners(
                loc_x, loc_y, H, W, COMPUTE_DTYPE)
            hx = 1 - lx
            hy = 1 - ly
            # ---- gather: each corner is a (BLOCK_Q, BLOCK_D) tile of scattered D-channel rows
            base = value_ptr + ((level_row0 + r00) * M + m) * D
            v00 = tl.load(base[:, None] + d[None, :], mask=(in00 & q_in)[:, None] & d_in[None, :], other=0.0)
            base = value_ptr + ((level_row0 + r01) * M + m) * D
            v01 = tl.load(base[:, None] + d[None, :], mask=(in01 & q_in)[:, None] & d_in[None, :], other=0.0)
            base = value_ptr + ((level_row0 + r10) * M + m) * D
            v10 = tl.load(base[:, None] + d[None, :], mask=(in10 & q_in)[:, None] & d_in[None, :], other=0.0)
            base = value_ptr + ((level_row0 + r11) * M + m) * D
            v11 = tl.load(base[:, None] + d[None, :], mask=(in11 & q_in)[:, None] & d_in[None, :], other=0.0)
            # ---- compute: bilinear weights fused with the attention weight
            acc += (attn * hy * hx)[:, None] * v00.to(COMPUTE_DTYPE)
            acc += (attn * hy * lx)[:, None] * v01.to(COMPUTE_DTYPE)
            acc += (attn * ly * hx)[:, None] * v10.to(COMPUTE_DTYPE)
            acc += (attn * ly * lx)[:, None] * v11.to(COMPUTE_DTYPE)

    # ---- store: one coalesced tile, cast to the output dtype
    out_ptrs = out_ptr + query_row[:, None] * D + d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=q_in[:, None] & d_in[None, :])


# Gradient of one sample, with corners v_yx (v00 = (y0, x0), v01 = (y0, x1), v10 = (y1, x0), v11 = (y1, x1)),
# fractions lx = x - x0, ly = y - y0, hx = 1 - lx, hy = 1 - ly, attention weight a and upstream gradient g:
#
#   val          = hy*hx*v00 + hy*lx*v01 + ly*hx*v10 + ly*lx*v11          (per channel)
#   out         += a * val
#   dL/da        = sum_d g * val
#   dL/dv_yx    += a * w_yx * g                 (w_yx the corner's bilinear weight; atomic scatter)
#   dval/dlx     = hy*(v01 - v00) + ly*(v11 - v10)
#   dval/dly     = hx*(v10 - v00) + lx*(v11 - v01)
#   dL/dloc_x    = a * W * sum_d g * dval/dlx   (x = loc_x*W - 0.5, so dx/dloc_x = W)
#   dL/dloc_y    = a * H * sum_d g * dval/dly
#
# Corners outside the map hold zeros in val and take no gradient, exactly as grid_sample's zero padding.
@triton.jit
def msda_backward_kernel(
    grad_out_ptr,     # (N, Lq, M, D)
    value_ptr,        # (N, S, M, D)
    levels_ptr,       # (L, 3) int64: H_l, W_l, first flat row of level l
    loc_ptr,          # (N, Lq, M, L, P, 2)
    weight_ptr,       # (N, Lq, M, L, P)
    grad_value_ptr,   # (N, S, M, D) accumulation buffer (float32, or float64 for float64 value), zeroed
    grad_loc_ptr,     # (N, Lq, M, L, P, 2) in sampling_locations' dtype
    grad_weight_ptr,  # (N, Lq, M, L, P) in attention_weights' dtype
    S,
    Lq,
    M: tl.constexpr,
    D: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_nm = tl.program_id(1)
    n = pid_nm // M
    m = pid_nm % M

    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    q_in = q < Lq
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_in = d < D
    tile_in = q_in[:, None] & d_in[None, :]  # (BLOCK_Q, BLOCK_D)
    query_row = (n.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,)
    value_row0 = n.to(tl.int64) * S

    # ---- load: the upstream gradient of these queries, reused by every sample
    g = tl.load(grad_out_ptr + query_row[:, None] * D + d[None, :], mask=tile_in, other=0.0)
    g = g.to(COMPUTE_DTYPE)  # (BLOCK_Q, BLOCK_D)

    for l in tl.static_range(L):
        H = tl.load(levels_ptr + 3 * l).to(tl.int32)
        W = tl.load(levels_ptr + 3 * l + 1).to(tl.int32)
        level_row0 = value_row0 + tl.load(levels_ptr + 3 * l + 2)
        for p in tl.static_range(P):
            sample = query_row * (L * P) + (l * P + p)  # (BLOCK_Q,)
            loc_x = tl.load(loc_ptr + 2 * sample, mask=q_in, other=0.0)
            loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=q_in, other=0.0)
            attn = tl.load(weight_ptr + sample, mask=q_in, other=0.0).to(COMPUTE_DTYPE)
            lx, ly, r00, r01, r10, r11, in00, in01, in10, in11 = _bilinear_corners(
                loc_x, loc_y, H, W, COMPUTE_DTYPE)
            hx = 1 - lx
            hy = 1 - ly
            m00 = (in00 & q_in)[:, None] & d_in[None, :]
            m01 = (in01 & q_in)[:, None] & d_in[None, :]
            m10 = (in10 & q_in)[:, None] & d_in[None, :]
            m11 = (in11 & q_in)[:, None] & d_in[None, :]
            off00 = (((level_row0 + r00) * M + m) * D)[:, None] + d[None, :]  # (BLOCK_Q, BLOCK_D)
            off01 = (((level_row0 + r01) * M + m) * D)[:, None] + d[None, :]
            off10 = (((level_row0 + r10) * M + m) * D)[:, None] + d[None, :]
            off11 = (((level_row0 + r11) * M + m) * D)[:, None] + d[None, :]
            # ---- gather the four corners
            v00 = tl.load(value_ptr + off00, mask=m00, other=0.0).to(COMPUTE_DTYPE)
            v01 = tl.load(value_ptr + off01, mask=m01, other=0.0).to(COMPUTE_DTYPE)
            v10 = tl.load(value_ptr + off10, mask=m10, other=0.0).to(COMPUTE_DTYPE)
            v11 = tl.load(value_ptr + off11, mask=m11, other=0.0).to(COMPUTE_DTYPE)
            # ---- compute: channel reductions stay inside the program
            val = (hy * hx)[:, None] * v00 + (hy * lx)[:, None] * v01 \
                + (ly * hx)[:, None] * v10 + (ly * lx)[:, None] * v11
            grad_attn = tl.sum(g * val, axis=1)  # (BLOCK_Q,)
            dval_dlx = hy[:, None] * (v01 - v00) + ly[:, None] * (v11 - v10)
            dval_dly = hx[:, None] * (v10 - v00) + lx[:, None] * (v11 - v01)
            grad_x = attn * W * tl.sum(g * dval_dlx, axis=1)  # (BLOCK_Q,)
            grad_y = attn * H * tl.sum(g * dval_dly, axis=1)
            # ---- store: location and weight gradients, one element per query each
            tl.store(grad_weight_ptr + sample, grad_attn.to(grad_weight_ptr.dtype.element_ty), mask=q_in)
            tl.store(grad_loc_ptr + 2 * sample, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=q_in)
            tl.store(grad_loc_ptr + 2 * sample + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=q_in)
            # ---- scatter: grad_value of the four corners; relaxed atomics, only the sums must be right
            ga = g * attn[:, None]
            tl.atomic_add(grad_value_ptr + off00, ga * (hy * hx)[:, None], mask=m00, sem="relaxed")
            tl.atomic_add(grad_value_ptr + off01, ga * (hy * lx)[:, None], mask=m01, sem="relaxed")
            tl.atomic_add(grad_value_ptr + off10, ga * (ly * hx)[:, None], mask=m10, sem="relaxed")
            tl.atomic_add(grad_value_ptr + off11, ga * (ly * lx)[:, None], mask=m11, sem="relaxed")
