"""Kernel benchmark: Triton multi-scale deformable attention against the grid_sample reference.

    python bench/msda.py --out bench/results            # the DESIGN section 4 workloads, GPU only
    python bench/msda.py --sweep --out bench/results    # also time every (BLOCK_Q, num_warps) per workload
    python bench/msda.py --graphs --out bench/results   # decoder workloads replayed as CUDA graphs only

Workloads: COCO 800x1333 levels (100,167) (50,84) (25,42) (13,21), S = 22223, M=8, D=32, L=4, P=4;
encoder N=2 and N=4 with Lq=S, decoder N=4 with Lq=300 and 900; realistic locations (each query's
reference point plus offsets of a few pixels) and uniform ones in [0, 1]; fp32 and bf16. Everything is
timed in the same process, so ratios compare like with like. Writes msda_h200.md, msda_h200.json and
msda_h200.png into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import msda  # noqa: E402
from msda import launch  # noqa: E402

LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]
M, D, P = 8, 32, 4
S = sum(h * w for h, w in LEVELS)
WORKLOADS = [("encoder N2", 2, S), ("encoder N4", 4, S), ("decoder N4 Lq300", 4, 300), ("decoder N4 Lq900", 4, 900)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SWEEP = [(16, 2), (16, 4), (32, 4), (32, 8)]


def encoder_reference_points(N: int, device) -> torch.Tensor:
    """(N, S, 2) pixel centres of every level in normalized coordinates, as the encoder's queries."""
    points = []
    for H, W in LEVELS:
        ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
        points.append(torch.stack([(xs.flatten() + 0.5) / W, (ys.flatten() + 0.5) / H], -1))
    return torch.cat(points).expand(N, -1, -1)


def make_inputs(N, Lq, dtype, locations, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    L = len(LEVELS)
    shapes = torch.tensor(LEVELS, device=device)
    value = torch.randn(N, S, M, D, device=device, generator=gen).to(dtype)
    if locations == "uniform":
        loc = torch.rand(N, Lq, M, L, P, 2, device=device, generator=gen)
    else:  # reference point plus a few pixels of offset on each level, as a trained model samples
        ref = encoder_reference_points(N, device) if Lq == S else torch.rand(N, Lq, 2, device=device, generator=gen)
        wh = torch.tensor([[w, h] for h, w in LEVELS], device=device, dtype=torch.float32)  # (L, 2)
        pixels = torch.randn(N, Lq, M, L, P, 2, device=device, generator=gen) * 2.0
        loc = ref[:, :, None, None, None, :] + pixels / wh[None, None, None, :, None, :]
    weights = torch.rand(N, Lq, M, L * P, device=device, generator=gen).softmax(-1).view(N, Lq, M, L, P)
    return value, shapes, loc.contiguous(), weights.to(torch.float32)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def peak_extra_mib(fn) -> float:
    """Peak memory above what was allocated before fn, in MiB (output and gradients included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def time_impl(impl, value, shapes, loc, weights, grad_out, block_q=None, num_warps=None):
    """Median forward, backward and forward+backward ms and extra peak MiB of one implementation."""
    start = msda.level_start_index_from_shapes(shapes)
    if impl == "triton" and (block_q or num_warps):  # the launchers alone, for the block-size sweep
        def fwd():
            return launch.forward(value, LEVELS, loc, weights, block_q=block_q, num_warps=num_warps)

        def bwd():
            return launch.backward(grad_out, value, LEVELS, loc, weights, block_q=block_q, num_warps=num_warps)

        return {"fwd": median_ms(fwd), "bwd": median_ms(bwd)}
    leaves = [t.detach().requires_grad_() for t in (value, loc, weights)]

    def fwd():
        return msda.multi_scale_deformable_attention(leaves[0], shapes, start, leaves[1], leaves[2], impl=impl)

    out = fwd()

    def bwd():
        return torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, grad_out)

    result = {"fwd": median_ms(fwd), "bwd": median_ms(bwd), "fwd_bwd": median_ms(fwd_bwd)}
    del out
    result["peak_mib"] = peak_extra_mib(fwd_bwd)
    return result


def graph_ms(fn) -> float:
    """Median ms of ``fn`` captured once as a CUDA graph and replayed: GPU time without host overhead.

    In a training step the host runs ahead of the GPU, so a small op costs its GPU time, not the Python
    and launch time that an eager loop around it alone measures.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: compiles, caches the level layout
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def run_graphs() -> list[dict]:
    rows = []
    for name, N, Lq in WORKLOADS:
        if Lq == S:
            continue
        for dtype_name, dtype in DTYPES.items():
            value, shapes, loc, weights = make_inputs(N, Lq, dtype, "uniform")
            grad_out = torch.randn(N, Lq, M * D, device="cuda", dtype=dtype)
            start = msda.level_start_index_from_shapes(shapes)
            leaves = [t.detach().requires_grad_() for t in (value, loc, weights)]
            row = {"workload": name, "dtype": dtype_name}
            for impl in ("triton", "pytorch"):
                def fwd(impl=impl):
                    return msda.multi_scale_deformable_attention(leaves[0], shapes, start, leaves[1], leaves[2],
                                                                 impl=impl)

                def fwd_bwd(fwd=fwd):
                    return torch.autograd.grad(fwd(), leaves, grad_out)

                row[impl] = {"fwd": graph_ms(fwd), "fwd_bwd": graph_ms(fwd_bwd)}
            rows.append(row)
            print(f"graphs {name} {dtype_name}: triton fwd {row['triton']['fwd']:.3f} fwd+bwd "
                  f"{row['triton']['fwd_bwd']:.3f} | ref {row['pytorch']['fwd']:.3f} / {row['pytorch']['fwd_bwd']:.3f} ms "
                  f"| x{row['pytorch']['fwd'] / row['triton']['fwd']:.1f} / "
                  f"x{row['pytorch']['fwd_bwd'] / row['triton']['fwd_bwd']:.1f}", flush=True)
    return rows


def write_graphs_markdown(rows, path: Path, header: dict):
    lines = [f"# msda decoder workloads as CUDA graphs on {header['gpu']}", "",
             f"Date {header['date']}; torch {header['torch']}, triton {header['triton']}, Python {header['python']}.",
             f"Command: `{header['command']}`", "",
             "Each call captured once as a CUDA graph and replayed (median ms, triton.testing.do_bench): the GPU "
             "time of the op without the host's Python and launch overhead, which is what it costs inside a "
             "training step where the host runs ahead. Uniform locations; both implementations in one run.", "",
             "| workload | dtype | triton fwd | triton fwd+bwd | ref fwd | ref fwd+bwd | fwd x | fwd+bwd x |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p = r["triton"], r["pytorch"]
        lines.append(f"| {r['workload']} | {r['dtype']} | {t['fwd']:.4f} | {t['fwd_bwd']:.4f} | {p['fwd']:.4f} | "
                     f"{p['fwd_bwd']:.4f} | {p['fwd'] / t['fwd']:.1f} | {p['fwd_bwd'] / t['fwd_bwd']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def gradient_mib(value, loc, weights) -> dict:
    grads = sum(t.numel() * t.element_size() for t in (value, loc, weights))
    fp32_buffer = value.numel() * 4 if value.dtype != torch.float32 else 0
    output = value.shape[0] * loc.shape[1] * M * D * value.element_size()
    return {"grads_mib": grads / 2 ** 20, "fp32_buffer_mib": fp32_buffer / 2 ** 20, "output_mib": output / 2 ** 20}


def check_close(value, shapes, loc, weights, grad_out) -> float:
    """Largest relative error of the Triton output and gradients against the reference at this dtype."""
    results = []
    for impl in ("triton", "pytorch"):
        leaves = [t.detach().float().requires_grad_() if impl == "pytorch" else t.detach().requires_grad_()
                  for t in (value, loc, weights)]
        out = msda.multi_scale_deformable_attention(leaves[0], shapes, None, leaves[1], leaves[2], impl=impl)
        results.append([out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))])
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*results))


def run(args):
    rows, sweeps = [], []
    for name, N, Lq in WORKLOADS:
        for dtype_name, dtype in DTYPES.items():
            for locations in ("uniform", "realistic"):
                value, shapes, loc, weights = make_inputs(N, Lq, dtype, locations)
                grad_out = torch.randn(N, Lq, M * D, device="cuda", dtype=dtype)
                row = {"workload": name, "N": N, "Lq": Lq, "dtype": dtype_name, "locations": locations}
                row["max_rel_err"] = check_close(value, shapes, loc, weights, grad_out)
                row["triton"] = time_impl("triton", value, shapes, loc, weights, grad_out)
                row["pytorch"] = time_impl("pytorch", value, shapes, loc, weights, grad_out)
                row.update(gradient_mib(value, loc, weights))
                gathered = N * Lq * M * len(LEVELS) * P * 4 * D * value.element_size()
                row["gather_gbps"] = gathered / (row["triton"]["fwd"] * 1e-3) / 1e9
                if args.sweep and locations == "uniform" and name in ("encoder N2", "decoder N4 Lq300"):
                    for block_q, warps in SWEEP:
                        t = time_impl("triton", value, shapes, loc, weights, grad_out, block_q, warps)
                        sweeps.append({"workload": name, "dtype": dtype_name, "block_q": block_q,
                                       "num_warps": warps, **t})
                        print(f"sweep {name} {dtype_name} BLOCK_Q={block_q} warps={warps}: "
                              f"fwd {t['fwd']:.3f} bwd {t['bwd']:.3f} ms", flush=True)
                rows.append(row)
                print(summary_line(row), flush=True)
                # Keep what is measured so far: a run cut short by its time limit still reports.
                (args.out / "msda_h200.partial.json").write_text(json.dumps({"rows": rows, "sweeps": sweeps}))
                del value, loc, weights, grad_out
                torch.cuda.empty_cache()
    return rows, sweeps


def summary_line(r) -> str:
    t, p = r["triton"], r["pytorch"]
    return (f"{r['workload']:<17} {r['dtype']} {r['locations']:<9} triton fwd {t['fwd']:.3f} bwd {t['bwd']:.3f} "
            f"fwd+bwd {t['fwd_bwd']:.3f} ms | ref {p['fwd']:.3f} / {p['fwd_bwd']:.3f} ms | x{p['fwd'] / t['fwd']:.1f} "
            f"/ x{p['fwd_bwd'] / t['fwd_bwd']:.1f} | peak {t['peak_mib']:.0f} vs {p['peak_mib']:.0f} MiB "
            f"| {r['gather_gbps']:.0f} GB/s | err {r['max_rel_err']:.1e}")


def write_markdown(rows, sweeps, path: Path, header: dict):
    lines = [f"# msda kernel benchmark on {header['gpu']}", "",
             f"Date {header['date']}; torch {header['torch']}, triton {header['triton']}, Python {header['python']}.",
             f"Command: `{header['command']}`", "",
             "Median ms by triton.testing.do_bench; ratio = reference time / Triton time in the same run; "
             "gather GB/s = N*Lq*M*L*P*4*D*bytes / Triton forward time; peak = extra peak memory of "
             "forward+backward above the inputs (output and gradients included); max rel err = largest "
             "relative L2 error of output and gradients against the fp32 reference.", "",
             "| workload | dtype | locations | triton fwd | bwd | fwd+bwd | ref fwd | ref fwd+bwd | fwd x | fwd+bwd x "
             "| gather GB/s | triton peak MiB | ref peak MiB | budget MiB | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p = r["triton"], r["pytorch"]
        budget = 1.1 * (r["grads_mib"] + r["fp32_buffer_mib"]) + r["output_mib"]
        lines.append(
            f"| {r['workload']} | {r['dtype']} | {r['locations']} | {t['fwd']:.3f} | {t['bwd']:.3f} | {t['fwd_bwd']:.3f} "
            f"| {p['fwd']:.3f} | {p['fwd_bwd']:.3f} | {p['fwd'] / t['fwd']:.1f} | {p['fwd_bwd'] / t['fwd_bwd']:.1f} "
            f"| {r['gather_gbps']:.0f} | {t['peak_mib']:.0f} | {p['peak_mib']:.0f} | {budget:.0f} | {r['max_rel_err']:.1e} |")
    lines += ["", "Budget = output + 1.1 x (the three gradients + the fp32 grad_value buffer for bf16 value)."]
    if sweeps:
        lines += ["", "## Block-size sweep (uniform locations)", "",
                  "| workload | dtype | BLOCK_Q | num_warps | fwd ms | bwd ms |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['workload']} | {s['dtype']} | {s['block_q']} | {s['num_warps']} | {s['fwd']:.3f} | "
                  f"{s['bwd']:.3f} |" for s in sweeps]
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uniform = [r for r in rows if r["locations"] == "uniform"]
    labels = [f"{r['workload']}\n{r['dtype']}" for r in uniform]
    fwd = [r["pytorch"]["fwd"] / r["triton"]["fwd"] for r in uniform]
    both = [r["pytorch"]["fwd_bwd"] / r["triton"]["fwd_bwd"] for r in uniform]
    x = range(len(uniform))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.bar([i - 0.2 for i in x], fwd, width=0.4, label="forward")
    ax.bar([i + 0.2 for i in x], both, width=0.4, label="forward+backward")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("speed-up over grid_sample reference (x)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sweep", action="store_true", help="also time every (BLOCK_Q, num_warps)")
    parser.add_argument("--graphs", action="store_true", help="only the decoder workloads, as CUDA graphs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/msda.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    header = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "command": "python " + " ".join(sys.argv)}
    if args.graphs:
        rows = run_graphs()
        (args.out / "msda_h200_graphs.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        write_graphs_markdown(rows, args.out / "msda_h200_graphs.md", header)
        return
    rows, sweeps = run(args)
    (args.out / "msda_h200.json").write_text(json.dumps({"header": header, "rows": rows, "sweeps": sweeps}, indent=1))
    write_markdown(rows, sweeps, args.out / "msda_h200.md", header)
    (args.out / "msda_h200.partial.json").unlink()
    plot(rows, args.out / "msda_h200.png", f"msda on {header['gpu']}, {header['date']} (uniform locations)")


if __name__ == "__main__":
    main()
