"""The launch table and what every launcher shares: block-shape lookup, the level layout's packing, helpers.

The lowest of the launch modules (launch.py and launch_grouped.py import it, it imports neither), so that
both kernel families read one table. ``TUNED`` holds the entries measured on a GPU; anything missing falls
back to a default chosen here.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_LEVELS, MAX_SIDE = 8, 2**14
LARGE = 2**16  # N*Lq*M from which a call counts as encoder-sized in the tables below
FAMILIES = ("classic", "grouped")
# Keys that choose what runs rather than a block shape: the table decides them under the interpreter too.
_CHOICES = (
    "scheme",
    "deterministic_scheme",
    "hybrid_split",
    "forward_kernels",
    "backward_kernels",
    "deterministic_kernels",
)

# ----------------------------------------------------------------------------------------------------
# launch table, measured on an H200 by `python bench/msda.py --out DIR`: it prints this block with the
# fastest measured entries (msda_sweep.md); paste it over the one below. Keys:
#   query kernels  (kernel, D, value bytes, L, P, large) -> (BLOCK_Q, BLOCK_P, num_warps)
#                  kernel: fused | sample_grads | scatter | keys | hybrid
#   forward        ("forward", D, value bytes, L, P, large) -> (BLOCK_Q, BLOCK_P, num_warps, UNROLL)
#   gather kernel  ("gather", D, value bytes, large)     -> (lanes = BLOCK_S * BLOCK_E, num_warps)
#   hybrid split   ("hybrid_split", D, value bytes, large) -> entries per value row from which a level is gathered
#   scheme         ("scheme", D, value bytes, L, P, large) -> fused | split | gather | hybrid | cells
#                  (non-deterministic)
#   kernel family  ("forward_kernels" | "backward_kernels" | "deterministic_kernels", D, value bytes, L, P, large)
#                  -> classic (msda/kernels.py) | grouped (msda/kernels_grouped.py), for each pass
#   grouped        ("grouped_" + forward | fused | keys | hybrid, D, value bytes, L, P, large)
#                  -> (BLOCK_Q, CH, num_warps)
#   cells          ("cells", D, value bytes, large) -> (lanes = BLOCK_K * BLOCK_E, CH, num_warps) of the cell pass
#   deterministic  ("deterministic_scheme", D, value bytes, L, P, large) -> gather | cells
# Anything not in the table falls back to _default_config: the forward takes 16 queries and 4 warps (2 for a 2-byte
# value) and one sample per step, unrolled 4 times; the backward fuses the atomic scatter into one kernel of 4
# queries and at least L*P/4 samples per step (the H200 sweeps' picks for D=32).
# The kernel families default to classic, the deterministic scheme to gather; grouped launches default to
# grouped_config's shapes.
# ----------------------------------------------------------------------------------------------------
# Measured on NVIDIA H200, 2026-12-02 and NVIDIA H100 80GB HBM3, 2026-12-06, torch 2.11.0+cu130, triton 3.6.0:
# python bench/msda.py --jobs 14 (H200); the grouped and cells picks from a variants sweep since retired (H100, in
# git history: bench/msda_variants.py)
TUNED: dict = {
    ("backward_kernels", 32, 4, 4, 4, False): "grouped",
    ("cells", 32, 2, True): (64, 4, 4),
    ("cells", 32, 4, True): (128, 8, 4),
    ("deterministic_kernels", 32, 2, 4, 4, False): "grouped",
    ("deterministic_kernels", 32, 2, 4, 4, True): "grouped",
    ("deterministic_kernels", 32, 4, 4, 4, False): "grouped",
    ("deterministic_kernels", 32, 4, 4, 4, True): "grouped",
    ("deterministic_scheme", 32, 2, 4, 4, False): "gather",
    ("deterministic_scheme", 32, 2, 4, 4, True): "cells",
    ("deterministic_scheme", 32, 4, 4, 4, False): "gather",
    ("deterministic_scheme", 32, 4, 4, 4, True): "cells",
    ("forward", 128, 2, 4, 4, False): (1, 4, 4, 1),
    ("forward", 128, 2, 4, 4, True): (4, 1, 4, 4),
    ("forward", 128, 4, 4, 4, False): (1, 4, 4, 1),
    ("forward", 128, 4, 4, 4, True): (4, 1, 4, 4),
    ("forward", 32, 2, 4, 4, False): (16, 1, 4, 4),
    ("forward", 32, 2, 4, 4, True): (16, 1, 2, 4),
    ("forward", 32, 4, 4, 4, False): (8, 2, 4, 2),
    ("forward", 32, 4, 4, 4, True): (16, 1, 2, 4),
    ("forward", 64, 2, 4, 4, False): (2, 4, 4, 4),
    ("forward", 64, 2, 4, 4, True): (8, 1, 4, 4),
    ("forward", 64, 4, 4, 4, False): (2, 4, 4, 4),
    ("forward", 64, 4, 4, 4, True): (8, 1, 4, 4),
    ("fused", 128, 2, 4, 4, False): (1, 4, 4),
    ("fused", 128, 2, 4, 4, True): (1, 4, 4),
    ("fused", 128, 4, 4, 4, False): (1, 4, 4),
    ("fused", 128, 4, 4, 4, True): (1, 4, 4),
    ("fused", 32, 2, 4, 4, False): (2, 16, 4),
    ("fused", 32, 2, 4, 4, True): (4, 4, 4),
    ("fused", 32, 4, 4, 4, False): (4, 4, 4),
    ("fused", 32, 4, 4, 4, True): (2, 16, 4),
    ("fused", 64, 2, 4, 4, False): (2, 4, 4),
    ("fused", 64, 2, 4, 4, True): (2, 4, 4),
    ("fused", 64, 4, 4, 4, False): (2, 4, 4),
    ("fused", 64, 4, 4, 4, True): (2, 4, 4),
    ("gather", 128, 2, False): (8, 4),
    ("gather", 128, 2, True): (8, 4),
    ("gather", 128, 4, False): (8, 4),
    ("gather", 128, 4, True): (8, 4),
    ("gather", 32, 2, False): (32, 4),
    ("gather", 32, 2, True): (32, 4),
    ("gather", 32, 4, False): (32, 4),
    ("gather", 32, 4, True): (32, 4),
    ("gather", 64, 2, False): (16, 4),
    ("gather", 64, 2, True): (16, 4),
    ("gather", 64, 4, False): (16, 4),
    ("gather", 64, 4, True): (16, 4),
    ("grouped_forward", 32, 2, 4, 4, False): (16, 2, 4),
    ("grouped_forward", 32, 2, 4, 4, True): (16, 4, 2),
    ("grouped_forward", 32, 4, 4, 4, False): (32, 8, 4),
    ("grouped_forward", 32, 4, 4, 4, True): (16, 8, 2),
    ("grouped_fused", 32, 2, 4, 4, False): (8, 4, 2),
    ("grouped_fused", 32, 2, 4, 4, True): (8, 4, 2),
    ("grouped_fused", 32, 4, 4, 4, False): (8, 4, 2),
    ("grouped_fused", 32, 4, 4, 4, True): (16, 4, 4),
    ("grouped_keys", 32, 2, 4, 4, False): (8, 4, 2),
    ("grouped_keys", 32, 2, 4, 4, True): (8, 4, 2),
    ("grouped_keys", 32, 4, 4, 4, False): (8, 4, 2),
    ("hybrid", 128, 2, 4, 4, False): (1, 4, 4),
    ("hybrid", 128, 2, 4, 4, True): (1, 4, 4),
    ("hybrid", 128, 4, 4, 4, False): (1, 4, 4),
    ("hybrid", 128, 4, 4, 4, True): (1, 4, 4),
    ("hybrid", 32, 2, 4, 4, False): (4, 4, 4),
    ("hybrid", 32, 2, 4, 4, True): (4, 4, 4),
    ("hybrid", 32, 4, 4, 4, False): (4, 4, 4),
    ("hybrid", 32, 4, 4, 4, True): (4, 4, 4),
    ("hybrid", 64, 2, 4, 4, False): (2, 4, 4),
    ("hybrid", 64, 2, 4, 4, True): (2, 4, 4),
    ("hybrid", 64, 4, 4, 4, False): (2, 4, 4),
    ("hybrid", 64, 4, 4, 4, True): (2, 4, 4),
    ("hybrid_split", 128, 2, False): 256,
    ("hybrid_split", 128, 2, True): 256,
    ("hybrid_split", 128, 4, False): 256,
    ("hybrid_split", 128, 4, True): 256,
    ("hybrid_split", 32, 2, False): 256,
    ("hybrid_split", 32, 2, True): 256,
    ("hybrid_split", 32, 4, False): 256,
    ("hybrid_split", 32, 4, True): 256,
    ("hybrid_split", 64, 2, False): 256,
    ("hybrid_split", 64, 2, True): 256,
    ("hybrid_split", 64, 4, False): 256,
    ("hybrid_split", 64, 4, True): 256,
    ("keys", 128, 2, 4, 4, False): (1, 4, 4),
    ("keys", 128, 2, 4, 4, True): (1, 4, 4),
    ("keys", 128, 4, 4, 4, False): (1, 4, 4),
    ("keys", 128, 4, 4, 4, True): (1, 4, 4),
    ("keys", 32, 2, 4, 4, False): (4, 4, 4),
    ("keys", 32, 2, 4, 4, True): (2, 16, 4),
    ("keys", 32, 4, 4, 4, False): (4, 4, 4),
    ("keys", 32, 4, 4, 4, True): (2, 16, 4),
    ("keys", 64, 2, 4, 4, False): (2, 4, 4),
    ("keys", 64, 2, 4, 4, True): (2, 4, 4),
    ("keys", 64, 4, 4, 4, False): (2, 4, 4),
    ("keys", 64, 4, 4, 4, True): (2, 4, 4),
    ("sample_grads", 128, 2, 4, 4, False): (1, 4, 4),
    ("sample_grads", 128, 2, 4, 4, True): (1, 4, 4),
    ("sample_grads", 128, 4, 4, 4, False): (1, 4, 4),
    ("sample_grads", 128, 4, 4, 4, True): (1, 4, 4),
    ("sample_grads", 32, 2, 4, 4, False): (2, 16, 4),
    ("sample_grads", 32, 2, 4, 4, True): (2, 16, 4),
    ("sample_grads", 32, 4, 4, 4, False): (2, 16, 4),
    ("sample_grads", 32, 4, 4, 4, True): (4, 4, 4),
    ("sample_grads", 64, 2, 4, 4, False): (2, 4, 4),
    ("sample_grads", 64, 2, 4, 4, True): (2, 4, 4),
    ("sample_grads", 64, 4, 4, 4, False): (2, 4, 4),
    ("sample_grads", 64, 4, 4, 4, True): (2, 4, 4),
    ("scatter", 128, 2, 4, 4, False): (1, 4, 4),
    ("scatter", 128, 2, 4, 4, True): (1, 4, 4),
    ("scatter", 128, 4, 4, 4, False): (1, 4, 4),
    ("scatter", 128, 4, 4, 4, True): (1, 4, 4),
    ("scatter", 32, 2, 4, 4, False): (2, 16, 4),
    ("scatter", 32, 2, 4, 4, True): (2, 16, 4),
    ("scatter", 32, 4, 4, 4, False): (2, 16, 4),
    ("scatter", 32, 4, 4, 4, True): (4, 4, 4),
    ("scatter", 64, 2, 4, 4, False): (2, 4, 4),
    ("scatter", 64, 2, 4, 4, True): (2, 4, 4),
    ("scatter", 64, 4, 4, 4, False): (2, 4, 4),
    ("scatter", 64, 4, 4, 4, True): (2, 4, 4),
    ("scheme", 128, 2, 4, 4, False): "fused",
    ("scheme", 128, 2, 4, 4, True): "fused",
    ("scheme", 128, 4, 4, 4, False): "fused",
    ("scheme", 128, 4, 4, 4, True): "fused",
    ("scheme", 32, 2, 4, 4, False): "fused",
    ("scheme", 32, 2, 4, 4, True): "fused",
    ("scheme", 32, 4, 4, 4, False): "fused",
    ("scheme", 32, 4, 4, 4, True): "fused",
    ("scheme", 64, 2, 4, 4, False): "hybrid",
    ("scheme", 64, 2, 4, 4, True): "fused",
    ("scheme", 64, 4, 4, 4, False): "fused",
    ("scheme", 64, 4, 4, 4, True): "fused",
}


def pow2(n: int) -> int:  # triton.next_power_of_2 / triton.cdiv are jit-callable objects: slow on the host
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grouped_config(kernel: str, D: int, nbytes: int, P: int, warps: int = 4) -> tuple:
    """(BLOCK_Q, CH, num_warps) of a grouped kernel. Channel groups of 8 (a 32-byte fp32 or 16-byte 2-byte chunk)
    but for a 2-byte value's backward: groups of 4 there, so that its loads and its fp32 vector atomics share one
    layout (8 would make Triton convert between two). Then as many queries as give each thread one sample chunk:
    more make Triton keep the sample arithmetic in a second layout and convert between them."""
    block_d = pow2(D)
    block_c = min(block_d, 4 if nbytes == 2 and kernel != "grouped_forward" else 8)
    chunk_bytes = block_c * (nbytes if kernel == "grouped_forward" else max(nbytes, 4))  # the backward's atomics
    return max(1, 32 * warps // (pow2(P) * max(1, chunk_bytes // 16))), block_d // block_c, warps


def _default_config(key: tuple):
    kernel, D, nbytes = key[:3]
    if kernel.endswith("_kernels"):
        return "classic"
    if kernel == "deterministic_scheme":
        return "gather"
    if INTERPRET:  # the CPU interpreter pays per program and per op: few, wide programs
        if kernel == "gather":
            return 256, 4
        if kernel == "cells":
            return 256, 1, 4
        if kernel == "scheme":
            return "fused"
        if kernel == "hybrid_split":
            return 8
        L, P = key[3], key[4]
        if kernel.startswith("grouped_"):
            return 64, 1, 4
        return (64, pow2(L * P), 4, 1) if kernel == "forward" else (64, pow2(L * P), 4)
    if kernel == "scheme":
        return "fused"
    if kernel == "hybrid_split":
        return 256
    if kernel == "gather":
        return max(8, 1024 // pow2(D)), 4
    if kernel == "cells":  # channel groups of 8: two threads per fp32 chunk, one lane per two threads
        return 64, max(1, pow2(D) // 8), 4
    if kernel.startswith("grouped_"):
        return grouped_config(kernel, D, nbytes, key[4])
    if kernel == "forward":
        return 16 if D <= 32 else 8 if D <= 64 else 4, 1, 2 if nbytes == 2 else 4, 4
    # The backward unrolls all its steps: four at most (as bench/msda.py's candidates), so that it compiles quickly.
    L, P = key[3], key[4]
    return 4 if D <= 32 else 2 if D <= 64 else 1, pow2(cdiv(L * P, 4)), 4


@functools.lru_cache(maxsize=1024)
def launch_config(key: tuple):
    """The table's entry for ``key`` (see TUNED), else the default. Under the CPU interpreter block shapes
    measured on a GPU would only slow it down: there the table decides the schemes and kernel families alone."""
    if INTERPRET and key[0] not in _CHOICES:
        return _default_config(key)
    return TUNED.get(key) or _default_config(key)


@functools.lru_cache(maxsize=256)
def pack_levels(levels: tuple) -> tuple:
    """((H, W), ...) -> the four int64 level arguments of the kernels (layout in msda/kernels.py)."""
    if not 1 <= len(levels) <= MAX_LEVELS or any(not 1 <= s < MAX_SIDE for hw in levels for s in hw):
        raise ValueError(f"the Triton kernels take 1 to {MAX_LEVELS} levels with 1 <= H, W < {MAX_SIDE}, got {levels}")
    fields = [(h << 16) | w for h, w in levels] + [0] * (MAX_LEVELS - len(levels))
    # Bit 62 keeps every argument in Triton's int64 range, so its type never changes with the sizes.
    return tuple((1 << 62) | (fields[2 * k + 1] << 32) | fields[2 * k] for k in range(MAX_LEVELS // 2))


def levels_key(levels) -> tuple:
    return levels if isinstance(levels, tuple) else tuple(tuple(hw) for hw in levels)


def check_grid(N: int, M: int):
    if N * M > 65535:
        raise ValueError(f"the Triton kernels put N*M on the grid's second axis (at most 65535), got N={N}, M={M}")


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """Triton launches on the current device: switch only when the tensors live elsewhere (rare, and not free)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD
