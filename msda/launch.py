"""Launchers for the Triton kernels: pick the launch configuration, allocate outputs, build the grid, launch.

Inputs arrive validated and contiguous (see ops.py); ``levels`` is a tuple of (H, W) Python ints. Imported
lazily so that ``import msda`` works without triton and the reference path never touches it. Nothing here
reads the device or copies host memory to it: the level layout travels as four int64 kernel arguments that
Triton does not specialize on, so a new image size neither syncs nor recompiles, eagerly, under
torch.compile (inside a custom op) or during CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton.language as tl

from .kernels import (
    msda_backward_kernel,
    msda_fill_cells_kernel,
    msda_forward_kernel,
    msda_grad_value_gather_kernel,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_LEVELS, MAX_SIDE = 8, 2 ** 14
LARGE = 2 ** 16  # N*Lq*M from which a call counts as encoder-sized in the tables below
SCHEMES = ("fused", "split", "gather", "hybrid")
_FLAGS = {"fused": (True, True, False), "sample_grads": (True, False, False), "scatter": (False, True, False),
          "keys": (True, False, True), "hybrid": (True, True, True)}  # SAMPLE_GRADS, SCATTER, KEYS

# ----------------------------------------------------------------------------------------------------
# launch table, measured on an H200 by `python bench/msda.py --out DIR`: it prints this block with the
# fastest measured entries (msda_sweep.md); paste it over the one below. Keys:
#   query kernels  (kernel, D, value bytes, L, P, large) -> (BLOCK_Q, BLOCK_P, num_warps)
#                  kernel: fused | sample_grads | scatter | keys | hybrid
#   forward        ("forward", D, value bytes, L, P, large) -> (BLOCK_Q, BLOCK_P, num_warps, UNROLL)
#   gather kernel  ("gather", D, value bytes, large)     -> (lanes = BLOCK_S * BLOCK_E, num_warps)
#   hybrid split   ("hybrid_split", D, value bytes, large) -> entries per value row from which a level is gathered
#   scheme         ("scheme", D, value bytes, L, P, large) -> fused | split | gather | hybrid (non-deterministic)
# Anything not in the table falls back to _default_config: the forward takes 16 queries and 4 warps (2 for a 2-byte
# value) and one sample per step, unrolled 4 times; the backward fuses the atomic scatter into one kernel of 4
# queries and at least L*P/4 samples per step (the H200 sweeps' picks for D=32).
# ----------------------------------------------------------------------------------------------------
# Measured on NVIDIA H200, 2026-12-02, torch 2.11.0+cu130, triton 3.6.0:
# python bench/msda.py --out /root/out --jobs 14 (table picked from the candidates with at most 4 unrolled steps)
TUNED: dict = {
    ('forward', 128, 2, 4, 4, False): (1, 4, 4, 1),
    ('forward', 128, 2, 4, 4, True): (4, 1, 4, 4),
    ('forward', 128, 4, 4, 4, False): (1, 4, 4, 1),
    ('forward', 128, 4, 4, 4, True): (4, 1, 4, 4),
    ('forward', 32, 2, 4, 4, False): (16, 1, 4, 4),
    ('forward', 32, 2, 4, 4, True): (16, 1, 2, 4),
    ('forward', 32, 4, 4, 4, False): (8, 2, 4, 2),
    ('forward', 32, 4, 4, 4, True): (16, 1, 2, 4),
    ('forward', 64, 2, 4, 4, False): (2, 4, 4, 4),
    ('forward', 64, 2, 4, 4, True): (8, 1, 4, 4),
    ('forward', 64, 4, 4, 4, False): (2, 4, 4, 4),
    ('forward', 64, 4, 4, 4, True): (8, 1, 4, 4),
    ('fused', 128, 2, 4, 4, False): (1, 4, 4),
    ('fused', 128, 2, 4, 4, True): (1, 4, 4),
    ('fused', 128, 4, 4, 4, False): (1, 4, 4),
    ('fused', 128, 4, 4, 4, True): (1, 4, 4),
    ('fused', 32, 2, 4, 4, False): (2, 16, 4),
    ('fused', 32, 2, 4, 4, True): (4, 4, 4),
    ('fused', 32, 4, 4, 4, False): (4, 4, 4),
    ('fused', 32, 4, 4, 4, True): (2, 16, 4),
    ('fused', 64, 2, 4, 4, False): (2, 4, 4),
    ('fused', 64, 2, 4, 4, True): (2, 4, 4),
    ('fused', 64, 4, 4, 4, False): (2, 4, 4),
    ('fused', 64, 4, 4, 4, True): (2, 4, 4),
    ('gather', 128, 2, False): (8, 4),
    ('gather', 128, 2, True): (8, 4),
    ('gather', 128, 4, False): (8, 4),
    ('gather', 128, 4, True): (8, 4),
    ('gather', 32, 2, False): (32, 4),
    ('gather', 32, 2, True): (32, 4),
    ('gather', 32, 4, False): (32, 4),
    ('gather', 32, 4, True): (32, 4),
    ('gather', 64, 2, False): (16, 4),
    ('gather', 64, 2, True): (16, 4),
    ('gather', 64, 4, False): (16, 4),
    ('gather', 64, 4, True): (16, 4),
    ('hybrid', 128, 2, 4, 4, False): (1, 4, 4),
    ('hybrid', 128, 2, 4, 4, True): (1, 4, 4),
    ('hybrid', 128, 4, 4, 4, False): (1, 4, 4),
    ('hybrid', 128, 4, 4, 4, True): (1, 4, 4),
    ('hybrid', 32, 2, 4, 4, False): (4, 4, 4),
    ('hybrid', 32, 2, 4, 4, True): (4, 4, 4),
    ('hybrid', 32, 4, 4, 4, False): (4, 4, 4),
    ('hybrid', 32, 4, 4, 4, True): (4, 4, 4),
    ('hybrid', 64, 2, 4, 4, False): (2, 4, 4),
    ('hybrid', 64, 2, 4, 4, True): (2, 4, 4),
    ('hybrid', 64, 4, 4, 4, False): (2, 4, 4),
    ('hybrid', 64, 4, 4, 4, True): (2, 4, 4),
    ('hybrid_split', 128, 2, False): 256,
    ('hybrid_split', 128, 2, True): 256,
    ('hybrid_split', 128, 4, False): 256,
    ('hybrid_split', 128, 4, True): 256,
    ('hybrid_split', 32, 2, False): 256,
    ('hybrid_split', 32, 2, True): 256,
    ('hybrid_split', 32, 4, False): 256,
    ('hybrid_split', 32, 4, True): 256,
    ('hybrid_split', 64, 2, False): 256,
    ('hybrid_split', 64, 2, True): 256,
    ('hybrid_split', 64, 4, False): 256,
    ('hybrid_split', 64, 4, True): 256,
    ('keys', 128, 2, 4, 4, False): (1, 4, 4),
    ('keys', 128, 2, 4, 4, True): (1, 4, 4),
    ('keys', 128, 4, 4, 4, False): (1, 4, 4),
    ('keys', 128, 4, 4, 4, True): (1, 4, 4),
    ('keys', 32, 2, 4, 4, False): (4, 4, 4),
    ('keys', 32, 2, 4, 4, True): (2, 16, 4),
    ('keys', 32, 4, 4, 4, False): (4, 4, 4),
    ('keys', 32, 4, 4, 4, True): (2, 16, 4),
    ('keys', 64, 2, 4, 4, False): (2, 4, 4),
    ('keys', 64, 2, 4, 4, True): (2, 4, 4),
    ('keys', 64, 4, 4, 4, False): (2, 4, 4),
    ('keys', 64, 4, 4, 4, True): (2, 4, 4),
    ('sample_grads', 128, 2, 4, 4, False): (1, 4, 4),
    ('sample_grads', 128, 2, 4, 4, True): (1, 4, 4),
    ('sample_grads', 128, 4, 4, 4, False): (1, 4, 4),
    ('sample_grads', 128, 4, 4, 4, True): (1, 4, 4),
    ('sample_grads', 32, 2, 4, 4, False): (2, 16, 4),
    ('sample_grads', 32, 2, 4, 4, True): (2, 16, 4),
    ('sample_grads', 32, 4, 4, 4, False): (2, 16, 4),
    ('sample_grads', 32, 4, 4, 4, True): (4, 4, 4),
    ('sample_grads', 64, 2, 4, 4, False): (2, 4, 4),
    ('sample_grads', 64, 2, 4, 4, True): (2, 4, 4),
    ('sample_grads', 64, 4, 4, 4, False): (2, 4, 4),
    ('sample_grads', 64, 4, 4, 4, True): (2, 4, 4),
    ('scatter', 128, 2, 4, 4, False): (1, 4, 4),
    ('scatter', 128, 2, 4, 4, True): (1, 4, 4),
    ('scatter', 128, 4, 4, 4, False): (1, 4, 4),
    ('scatter', 128, 4, 4, 4, True): (1, 4, 4),
    ('scatter', 32, 2, 4, 4, False): (2, 16, 4),
    ('scatter', 32, 2, 4, 4, True): (2, 16, 4),
    ('scatter', 32, 4, 4, 4, False): (2, 16, 4),
    ('scatter', 32, 4, 4, 4, True): (4, 4, 4),
    ('scatter', 64, 2, 4, 4, False): (2, 4, 4),
    ('scatter', 64, 2, 4, 4, True): (2, 4, 4),
    ('scatter', 64, 4, 4, 4, False): (2, 4, 4),
    ('scatter', 64, 4, 4, 4, True): (2, 4, 4),
    ('scheme', 128, 2, 4, 4, False): 'fused',
    ('scheme', 128, 2, 4, 4, True): 'fused',
    ('scheme', 128, 4, 4, 4, False): 'fused',
    ('scheme', 128, 4, 4, 4, True): 'fused',
    ('scheme', 32, 2, 4, 4, False): 'fused',
    ('scheme', 32, 2, 4, 4, True): 'fused',
    ('scheme', 32, 4, 4, 4, False): 'fused',
    ('scheme', 32, 4, 4, 4, True): 'fused',
    ('scheme', 64, 2, 4, 4, False): 'hybrid',
    ('scheme', 64, 2, 4, 4, True): 'fused',
    ('scheme', 64, 4, 4, 4, False): 'fused',
    ('scheme', 64, 4, 4, 4, True): 'fused',
}


def _pow2(n: int) -> int:  # triton.next_power_of_2 / triton.cdiv are jit-callable objects: slow on the host
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_config(key: tuple):
    kernel, D, nbytes = key[:3]
    if INTERPRET:  # the CPU interpreter pays per program and per op: few, wide programs
        if kernel == "gather":
            return 256, 4
        if kernel == "scheme":
            return "fused"
        if kernel == "hybrid_split":
            return 8
        L, P = key[3], key[4]
        return (64, _pow2(L * P), 4, 1) if kernel == "forward" else (64, _pow2(L * P), 4)
    if kernel == "scheme":
        return "fused"
    if kernel == "hybrid_split":
        return 256
    if kernel == "gather":
        return max(8, 1024 // _pow2(D)), 4
    if kernel == "forward":
        return 16 if D <= 32 else 8 if D <= 64 else 4, 1, 2 if nbytes == 2 else 4, 4
    # The backward unrolls all its steps: four at most (as bench/msda.py's candidates), so that it compiles quickly.
    L, P = key[3], key[4]
    return 4 if D <= 32 else 2 if D <= 64 else 1, _pow2(_cdiv(L * P, 4)), 4


@functools.lru_cache(maxsize=1024)
def launch_config(key: tuple):
    """The table's entry for ``key`` (see TUNED), else the default. Under the CPU interpreter block shapes
    measured on a GPU would only slow it down: there the table decides the schemes alone."""
    if INTERPRET and key[0] not in ("scheme", "hybrid_split"):
        return _default_config(key)
    return TUNED.get(key) or _default_config(key)


def update_table(entries: dict):
    """Merge measured entries into TUNED at run time (bench/msda.py does, after its sweep)."""
    TUNED.update(entries)
    launch_config.cache_clear()
    _plan.cache_clear()


@functools.lru_cache(maxsize=256)
def pack_levels(levels: tuple) -> tuple:
    """((H, W), ...) -> the four int64 level arguments of the kernels (layout in msda/kernels.py)."""
    if not 1 <= len(levels) <= MAX_LEVELS or any(not 1 <= s < MAX_SIDE for hw in levels for s in hw):
        raise ValueError(f"the Triton kernels take 1 to {MAX_LEVELS} levels with 1 <= H, W < {MAX_SIDE}, "
                         f"got {levels}")
    fields = [(h << 16) | w for h, w in levels] + [0] * (MAX_LEVELS - len(levels))
    # Bit 62 keeps every argument in Triton's int64 range, so its type never changes with the sizes.
    return tuple((1 << 62) | (fields[2 * k + 1] << 32) | fields[2 * k] for k in range(MAX_LEVELS // 2))


def _levels_key(levels) -> tuple:
    return levels if isinstance(levels, tuple) else tuple(tuple(hw) for hw in levels)


_NO_GUARD = contextlib.nullcontext()


def _device_guard(t: torch.Tensor):
    """Triton launches on the current device: switch only when the tensors live elsewhere (rare, and not free)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


@functools.lru_cache(maxsize=1024)
def _plan(kernel: str, N: int, Lq: int, M: int, D: int, L: int, P: int, dtype: torch.dtype, levels: tuple,
          config: tuple | None, gather_level: int = 0):
    """(grid, trailing int arguments, keyword arguments) of one query-kernel launch, built once per shape.

    The eager training step is host-bound: per call only a dict lookup remains of the configuration work.
    """
    if N * M > 65535:
        raise ValueError(f"the Triton kernels put N*M on the grid's second axis (at most 65535), got N={N}, M={M}")
    nbytes = dtype.itemsize
    config = config or launch_config((kernel, D, nbytes, L, P, N * Lq * M >= LARGE))
    block_q, block_p, warps = config[:3]
    kwargs = dict(M=M, D=D, L=L, P=P, BLOCK_D=_pow2(D), COMPUTE_DTYPE=tl.float64 if dtype == torch.float64
                  else tl.float32, BLOCK_Q=block_q, BLOCK_P=block_p, num_warps=warps)
    if kernel == "forward":
        if len(config) != 4:
            raise ValueError(f"a forward config is (BLOCK_Q, BLOCK_P, num_warps, UNROLL), got {config}")
        kwargs["UNROLL"] = config[3]
        return (_cdiv(Lq, block_q), N * M), (Lq, *pack_levels(levels)), kwargs
    kwargs.update(zip(("SAMPLE_GRADS", "SCATTER", "KEYS"), _FLAGS[kernel]))
    return (_cdiv(Lq, block_q), N * M), (Lq, gather_level, *pack_levels(levels)), kwargs


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
def forward(value, levels, sampling_locations, attention_weights, *, config: tuple | None = None) -> torch.Tensor:
    """Returns (N, Lq, M*D) in value's dtype. config = (BLOCK_Q, BLOCK_P, num_warps, UNROLL) overrides the table."""
    N, S, M, D = value.shape
    shape = sampling_locations.shape  # (N, Lq, M, L, P, 2)
    output = torch.empty((N, shape[1], M, D), dtype=value.dtype, device=value.device)  # (N, Lq, M, D)
    if N == 0 or shape[1] == 0:
        return output.view(N, shape[1], M * D)
    grid, args, kwargs = _plan("forward", N, shape[1], M, D, shape[3], shape[4], value.dtype, _levels_key(levels),
                               config)
    with _device_guard(value):
        msda_forward_kernel[grid](value, sampling_locations, attention_weights, output, *args, **kwargs)
    return output.view(N, shape[1], M * D)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
def backward(grad_output, value, levels, sampling_locations, attention_weights, *, deterministic: bool = False,
             scheme: str | None = None, configs: dict | None = None):
    """Returns (grad_value, grad_sampling_locations, grad_attention_weights), each in its input's dtype.

    deterministic=False: the scheme from the table. "fused" and "split" add grad_value with fp32 atomics
    (fp64 for fp64 value) into a zeroed buffer, cast once; "gather" buckets the samples by cell with atomics
    and sums every value row in registers; "hybrid" scatters the fine levels and gathers the dense coarse
    ones (their rows collect many entries, on which atomics would queue). Either way the last bits of
    grad_value vary run to run.
    deterministic=True: the gather scheme over a stable sort of the samples by cell; every value row is summed
    in a fixed order, so all three gradients are bitwise identical run to run (the location and weight
    gradients never use atomics). scheme / configs (kernel name -> config tuple) override the table (benchmarks).
    """
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grad_loc = torch.empty_like(sampling_locations)  # (N, Lq, M, L, P, 2)
    grad_weight = torch.empty_like(attention_weights)  # (N, Lq, M, L, P)
    if N == 0 or Lq == 0:
        return torch.zeros_like(value), grad_loc, grad_weight
    levels = _levels_key(levels)
    if deterministic:
        scheme = "gather"
    elif scheme is None:
        scheme = launch_config(("scheme", D, value.element_size(), L, P, N * Lq * M >= LARGE))
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    configs = configs or {}

    nbytes, large = value.element_size(), N * Lq * M >= LARGE
    first_gathered = 0  # levels from this one on are summed by the gather kernel
    if scheme == "hybrid":
        threshold = configs.get("hybrid_split") or launch_config(("hybrid_split", D, nbytes, large))
        first_gathered = gather_from(levels, Lq, P, threshold)
        scheme = "fused" if first_gathered == L else scheme

    def query_kernel(name, grad_value, keys, counts):
        grid, args, kwargs = _plan(name, N, Lq, M, D, L, P, value.dtype, levels, configs.get(name),
                                   L if name in ("fused", "scatter") else first_gathered)
        msda_backward_kernel[grid](grad_output, value, sampling_locations, attention_weights, grad_value, grad_loc,
                                   grad_weight, keys, counts, *args, **kwargs)

    with _device_guard(value):
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
        index_dtype = torch.int32 if max(num_cells + 1, num_samples) < 2 ** 31 else torch.int64
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
            msda_fill_cells_kernel[(_cdiv(num_samples, 1024),)](keys, counts, perm, num_samples, num_cells,
                                                                 BLOCK=1024, num_warps=4)
        lanes, warps = configs.get("gather") or launch_config(("gather", D, nbytes, large))
        common = dict(M=M, D=D, L=L, P=P, BLOCK_D=_pow2(D), FILLED=not deterministic, num_warps=warps,
                      COMPUTE_DTYPE=tl.float64 if value.dtype == torch.float64 else tl.float32)
        s_first = sum(h * w for h, w in levels[:first_gathered])
        for s_begin, s_end, block_e in gather_groups(levels, Lq, P, lanes):
            s_begin = max(s_begin, s_first)
            if s_begin >= s_end:
                continue
            block_s = lanes // block_e
            msda_grad_value_gather_kernel[(_cdiv(s_end - s_begin, block_s), N * M)](
                grad_output, sampling_locations, attention_weights, counts, perm, grad_value,
                Lq, s_begin, s_end, *pack_levels(levels), BLOCK_S=block_s, BLOCK_E=block_e, **common)
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
