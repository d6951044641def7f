"""Compile the attention's Triton kernels side by side, ahead of their first launches.

A step of the model launches the forward and the backward kernel in two configurations each (launch.TUNED:
one for encoder-sized calls, one for decoder-sized ones). Compiled at their launches, the four compile one
after another on a cold cache, before the first step can finish. Instead, the first call of its kind
(dtypes, head layout, batch) hands every configuration the step will need to a pool of threads: the same
launchers run on meta tensors shaped as this call and as a call of the other size, which compile the
kernels and launch nothing. Triton's compiler releases the GIL, so the compilations run in parallel. The
next real launch waits for all of them.

Best effort: a configuration it did not foresee (the hybrid backward's gather tiles depend on the exact
query count) compiles at its launch, as it would without this. Without Triton's async compile mode (an
internal of Triton that Inductor uses too) nothing is precompiled.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading

import torch

from . import launch

log = logging.getLogger(__name__)

MAX_THREADS = 8
_seen: set = set()
_lock = threading.Lock()


def _async_compile():
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    if not (hasattr(_async_compile, "AsyncCompileMode") and hasattr(_async_compile, "active_mode")):
        return None
    return _async_compile


@functools.lru_cache(maxsize=1)
def _executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=min(MAX_THREADS, os.cpu_count() or 1),
                                                 thread_name_prefix="msda-compile")


def stand_ins(value: torch.Tensor, sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> list:
    """[(value, sampling_locations, attention_weights, grad_output)] on the meta device: shaped as this call,
    and as a call on the other side of launch.LARGE (a decoder's queries for an encoder's call, and back)."""
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    other = 1 if N * Lq * M >= launch.LARGE else -(-launch.LARGE // (N * M))
    calls = []
    for queries in (Lq, other):
        calls.append((torch.empty((N, S, M, D), dtype=value.dtype, device="meta"),
                      torch.empty((N, queries, M, L, P, 2), dtype=sampling_locations.dtype, device="meta"),
                      torch.empty((N, queries, M, L, P), dtype=attention_weights.dtype, device="meta"),
                      torch.empty((N, queries, M * D), dtype=value.dtype, device="meta")))
    return calls


def precompile(value, levels, sampling_locations, attention_weights, *, backward: bool, deterministic: bool) -> int:
    """Start compiling the kernels of calls like this one (and their backward when ``backward``), once per
    kind of call; returns how many compilations started (0 when all were compiled or are compiling)."""
    if launch.INTERPRET or not value.is_cuda or value.shape[0] == 0:
        return 0
    kind = (value.device, value.dtype, sampling_locations.dtype, attention_weights.dtype, (value.shape[0], *value.shape[2:]),
            tuple(sampling_locations.shape[3:5]), backward, deterministic)
    with _lock:
        if kind in _seen:
            return 0
        _seen.add(kind)
    async_compile = _async_compile()
    if async_compile is None:
        return 0
    mode = async_compile.AsyncCompileMode(_executor())
    token = async_compile.active_mode.set(mode)
    try:
        with torch.cuda.device(value.device):
            for v, loc, weight, grad in stand_ins(value, sampling_locations, attention_weights):
                launch.forward(v, levels, loc, weight)
                if backward:
                    launch.backward(grad, v, levels, loc, weight, deterministic=deterministic)
    except Exception as error:  # noqa: BLE001 - a stand-in that fails is compiled at its real launch instead
        log.debug("precompiling the attention kernels failed: %s", error)
    finally:
        async_compile.active_mode.reset(token)
    started = list(mode.future_kernels.values())
    with _lock:
        launch.PENDING.extend(started)
    return len(started)


def finish_pending() -> None:
    """Wait for the kernels being precompiled and put them in Triton's kernel cache. A failed compilation is
    left to the launch that needs that kernel, which raises its error as an uncached kernel would."""
    with _lock:
        pending, launch.PENDING[:] = list(launch.PENDING), []
    for kernel in pending:
        try:
            kernel.result()
        except Exception as error:  # noqa: BLE001 - see the docstring
            log.debug("a precompiled attention kernel failed to compile: %s", error)
