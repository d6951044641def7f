"""Kernel variants: are the grouped kernels and the cells scheme faster than today's kernels, with which table?

    python bench/msda_variants.py --out DIR                 # on an H100/H200: about 3-4 min, one process
    python bench/msda_variants.py --out DIR --apply-table   # and the picks merged into msda/launch_table.py
    python bench/msda_variants.py --smoke                   # every code path on the CPU interpreter, tiny shapes

1. precompile  every variant below in --jobs worker processes (Triton's disk cache), as bench/msda.py does.
2. check       each new path on the GPU against the fp64 grid_sample reference, fp32 and bf16, output and all
               three gradients (encoder levels, uniform and realistic), and the deterministic paths bitwise over
               3 runs. Every swept configuration is also checked against the default one's result on its first
               call. A failure prints CHECK FAILED, stays in the report, and the run exits with status 1.
3. sweep       each new kernel's configurations (candidates()) at encoder N2 and N4 and decoder N4 Lq300, uniform
               and realistic locations, fp32/fp16/bf16 (D=32, M=8, L=4, P=4); per table key the configuration
               with the least summed time wins, and so does each pass's fastest family and scheme.
4. compare     today's kernels (classic, the committed table) beside the picks, through the launchers in the
               same process: forward, backward, forward+backward and the deterministic backward, with the
               backward's extra peak memory. The issue's targets are checked on these rows.
Writes msda_variants_h200.json and .md, and the table entries that make the picks the defaults. The original
CUDA op and DCNv4 are not built here: the GPU machine has no network.
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
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; the workers inherit it

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.msda import DEVICE, LAUNCH_PY, LEVELS, S, apply_table, make_inputs, sync, table_source  # noqa: E402
from bench.msda_variants_report import report_lines, target_checks  # noqa: E402
from bench.report import out_dir, run_header, write_report  # noqa: E402
from msda import launch, launch_table  # noqa: E402
from msda.reference import multi_scale_deformable_attention_reference, off_cell_edges  # noqa: E402

NAME = "msda_variants_h200"
SMOKE = DEVICE == "cpu"
L, P, M, D = len(LEVELS), 4, (2 if SMOKE else 8), (8 if SMOKE else 32)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DISTS = ("uniform", "realistic")
WORKLOADS = [("encoder N2", 2, S), ("encoder N4", 4, S), ("decoder N4 Lq300", 4, 300)]
if SMOKE:  # every code path once: the interpreter takes about a second a call
    DTYPES.pop("fp16")
    WORKLOADS = [("encoder N2", 2, S), ("decoder N4 Lq300", 4, 3)]
DETERMINISTIC = ("det_grouped_cells", "det_classic_cells", "det_grouped_gather")
BACKWARD = ("grouped_fused", "grouped_hybrid")
TODAY = ("classic_forward", "classic_backward", "classic_deterministic")  # the committed table's kernels
TODAY_TABLE = dict(launch_table.TUNED)  # before this run's picks are merged into it


def candidates(kind: str, nbytes: int) -> list:
    """Configurations swept per kind. Grouped query kernels (BLOCK_Q, CH, warps) take one sample chunk per
    thread (more make Triton convert layouts, launch_table.grouped_config); cells (lanes, CH, warps) likewise
    one lane per thread chunk; the deterministic kinds pair the keys kernel's config with the cell pass's."""
    if SMOKE:
        return {
            "grouped_forward": [(64, 1, 4), (32, 2, 2)],
            "grouped_fused": [(64, 1, 4)],
            "grouped_hybrid": [(None, 8)],
            "det_grouped_cells": [(None, (64, 1, 4))],
            "det_classic_cells": [(None, (64, 1, 4))],
            "det_grouped_gather": [None],
        }[kind]
    if kind in ("grouped_forward", "grouped_fused"):
        configs = []
        # Chunks of 16 or 32 bytes; 4-channel groups of a 2-byte value spill in the forward (bench/msda_sass.py).
        for block_c in ((8, 4) if nbytes == 4 else (16, 8)) if kind == "grouped_forward" else (8, 4):
            # the forward's chunks are of value's dtype; the backward's threads follow its fp32 atomics
            chunk_threads = max(1, block_c * (nbytes if kind == "grouped_forward" else 4) // 16)
            configs += [(32 * warps // (P * chunk_threads), D // block_c, warps) for warps in (2, 4, 8)]
        return configs
    cells = [(64, 4, 4), (128, 8, 4), (32, 4, 2)]
    return {
        "grouped_hybrid": [(None, 64), (None, 256)],
        "det_grouped_cells": [(None, c) for c in cells] + [((8, 4, 2), (64, 4, 4))],
        "det_classic_cells": [(None, (64, 4, 4))],
        "det_grouped_gather": [None, (8, 4, 2)],
    }[kind]


def run(kind: str, config, inputs):
    """One call of a variant through the launchers; config None: the table's (today's for classic kinds)."""
    value, loc, weights, grad_out = inputs
    if kind.endswith("forward"):
        return launch.forward(
            value, LEVELS, loc, weights, config=config, kernels="grouped" if kind.startswith("grouped") else "classic"
        )
    configs, kwargs = {}, {"kernels": "grouped"}
    if kind == "classic_backward":
        large = value.shape[0] * loc.shape[1] * M >= launch_table.LARGE
        kwargs = {
            "kernels": "classic",
            "scheme": TODAY_TABLE.get(("scheme", D, value.element_size(), L, P, large), "fused"),
        }
    elif kind == "classic_deterministic":
        kwargs = {"kernels": "classic", "deterministic": True, "scheme": "gather"}
    elif kind == "new_backward":
        kwargs = {}  # the table's, after the picks are applied
    elif kind == "new_deterministic":
        kwargs = {"deterministic": True}
    elif kind == "grouped_fused":
        kwargs["scheme"], configs = "fused", {"grouped_fused": config}
    elif kind == "grouped_hybrid":
        kwargs["scheme"], configs = "hybrid", {"grouped_hybrid": config[0], "hybrid_split": config[1]}
    else:  # the deterministic kinds: det_<family>_<scheme>
        _, family, scheme = kind.split("_")
        kwargs = {"kernels": family, "deterministic": True, "scheme": scheme}
        configs = {"grouped_keys": config[0], "cells": config[1]} if scheme == "cells" else {"grouped_keys": config}
    configs = {k: v for k, v in configs.items() if v is not None}
    return launch.backward(grad_out, value, LEVELS, loc, weights, configs=configs, **kwargs)


def median_ms(fn, rep: int = 20) -> float:
    if SMOKE:  # one interpreted call, wall clock
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def all_variants(nbytes: int) -> list:
    """(kind, config) of every kernel variant this run launches for a value of ``nbytes``, today's included."""
    return [(k, c) for k in ("grouped_forward", *BACKWARD, *DETERMINISTIC) for c in candidates(k, nbytes)] + [
        (k, None) for k in TODAY
    ]


# ----------------------------------------------------------------------------------------------------
# 1. precompile, 2. check
# ----------------------------------------------------------------------------------------------------
_WORKER_INPUTS: dict = {}


def _warm(task) -> str:
    _name, N, Lq, dtype_name, kind, config = task
    try:
        if (N, Lq, dtype_name) not in _WORKER_INPUTS:
            _WORKER_INPUTS[(N, Lq, dtype_name)] = make_inputs(N, Lq, M, D, DTYPES[dtype_name], "uniform")
        run(kind, config, _WORKER_INPUTS[(N, Lq, dtype_name)])
        sync()
        return ""
    except Exception as error:  # reported; the timing process compiles it itself
        return f"{task}: {type(error).__name__}: {error}"


def precompile(jobs: int) -> float:
    """Compiles each variant once per size class: the cell and gather passes' tiles follow the density, today's
    configurations the table's encoder or decoder entries."""
    classes = [WORKLOADS[0], WORKLOADS[-1]]
    tasks = [
        (w[0], w[1], w[2], d, kind, config)
        for w in classes
        for d, t in DTYPES.items()
        for kind, config in all_variants(t.itemsize)
    ]
    tasks = tasks[:3] if SMOKE else tasks
    start = time.perf_counter()
    try:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            errors = [e for e in pool.imap_unordered(_warm, tasks) if e]
    except Exception as error:  # without the pool every kernel still compiles on first use, only slower
        errors = [f"the pool itself: {type(error).__name__}: {error}"]
    seconds = time.perf_counter() - start
    print(
        f"precompiled {len(tasks)} variants in {seconds:.0f} s with {jobs} processes"
        + "".join(f"\n  failed {e}" for e in errors),
        flush=True,
    )
    return seconds


def reference(inputs):
    """fp64 output and gradients of the grid_sample reference on exactly these (rounded) inputs."""
    value, loc, weights, grad_out = inputs
    leaves = [t.detach().double().requires_grad_() for t in (value, loc, weights)]
    out = multi_scale_deformable_attention_reference(leaves[0], list(LEVELS), leaves[1], leaves[2])
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.double())]


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


CHECKS = [
    ("grouped_forward", None),
    ("grouped_fused", None),
    ("grouped_hybrid", (None, 64)),
    ("det_grouped_cells", (None, None)),
    ("det_classic_cells", (None, None)),
    ("det_grouped_gather", None),
]


def check(failures: list) -> list:
    """Each new path against the fp64 reference (encoder levels, one image), fp32 and bf16."""
    rows = []
    for dtype_name in ("fp32", "bf16"):
        tolerance = 1e-5 if dtype_name == "fp32" else 1e-2
        for dist in DISTS:
            inputs = make_inputs(1, S, M, D, DTYPES[dtype_name], dist, seed=1)
            exact = reference(inputs)
            # float32 and fp64 may sample either side of a cell edge: gradients by location are compared off them
            away = off_cell_edges(LEVELS, inputs[1])
            exact[2] = exact[2] * away
            for kind, config in CHECKS:
                errors, bitwise, raised = [], None, ""
                try:
                    got = run(kind, config, inputs)
                    got = [got] if kind.endswith("forward") else [None, *got]
                    compared = got if len(got) == 1 else [*got[:2], got[2].view_as(exact[2]) * away, got[3]]
                    errors = [rel_err(g.view_as(x), x) if g is not None else None for g, x in zip(compared, exact)]
                    if kind.startswith("det"):
                        again = run(kind, config, inputs)
                        bitwise = all(torch.equal(a, b) for a, b in zip(got[1:], again))
                except Exception as error:  # a kernel this Triton cannot build or run: reported, the run goes on
                    raised = f"{type(error).__name__}: {error}"
                ok = not raised and all(e is None or e < tolerance for e in errors) and bitwise is not False
                rows.append(
                    {
                        "kind": kind,
                        "dtype": dtype_name,
                        "locations": dist,
                        "errors": errors,
                        "bitwise": bitwise,
                        "ok": ok,
                        "raised": raised,
                    }
                )
                if not ok:
                    failures.append(f"{kind} {dtype_name} {dist}: errors {errors}, bitwise {bitwise} {raised}")
                    print(f"CHECK FAILED {failures[-1]}", flush=True)
    print(f"checks: {sum(r['ok'] for r in rows)}/{len(rows)} passed", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------
# 3. sweep, picks
# ----------------------------------------------------------------------------------------------------
def sweep(out: Path, failures: list) -> list:
    records = []
    for name, N, Lq in WORKLOADS:
        for dtype_name, dtype in DTYPES.items():
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            for dist in DISTS:
                inputs = make_inputs(N, Lq, M, D, dtype, dist)
                for kind in ("grouped_forward", *BACKWARD, *DETERMINISTIC, *TODAY):
                    first = None
                    for config in candidates(kind, dtype.itemsize) if kind not in TODAY else [None]:
                        try:
                            result = run(kind, config, inputs)
                        except Exception as error:  # reported; the other candidates still compete
                            failures.append(
                                f"sweep {kind} {config} {name} {dtype_name}: {type(error).__name__}: {error}"
                            )
                            print(f"CHECK FAILED {failures[-1]}", flush=True)
                            continue
                        result = [result] if kind.endswith("forward") else list(result)
                        if first is None:
                            first = result
                        elif max(rel_err(a, b) for a, b in zip(result, first)) > tolerance:
                            failures.append(
                                f"sweep {kind} {config} {name} {dtype_name} {dist}: differs from "
                                f"{candidates(kind, dtype.itemsize)[0]}"
                            )
                            print(f"CHECK FAILED {failures[-1]}", flush=True)
                        ms = median_ms(lambda: run(kind, config, inputs))
                        records.append(
                            {
                                "workload": name,
                                "large": N * Lq * M >= launch_table.LARGE,
                                "dtype": dtype_name,
                                "locations": dist,
                                "kind": kind,
                                "config": config,
                                "ms": ms,
                            }
                        )
                best = {
                    k: min(
                        [
                            r["ms"]
                            for r in records
                            if (r["workload"], r["dtype"], r["locations"], r["kind"]) == (name, dtype_name, dist, k)
                        ],
                        default=float("nan"),
                    )
                    for k in ("grouped_forward", *BACKWARD, *DETERMINISTIC, *TODAY)
                }
                print(
                    f"sweep {name:<17} {dtype_name} {dist:<9} best ms: "
                    + " ".join(f"{k} {v:.3f}" for k, v in best.items()),
                    flush=True,
                )
        (out / f"{NAME}_sweep.partial.json").write_text(json.dumps(records))
    return records


def _totals(records) -> dict:
    """(kind, nbytes, large) -> {config: summed ms over the workloads, locations and dtypes of that size}."""
    totals: dict = {}
    for r in records:
        by_config = totals.setdefault((r["kind"], DTYPES[r["dtype"]].itemsize, r["large"]), {})
        by_config[r["config"]] = by_config.get(r["config"], 0.0) + r["ms"]
    return totals


def picks(records) -> tuple[dict, dict]:
    """(table entries for the fastest configuration of each new kernel, summed ms of each kind's best)."""
    table, best = {}, {}
    for (kind, nbytes, large), by_config in _totals(records).items():
        config, ms = min(by_config.items(), key=lambda item: item[1])
        key = (D, nbytes, L, P, large)
        best[(kind, nbytes, large)] = (config, ms)
        if kind == "grouped_forward":
            table[("grouped_forward", *key)] = config
        elif kind == "grouped_fused":
            table[("grouped_fused", *key)] = config
    return table, best


def switches(best: dict) -> dict:
    """Entries that make each pass's fastest variant the default where it beats today's (summed ms)."""
    entries = {}
    for nbytes, large in {(nb, lg) for (_, nb, lg) in best}:
        key = (D, nbytes, L, P, large)
        today = {kind.split("_")[1]: best[(kind, nbytes, large)][1] for kind in TODAY}
        missing = (None, float("inf"))  # a kind whose every candidate failed
        best = {**{(k, nbytes, large): missing for k in ("grouped_forward", *BACKWARD, *DETERMINISTIC)}, **best}
        if best[("grouped_forward", nbytes, large)][1] < today["forward"]:
            entries[("forward_kernels", *key)] = "grouped"
        backward = min(BACKWARD, key=lambda k: best[(k, nbytes, large)][1])
        config, ms = best[(backward, nbytes, large)]
        if ms < today["backward"]:
            entries[("backward_kernels", *key)] = "grouped"
            entries[("scheme", *key)] = backward.split("_")[1]
            if backward == "grouped_hybrid":
                entries[("grouped_hybrid", *key)] = config[0] or launch_table.grouped_config(
                    "grouped_hybrid", D, nbytes, P
                )
                entries[("hybrid_split", D, nbytes, large)] = config[1]
        deterministic = min(DETERMINISTIC, key=lambda k: best[(k, nbytes, large)][1])
        config, ms = best[(deterministic, nbytes, large)]
        if ms < today["deterministic"]:
            _, family, scheme = deterministic.split("_")
            entries[("deterministic_kernels", *key)] = family
            entries[("deterministic_scheme", *key)] = scheme
            keys_config, cells_config = config if scheme == "cells" else (config, None)
            if family == "grouped" and keys_config:
                entries[("grouped_keys", *key)] = keys_config
            if cells_config:
                entries[("cells", D, nbytes, large)] = cells_config
    return entries


# ----------------------------------------------------------------------------------------------------
# 4. compare
# ----------------------------------------------------------------------------------------------------
def peak_extra_mib(fn) -> float:
    if SMOKE:
        return float("nan")
    sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def compare(out: Path, failures: list) -> list:
    rows = []
    for name, N, Lq in WORKLOADS:
        for dtype_name, dtype in DTYPES.items():
            for dist in DISTS:
                inputs = make_inputs(N, Lq, M, D, dtype, dist)
                row = {"workload": name, "dtype": dtype_name, "locations": dist, "large": N * Lq * M >= launch.LARGE}
                try:
                    for era, kinds in (
                        ("today", TODAY),
                        ("new", ("grouped_forward", "new_backward", "new_deterministic")),
                    ):
                        forward, backward, deterministic = kinds
                        if era == "new":  # the forward's family as the table now says
                            forward = (
                                "grouped_forward"
                                if launch.launch_config(("forward_kernels", D, dtype.itemsize, L, P, row["large"]))
                                == "grouped"
                                else "classic_forward"
                            )
                        row[era] = {
                            "fwd": median_ms(lambda: run(forward, None, inputs), rep=50),
                            "bwd": median_ms(lambda: run(backward, None, inputs), rep=50),
                            "fwd_bwd": median_ms(
                                lambda: (run(forward, None, inputs), run(backward, None, inputs)), rep=50
                            ),
                            "det_bwd": median_ms(lambda: run(deterministic, None, inputs), rep=50),
                            "bwd_mib": peak_extra_mib(lambda: run(backward, None, inputs)),
                            "det_mib": peak_extra_mib(lambda: run(deterministic, None, inputs)),
                        }
                except Exception as error:  # reported; the other rows are still measured
                    failures.append(f"compare {name} {dtype_name} {dist}: {type(error).__name__}: {error}")
                    print(f"CHECK FAILED {failures[-1]}", flush=True)
                    continue
                rows.append(row)
                t, n = row["today"], row["new"]
                print(
                    f"{name:<17} {dtype_name} {dist:<9} fwd {t['fwd']:.3f}->{n['fwd']:.3f} bwd {t['bwd']:.3f}->"
                    f"{n['bwd']:.3f} f+b {t['fwd_bwd']:.3f}->{n['fwd_bwd']:.3f} det {t['det_bwd']:.3f}->"
                    f"{n['det_bwd']:.3f} ms",
                    flush=True,
                )
                (out / f"{NAME}.partial.json").write_text(json.dumps(rows))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; smoke: outputs/bench)")
    parser.add_argument("--smoke", action="store_true", help="every code path on the CPU interpreter, tiny shapes")
    parser.add_argument("--apply-table", action="store_true", help="merge the picks into msda/launch_table.py")
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(16, (multiprocessing.cpu_count() or 2) - 2)),
        help="processes that precompile the kernels",
    )
    return parser


def main():
    args = build_parser().parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/msda_variants.py needs a CUDA GPU (or --smoke)")
    out = out_dir(args.out, args.smoke)
    out.mkdir(parents=True, exist_ok=True)
    header, start, failures = run_header(), time.perf_counter(), []
    record = {"header": header, "compile_s": precompile(args.jobs), "checks": check(failures)}
    record["sweep"] = sweep(out, failures)
    table, best = picks(record["sweep"])
    entries = {**table, **switches(best)}
    launch.update_table(entries)
    record["table"] = [[list(k), v] for k, v in entries.items()]
    print(f"picks:\n{table_source(entries, header)}", flush=True)
    record["rows"] = compare(out, failures)
    record["failures"] = failures
    header["seconds"] = time.perf_counter() - start
    json_path, md_path = write_report(NAME, record, report_lines(record, table_source(entries, header)), out=out)
    for partial in out.glob(f"{NAME}*.partial.json"):
        partial.unlink()
    if args.apply_table and not args.smoke:
        # The committed table stays, with this run's entries merged into it: its heading names both runs.
        before = re.search(r"# Measured on .*\n# (.*)\nTUNED", LAUNCH_PY.read_text())
        merged = dict(header, command=(f"{before.group(1)}; merged: " if before else "") + header["command"])
        apply_table(table_source({**launch_table.TUNED, **entries}, merged))
    print(f"\ndone in {header['seconds']:.0f} s: {json_path}, {md_path}")
    for name, value, ok in target_checks(record["rows"]):
        print(f"{'met   ' if ok else 'MISSED'} {name}: {value}")
    if failures:
        sys.exit(f"{len(failures)} CHECKS FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
