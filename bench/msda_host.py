"""Where the host time of one eager msda call goes, on the decoder-sized workload (issue: the eager op must not
be slower than the original CUDA op, whose host path is a few C++ calls).

    python bench/msda_host.py [--out DIR] [--calls 300]

Each line is one piece, timed as a plain loop of --calls calls: the host time per call (until the loop has
queued everything) and the wall time per call (until the GPU has run it). Kept short (a few hundred launches)
so that the launch queue never fills: a full queue would make the host wait for the GPU, and the host
figure would be GPU time. Where wall is well above host, the piece is bound by the GPU. Then the whole call
under cProfile. Writes msda_host_h200.json and msda_host_h200_profile.txt into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import msda  # noqa: E402
from bench.e2e_steptime import python_profile  # noqa: E402
from bench.msda import LEVELS, heads, make_inputs, run_header  # noqa: E402
from msda import launch  # noqa: E402
from msda.validation import validate_inputs  # noqa: E402


def host_us(fn, calls: int) -> dict:
    """{"host": us per call until queued, "wall": us per call until run}."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return {"host": queued / calls * 1e6, "wall": (time.perf_counter() - start) / calls * 1e6}


class NoWork(torch.autograd.Function):
    """The floor of any eager autograd op: saves the inputs, allocates its output and three gradients, launches
    nothing. What torch.autograd.grad costs around it is the autograd engine's share of one eager call."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        N, Lq, M = sampling_locations.shape[:3]
        return value.new_empty((N, Lq, M * value.shape[-1]))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def pieces(dtype: torch.dtype, calls: int) -> dict:
    value, loc, weights, grad_out = make_inputs(4, 300, heads(32), 32, dtype, "uniform")
    leaves = [t.detach().requires_grad_() for t in (value, loc, weights)]
    out = torch.empty(4, 300, heads(32), 32, dtype=dtype, device="cuda")
    grid, args, kwargs = launch._plan("forward", 4, 300, heads(32), 32, 4, 4, dtype, LEVELS, None)

    def public(impl):
        return lambda: msda.multi_scale_deformable_attention(leaves[0], LEVELS, None, leaves[1], leaves[2], impl=impl)

    def fwd_bwd(impl):
        return lambda: torch.autograd.grad(public(impl)(), leaves, grad_out)

    return {
        "validate_inputs": host_us(lambda: validate_inputs(value, LEVELS, None, loc, weights), calls),
        "torch.empty (output)": host_us(lambda: torch.empty(4, 300, heads(32), 32, dtype=dtype, device="cuda"), calls),
        "kernel launch alone (forward)": host_us(
            lambda: launch.msda_forward_kernel[grid](value, loc, weights, out, *args, **kwargs), calls),
        "launch.forward": host_us(lambda: launch.forward(value, LEVELS, loc, weights), calls),
        "public forward, no grad": host_us(lambda: msda.multi_scale_deformable_attention(
            value, LEVELS, None, loc, weights, impl="triton"), calls),
        "public forward, grad": host_us(public("triton"), calls),
        "launch.backward": host_us(lambda: launch.backward(grad_out, value, LEVELS, loc, weights), calls // 3),
        "torch.zeros (grad_value)": host_us(lambda: torch.zeros(value.shape, device="cuda"), calls),
        "public forward+backward": host_us(fwd_bwd("triton"), calls // 3),
        "autograd and allocations only (NoWork forward+backward)": host_us(
            lambda: torch.autograd.grad(NoWork.apply(*leaves), leaves, grad_out), calls // 3),
        "reference forward+backward": host_us(fwd_bwd("pytorch"), calls // 20),
        "_profile": python_profile(fwd_bwd("triton"), torch.cuda.synchronize, steps=calls // 2),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--calls", type=int, default=300, help="calls per loop (fewer for the multi-launch pieces)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/msda_host.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    header = run_header(workload="decoder N4 Lq300, D=32, M=8, uniform")
    results, profiles = {}, []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        timings = pieces(dtype, args.calls)
        profiles.append(f"==== {name}: cProfile of public forward+backward\n{timings.pop('_profile')}")
        results[name] = timings
        for piece, us in timings.items():
            print(f"{name} {piece:<32} host {us['host']:8.1f} us, wall {us['wall']:8.1f} us", flush=True)
    (args.out / "msda_host_h200.json").write_text(json.dumps({"header": header, "host_us": results}, indent=1))
    (args.out / "msda_host_h200_profile.txt").write_text("\n".join(profiles))
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
