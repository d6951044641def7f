"""The attention's kernels compiled side by side ahead of their first launches (msda/precompile.py): the
stand-in calls, launches on meta tensors that compile and launch nothing, the wait before the next real
launch, and on the GPU a cold process whose real launches compile nothing themselves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from child_process import child_env
from msda import launch, precompile


def test_stand_ins_are_this_call_and_one_on_the_other_side_of_the_size_threshold():
    N, S, M, D, L, P = 2, 1000, 8, 32, 4, 4
    for queries in (S, 300):  # an encoder's call (one query per value position), a decoder's
        value = torch.empty((N, S, M, D), dtype=torch.bfloat16)
        loc, weight = torch.empty((N, queries, M, L, P, 2)), torch.empty((N, queries, M, L, P))
        calls = precompile.stand_ins(value, loc, weight)
        sizes = [c[1].shape[1] for c in calls]
        assert sizes[0] == queries
        large = [N * q * M >= launch.LARGE for q in sizes]
        assert large[0] != large[1], sizes
        for v, l_, w, grad in calls:
            assert all(t.is_meta for t in (v, l_, w, grad))
            assert (v.dtype, l_.dtype, w.dtype, grad.dtype) == (torch.bfloat16, torch.float32, torch.float32,
                                                                 torch.bfloat16)
            assert v.shape == value.shape and l_.shape[2:] == loc.shape[2:] and grad.shape == (N, l_.shape[1], M * D)


class _RecordingKernel:
    def __init__(self):
        self.warmups, self.launches = [], []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, args, kwargs))
        return "compiled"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_a_launch_on_meta_tensors_compiles_and_launches_nothing():
    kernel = _RecordingKernel()
    meta, real = torch.empty(4, device="meta"), torch.empty(4)
    assert launch._launch(kernel, (3, 2), meta, 7, BLOCK=16) == "compiled"
    assert kernel.warmups == [((3, 2), (meta, 7), {"BLOCK": 16})] and not kernel.launches
    launch._launch(kernel, (1,), real, 7, BLOCK=16)
    assert kernel.launches == [((1,), (real, 7), {"BLOCK": 16})] and len(kernel.warmups) == 1


def test_the_next_real_launch_waits_for_every_pending_compilation(monkeypatch):
    order = []

    class Pending:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def result(self):
            order.append(self.name)
            if self.fails:  # left to the launch that needs this kernel
                raise RuntimeError("ptxas failed")

    monkeypatch.setattr(launch, "PENDING", [Pending("a"), Pending("b", fails=True), Pending("c")])
    kernel = _RecordingKernel()
    launch._launch(kernel, (1,), torch.empty(1))
    assert order == ["a", "b", "c"] and launch.PENDING == [] and len(kernel.launches) == 1
    launch._launch(kernel, (1,), torch.empty(1))
    assert order == ["a", "b", "c"]  # waited once


def test_nothing_is_precompiled_off_the_gpu():
    value = torch.randn(2, 20, 2, 8)
    loc, weight = torch.rand(2, 5, 2, 1, 2, 2), torch.rand(2, 5, 2, 1, 2)
    assert precompile.precompile(value, ((4, 5),), loc, weight, backward=True, deterministic=False) == 0
    assert launch.PENDING == []


_COLD_PROCESS = r"""
import json, threading
import torch, triton.compiler

compiled_in = []
original = triton.compiler.compile

def counting(*args, **kwargs):
    compiled_in.append(threading.current_thread().name)
    return original(*args, **kwargs)

triton.compiler.compile = counting  # before any kernel builds its binder, which takes the function from here
import msda

torch.manual_seed(0)
levels = ((100, 152), (50, 76), (25, 38), (13, 19))  # an 800x1216 image's feature maps
N, M, D, L, P = 2, 8, 32, 4, 4
S = sum(h * w for h, w in levels)
value = torch.randn(N, S, M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
total = 0
for queries in (S, 300):  # the encoder's call, then a decoder layer's
    loc = (torch.rand(N, queries, M, L, P, 2, device="cuda") * 1.2 - 0.1).requires_grad_()
    weight = torch.rand(N, queries, M, L, P, device="cuda").softmax(-1).requires_grad_()
    total = total + msda.multi_scale_deformable_attention(value, levels, None, loc, weight, impl="triton").float().sum()
total.backward()
torch.cuda.synchronize()
print(json.dumps(compiled_in))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_a_cold_first_step_compiles_its_kernels_in_the_pool_not_at_the_launches(tmp_path):
    result = subprocess.run([sys.executable, "-c", _COLD_PROCESS], capture_output=True, text=True, timeout=600,
                            env=child_env(TRITON_CACHE_DIR=str(tmp_path / "triton")))
    assert result.returncode == 0, result.stderr[-3000:]
    threads = json.loads(result.stdout.strip().splitlines()[-1])
    # forward and backward, each in its encoder-sized and decoder-sized configuration
    assert len(threads) == 4, threads
    assert all(name.startswith("msda-compile") for name in threads), threads
