"""What bounds the encoder backward: its kernels one by one, and how fast the GPU adds fp32 rows at all.

    python bench/msda_bounds.py --out DIR     # about a minute on an H200
    python bench/msda_bounds.py --smoke       # the script end to end on the CPU interpreter (times meaningless)

1. pieces   encoder N2 (D=32, M=8), fp32 and bf16 value, uniform and realistic locations, median ms
            (triton.testing.do_bench): the forward kernel; the fused backward kernel alone (into a reused
            fp32 buffer, so without its memset); its two halves as the split scheme launches them
            (sample_grads: the value gathers and the location and weight gradients; scatter: grad_value's
            fp32 atomics and nothing else); the memset of the fp32 buffer; for bf16 value, the cast of that
            buffer to bf16; launch.backward whole; the reference forward+backward (fp32 for both dtypes). From
            them, the floor that the atomics put under forward+backward (forward + memset + scatter alone +
            cast, as if the fused kernel hid every gather behind its atomics) and the ratio to the reference
            that floor allows. Bandwidths count every corner, those outside the map (masked, free) included.
2. probe    one small kernel that touches as many 32-channel fp32 rows as the encoder's corners
            (N*Lq*M*L*P*4 = 22.8M) in a buffer the size of grad_value: random rows read, written, and added
            with relaxed atomics, and consecutive rows added. It says what the atomics cost on this GPU apart
            from any msda arithmetic, and whether ordering the rows (what a sort or a combining pass would
            buy) could make them cheaper.
3. breakdown the GPU time of one launch.backward by kernel (torch.profiler, mean of 10 calls) for the fused,
            the bucketed gather and the deterministic (sorted gather) schemes: where the deterministic mode's
            extra time goes.
Writes msda_bounds_h200.json into --out and prints every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import msda  # noqa: E402
from bench.e2e_steptime import _device_us, is_device_work  # noqa: E402
from bench.msda import (  # noqa: E402
    DEVICE,
    DTYPES,
    LEVELS,
    L,
    P,
    S,
    heads,
    kernel_bench_args,
    make_inputs,
    median_ms,
    run_header,
    sync,
)
from msda import launch  # noqa: E402

D = 32
PROBE_MODES = {"load": 0, "store": 1, "atomic add": 2}


# ----------------------------------------------------------------------------------------------------
# 1. the backward's pieces
# ----------------------------------------------------------------------------------------------------
def backward_kernel(name: str, value, loc, weights, grad_out, grad_value):
    """One launch of msda_backward_kernel as launch.backward makes it, flags chosen by ``name``."""
    N, _, M, _ = value.shape
    Lq = loc.shape[1]
    grid, args, kwargs = launch._plan(name, N, Lq, M, D, L, P, value.dtype, LEVELS, None, L)
    grad_loc, grad_weight = torch.empty_like(loc), torch.empty_like(weights)
    return lambda: launch.msda_backward_kernel[grid](
        grad_out, value, loc, weights, grad_value, grad_loc, grad_weight, grad_weight, grad_weight, *args, **kwargs)


def reference_fwd_bwd_ms(value, loc, weights, grad_out) -> float:
    leaves = [t.detach().float().requires_grad_() for t in (value, loc, weights)]

    def fwd_bwd():
        out = msda.multi_scale_deformable_attention(leaves[0], LEVELS, None, leaves[1], leaves[2], impl="pytorch")
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))

    return median_ms(fwd_bwd, rep=20)


def pieces(N: int, Lq: int, dtype_name: str, locations: str) -> dict:
    value, loc, weights, grad_out = make_inputs(N, Lq, heads(D), D, DTYPES[dtype_name], locations)
    M = heads(D)
    grad_out4 = grad_out.view(N, Lq, M, D)
    buffer = torch.zeros((N, S, M, D), dtype=torch.float32, device=value.device)
    ms = {
        "forward": median_ms(lambda: launch.forward(value, LEVELS, loc, weights)),
        "fused kernel": median_ms(backward_kernel("fused", value, loc, weights, grad_out4, buffer)),
        "sample_grads kernel": median_ms(backward_kernel("sample_grads", value, loc, weights, grad_out4, buffer)),
        "scatter kernel": median_ms(backward_kernel("scatter", value, loc, weights, grad_out4, buffer)),
        "memset (fp32 grad_value)": median_ms(buffer.zero_),
        "cast (fp32 grad_value to value's dtype)": (median_ms(lambda: buffer.to(value.dtype))
                                                    if value.dtype != torch.float32 else 0.0),
        "launch.backward (fused)": median_ms(lambda: launch.backward(grad_out4, value, LEVELS, loc, weights,
                                                                     scheme="fused")),
        "reference forward+backward": reference_fwd_bwd_ms(value, loc, weights, grad_out),
    }
    floor = (ms["forward"] + ms["memset (fp32 grad_value)"] + ms["scatter kernel"]
             + ms["cast (fp32 grad_value to value's dtype)"])
    now = ms["forward"] + ms["launch.backward (fused)"]
    corner_rows = N * Lq * M * L * P * 4
    return {"ms": ms, "corner_rows": corner_rows,
            "scatter GB/s (all corners counted)": corner_rows * D * 4 / ms["scatter kernel"] / 1e6,
            "gathered GB/s (forward, all corners counted)":
                corner_rows * D * value.element_size() / ms["forward"] / 1e6,
            "forward+backward now": now, "atomic floor of forward+backward": floor,
            "x reference now": ms["reference forward+backward"] / now,
            "x reference at the floor": ms["reference forward+backward"] / floor,
            "fused kernel / scatter kernel": ms["fused kernel"] / ms["scatter kernel"]}


# ----------------------------------------------------------------------------------------------------
# 2. the probe: fp32 rows read, written or added, in a chosen order
# ----------------------------------------------------------------------------------------------------
@triton.jit
def rows_probe_kernel(buf_ptr, rows_ptr, sums_ptr, num_rows, MODE: tl.constexpr, D: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """MODE 0: load the rows (their sum per program keeps the loads alive); 1: store ones; 2: atomic-add ones."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    ok = r < num_rows
    row = tl.load(rows_ptr + r, mask=ok, other=0).to(tl.int64)
    offs = row[:, None] * D + tl.arange(0, D)[None, :]  # (BLOCK_R, D)
    if MODE == 0:
        v = tl.load(buf_ptr + offs, mask=ok[:, None], other=0.0)
        tl.store(sums_ptr + tl.program_id(0), tl.sum(tl.sum(v, axis=1), axis=0))
    elif MODE == 1:
        tl.store(buf_ptr + offs, tl.full((BLOCK_R, D), 1.0, tl.float32), mask=ok[:, None])
    else:
        tl.atomic_add(buf_ptr + offs, tl.full((BLOCK_R, D), 1.0, tl.float32), mask=ok[:, None], sem="relaxed")


def probe(N: int, Lq: int, block_r: int = 32) -> dict:
    M = heads(D)
    num_rows = N * Lq * M * L * P * 4
    buffer_rows = N * S * M
    buffer = torch.zeros((buffer_rows, D), dtype=torch.float32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    orders = {"random": torch.randint(0, buffer_rows, (num_rows,), device=DEVICE, generator=gen, dtype=torch.int32),
              "consecutive": torch.arange(num_rows, device=DEVICE, dtype=torch.int32) % buffer_rows}
    grid = (triton.cdiv(num_rows, block_r),)
    sums = torch.empty(grid[0], dtype=torch.float32, device=DEVICE)
    results = {}
    for order, rows in orders.items():
        for mode, code in PROBE_MODES.items():
            if order != "random" and mode != "atomic add":
                continue
            ms = median_ms(lambda: rows_probe_kernel[grid](buffer, rows, sums, num_rows, MODE=code, D=D,
                                                           BLOCK_R=block_r, num_warps=4))
            results[f"{mode}, {order} rows"] = {"ms": ms, "GB/s": num_rows * D * 4 / ms / 1e6}
    return {"rows": num_rows, "buffer rows": buffer_rows, "results": results}


# ----------------------------------------------------------------------------------------------------
# 3. the backward schemes' kernels
# ----------------------------------------------------------------------------------------------------
def kernel_ms(fn, calls: int = 10) -> dict:
    """{kernel name: GPU ms per call} of fn, from torch.profiler's device time, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])) as prof:
        for _ in range(calls):
            fn()
        sync()
    times: dict = {}
    for e in prof.key_averages():
        if is_device_work(e):  # names are cut short for the report: two kernels may share one
            times[e.key[:90]] = times.get(e.key[:90], 0.0) + _device_us(e) / 1e3 / calls
    return dict(sorted(((k, v) for k, v in times.items() if v > 0), key=lambda kv: -kv[1]))


def breakdown(N: int, Lq: int, dtype_name: str) -> dict:
    value, loc, weights, grad_out = make_inputs(N, Lq, heads(D), D, DTYPES[dtype_name], "uniform")
    grad_out4 = grad_out.view(N, Lq, heads(D), D)
    schemes = {"fused": dict(scheme="fused"), "gather": dict(scheme="gather"),
               "deterministic": dict(deterministic=True)}
    return {name: kernel_ms(lambda: launch.backward(grad_out4, value, LEVELS, loc, weights, **options))
            for name, options in schemes.items()}


def main():
    args = kernel_bench_args(argparse.ArgumentParser(description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    header = run_header(workload=f"encoder N2, Lq=S={S}, D={D}, M={heads(D)}, L={L}, P={P}")
    start = time.perf_counter()
    rows = []
    for dtype_name in DTYPES:
        for locations in ("uniform", "realistic"):
            row = {"dtype": dtype_name, "locations": locations, **pieces(2, S, dtype_name, locations)}
            rows.append(row)
            print(f"{dtype_name} {locations}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["ms"].items()), flush=True)
            print("    " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    atomics = probe(2, S)
    for name, r in atomics["results"].items():
        print(f"probe {name:<28} {r['ms']:.3f} ms, {r['GB/s']:.0f} GB/s over {atomics['rows']} rows", flush=True)
    kernels = {}
    for dtype_name in DTYPES:  # under --smoke the profiler sees no device time: empty tables
        kernels[dtype_name] = breakdown(2, S, dtype_name)
        for scheme, times in kernels[dtype_name].items():
            print(f"kernels {dtype_name} {scheme}: total {sum(times.values()):.3f} ms: "
                  + "; ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    header["seconds"] = time.perf_counter() - start
    (args.out / "msda_bounds_h200.json").write_text(json.dumps(
        {"header": header, "pieces": rows, "probe": atomics, "kernels": kernels}, indent=1))
    print(f"done in {header['seconds']:.0f} s")


if __name__ == "__main__":
    main()
