"""Compile the msda kernels for the encoder workload and report what the backend made of them.

    python bench/kernel_asm.py [--out DIR]

Prints registers, spills and shared memory, and counts the PTX instructions that bound these kernels:
global loads by width, and atomics (scalar atom/red against vector red.v2/.v4). Writes the PTX to --out.
"""

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msda.kernels import msda_backward_kernel, msda_forward_kernel  # noqa: E402
from msda.launch import launch_config, level_table  # noqa: E402

LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
N, M, D, L, P, Lq = 1, 8, 32, 4, 4, 1000


def instruction_counts(ptx: str) -> Counter:
    counts = Counter()
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0]
        if re.match(r"(@%p\d+ )?(ld\.global|atom|red)", line.strip()) or op.startswith(("ld.global", "atom", "red")):
            counts[re.sub(r"^@!?%p\d+\s+", "", line.strip()).split(" ")[0]] += 1
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    S = sum(h * w for h, w in LEVELS)
    for dtype in (torch.float32, torch.bfloat16):
        value = torch.randn(N, S, M, D, device="cuda", dtype=dtype)
        loc = torch.rand(N, Lq, M, L, P, 2, device="cuda")
        weights = torch.rand(N, Lq, M, L, P, device="cuda")
        table = level_table(LEVELS, value.device)
        block_q, warps = launch_config(D, value.element_size(), backward=True)
        common = dict(M=M, D=D, L=L, P=P, BLOCK_Q=block_q, BLOCK_D=triton.next_power_of_2(D),
                      COMPUTE_DTYPE=tl.float32, num_warps=warps)
        grid = (triton.cdiv(Lq, block_q), N * M)
        out = torch.empty(N, Lq, M, D, device="cuda", dtype=dtype)
        fwd = msda_forward_kernel[grid](value, table, loc, weights, out, S, Lq, **common)
        grad_value = torch.zeros(N, S, M, D, device="cuda")
        bwd = msda_backward_kernel[grid](out, value, table, loc, weights, grad_value, torch.empty_like(loc),
                                         torch.empty_like(weights), S, Lq, **common)
        for name, kernel in (("forward", fwd), ("backward", bwd)):
            ptx = kernel.asm["ptx"]
            print(f"{name} {dtype}: registers {kernel.n_regs}, spills {kernel.n_spills}, "
                  f"shared {kernel.metadata.shared} B; {dict(instruction_counts(ptx))}")
            if args.out:
                (args.out / f"{name}_{str(dtype).split('.')[-1]}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
