"""Kernel benchmark: how fast are the Triton kernels against the grid_sample reference, and with which launch table?

    python bench/msda.py                     # on a GPU: sweep, then targets; about 3-4 min on an H200
    python bench/msda.py --apply-table       # the same, and the swept table written into msda/launch_table.py
    python bench/msda.py --no-sweep          # targets only, with the table in msda/launch_table.py
    python bench/msda.py --smoke             # every code path on the CPU interpreter, tiny shapes (times meaningless)
    python bench/msda.py --external external/build --only-external   # ours beside the external ops alone: ~1 min

1. precompile  every candidate kernel in --jobs worker processes; they fill Triton's on-disk cache, so the
               timing process only loads binaries (the unrolled kernels take seconds each to compile).
2. sweep       per head dim D (32: M=8; 64: M=4; 128: M=2, so M*D = 256) on encoder N2 (Lq=S) and decoder
               N4 Lq300, uniform and realistic locations, fp32 and bf16: the forward's (BLOCK_Q, BLOCK_P, warps,
               UNROLL) and each grad_value scheme (fused, split, gather, hybrid) in its candidate configurations.
               For every table key the configuration with the least summed time over both distributions wins;
               the winners are this run's launch table (in the json; --apply-table: into msda/launch_table.py).
3. targets     encoder N2/N4 and decoder N4 Lq300/Lq900 (the COCO workloads: 800x1333 images, levels 100x167
               down to 13x21), fp32/bf16, uniform/realistic, D=32, through the public op with the picked table:
               forward, backward, forward+backward (triton.testing.do_bench median ms) against the reference in
               the same run; the deterministic backward's cost and a bitwise check of all gradients over 5
               deterministic runs, the error against the reference; decoder rows also as CUDA-graph
               replays (GPU time) and as eager loops (host time per call).
4. external    with --external BUILD (bench/build_external_ops.sh builds into external/build): ours (on weights,
               and on logits as DCNv4 takes them) beside the original Deformable DETR CUDA op (fp32) and DCNv4's
               FlashDeformAttn (fp16/bf16/fp32), encoder N2 and
               decoder N2 Lq300, each dtype an op supports: first each op's output and gradients against the
               float64 reference at a small and the COCO shape (an op that disagrees is not timed), then forward
               and forward+backward. bench/external_ops.py loads and adapts them; one that is missing or fails to
               import is named in the report. --only-external runs this step alone (no sweep, no targets) and
               replaces the external section of the current report (--out's, else bench/results').
Writes msda_h200.json and msda_h200.md (partial JSON in --out as it goes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--smoke" in sys.argv:
    # The interpreter must be on before triton is imported; the workers inherit it through the environment.
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import msda  # noqa: E402
from bench import external_ops  # noqa: E402
from bench.report import RESULTS, cell, header_lines, out_dir, run_header, table, write_report  # noqa: E402
from msda import launch  # noqa: E402

NAME = "msda_h200"
LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
S = sum(h * w for h, w in LEVELS)
L, P, HIDDEN = len(LEVELS), 4, 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NBYTES = {"fp32": 4, "bf16": 2}
DISTS = ("uniform", "realistic")
SWEEP_WORKLOADS = [("encoder N2", 2, S), ("decoder N4 Lq300", 4, 300)]
TARGET_WORKLOADS = [
    ("encoder N2", 2, S),
    ("encoder N4", 4, S),
    ("decoder N4 Lq300", 4, 300),
    ("decoder N4 Lq900", 4, 900),
]
EXTERNAL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EXTERNAL_WORKLOADS = [("encoder N2", 2, S), ("decoder N2 Lq300", 2, 300)]
CHECK_LEVELS, CHECK_LQ = ((9, 11), (5, 6), (3, 3), (2, 1)), 24  # the external checks' small shape (N=2), then COCO's
DEVICE = "cuda"
if launch.INTERPRET:  # --smoke: tiny levels and query counts on the CPU, so that every code path runs in minutes
    LEVELS, DEVICE, HIDDEN = ((6, 5), (3, 3), (2, 2), (1, 1)), "cpu", 64
    S = sum(h * w for h, w in LEVELS)
    SWEEP_WORKLOADS = [("encoder N2", 2, S), ("decoder N4 Lq300", 4, 3)]
    TARGET_WORKLOADS = [
        ("encoder N2", 2, S),
        ("encoder N4", 4, S),
        ("decoder N4 Lq300", 4, 3),
        ("decoder N4 Lq900", 4, 5),
    ]
    EXTERNAL_WORKLOADS = [("encoder N2", 2, S), ("decoder N2 Lq300", 2, 3)]
    CHECK_LEVELS, CHECK_LQ = ((3, 2), (2, 2), (1, 2), (1, 1)), 4
LAUNCH_PY = ROOT / "msda" / "launch_table.py"
SWEPT_KINDS = ("forward", "fused", "sample_grads", "scatter", "keys", "hybrid", "gather", "hybrid_split", "scheme")
TUNED_BLOCK = re.compile(r"(?:# Measured on .*\n# .*\n)?TUNED: dict = \{\n(?:    .*\n)*\}\n")


def heads(D: int) -> int:
    """M for head dim D at the model's width (M*D = 256)."""
    return max(1, HIDDEN // D)


# Steps of L*P / BLOCK_P samples that a kernel may unroll: the backward unrolls all of its steps, so its candidates
# take BLOCK_P >= L*P / 4; the forward's loop is unrolled at most this many times. Triton's compile time grows much
# faster than the unrolled code (the default model's kernels: 5 s against 15 s fully unrolled, bf16, a 2-core CPU),
# and a run with an empty cache pays it in its first step; 16 unrolled steps gained at most 1.4% of kernel time
# (the H200 sweep of 2026-12-02).
MAX_UNROLLED_STEPS = 4


def forward_unrolled(configs: list) -> list:
    """Each forward (BLOCK_Q, BLOCK_P, warps) with the loop over its L*P / BLOCK_P steps unrolled 1, 2 or 4 times
    (one step needs no unrolling)."""
    return [(*c, unroll) for c in configs for unroll in ((1, 2, MAX_UNROLLED_STEPS) if c[1] < L * P else (1,))]


def candidates(D: int) -> dict:
    """Configurations timed per kernel. Forward: (BLOCK_Q, BLOCK_P, num_warps, UNROLL); the other query kernels:
    (BLOCK_Q, BLOCK_P, num_warps); split uses one for both of its kernels; gather: ((BLOCK_Q, BLOCK_P, warps) of
    the keys kernel, (lanes, warps) of the row sums); hybrid: ((BLOCK_Q, BLOCK_P, warps), entries per value row
    from which a level is gathered)."""
    if DEVICE == "cpu":  # --smoke: wide programs, which the interpreter runs fastest; two each for the picks
        return {
            "forward": [(64, 16, 4, 1), (32, 16, 2, 1)],
            "fused": [(64, 16, 4), (32, 16, 2)],
            "split": [(64, 16, 4)],
            "gather": [((64, 16, 4), (256, 4)), ((32, 16, 2), (128, 2))],
            "hybrid": [((64, 16, 4), 8)],
        }
    if D == 32:  # (16, 1, *) is the forward's measured best: one sample per step, 16 queries
        return {
            "forward": forward_unrolled([(16, 1, 4), (16, 1, 2), (8, 2, 4), (4, 4, 4), (2, 16, 4), (4, 16, 8)]),
            "fused": [(4, 4, 4), (2, 16, 4)],
            "split": [(4, 4, 4), (2, 16, 4)],
            "gather": [((4, 4, 4), (32, 4)), ((2, 16, 4), (32, 4)), ((2, 16, 4), (64, 8))],
            "hybrid": [((4, 4, 4), 256), ((4, 4, 4), 64), ((2, 16, 4), 256)],
        }
    wide, narrow = max(1, 512 // D), max(1, 128 // D)  # keep BLOCK_Q * D about that of the D=32 candidates
    return {
        "forward": forward_unrolled([(wide, 1, 4), (narrow, 4, 4), (1, 16, 4 if D <= 64 else 8)]),
        "fused": [(narrow, 4, 4)],
        "split": [(narrow, 4, 4)],
        "gather": [((narrow, 4, 4), (max(8, 1024 // D), 4))],
        "hybrid": [((narrow, 4, 4), 256)],
    }


def make_inputs(N, Lq, M, D, dtype, locations, seed=0):
    """value, fp32 locations and weights, upstream gradient. Realistic: each query's reference point (the
    encoder's own pixel centre, the decoder's a random point) plus offsets of a few pixels on every level."""
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(seed)
    value = torch.randn(N, S, M, D, device=dev, generator=gen).to(dtype)
    if locations == "uniform":
        loc = torch.rand(N, Lq, M, L, P, 2, device=dev, generator=gen)
    else:
        if Lq == S:  # the encoder: every level's pixel centres, as (x, y)
            axes = [[(torch.arange(n, device=dev) + 0.5) / n for n in (w, h)] for h, w in LEVELS]
            ref = torch.cat([torch.stack(torch.meshgrid(*xy, indexing="xy"), -1).flatten(0, 1) for xy in axes])
            ref = ref.expand(N, -1, -1)
        else:
            ref = torch.rand(N, Lq, 2, device=dev, generator=gen)
        wh = torch.tensor([[w, h] for h, w in LEVELS], device=dev, dtype=torch.float32)  # (L, 2)
        pixels = torch.randn(N, Lq, M, L, P, 2, device=dev, generator=gen) * 2.0
        loc = ref[:, :, None, None, None, :] + pixels / wh[None, None, None, :, None, :]
    weights = torch.rand(N, Lq, M, L * P, device=dev, generator=gen).softmax(-1).view(N, Lq, M, L, P)
    grad_out = torch.randn(N, Lq, M * D, device=dev, generator=gen).to(dtype)
    return value, loc.contiguous(), weights, grad_out


def run_variant(kind, config, value, loc, weights, grad_out):
    """One call of a sweep candidate through the launchers, on the classic kernels, whose configurations the sweep
    picks (the table's kernel families can choose the grouped ones, which take other configurations and no split)."""
    if kind == "forward":
        return launch.forward(value, LEVELS, loc, weights, config=config, kernels="classic")
    if kind == "fused":
        scheme, configs = "fused", {"fused": config}
    elif kind == "split":
        scheme, configs = "split", {"sample_grads": config, "scatter": config}
    elif kind == "hybrid":
        scheme, configs = "hybrid", {"hybrid": config[0], "hybrid_split": config[1]}
    else:  # gather, or "sorted": the deterministic gather (the same keys kernel, an int64 permutation)
        scheme, configs = "gather", {"keys": config[0], "gather": config[1]}
    options = {"scheme": scheme, "configs": configs, "deterministic": kind == "sorted", "kernels": "classic"}
    return launch.backward(grad_out, value, LEVELS, loc, weights, **options)


def median_ms(fn, rep=50) -> float:
    if DEVICE == "cpu":  # --smoke: one interpreted call, wall clock
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# 1. precompile in worker processes
# ----------------------------------------------------------------------------------------------------
_WORKER_INPUTS: dict = {}


def _warm(task) -> str:
    D, N, Lq, dtype_name, kind, config = task
    try:
        key = (D, N, Lq, dtype_name)
        if key not in _WORKER_INPUTS:
            _WORKER_INPUTS[key] = make_inputs(N, Lq, heads(D), D, DTYPES[dtype_name], "uniform")
        run_variant(kind, config, *_WORKER_INPUTS[key])
        sync()
        return ""
    except Exception as error:  # reported, and the timing process compiles it itself
        return f"{task}: {type(error).__name__}: {error}"


def precompile(dims, jobs: int):
    tasks = []
    for D in dims:
        for _, N, Lq in SWEEP_WORKLOADS:
            for dtype_name in DTYPES:
                for kind, configs in candidates(D).items():
                    # Query kernels compile the same for every workload; the gather's tiles follow its density.
                    if kind in ("gather", "hybrid") or (N, Lq) == SWEEP_WORKLOADS[0][1:]:
                        tasks += [(D, N, Lq, dtype_name, kind, config) for config in configs]
                    if kind == "gather":  # the deterministic path: same keys kernel, int64 perm
                        tasks += [(D, N, Lq, dtype_name, "sorted", config) for config in configs]
    # One-sample-per-step kernels compile longest: start them first.
    tasks.sort(key=lambda t: t[4] in ("gather", "sorted") or t[5][1] != 1)
    tasks = tasks[:4] if DEVICE == "cpu" else tasks  # --smoke: the pool itself is what is checked
    in_pool(_warm, tasks, jobs, "variants")


def in_pool(fn, tasks: list, jobs: int, what: str) -> None:
    """fn over tasks in ``jobs`` spawned processes, which fill Triton's on-disk cache; fn returns "" or an error."""
    start = time.perf_counter()
    try:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
            errors = [e for e in pool.imap_unordered(fn, tasks) if e]
    except Exception as error:  # without the pool every kernel still compiles on first use, only slower
        errors = [f"the pool itself: {type(error).__name__}: {error}"]
    print(
        f"precompiled {len(tasks)} {what} in {time.perf_counter() - start:.0f} s with {min(jobs, len(tasks))} "
        "processes" + "".join(f"\n  failed {e}" for e in errors),
        flush=True,
    )


# ----------------------------------------------------------------------------------------------------
# 2. sweep and picks
# ----------------------------------------------------------------------------------------------------
def sweep(dims, out: Path) -> list:
    records = []
    for D in dims:
        for name, N, Lq in SWEEP_WORKLOADS:
            for dtype_name, dtype in DTYPES.items():
                for dist in DISTS:
                    inputs = make_inputs(N, Lq, heads(D), D, dtype, dist)
                    large = N * Lq * heads(D) >= launch.LARGE
                    point = {"D": D, "workload": name, "large": large, "dtype": dtype_name, "locations": dist}
                    timed = []
                    for kind, configs in candidates(D).items():
                        for config in configs:
                            ms = median_ms(lambda: run_variant(kind, config, *inputs), rep=30)
                            timed.append({**point, "kind": kind, "config": config, "ms": ms})
                    records += timed
                    best = {k: min(r["ms"] for r in timed if r["kind"] == k) for k in candidates(D)}
                    print(
                        f"sweep D{D} {name:<17} {dtype_name} {dist:<9} best ms: "
                        + " ".join(f"{k} {v:.3f}" for k, v in best.items()),
                        flush=True,
                    )
        (out / f"{NAME}_sweep.partial.json").write_text(json.dumps(records))
    return records


def picks(records) -> dict:
    """Launch-table entries: per (kind, D, dtype, size) the config with the least time summed over locations."""
    totals: dict = {}
    for r in records:
        key = (r["kind"], r["D"], NBYTES[r["dtype"]], r["large"])
        config = r["config"]
        config = tuple(tuple(c) if isinstance(c, (list, tuple)) else c for c in config)
        totals.setdefault(key, {}).setdefault(config, []).append(r["ms"])
    table, best_scheme = {}, {}
    for (kind, D, nbytes, large), by_config in totals.items():
        config, times = min(by_config.items(), key=lambda item: sum(item[1]))
        if kind == "forward":
            table[("forward", D, nbytes, L, P, large)] = config
            continue
        if kind == "fused":
            table[("fused", D, nbytes, L, P, large)] = config
        elif kind == "split":
            table[("sample_grads", D, nbytes, L, P, large)] = table[("scatter", D, nbytes, L, P, large)] = config
        elif kind == "hybrid":
            table[("hybrid", D, nbytes, L, P, large)], table[("hybrid_split", D, nbytes, large)] = config
        else:
            table[("keys", D, nbytes, L, P, large)], table[("gather", D, nbytes, large)] = config
        best_scheme.setdefault((D, nbytes, large), []).append((sum(times), kind))
    for (D, nbytes, large), options in best_scheme.items():
        table[("scheme", D, nbytes, L, P, large)] = min(options)[1]
    return table


# ----------------------------------------------------------------------------------------------------
# 3. targets
# ----------------------------------------------------------------------------------------------------
def graph_ms(fn) -> float:
    """fn captured once as a CUDA graph and replayed: its GPU time without the host's share (NaN if the
    capture fails, which is itself a finding: the op must stay capturable)."""
    if DEVICE == "cpu":
        return float("nan")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:
        print(f"CUDA-graph capture failed: {type(error).__name__}: {error}", flush=True)
        return float("nan")
    return median_ms(graph.replay)


def eager_ms(fn, calls=100) -> float:
    """Wall ms per call of a plain Python loop, synchronized at its end: host-bound for small calls."""
    calls = calls if DEVICE == "cuda" else 1
    for _ in range(5 if DEVICE == "cuda" else 0):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e3


def time_public(impl, inputs, shapes, decoder: bool) -> dict:
    """Forward, backward (autograd over a retained graph) and forward+backward through the public op."""
    value, loc, weights, grad_out = inputs
    leaves = [t.detach().requires_grad_() for t in (value, loc, weights)]

    def fwd():
        return msda.multi_scale_deformable_attention(leaves[0], shapes, None, leaves[1], leaves[2], impl=impl)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, grad_out)

    out = fwd()
    result = {
        "fwd": median_ms(fwd),
        "bwd": median_ms(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)),
        "fwd_bwd": median_ms(fwd_bwd),
    }
    if decoder:  # decoder-sized calls are bound by the host when called eagerly
        result["graph_fwd_bwd"] = graph_ms(fwd_bwd)
        result["eager_fwd_bwd"] = eager_ms(fwd_bwd)
    return result


def max_rel_err(inputs, shapes) -> float:
    value, loc, weights, grad_out = inputs
    results = []
    for impl in ("triton", "pytorch"):
        cast = (lambda t: t.float()) if impl == "pytorch" else (lambda t: t)
        leaves = [cast(t.detach()).requires_grad_() for t in (value, loc, weights)]
        out = msda.multi_scale_deformable_attention(leaves[0], shapes, None, leaves[1], leaves[2], impl=impl)
        results.append([out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))])
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*results))


def deterministic_stats(inputs) -> dict:
    """The deterministic backward (launcher alone) against the default one, and whether 5 runs agree bitwise."""
    value, loc, weights, grad_out = inputs

    def det():
        return launch.backward(grad_out, value, LEVELS, loc, weights, deterministic=True)

    runs = [det() for _ in range(5)]
    return {
        "det_bwd": median_ms(det),
        "default_bwd": median_ms(lambda: launch.backward(grad_out, value, LEVELS, loc, weights)),
        "det_bitwise_5": all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run)),
    }


def targets(out: Path) -> list:
    rows = []
    shapes = torch.tensor(LEVELS, device=DEVICE)
    for name, N, Lq in TARGET_WORKLOADS:
        for dtype_name, dtype in DTYPES.items():
            for dist in DISTS:
                inputs = make_inputs(N, Lq, heads(32), 32, dtype, dist)
                large = N * Lq * heads(32) >= launch.LARGE
                row = {"workload": name, "N": N, "Lq": Lq, "dtype": dtype_name, "locations": dist}
                row["scheme"] = launch.launch_config(("scheme", 32, NBYTES[dtype_name], L, P, large))
                row["max_rel_err"] = max_rel_err(inputs, shapes)
                decoder = Lq < S and dist == "uniform"  # the eager loop and the graph replay: time_public
                row.update({impl: time_public(impl, inputs, shapes, decoder) for impl in ("triton", "pytorch")})
                row.update(deterministic_stats(inputs))
                rows.append(row)
                t, p = row["triton"], row["pytorch"]
                print(
                    f"{name:<17} {dtype_name} {dist:<9} {row['scheme']:<6} fwd {t['fwd']:.3f} fwd+bwd "
                    f"{t['fwd_bwd']:.3f} ms | ref {p['fwd']:.3f} / {p['fwd_bwd']:.3f} | x{p['fwd'] / t['fwd']:.1f} / "
                    f"x{p['fwd_bwd'] / t['fwd_bwd']:.1f} | err {row['max_rel_err']:.1e}",
                    flush=True,
                )
                (out / f"{NAME}.partial.json").write_text(json.dumps(rows))
                del inputs
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    return rows


def target_checks(rows) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for each of the kernels' design targets."""

    def find(workload, dtype, dist="uniform"):
        return next(r for r in rows if (r["workload"], r["dtype"], r["locations"]) == (workload, dtype, dist))

    def ratio(row, key):
        return row["pytorch"][key] / row["triton"][key]

    enc = find("encoder N2", "fp32")
    checks = []
    for key, target in (("fwd_bwd", 16.5), ("fwd", 17)):
        speedup = ratio(enc, key)
        name = f"encoder N2 fp32 uniform {key.replace('_', '+')} >= {target}x"
        checks.append((name, f"{speedup:.1f}x", speedup >= target))
    for dist in DISTS:
        fp32, bf16 = (find("encoder N2", dtype, dist)["triton"]["fwd_bwd"] for dtype in ("fp32", "bf16"))
        speed = fp32 / bf16
        checks.append((f"encoder N2 bf16 fwd+bwd >= 1.3x faster than fp32 ({dist})", f"{speed:.2f}x", speed >= 1.3))
    for workload in ("decoder N4 Lq300", "decoder N4 Lq900"):
        for dtype in DTYPES:
            r = find(workload, dtype)
            eager = ratio(r, "eager_fwd_bwd")
            measured = f"{eager:.1f}x eager loop, {ratio(r, 'fwd_bwd'):.1f}x do_bench"
            checks.append((f"{workload} {dtype} eager fwd+bwd >= 7x", measured, eager >= 7))
    bitwise = all(r["det_bitwise_5"] for r in rows)
    cost = max(r["det_bwd"] / r["default_bwd"] for r in rows if r["workload"].startswith("encoder"))
    return checks + [
        ("deterministic grad_value bitwise identical over 5 runs (all rows)", str(bitwise), bitwise),
        ("deterministic backward <= 1.5x the default backward (worst encoder row)", f"{cost:.2f}x", cost <= 1.5),
    ]


# ----------------------------------------------------------------------------------------------------
# 4. beside the external ops
# ----------------------------------------------------------------------------------------------------
def _check_shapes(N=2) -> list[tuple]:
    """(levels, N, Lq) of the checks: the small shape, then the COCO encoder's."""
    return [(CHECK_LEVELS, N, CHECK_LQ), (LEVELS, N, S)]


def _warm_ours(task) -> str:
    logits, dtype_name, levels, N, Lq = task
    try:
        op = external_ops.Ours(logits)
        external_ops.check(op, EXTERNAL_DTYPES[dtype_name], levels, N, Lq, heads(32), 32, DEVICE)
        sync()
        return ""
    except Exception as error:
        return f"{'logits' if logits else 'weights'} {dtype_name} N{N} Lq{Lq}: {type(error).__name__}: {error}"


def time_op(op, inputs, shapes, start, backward: bool) -> dict:
    """Forward and forward+backward of one op on make_inputs' inputs (its logits: the log of the weights)."""
    value, loc, weights, grad_out = inputs
    given = weights.log() if op.takes_logits else weights
    leaves = [t.detach().requires_grad_() for t in op.leaves(value, loc, given, value.dtype)]

    def fwd():
        return op(leaves, shapes, start)

    result = {"fwd": median_ms(fwd)}
    if backward:
        result["fwd_bwd"] = median_ms(lambda: torch.autograd.grad(fwd(), leaves, grad_out))
    return result


def external_comparison(build: Path | None, jobs: int) -> dict:
    """Ours beside the external ops: each op's checks in each dtype it supports, then its timings where they
    passed (the report's external section)."""
    ops, notes = external_ops.load(build)
    section = {"header": run_header(), "notes": notes, "checks": [], "rows": []}
    if DEVICE == "cuda" and not torch.cuda.is_available():
        section["skipped"] = "no CUDA device: nothing was run (--smoke runs ours under Triton's interpreter)"
        return section
    start_time = time.perf_counter()
    if DEVICE == "cuda":  # ours compiles for each dtype and shape class: in parallel, before anything is timed
        shapes_used = _check_shapes() + [(LEVELS, N, Lq) for _, N, Lq in EXTERNAL_WORKLOADS[1:]]
        tasks = [(logits, d, *shape) for logits in (False, True) for d in EXTERNAL_DTYPES for shape in shapes_used]
        in_pool(_warm_ours, tasks, jobs, "public calls")
    passed = {}  # (op, dtype) -> (forward passed at every shape, backward too)
    for op in ops:
        for dtype in op.dtypes:
            results = [external_ops.check(op, dtype, *shape, heads(32), 32, DEVICE) for shape in _check_shapes()]
            section["checks"] += results
            passed[op.name, dtype] = (all(r["fwd_ok"] for r in results), all(r["bwd_ok"] for r in results))
            for r in results:
                worst = max((e[0] for e in r["errors"].values()), default=float("nan"))
                print(
                    f"check {op.name:<15} {r['dtype']} N{r['N']} Lq{r['Lq']:<6} worst rel err {worst:.1e} "
                    f"(tolerance {r['tolerance']:.0e}) {check_verdict(r)} {r.get('error', '')}",
                    flush=True,
                )
    shapes = torch.tensor(LEVELS, device=DEVICE)
    start = msda.level_start_index_from_shapes(shapes)
    names = [op.name for op in ops]
    for name, N, Lq in EXTERNAL_WORKLOADS:
        for dist in DISTS:
            for dtype_name, dtype in EXTERNAL_DTYPES.items():
                inputs = make_inputs(N, Lq, heads(32), 32, dtype, dist)
                row = {"workload": name, "N": N, "Lq": Lq, "locations": dist, "dtype": dtype_name}
                for op in (op for op in ops if dtype in op.dtypes and passed[op.name, dtype][0]):
                    try:
                        row[op.name] = time_op(op, inputs, shapes, start, backward=passed[op.name, dtype][1])
                    except Exception as error:  # reported, the other ops still timed
                        row.setdefault("errors", {})[op.name] = external_ops.describe(error)
                section["rows"].append(row)
                timed = [f"{n} " + " / ".join(f"{v:.3f}" for v in row[n].values()) for n in names if n in row]
                print(f"{name:<17} {dist:<9} {dtype_name} " + " | ".join(timed), row.get("errors", ""), flush=True)
    dcnv4 = [op for op in ops if isinstance(op, external_ops.FlashDeformAttn)]
    section["dcnv4_launch"] = {"N{} Lq{} M{} D{}".format(*key): spec for op in dcnv4 for key, spec in op.specs.items()}
    section["header"]["seconds"] = time.perf_counter() - start_time
    return section


# Each external op against ours in the same contract: DCNv4 (softmax inside) against ours on logits, the original
# (softmaxed weights given) against ours on weights.
OURS_FOR = {"dcnv4": "ours_logits", "deformable_detr": "ours"}
# The ratio table's pairs of columns: ours in fp16 and bf16 against DCNv4, in fp32 against the original.
AGAINST = {
    "DCNv4 fp16": ("fp16", "dcnv4"),
    "DCNv4 bf16": ("bf16", "dcnv4"),
    "original fp32": ("fp32", "deformable_detr"),
}


def check_verdict(check: dict) -> str:
    """An external check's verdict: the op is timed forward and backward, forward only, or not at all."""
    return "ok" if check["fwd_ok"] and check["bwd_ok"] else "forward only" if check["fwd_ok"] else "REFUSED"


def checks_table(checks: list[tuple[str, str, bool]]) -> list[str]:
    return table("target | measured | met", [[name, value, "yes" if ok else "NO"] for name, value, ok in checks])


def print_checks(checks: list[tuple[str, str, bool]]) -> None:
    for name, value, ok in checks:
        print(f"{'met   ' if ok else 'MISSED'} {name}: {value}")


def _ratio(row, theirs: str, key: str, ours: str | None = None) -> float | None:
    """Their ms over ours in the row (> 1: ours is faster); None where either was not timed."""
    ours = ours or OURS_FOR[theirs]
    if key not in row.get(theirs, {}) or key not in row.get(ours, {}):
        return None
    return row[theirs][key] / row[ours][key]


def external_targets(section) -> list[tuple[str, str, bool]]:
    """(target, measured, met): our fp16 forward against DCNv4's on the encoder, both softmaxing the logits."""
    checks = []
    for r in section["rows"]:
        if r["workload"] == EXTERNAL_WORKLOADS[0][0] and r["dtype"] == "fp16":
            ratio, on_weights = _ratio(r, "dcnv4", "fwd"), _ratio(r, "dcnv4", "fwd", ours="ours")
            measured = f"{cell(ratio, '.2f')}x (ours on weights: {cell(on_weights, '.2f')}x)"
            target = f"{r['workload']} fp16 {r['locations']}: our forward >= 1.2x DCNv4's"
            checks.append((target, "DCNv4 not timed" if ratio is None else measured, (ratio or 0) >= 1.2))
    return checks


def external_lines(section, standalone: bool = False) -> list[str]:
    """The report's section on the external ops, under its own run's header (a report of its own if standalone)."""
    lines = header_lines(
        "Multi-scale deformable attention: the Triton kernels beside the external ops",
        section["header"],
        "Ours, the original Deformable DETR CUDA op (`deformable_detr`, fp32) and DCNv4's FlashDeformAttn kernels "
        "(`dcnv4`), built by bench/build_external_ops.sh and adapted by bench/external_ops.py, each given its inputs "
        "as its module passes them: ours the value in the dtype with fp32 locations and softmaxed weights (`ours`) "
        "or their logits (`ours_logits`: weights_are_logits, the softmax over L*P inside the kernels, as the model "
        "calls it on CUDA), DCNv4 the value and the packed locations and logits in the dtype (its kernels apply the "
        "softmax too), the original fp32 throughout; DCNv4 is compared with ours_logits, the original with ours. "
        "DCNv4 runs through its extension with the launch its wrapper picks (d_stride, threads per block: below), "
        "computed once per shape: the wrapper itself recomputes it on every call with a Python loop over the "
        "divisors of N*Lq, host time that is not counted here. Checks: relative L2 error of the output and each "
        "gradient against our PyTorch reference in float64 on the op's own inputs, at a small shape and at the COCO "
        "encoder's; an op is timed in a dtype only where every error is within the tolerance (its backward only "
        "where the gradients are too). Timings: median ms (triton.testing.do_bench) of the forward and the "
        "forward+backward, D=32, M=8; ratios: their ms over ours in the same dtype and contract (ours fp32 against "
        "the original), > 1 where ours is faster.",
    )
    if not standalone:
        lines[0] = "## Beside the external ops"
    lines += [f"- `{name}`: {note}" for name, note in section["notes"].items()]
    if "skipped" in section:
        return lines + ["", section["skipped"]]
    checks = []
    for c in section["checks"]:
        errors = {k: e[0] for k, e in c["errors"].items()}
        relative = [errors.get(k) for k in ("output", "grad_value", "grad_loc")]
        relative.append(errors.get("grad_logits", errors.get("grad_weights")))
        figures = [*relative, max((e[1] for e in c["errors"].values()), default=None)]  # and the largest absolute
        shape, tolerance = f"N{c['N']} Lq{c['Lq']}", f"{c['tolerance']:.0e}"
        verdict = check_verdict(c) + (f": {c['error']}" if "error" in c else "")
        checks.append([c["op"], c["dtype"], shape, *(cell(e, ".1e") for e in figures), tolerance, verdict])
    columns = "op | dtype | shape | output | grad value | grad loc | grad weights/logits | max abs | tol | verdict"
    lines += ["", *table(columns, checks)]
    names, keys = ("ours", "ours_logits", "dcnv4", "deformable_detr"), ("fwd", "fwd_bwd")
    timings = [
        [r["workload"], r["locations"], r["dtype"], *(cell(r.get(n, {}).get(k), ".3f") for n in names for k in keys)]
        for r in section["rows"]
    ]
    columns = ["workload", "locations", "dtype"] + [f"{n} {k.replace('_', '+')}" for n in names for k in keys]
    lines += ["", *table(columns, timings)]
    lines += [
        f"- {r['workload']} {r['locations']} {r['dtype']}: {name} failed: {error}"
        for r in section["rows"]
        for name, error in r.get("errors", {}).items()
    ]
    by_key = {(r["workload"], r["locations"], r["dtype"]): r for r in section["rows"]}
    ratios = [
        [w, dist, *(cell(_ratio(by_key[w, dist, d], theirs, k), ".2f") for d, theirs in AGAINST.values() for k in keys)]
        for w, dist, dtype in by_key
        if dtype == "fp32"
    ]
    columns = ["workload", "locations"] + [f"vs {label} {k}" for label in AGAINST for k in ("fwd", "fwd+bwd")]
    lines += ["", *table(columns, ratios)]
    if section.get("dcnv4_launch"):
        launches = "; ".join(f"{k}: {tuple(v[:2])}, {tuple(v[2:])}" for k, v in section["dcnv4_launch"].items())
        lines += [
            "",
            "DCNv4's launch as its wrapper picks it, (d_stride, threads per block) of the forward then the "
            f"backward: {launches}.",
        ]
    return lines + ["", *checks_table(external_targets(section))]


def table_source(table: dict, header: dict) -> str:
    """The launch table as msda/launch_table.py holds it: the TUNED block, headed by the run it comes from."""
    lines = [
        f"# Measured on {header['gpu']}, {header['date']}, torch {header['torch']}, triton {header['triton']}:",
        f"# {header['command']}",
        "TUNED: dict = {",
    ]
    lines += [f"    {key!r}: {value!r}," for key, value in sorted(table.items(), key=lambda kv: str(kv[0]))]
    return "\n".join(lines + ["}"]) + "\n"


def apply_table(source: str) -> None:
    """Replace msda/launch_table.py's TUNED block (and the two comment lines above it) with ``source``."""
    text = LAUNCH_PY.read_text()
    if len(TUNED_BLOCK.findall(text)) != 1:
        raise SystemExit(f"{LAUNCH_PY}: expected exactly one TUNED block")
    LAUNCH_PY.write_text(TUNED_BLOCK.sub(lambda _: source, text))
    print(f"{LAUNCH_PY}: TUNED replaced with this run's table", flush=True)


def report_lines(record: dict) -> list[str]:
    """The kernels' tables, then the external section where the record has one; the external section alone after
    an --only-external run with no report to join."""
    if "rows" not in record:
        return external_lines(record["external"], standalone=True)
    return kernel_lines(record) + (["", *external_lines(record["external"])] if "external" in record else [])


def kernel_lines(record: dict) -> list[str]:
    header, rows = record["header"], record["rows"]
    lines = header_lines(
        "Multi-scale deformable attention: Triton kernels against the PyTorch reference",
        header,
        "Median ms (triton.testing.do_bench) through the public op, head dim 32; fwd+bwd x and fwd x: the "
        "reference's time over Triton's, same run (the reference: grid_sample, impl=pytorch, on the same inputs). det "
        "cost: the deterministic backward over the default (atomic) one, bitwise: its gradients equal over 5 runs; "
        "err: largest relative L2 error of the output and gradients against the fp32 reference. Decoder rows "
        "(uniform): eager = wall ms per forward+backward of a Python loop (host-bound), graph = its CUDA-graph "
        f"replay (GPU time). {record.get('table_note', '')}".rstrip(),
    )
    cells = []
    for r in rows:
        t, p = r["triton"], r["pytorch"]
        times = [f"{ms:.3f}" for ms in (t["fwd"], t["fwd_bwd"], p["fwd"], p["fwd_bwd"])]
        speedups = [f"{p[key] / t[key]:.1f}" for key in ("fwd", "fwd_bwd")]
        det = [f"{r['det_bwd'] / r['default_bwd']:.2f}", r["det_bitwise_5"], f"{r['max_rel_err']:.1e}"]
        eager = [t.get("eager_fwd_bwd"), p.get("eager_fwd_bwd"), t.get("graph_fwd_bwd")]  # decoder rows only
        eager = ["" if ms is None else f"{ms:.3f}" for ms in eager]
        cells.append([r["workload"], r["dtype"], r["locations"], r["scheme"], *times, *speedups, *det, *eager])
    lines += table(
        "workload | dtype | locations | scheme | fwd | fwd+bwd | ref fwd | ref fwd+bwd | fwd x | fwd+bwd x | det cost "
        "| bitwise | err | eager fwd+bwd | ref eager | graph fwd+bwd",
        cells,
    )
    return lines + ["", *checks_table(target_checks(rows))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; smoke: outputs/bench)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check the script end to end on the CPU interpreter (tiny shapes, times meaningless)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="targets only, with the table in msda/launch_table.py")
    parser.add_argument(
        "--apply-table",
        action="store_true",
        help="write the swept launch table into msda/launch_table.py (its TUNED block)",
    )
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128], help="head dims to sweep")
    parser.add_argument(
        "--external",
        type=Path,
        metavar="BUILD",
        help="also time ours beside the external ops built in BUILD (external/build: bench/build_external_ops.sh)",
    )
    parser.add_argument(
        "--only-external",
        action="store_true",
        help="only the comparison with the external ops (no sweep, no targets): its section replaces the current "
        "report's (--out's, else bench/results')",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(16, (multiprocessing.cpu_count() or 2) - 2)),
        help="processes that precompile the sweep's kernels",
    )
    return parser


def only_external(args, out: Path) -> None:
    """The comparison with the external ops alone, its section put into the current report."""
    section = external_comparison(args.external, args.jobs)
    trial = args.smoke or not torch.cuda.is_available()
    # A trial (CPU) run's section never joins the GPU report in bench/results.
    candidates = [out / f"{NAME}.json"] + ([] if trial else [RESULTS / f"{NAME}.json"])
    base = next((p for p in candidates if p.exists()), None)
    record = json.loads(base.read_text()) if base is not None else {"header": section["header"]}
    record["external"] = section
    json_path, md_path = write_report(NAME, record, report_lines(record), out=out)
    print(f"\ndone: {json_path}, {md_path}" + (f" (joined to the report of {base})" if base else ""))
    print_checks(external_targets(section))


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.only_external and args.external is None:
        parser.error("--only-external needs --external BUILD (the external ops' folder, external/build)")
    if not args.smoke and not torch.cuda.is_available() and not args.only_external:
        sys.exit("bench/msda.py needs a CUDA GPU (or --smoke)")
    if args.apply_table and (args.no_sweep or args.smoke or args.only_external):
        parser.error("--apply-table writes a table measured on a GPU: not with --no-sweep, --smoke or --only-external")
    out = out_dir(args.out, args.smoke or not torch.cuda.is_available())
    out.mkdir(parents=True, exist_ok=True)
    if args.only_external:
        only_external(args, out)
        return
    header = run_header()
    start = time.perf_counter()
    record = {"header": header}
    if not args.no_sweep:
        precompile(args.dims, args.jobs)
        records = sweep(args.dims, out)
        table = picks(records)
        launch.update_table(table)
        record.update(
            sweep=records,
            table=[[list(k), v] for k, v in table.items()],
            table_note="The launch table is this run's sweep's (the json's table).",
        )
        print(f"sweep done at {time.perf_counter() - start:.0f} s; table:\n{table_source(table, header)}", flush=True)
        if args.apply_table:  # entries of kinds it does not sweep (kernel families, grouped kernels, cells) stay
            kept = {key: value for key, value in launch.TUNED.items() if key[0] not in SWEPT_KINDS}
            apply_table(table_source({**kept, **table}, header))
    else:
        record["table_note"] = "The launch table is msda/launch_table.py's."
    record["rows"] = targets(out)
    if args.external is not None:
        record["external"] = external_comparison(args.external, args.jobs)
    header["seconds"] = time.perf_counter() - start
    json_path, md_path = write_report(NAME, record, report_lines(record), out=out)
    for partial in out.glob(f"{NAME}*.partial.json"):
        partial.unlink()
    print(f"\ndone in {header['seconds']:.0f} s: {json_path}, {md_path}\n")
    print_checks(target_checks(record["rows"]) + external_targets(record.get("external", {"rows": []})))


if __name__ == "__main__":
    main()
