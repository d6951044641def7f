"""Launchers for the Triton kernels: allocate outputs, pick block sizes, build the grid, launch.

Inputs arrive validated and contiguous (see ops.py). Imported lazily so that ``import msda`` works without
triton being importable, and the reference path never touches it.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from .kernels import msda_backward_kernel, msda_forward_kernel
from .layout import level_starts

_COMPUTE_DTYPES = {torch.float64: tl.float64}  # everything else computes in float32


def launch_config(D: int, element_size: int, backward: bool) -> tuple[int, int]:
    """(BLOCK_Q, num_warps) from a sweep on an H200 (bench/results/msda_h200.md, "Block-size sweep").

    On the encoder workload (D=32) 16 queries per program was fastest for both kernels (fp32 fwd 0.247 ms
    vs 0.460 ms at 64 queries; bwd 1.064 vs 1.806 ms): small programs keep more of them resident to hide
    the latency of the scattered gathers, and the 4 corner tiles (5 in the backward) stay in registers.
    A 2-byte value's forward was faster with 2 warps (bf16 0.195 vs 0.264 ms); its backward, bound by the
    same fp32 atomics as fp32's, kept 4. D is not in the table yet: only D=32 was measured.
    Triton's CPU interpreter runs programs one after another at a fixed cost each, so there 64-query
    programs make the tests several times faster; block size changes no result, only the masking pattern.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 64, 4
    if element_size == 2 and not backward:
        return 16, 2
    return 16, 4


@functools.lru_cache(maxsize=256)
def level_table(levels: tuple, device: torch.device) -> torch.Tensor:
    """(L, 3) int64 rows (H, W, first flat row) on ``device``, made once per level layout.

    Cached so that a training loop, which sees a handful of layouts, pays the host->device copy once
    per layout instead of once per attention call.
    """
    rows = [(h, w, start) for (h, w), start in zip(levels, level_starts(levels))]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _grid(N: int, M: int, Lq: int, block_q: int):
    return (triton.cdiv(Lq, block_q), N * M)


def forward(value, levels, sampling_locations, attention_weights,
            block_q: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """levels: [(H, W), ...]. Returns (N, Lq, M*D) in value's dtype. block_q / num_warps override the tuned table (benchmarks)."""
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    default_q, default_warps = launch_config(D, value.element_size(), backward=False)
    block_q = block_q or default_q
    output = torch.empty((N, Lq, M, D), dtype=value.dtype, device=value.device)  # (N, Lq, M, D)
    with torch.cuda.device(value.device) if value.is_cuda else contextlib.nullcontext():
        msda_forward_kernel[_grid(N, M, Lq, block_q)](
            value, level_table(tuple(levels), value.device), sampling_locations, attention_weights, output,
            S, Lq, M=M, D=D, L=L, P=P, BLOCK_Q=block_q, BLOCK_D=triton.next_power_of_2(D),
            COMPUTE_DTYPE=_COMPUTE_DTYPES.get(value.dtype, tl.float32),
            num_warps=num_warps or default_warps)
    return output.view(N, Lq, M * D)


def backward(grad_output, value, levels, sampling_locations, attention_weights, *, deterministic: bool = False,
             block_q: int | None = None, num_warps: int | None = None):
    """Returns (grad_value, grad_sampling_locations, grad_attention_weights), each in its input's dtype.

    grad_value is accumulated with atomics in a float32 buffer (float64 for float64 value) and cast once,
    so it is run-to-run nondeterministic in the last bits.
    """
    if deterministic:
        raise NotImplementedError("deterministic=True: the deterministic backward is not implemented yet")
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    default_q, default_warps = launch_config(D, value.element_size(), backward=True)
    block_q = block_q or default_q
    accum_dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    grad_value = torch.zeros((N, S, M, D), dtype=accum_dtype, device=value.device)  # (N, S, M, D)
    grad_loc = torch.empty_like(sampling_locations)  # (N, Lq, M, L, P, 2)
    grad_weight = torch.empty_like(attention_weights)  # (N, Lq, M, L, P)
    with torch.cuda.device(value.device) if value.is_cuda else contextlib.nullcontext():
        msda_backward_kernel[_grid(N, M, Lq, block_q)](
            grad_output, value, level_table(tuple(levels), value.device), sampling_locations,
            attention_weights, grad_value, grad_loc, grad_weight,
            S, Lq, M=M, D=D, L=L, P=P, BLOCK_Q=block_q, BLOCK_D=triton.next_power_of_2(D),
            COMPUTE_DTYPE=_COMPUTE_DTYPES.get(value.dtype, tl.float32),
            num_warps=num_warps or default_warps)
    return grad_value.to(value.dtype), grad_loc, grad_weight
