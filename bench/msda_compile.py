"""Triton compile time of the attention's kernels as the default model launches them, for a GPU architecture,
on any machine: Triton compiles for a named target, so no GPU is needed.

    python bench/msda_compile.py --out bench/results             # sm_90 (H100, H200), D=32, bf16 and fp32

A run whose Triton cache is empty compiles each of these kernels once, inside its first step (with CUDA graphs
inside the first recording, eagerly in the warm-up), so their sum is most of what a cold first step waits for
beyond the setup. Per kernel and launch configuration that msda/launch.py picks for the encoder's and the
decoder's calls: the seconds of one compile into an empty cache and the size of its PTX. The kernels compile one
after another in one process, as in a run, after a small kernel that pays Triton's start. Backward schemes other
than "fused" (the default model's) are listed and not compiled.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Levels and sizes of the default model's calls at 800 x 1344: the encoder's queries are its tokens, the
# decoder's its 300 queries; only whether N * Lq * M reaches msda.launch.LARGE picks the table's entry.
LEVELS = ((100, 168), (50, 84), (25, 42), (13, 21))
CALLS = {"encoder": sum(h * w for h, w in LEVELS), "decoder": 300}
BATCH, HEADS, POINTS = 2, 8, 4


def pointer_types(value_type: str) -> dict[str, str]:
    """Triton pointer types of the kernels' tensor arguments: value and its gradient's input in the value's
    dtype, locations and weights float32 (as the model passes them under autocast), gradients accumulated in
    float32; the fused backward passes its weight gradient as the unused key and count buffers."""
    return {"value_ptr": value_type, "out_ptr": value_type, "grad_out_ptr": value_type, "loc_ptr": "*fp32",
            "weight_ptr": "*fp32", "grad_value_ptr": "*fp32", "grad_loc_ptr": "*fp32", "grad_weight_ptr": "*fp32",
            "keys_ptr": "*fp32", "counts_ptr": "*fp32"}


def compile_seconds(fn, kwargs: dict, pointers: dict, target) -> tuple[float, int]:
    """Seconds of one compile of ``fn`` with the launch keyword arguments ``kwargs``, and its PTX size."""
    import triton
    from triton.compiler import ASTSource

    constants = {k: v for k, v in kwargs.items() if k != "num_warps"}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers[name]
        else:
            signature[name] = "i64"  # the level layout and sizes (do_not_specialize)
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    started = time.perf_counter()
    kernel = triton.compile(source, target=target, options={"num_warps": kwargs["num_warps"]})
    return time.perf_counter() - started, len(kernel.asm.get("ptx", ""))


def measure(args) -> list[dict]:
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from msda import launch
    from msda.kernels import msda_backward_kernel, msda_forward_kernel

    target = GPUTarget("cuda", args.arch, 32)

    @triton.jit
    def start(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK).to(tl.float32))

    compile_seconds(start, {"BLOCK": 64, "num_warps": 4}, {"x_ptr": "*fp32"}, target)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows, compiled = [], set()
    for name in args.dtypes:
        dtype = dtypes[name]
        for call, queries in CALLS.items():
            large = BATCH * queries * HEADS >= launch.LARGE
            scheme = launch.launch_config(("scheme", args.head_dim, dtype.itemsize, len(LEVELS), POINTS, large))
            kernels = [("forward", msda_forward_kernel)] + ([("fused", msda_backward_kernel)] if scheme == "fused" else [])
            for kernel, fn in kernels:
                _, _, kwargs = launch._plan(kernel, BATCH, queries, HEADS, args.head_dim, len(LEVELS), POINTS, dtype,
                                            LEVELS, None)
                seconds, ptx = compile_seconds(fn, kwargs, pointer_types(f"*{name}"), target)
                config = [kwargs["BLOCK_Q"], kwargs["BLOCK_P"], kwargs["num_warps"], kwargs.get("UNROLL", "all")]
                key = (name, kernel, *config)
                row = {"dtype": name, "call": call, "kernel": kernel, "scheme": None if kernel == "forward" else scheme,
                       "config": config, "compile_s": seconds, "ptx_chars": ptx,
                       "cached": key in compiled}  # the other call's kernel: a run compiles it once
                compiled.add(key)
                print(f"{name} {call:<8} {kernel:<8} BLOCK_Q {config[0]:>2} BLOCK_P {config[1]:>2} warps {config[2]} "
                      f"unroll {config[3]}: {seconds:.1f} s, PTX {ptx / 1e3:.0f} k chars", flush=True)
                rows.append(row)
            if scheme != "fused":
                rows.append({"dtype": name, "call": call, "kernel": "backward", "scheme": scheme, "config": None,
                             "compile_s": None, "ptx_chars": None, "cached": False})
    return rows


def write_report(out: Path, record: dict) -> None:
    lines = [f"# Triton compile time of the attention's kernels (sm_{record['arch']})", "",
             f"{record['date']}, {record['machine']}, triton {record['triton']}: `{record['command']}`", "",
             f"Head dim {record['head_dim']}, {len(LEVELS)} levels, {POINTS} points, {HEADS} heads; one compile each "
             "into an empty cache, in one process, after a small kernel that paid Triton's start.", "",
             "| dtype | call | kernel | backward scheme | BLOCK_Q, BLOCK_P, warps, unroll | compile s | PTX k chars |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if r["compile_s"] is None:
            lines.append(f"| {r['dtype']} | {r['call']} | {r['kernel']} | {r['scheme']} | - | not compiled | - |")
            continue
        seconds = "cached (the other call's kernel)" if r["cached"] else f"{r['compile_s']:.1f}"
        lines.append(f"| {r['dtype']} | {r['call']} | {r['kernel']} | {r['scheme'] or '-'} | "
                     f"{', '.join(map(str, r['config']))} | {seconds} | {r['ptx_chars'] / 1e3:.0f} |")
    totals = ", ".join(f"{dtype} {sum(r['compile_s'] or 0 for r in record['rows'] if r['dtype'] == dtype):.1f} s"
                       for dtype in dict.fromkeys(r["dtype"] for r in record["rows"]))
    lines += ["", f"In all, what a run of each precision compiles: {totals}."]
    (out / "msda_compile.md").write_text("\n".join(lines) + "\n")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability without the dot (90: sm_90)")
    parser.add_argument("--head-dim", type=int, default=32, help="channels per head (256 / 8 in the default model)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = parser.parse_args()
    # Before triton is imported: every compile goes into an empty cache of this run's own.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="msda_compile_")
    os.environ.pop("TRITON_INTERPRET", None)
    rows = measure(args)
    import triton

    from datasets.json_file import write_json

    record = {"date": datetime.date.today().isoformat(), "arch": args.arch, "head_dim": args.head_dim,
              "machine": f"{cpu_name()}, {len(os.sched_getaffinity(0))} CPU cores",
              "triton": triton.__version__, "command": "python " + " ".join(sys.argv), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "msda_compile.json", record, indent=1)
    write_report(args.out, record)


if __name__ == "__main__":
    main()
