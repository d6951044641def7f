"""Compile every msda kernel variant for Hopper and report what the backend made of it. Needs no GPU.

    python bench/kernel_asm.py [--out DIR] [--arch 90] [--dtype fp32 bf16] [--D 32 64 128]

Compiles through Triton's own toolchain (ptxas ships with the wheel) for the encoder workload's constants in
the launch configuration launch.py would pick, and prints per kernel: compile seconds, registers, spill
bytes, and counts of the instructions that bound these kernels (global loads by width, atomics as
PTX and as SASS: REDG is a fire-and-forget reduction, ATOMG waits for the old value). Writes PTX and SASS to
--out. Useful before spending GPU time: a configuration that spills or loses its vector atomics shows here.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msda import kernels  # noqa: E402
from msda.launch import launch_config  # noqa: E402

M, L, P = 8, 4, 4
POINTER_TYPES = {"keys_ptr": "*i32", "counts_ptr": "*i32", "perm_ptr": "*i32"}  # int32 indices: all but huge calls
DTYPES = {"fp32": ("*fp32", 4), "bf16": ("*bf16", 2)}


def tool(name: str) -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else shutil.which(name) or name


def signature(fn, constants: dict, value_type: str):
    """Triton signature of ``fn``: value-like pointers in value's type, 16-byte aligned; ints unspecialized."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            # grad_value is the fp32 accumulation buffer for the scatter, value's dtype for the gather.
            value_like = name in ("value_ptr", "grad_out_ptr", "out_ptr") or (
                name == "grad_value_ptr" and fn is kernels.msda_grad_value_gather_kernel)
            sig[name] = POINTER_TYPES.get(name, value_type if value_like else "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i64" if name.startswith("levels") else "i32"
    return sig, attrs


def compile_report(fn, constants: dict, value_type: str, warps: int, arch: int, out: Path | None, label: str):
    sig, attrs = signature(fn, constants, value_type)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx_path).write_text(ptx)
        info = subprocess.run([tool("ptxas"), f"-arch=sm_{arch}a", "-v", ptx_path, "-o", cubin_path],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin_path], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    ptx_ops = Counter(re.findall(r"\b((?:atom|red)\.[\w.]+|ld\.global[\w.]*|st\.global[\w.]*)", ptx))
    sass_ops = Counter(re.findall(r"\b((?:REDG|ATOMG|RED|ATOM)\.[\w.]+)", sass))
    print(f"{label:<58} {seconds:5.1f}s  regs {regs.group(1) if regs else '?':>3}  spill "
          f"{spills.group(1) if spills else '?'} B  ptx {dict(ptx_ops)}  sass {dict(sass_ops)}", flush=True)
    if out:
        name = re.sub(r"[^\w]+", "_", label).strip("_")
        (out / f"{name}.ptx").write_text(ptx)
        (out / f"{name}.sass").write_text(sass)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--D", nargs="+", type=int, default=[32])
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    flags = {"fused": (True, True, False), "sample_grads": (True, False, False), "scatter": (False, True, False),
             "keys": (True, False, True), "hybrid": (True, True, True)}
    for D in args.D:
        for dtype in args.dtype:
            value_type, nbytes = DTYPES[dtype]
            common = dict(M=M, D=D, L=L, P=P, BLOCK_D=triton.next_power_of_2(D), COMPUTE_DTYPE=tl.float32)
            block_q, block_p, warps, unroll = launch_config(("forward", D, nbytes, L, P, True))
            compile_report(kernels.msda_forward_kernel, dict(common, BLOCK_Q=block_q, BLOCK_P=block_p, UNROLL=unroll),
                           value_type, warps, args.arch, args.out,
                           f"forward D{D} {dtype} q{block_q} p{block_p} w{warps} u{unroll}")
            for name, (grads, scatter, keys) in flags.items():
                block_q, block_p, warps = launch_config((name, D, nbytes, L, P, True))
                constants = dict(common, BLOCK_Q=block_q, BLOCK_P=block_p, SAMPLE_GRADS=grads, SCATTER=scatter,
                                 KEYS=keys)
                compile_report(kernels.msda_backward_kernel, constants, value_type, warps, args.arch, args.out,
                               f"backward:{name} D{D} {dtype} q{block_q} p{block_p} w{warps}")
            lanes, warps = launch_config(("gather", D, nbytes, True))
            for block_e in sorted({1, min(4, lanes), min(16, lanes), lanes}):
                constants = dict(common, BLOCK_S=lanes // block_e, BLOCK_E=block_e, FILLED=False)
                compile_report(kernels.msda_grad_value_gather_kernel, constants, value_type, warps, args.arch,
                               args.out, f"gather D{D} {dtype} s{lanes // block_e} e{block_e} w{warps}")
    compile_report(kernels.msda_fill_cells_kernel, dict(BLOCK=1024), "*i32", 4, args.arch, args.out, "fill_cells")


if __name__ == "__main__":
    main()
