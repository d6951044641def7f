"""What do the attention's kernels compile to on a Hopper GPU? Registers, spills, layout conversions, instructions.

    python bench/msda_sass.py                 # no GPU needed: Triton compiles for sm_90, ptxas and cuobjdump report
    python bench/msda_sass.py --arch 100      # another target

Each kernel variant that bench/msda_variants.py times (the COCO encoder's shapes: D=32, M=8, L=4, P=4), and today's
default ones, is compiled through the launchers' own plans for the target, without launching. Per variant: registers,
spilled bytes (stack and local memory: a spill is a finding), shared memory, BAR.SYNC count (Triton's layout
conversions go through shared memory behind a barrier), the SASS instruction count and, for the kernels without a
runtime loop, the thread-instructions per sample (instructions x threads / samples a program owns), the measure the
grouped kernels cut. Written to msda_sass.md under --out (outputs/bench by default).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.msda_variants import DTYPES, LEVELS, candidates  # noqa: E402
from bench.report import TRIAL, table  # noqa: E402
from msda import launch, launch_grouped  # noqa: E402
from msda.kernels import msda_backward_kernel, msda_forward_kernel  # noqa: E402
from msda.kernels_cells import msda_cell_partials_kernel, msda_cell_rows_kernel  # noqa: E402
from msda.kernels_grouped import msda_backward_grouped_kernel, msda_forward_grouped_kernel  # noqa: E402

N, LQ, M, D, P = 2, sum(h * w for h, w in LEVELS), 8, 32, 4
L = len(LEVELS)
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


def tool(name: str) -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else (shutil.which(name) or name)


def compile_variant(fn, pointer_types: list, ints: tuple, kwargs: dict, arch: int) -> dict:
    """fn compiled for sm_<arch> with these pointer element types, trailing int arguments and constexprs."""
    kwargs = dict(kwargs)
    warps = kwargs.pop("num_warps")
    names = fn.arg_names
    signature = {name: "*" + TRITON_TYPES[t] for name, t in zip(names, pointer_types)}
    signature.update({name: "i64" if abs(v) >= 2**31 else "i32" for name, v in zip(names[len(pointer_types) :], ints)})
    signature.update({name: "constexpr" for name in kwargs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointer_types))}  # as the JIT specializes them
    kernel = triton.compile(
        ASTSource(fn, signature, kwargs, attrs), target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    regs, stack, shared, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage).groups())
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)", sass))
    atomics = {op: n for op, n in ops.items() if op.startswith(("REDG", "ATOMG", "RED."))}
    return {
        "regs": regs,
        "spill": stack + local,
        "shared": shared,
        "threads": 32 * warps,
        "instructions": sum(ops.values()),
        "barriers": sum(n for op, n in ops.items() if op.startswith("BAR")),
        "atomics": ", ".join(f"{op} x{n}" for op, n in sorted(atomics.items())),
    }


def variants(dtype: torch.dtype):
    """(name, config, kernel, pointer types, ints, kwargs, samples per program or None)."""
    levels, value = LEVELS, dtype
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    for config in [None, *candidates("grouped_forward", dtype.itemsize)]:
        _, ints, kw = launch_grouped.plan("forward", N, LQ, M, D, L, P, dtype, levels, config)
        yield (
            "grouped forward",
            config,
            msda_forward_grouped_kernel,
            [value, f32, f32, value],
            ints,
            kw,
            kw["BLOCK_Q"] * L * P,
        )
    for kernel, configs in (("fused", candidates("grouped_fused", dtype.itemsize)), ("keys", [None])):
        for config in [None, *configs]:
            _, ints, kw = launch_grouped.plan(kernel, N, LQ, M, D, L, P, dtype, levels, config, L)
            yield (
                f"grouped {kernel}",
                config,
                msda_backward_grouped_kernel,
                [value, value, f32, f32, f32, f32, f32, i32, i32],
                ints,
                kw,
                kw["BLOCK_Q"] * L * P,
            )
    for config in dict.fromkeys([None, *(c for _, c in candidates("det_grouped_cells", dtype.itemsize))]):
        cells, rows, _, _ = launch_grouped.cell_plans(N, LQ, M, D, L, P, dtype, levels, config, False)
        for _, ints, kw in cells:
            yield (
                f"cell pass {kw['BLOCK_K']}x{kw['BLOCK_E']}",
                config,
                msda_cell_partials_kernel,
                [value, f32, f32, i32, i64, f32],
                ints,
                kw,
                None,
            )
        yield ("cell rows", config, msda_cell_rows_kernel, [f32, value], rows[1], rows[2], None)
    _, ints, kw = launch._plan("forward", N, LQ, M, D, L, P, dtype, levels, None)
    yield "classic forward", "table", msda_forward_kernel, [value, f32, f32, value], ints, kw, None
    _, ints, kw = launch._plan("fused", N, LQ, M, D, L, P, dtype, levels, None, L)
    yield (
        "classic fused",
        "table",
        msda_backward_kernel,
        [value, value, f32, f32, f32, f32, f32, i32, i32],
        ints,
        kw,
        kw["BLOCK_Q"] * L * P,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    parser.add_argument("--out", type=Path, default=TRIAL, help="report folder")
    return parser


def main():
    args = build_parser().parse_args()
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for name, config, fn, pointers, ints, kwargs, samples in variants(dtype):
            r = compile_variant(fn, pointers, ints, kwargs, args.arch)
            per_sample = f"{r['instructions'] * r['threads'] / samples:.0f}" if samples else "loop"
            rows.append(
                [
                    name,
                    dtype_name,
                    config or "default",
                    r["regs"],
                    r["spill"],
                    r["shared"],
                    r["barriers"],
                    r["instructions"],
                    per_sample,
                    r["atomics"],
                ]
            )
            print(" | ".join(map(str, rows[-1])), flush=True)
    lines = [
        f"# Attention kernels compiled for sm_{args.arch} (triton {triton.__version__})",
        "",
        "Per variant: registers, spilled bytes, shared bytes, BAR.SYNC count (layout conversions), SASS "
        "instructions, thread-instructions per sample (fully unrolled kernels; 'loop': a runtime loop), atomics.",
        "",
        *table(
            [
                "kernel",
                "dtype",
                "config",
                "regs",
                "spill",
                "shared",
                "barriers",
                "instructions",
                "per sample",
                "atomics",
            ],
            rows,
        ),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"msda_sass_sm{args.arch}.md").write_text("\n".join(lines) + "\n")
    spilled = [row for row in rows if row[4]]
    print(f"\n{len(rows)} variants, {len(spilled)} with spills: {args.out / f'msda_sass_sm{args.arch}.md'}")
    sys.exit(1 if spilled else 0)


if __name__ == "__main__":
    main()
