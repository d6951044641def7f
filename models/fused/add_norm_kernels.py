"""Triton kernels of LayerNorm(x + y) over the last dimension (C): the forward, and the backward with the gradients of
x and y (one and the same, dz) and the per-program partial sums of the weight's and the bias's gradients.

Rows are (rows, C) contiguous, C padded to BLOCK_C (a power of 2) lanes; a program takes BLOCK_R rows at a time.
The sum z = x + y is rounded to SUM_DTYPE, the dtype torch's ``x + y`` gives, before it is normalized in
COMPUTE_DTYPE (float32, float64 for float64 inputs), so the kernel normalizes exactly what the unfused ops do. The
backward recomputes z, its mean and its inverse deviation from x and y rather than reading saved ones: a row is read
whole anyway, and nothing but x and y has to be kept between the passes.

    xhat = (z - mean) * rstd        out = xhat * weight + bias
    dz   = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dout * weight
    dweight = sum over rows of dout * xhat,  dbias = sum over rows of dout
"""

import triton
import triton.language as tl


@triton.jit
def _normalized_rows(
    x_ptr, y_ptr, offsets, mask, C: tl.constexpr, eps, SUM_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr
):
    """(xhat, rstd) of the rows at ``offsets`` (BLOCK_R, BLOCK_C): xhat is 0 in masked lanes."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    z = (x + y).to(SUM_DTYPE).to(COMPUTE_DTYPE)
    mean = tl.sum(z, axis=1) / C  # (BLOCK_R,)
    centred = tl.where(mask, z - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / C + eps)  # (BLOCK_R,)
    return centred * rstd[:, None], rstd


# Row counts change with every image size: specializing on them would compile again for new sizes.
@triton.jit(do_not_specialize=["rows"])
def add_layer_norm_forward_kernel(
    x_ptr,  # (rows, C)
    y_ptr,  # (rows, C)
    weight_ptr,  # (C,)
    bias_ptr,  # (C,)
    out_ptr,  # (rows, C) out
    rows,
    eps,
    C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    c = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    mask = (r < rows)[:, None] & (c < C)[None, :]
    offsets = r[:, None] * C + c[None, :]  # (BLOCK_R, BLOCK_C)
    xhat, _rstd = _normalized_rows(x_ptr, y_ptr, offsets, mask, C, eps, SUM_DTYPE, COMPUTE_DTYPE)
    weight = tl.load(weight_ptr + c, mask=c < C, other=0.0).to(COMPUTE_DTYPE)
    bias = tl.load(bias_ptr + c, mask=c < C, other=0.0).to(COMPUTE_DTYPE)
    out = xhat * weight[None, :] + bias[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def add_layer_norm_backward_kernel(
    grad_out_ptr,  # (rows, C)
    x_ptr,  # (rows, C)
    y_ptr,  # (rows, C)
    weight_ptr,  # (C,)
    grad_x_ptr,  # (rows, C) out, in x's dtype
    grad_y_ptr,  # (rows, C) out, in y's dtype; written only if GRAD_Y (else grad_x serves both)
    partial_weight_ptr,  # (programs, C) out: this program's sum of dout * xhat
    partial_bias_ptr,  # (programs, C) out: this program's sum of dout
    rows,
    eps,
    C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    GRAD_Y: tl.constexpr,
):
    """Program p takes row blocks p, p + programs, ...: its partial sums cover them, in a fixed order."""
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    c_in = c < C
    weight = tl.load(weight_ptr + c, mask=c_in, other=0.0).to(COMPUTE_DTYPE)
    acc_weight = tl.zeros((BLOCK_R, BLOCK_C), dtype=COMPUTE_DTYPE)
    acc_bias = tl.zeros((BLOCK_R, BLOCK_C), dtype=COMPUTE_DTYPE)
    for start in range(pid * BLOCK_R, rows, tl.num_programs(0) * BLOCK_R):
        r = start + tl.arange(0, BLOCK_R).to(tl.int64)  # (BLOCK_R,)
        mask = (r < rows)[:, None] & c_in[None, :]
        offsets = r[:, None] * C + c[None, :]  # (BLOCK_R, BLOCK_C)
        xhat, rstd = _normalized_rows(x_ptr, y_ptr, offsets, mask, C, eps, SUM_DTYPE, COMPUTE_DTYPE)
        grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        grad_xhat = grad_out * weight[None, :]
        mean_grad = tl.sum(grad_xhat, axis=1) / C  # (BLOCK_R,)
        mean_grad_xhat = tl.sum(grad_xhat * xhat, axis=1) / C
        grad_z = (grad_xhat - mean_grad[:, None] - xhat * mean_grad_xhat[:, None]) * rstd[:, None]
        tl.store(grad_x_ptr + offsets, grad_z.to(grad_x_ptr.dtype.element_ty), mask=mask)
        if GRAD_Y:
            tl.store(grad_y_ptr + offsets, grad_z.to(grad_y_ptr.dtype.element_ty), mask=mask)
        acc_weight += grad_out * xhat
        acc_bias += grad_out
    tl.store(partial_weight_ptr + pid * C + c, tl.sum(acc_weight, axis=0), mask=c_in)
    tl.store(partial_bias_ptr + pid * C + c, tl.sum(acc_bias, axis=0), mask=c_in)
