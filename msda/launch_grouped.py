"""Launchers for the channel-grouped kernels (msda/kernels_grouped.py): the forward, and the query-side backward
kernel that launch.py's grad_value schemes call (fused scatter, the gather's cell keys, hybrid).

A grouped configuration is (BLOCK_Q, CH, num_warps): BLOCK_Q queries per program, the head's BLOCK_D channels in
CH groups of BLOCK_D / CH per thread (launch_table.grouped_config explains the defaults). Inputs arrive validated
and contiguous; nothing here reads the device.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

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
def plan(kernel: str, N: int, Lq: int, M: int, D: int, L: int, P: int, dtype: torch.dtype, levels: tuple,
         config: tuple | None, gather_level: int = 0):
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
    kwargs = dict(M=M, D=D, L=L, P=P, BLOCK_Q=block_q, BLOCK_P=pow2(P), CH=ch, BLOCK_C=block_d // ch,
                  COMPUTE_DTYPE=tl.float64 if dtype == torch.float64 else tl.float32, num_warps=warps)
    grid = (cdiv(Lq, block_q), N * M)
    if kernel == "forward":
        return grid, (Lq, *pack_levels(levels)), kwargs
    kwargs.update(zip(("SCATTER", "KEYS"), _FLAGS[kernel]))
    return grid, (Lq, gather_level, *pack_levels(levels)), kwargs


def forward(value, levels: tuple, sampling_locations, attention_weights, output, config: tuple | None = None):
    """Fills output (N, Lq, M, D), in value's dtype, for N, Lq > 0."""
    N, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grid, args, kwargs = plan("forward", N, Lq, M, D, L, P, value.dtype, levels, config)
    msda_forward_grouped_kernel[grid](value, sampling_locations, attention_weights, output, *args, **kwargs)


def query_kernel(kernel: str, grad_output, value, levels: tuple, sampling_locations, attention_weights, grad_value,
                 grad_loc, grad_weight, keys, counts, config: tuple | None = None, gather_level: int = 0):
    """One backward pass over the queries: grad_loc and grad_weight always; for "fused" and "hybrid" the scatter
    into grad_value of the levels below gather_level; for "keys" and "hybrid" the cell keys and counts of the
    levels from gather_level on. Buffers a kernel does not use may be any tensor."""
    N, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grid, args, kwargs = plan(kernel, N, Lq, M, D, L, P, value.dtype, levels, config, gather_level)
    msda_backward_grouped_kernel[grid](grad_output, value, sampling_locations, attention_weights, grad_value,
                                       grad_loc, grad_weight, keys, counts, *args, **kwargs)

