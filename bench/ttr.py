"""Time to result: how long from `python train.py` to an AP, as a user waits for it, by default and eagerly?

    python bench/ttr.py                                        # on a GPU: the default rows, in order
    python bench/ttr.py --rows auto:cold auto:warm compiled:cold --deadline-s 540

The job: the COCO recipe's model (ResNet-50, from scratch) on a synthetic COCO-format set of --num-train images of
varied aspect ratios (long side --image-size, short side 75-100% of it, both orientations) trained with the
COCO recipe's multi-scale sizes (`dataset=custom`: short side 480-800, long side up to 1333, crops) for
--steps steps at batch 2, then one evaluation of --num-val images at 800. Each row is one `python train.py`
in a process of its own, with compile.mode and model.msda as named:

    auto           the default: for a job this short, the eager model's CUDA graphs (compile.mode=graphs)
    compiled       compile.mode=reduce-overhead: Inductor with CUDA graphs (auto's choice for long runs)
    eager          compile.mode=eager (model.msda=triton)
    pytorch-eager  compile.mode=eager model.msda=pytorch

``cold`` starts from an empty compile.cache_dir (Inductor's, AOTAutograd's and Triton's caches), ``warm`` from
the one the row's cold run filled. Before the first row one process imports what train.py imports, so that the
checkout's byte-compilation falls on no row. total is the wall time from the process's start until its evaluation
json is written; the split (setup, compile, warm-up, train, eval), the first step, the steady step and the graphs
come from the run's own timing.json (engine/train/hooks/timing.py). Writes ttr_h200.json and .md after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import cell, header_lines, out_dir, run_header, table, write_report  # noqa: E402
from bench.train_runs import environment_without_cache_choice, run_train_py  # noqa: E402

NAME = "ttr_h200"
MODES = {
    "auto": [],
    "compiled": ["compile.mode=reduce-overhead"],
    "eager": ["compile.mode=eager", "model.msda=triton"],
    "pytorch-eager": ["compile.mode=eager", "model.msda=pytorch"],
}
ROWS = tuple(f"{mode}:{cache}" for mode in MODES for cache in ("cold", "warm"))
DEFAULT_ROWS = ("auto:cold", "auto:warm", "eager:cold", "eager:warm", "pytorch-eager:cold", "pytorch-eager:warm")
# The graphs (engine/compile/clock.py's names) that hold the backbone: its own and evaluation's compiled graphs, the
# eager model's recordings (engine/compile/cuda_graphs.py).
BACKBONE_GRAPHS = ("features", "detect", "graphed_forward", "graphed_detect")
# Seconds a row is expected to take when no measurement of it exists yet (for --deadline-s).
GUESS_S = {"auto": 100, "compiled": 480, "eager": 110, "pytorch-eager": 150}
# A row's figures taken from its run's timing.json as they are: the split of its wall time, then the rest.
SPLIT_KEYS = ("setup_s", "first_step_s", "compile_s", "warmup_s", "train_s", "eval_s", "checkpoint_s")
TIMING_KEYS = (*SPLIT_KEYS, "steady_step_ms", "graphs_compiled", "padding_waste", "steps")


def data_overrides(root: Path) -> list[str]:
    return [
        "dataset=custom",
        f"dataset.train_images={root / 'train2017'}",
        f"dataset.train_annotations={root / 'annotations' / 'instances_train2017.json'}",
        f"dataset.val_images={root / 'val2017'}",
        f"dataset.val_annotations={root / 'annotations' / 'instances_val2017.json'}",
    ]


def prime() -> float:
    """Import what train.py imports once, in a process of its own, before the first row: its modules are then
    byte-compiled and its libraries read from disk, as for every later row. Otherwise the first row alone would
    pay that, whichever it is. Returns the seconds it took."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, check=True)
    return time.perf_counter() - started


def run_row(args, data: Path, mode: str, cache: str) -> dict:
    work = args.work
    cache_dir = work / f"cache_{mode}"
    if cache == "cold" and cache_dir.exists():
        shutil.rmtree(cache_dir)
    run_dir = work / f"run_{mode}_{cache}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [
        *data_overrides(data),
        "model=deformable_detr",
        "model.pretrained=none",
        f"max_steps={args.steps}",
        "batch_size=2",
        f"num_workers={args.num_workers}",
        "eval_every=1000",
        "log_every=50",
        f"compile.cache_dir={cache_dir}",
        f"output_dir={run_dir}",
        *MODES[mode],
    ]
    log = work / f"{mode}_{cache}.log"
    started = time.time()
    returncode = run_train_py(overrides, log=log, env=environment_without_cache_choice())
    ended = time.time()
    if returncode != 0:
        raise RuntimeError(f"train.py failed (exit {returncode}); see {log}")
    (eval_json,) = run_dir.glob("eval_epoch*.json")
    timing = json.loads((run_dir / "timing.json").read_text())
    evaluation = json.loads(eval_json.read_text())
    graphs = timing["graphs_by_function"]
    return {
        "mode": mode,
        "cache": cache,
        "total_s": eval_json.stat().st_mtime - started,
        "process_s": ended - started,
        **{key: timing[key] for key in TIMING_KEYS},
        "backbone_graphs": sum(graphs.get(name, 0) for name in BACKBONE_GRAPHS),
        "graphs_by_function": graphs,
        "ap": evaluation["AP"],
        "ap50": evaluation["AP50"],
        "command": "python train.py " + " ".join(overrides),
    }


def targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """(target, met, the figures) for each target whose rows were measured."""
    found = {(r["mode"], r["cache"]): r for r in rows}
    checks = []
    for cache in ("cold", "warm"):
        auto, eager = found.get(("auto", cache)), found.get(("eager", cache))
        if auto and eager and cache == "cold":
            ratio = auto["total_s"] / eager["total_s"]
            checks.append(("cold total of the default <= 0.6x triton eager's", ratio <= 0.6, f"{ratio:.2f}x"))
        if auto:
            limit = 90 if cache == "cold" else 20
            checks += [
                (f"{cache} first step <= {limit} s", auto["first_step_s"] <= limit, f"{auto['first_step_s']:.0f} s"),
                (f"backbone graphs <= 8 ({cache})", auto["backbone_graphs"] <= 8, str(auto["backbone_graphs"])),
                (f"steady step <= 40 ms ({cache})", auto["steady_step_ms"] <= 40, f"{auto['steady_step_ms']:.1f} ms"),
            ]
        if auto and eager:
            checks.append(
                (
                    f"default eval <= triton eager's ({cache})",
                    auto["eval_s"] <= eager["eval_s"],
                    f"{auto['eval_s']:.1f} s vs {eager['eval_s']:.1f} s",
                )
            )
    return checks


def report_lines(record: dict) -> list[str]:
    h = record["header"]
    lines = header_lines(
        "Time to result",
        h,
        f"The job: {h['job']} ({h['cpus']} CPU cores). Each row is one `python train.py` in its own process; cold: "
        "an empty compile.cache_dir, warm: the one its cold run filled. total: process start to the evaluation "
        "json; setup, compile, warm-up (the first two steps of each size), train and eval: the run's own split "
        "(timing.json), compilation and CUDA-graph recording counted as compile wherever they happened; graphs: "
        "compiled or recorded, the backbone's in brackets; padding: share of the batches' pixels. The steps are "
        "bound by the host, so the figures move with the machine: compare rows of one run.",
    )
    seconds = ("total_s", "setup_s", "first_step_s", "compile_s", "warmup_s", "train_s", "eval_s", "steady_step_ms")
    lines += table(
        "mode | cache | total s | setup s | first step s | compile s | warm-up s | train s | eval s | steady step ms "
        "| graphs | padding | AP",
        [
            [r["mode"], r["cache"], *(cell(r.get(key)) for key in seconds)]
            + [f"{r['graphs_compiled']} ({r['backbone_graphs']})", f"{r['padding_waste']:.0%}", f"{r['ap']:.4f}"]
            for r in record["rows"]
        ],
    )
    checks = targets(record["rows"])
    if checks:
        lines += [
            "",
            *table(
                ["target", "met", "figure"], [[name, "yes" if met else "NO", figure] for name, met, figure in checks]
            ),
        ]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_ttr"))
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-val", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=640, help="the synthetic images' long side")
    parser.add_argument("--num-workers", type=int, default=4, help="data loader workers (experiment=coco_gpu's)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="skip a row that would not end within this many seconds of the start",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    t0 = time.perf_counter()
    from datasets import ensure_synthetic_dataset

    out = out_dir(args.out, False)
    args.work.mkdir(parents=True, exist_ok=True)
    data = ensure_synthetic_dataset(
        args.work / "data", num_train=args.num_train, num_val=args.num_val, image_size=args.image_size, seed=0
    )
    record = {
        "header": run_header(
            cpus=len(os.sched_getaffinity(0)),
            prime_s=prime(),
            job=f"{args.steps} steps of batch 2 on {args.num_train} images of long side "
            f"{args.image_size}, evaluation of {args.num_val} at 800",
        ),
        "rows": [],
    }
    done = {}
    for name in args.rows:
        mode, cache = name.split(":")
        cold = done.get(f"{mode}:cold")
        # A warm compiled run skips most of its cold run's compilation.
        expected = (
            GUESS_S[mode] if cold is None else cold["process_s"] - (0.7 * cold["compile_s"] if cache == "warm" else 0)
        )
        if args.deadline_s is not None and time.perf_counter() - t0 + expected > args.deadline_s:
            print(f"ttr {name}: skipped, about {expected:.0f} s would pass the deadline", flush=True)
            continue
        try:
            row = run_row(args, data, mode, cache)
        except RuntimeError as error:  # the other rows are still measured; the log says what went wrong
            log = args.work / f"{mode}_{cache}.log"
            print(f"ttr {name}: FAILED: {error}\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)
            continue
        done[name] = row
        record["rows"].append(row)
        write_report(NAME, record, report_lines(record), out=out)
        print(
            f"ttr {name}: total {row['total_s']:.1f} s (first step {row['first_step_s']:.1f}, compile "
            f"{row['compile_s']:.1f}, train {row['train_s']:.1f}, eval {row['eval_s']:.1f}), steady step "
            f"{cell(row['steady_step_ms'])} ms, {row['graphs_compiled']} graphs ({row['backbone_graphs']} backbone), "
            f"padding {100 * row['padding_waste']:.0f}%, AP {row['ap']:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
