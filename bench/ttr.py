"""Time to result: from `python train.py` to an AP, as a user waits for it, for the default and the eager paths.

    python bench/ttr.py --out bench/results                      # on a GPU: every row below, in order
    python bench/ttr.py --rows auto:cold auto:warm --deadline-s 540

The job: the default model (ResNet-50, from scratch) on a synthetic COCO-format set of --num-train images of
varied aspect ratios (long side --image-size, short side 75-100% of it, both orientations) trained with the
COCO recipe's multi-scale sizes (`dataset=custom`: short side 480-800, long side up to 1333, crops) for
--steps steps at batch 2, then one evaluation of --num-val images at 800. Each row is one `python train.py`
in a process of its own, with compile.mode and model.msda as named:

    auto           the default: for a job this short, the eager model's CUDA graphs (compile.mode=graphs), size buckets
    compiled       compile.mode=reduce-overhead: Inductor with CUDA graphs, the transformer as one graph, the
                   backbone a graph per size (auto's choice for long runs; the default before graphs: run 1's "auto")
    auto-layers    compiled with compile.regions=layers (a graph per layer kind: less to compile, more host time)
    layers-eager-backbone  auto-layers with compile.backbone=eager (no graph per size)
    eager          compile.mode=eager (model.msda=triton)
    pytorch-eager  compile.mode=eager model.msda=pytorch

``cold`` starts from an empty compile.cache_dir (Inductor's, AOTAutograd's and Triton's caches), ``warm`` from
the one the row's cold run filled. Before the first row one process imports what train.py imports, so that the
checkout's byte-compilation falls on no row. total_s is the wall time from the process's start until its evaluation
json is written; compile_s, train_s and eval_s, the first step, the steady step and the graphs compiled come
from the run's own timing.json (engine/train/run_timing.py). Rows go into ttr_h200.json as each ends, with the
number of this run (one call of the script; earlier runs' rows are kept), and ttr_h200.md with the targets,
each from one run's rows where a run measured all it needs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"auto": [], "compiled": ["compile.mode=reduce-overhead"], "auto-layers": ["compile.regions=layers"],
         "layers-eager-backbone": ["compile.regions=layers", "compile.backbone=eager"],
         "eager": ["compile.mode=eager", "model.msda=triton"],
         "pytorch-eager": ["compile.mode=eager", "model.msda=pytorch"]}
ROWS = ("auto:cold", "auto:warm", "compiled:cold", "compiled:warm", "auto-layers:cold", "auto-layers:warm", "layers-eager-backbone:cold",
        "layers-eager-backbone:warm", "eager:cold", "eager:warm",
        "pytorch-eager:cold", "pytorch-eager:warm")
DEFAULT_ROWS = ("auto:cold", "auto:warm", "eager:cold", "eager:warm", "pytorch-eager:cold", "pytorch-eager:warm")
# The graphs (engine/compile/clock.py's names) that hold the backbone: its own and evaluation's compiled graphs, the
# eager model's recordings (engine/compile/cuda_graphs.py).
BACKBONE_GRAPHS = ("features", "detect", "graphed_forward", "graphed_detect")
# Seconds a row is expected to take when no measurement of it exists yet (for --deadline-s).
GUESS_S = {"auto": 100, "compiled": 480, "auto-layers": 300, "layers-eager-backbone": 150, "eager": 110, "pytorch-eager": 150}


def write_data(work: Path, args) -> Path:
    from datasets import ensure_synthetic_dataset

    return ensure_synthetic_dataset(work / "data", num_train=args.num_train, num_val=args.num_val,
                                    image_size=args.image_size, seed=0)


def data_overrides(root: Path) -> list[str]:
    return ["dataset=custom", f"dataset.train_images={root / 'train2017'}",
            f"dataset.train_annotations={root / 'annotations' / 'instances_train2017.json'}",
            f"dataset.val_images={root / 'val2017'}",
            f"dataset.val_annotations={root / 'annotations' / 'instances_val2017.json'}"]


def prime() -> float:
    """Import what train.py imports once, in a process of its own, before the first row: its modules are then
    byte-compiled and its libraries read from disk, as for every later row. Otherwise the first row alone would
    pay that, whichever it is. Returns the seconds it took."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, check=True)
    return time.perf_counter() - started


def run_row(args, work: Path, data: Path, mode: str, cache: str) -> dict:
    cache_dir = work / f"cache_{mode}"
    if cache == "cold" and cache_dir.exists():
        shutil.rmtree(cache_dir)
    run_dir = work / f"run_{mode}_{cache}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [*data_overrides(data), "model=deformable_detr", "model.pretrained=none", f"max_steps={args.steps}",
                 "batch_size=2", f"num_workers={args.num_workers}", "eval_every=1000", "log_every=50",
                 f"compile.cache_dir={cache_dir}", f"output_dir={run_dir}", *MODES[mode]]
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    started = time.time()
    with open(work / f"{mode}_{cache}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {cache}: train.py failed (exit {proc.returncode}); "
                           f"see {work / f'{mode}_{cache}.log'}")
    (eval_json,) = run_dir.glob("eval_epoch*.json")
    timing = json.loads((run_dir / "timing.json").read_text())
    evaluation = json.loads(eval_json.read_text())
    graphs = timing["graphs_by_function"]
    return {"impl": "pytorch" if mode == "pytorch-eager" else "triton", "mode": mode, "cache": cache,
            "total_s": eval_json.stat().st_mtime - started, "process_s": ended - started,
            "first_step_s": timing["first_step_s"], "compile_s": timing["compile_s"],
            "warmup_s": timing["warmup_s"], "train_s": timing["train_s"],
            "eval_s": timing["eval_s"], "setup_s": timing["setup_s"], "checkpoint_s": timing["checkpoint_s"],
            "steady_step_ms": timing["steady_step_ms"], "graphs_compiled": timing["graphs_compiled"],
            "backbone_graphs": sum(graphs.get(name, 0) for name in BACKBONE_GRAPHS), "graphs_by_function": graphs,
            "padding_waste": timing["padding_waste"], "ap": evaluation["AP"], "ap50": evaluation["AP50"],
            "steps": timing["steps"], "command": "python train.py " + " ".join(overrides)}


def pad128_waste(data: Path, args) -> float:
    """Padding of this job's training batches as they were before size buckets: random batches of 2 padded to
    multiples of 128 (dataset.pad_to_multiple=128), over as many steps as the job runs."""
    import itertools

    from bench.e2e import compose_config
    from datasets import BatchPlan, build_dataset

    cfg = compose_config(data_overrides(data))
    train = build_dataset("train", cfg.dataset, check=False)
    plan = BatchPlan(sizes=[train.image_size(i) for i in range(len(train))], transform=train.transforms,
                     batch_size=2, buckets=None, train=True, multiple=128)
    for _ in itertools.islice(iter(plan), args.steps):
        pass
    return plan.padding_waste


def latest(record: dict, mode: str, cache: str, run: int | None = None) -> dict | None:
    """The row of ``mode``:``cache`` from ``run``, or from the latest run that measured it."""
    found = [r for r in record["rows"] if r["mode"] == mode and r["cache"] == cache
             and (run is None or r["run"] == run)]
    return max(found, key=lambda r: r["run"]) if found else None


def paired(record: dict, cache: str) -> tuple[dict | None, dict | None]:
    """The default's and triton eager's rows of ``cache``: from one run where a run measured both (a ratio of
    one machine), else the latest of each."""
    both = [r["run"] for r in record["rows"] if r["mode"] == "auto" and r["cache"] == cache
            and latest(record, "eager", cache, r["run"])]
    if both:
        return latest(record, "auto", cache, max(both)), latest(record, "eager", cache, max(both))
    return latest(record, "auto", cache), latest(record, "eager", cache)


def targets(record: dict) -> list[tuple[str, bool, str]]:
    """(target, met, the figures) for each target whose rows were measured."""
    def runs(*rows):
        numbers = sorted({r["run"] for r in rows})
        return f" (run {numbers[0]})" if len(numbers) == 1 else f" (runs {', '.join(map(str, numbers))}: two machines)"

    checks = []
    auto_cold, eager_cold = paired(record, "cold")
    auto_warm, eager_warm = paired(record, "warm")
    if auto_cold and eager_cold:
        ratio = auto_cold["total_s"] / eager_cold["total_s"]
        # Every run that measured both: the ratio moves with the machine's host, which the eager step is bound by.
        others = [(r["run"], latest(record, "auto", "cold", r["run"])["total_s"] / r["total_s"])
                  for r in record["rows"] if r["mode"] == "eager" and r["cache"] == "cold"
                  and r["run"] != auto_cold["run"] and latest(record, "auto", "cold", r["run"])]
        checks.append(("cold total of the default <= 0.6x triton eager's", ratio <= 0.6,
                       f"{ratio:.2f}x{runs(auto_cold, eager_cold)}"
                       + "".join(f"; run {run}: {other:.2f}x" for run, other in sorted(others))))
    if auto_cold:
        checks.append(("cold first step <= 90 s", auto_cold["first_step_s"] <= 90,
                       f"{auto_cold['first_step_s']:.0f} s{runs(auto_cold)}"))
    if auto_warm:
        checks.append(("warm first step <= 20 s", auto_warm["first_step_s"] <= 20,
                       f"{auto_warm['first_step_s']:.0f} s{runs(auto_warm)}"))
    for row in (auto_cold, auto_warm):
        if row:
            checks.append((f"backbone graphs compiled <= 8 ({row['cache']})", row["backbone_graphs"] <= 8,
                           f"{row['backbone_graphs']}{runs(row)}"))
            checks.append((f"steady step <= 40 ms ({row['cache']})", row["steady_step_ms"] <= 40,
                           f"{row['steady_step_ms']:.1f} ms{runs(row)}"))
    for cache, auto, eager in (("cold", auto_cold, eager_cold), ("warm", auto_warm, eager_warm)):
        if auto and eager:
            checks.append((f"default eval_s <= triton eager's ({cache})", auto["eval_s"] <= eager["eval_s"],
                           f"{auto['eval_s']:.1f} s vs {eager['eval_s']:.1f} s{runs(auto, eager)}"))
    return checks


def write_report(out: Path, record: dict) -> None:
    first = record["runs"][min(record["runs"], key=int)]
    lines = [f"# Time to result on {first['gpu']}", "",
             f"The job: {first['job']}. Each row is one `python train.py` in its own process; cold: an empty "
             "compile.cache_dir, warm: the one its cold run filled. total = process start to the evaluation json; "
             "compile, train and eval are the run's own split (timing.json), compilation charged to compile "
             "wherever it happened. Each run is one call of this script on one machine; ratios between rows of "
             "different runs compare two machines.", ""]
    lines += [f"- run {n}, {h['date']}, {h['gpu']}, torch {h['torch']}, triton {h['triton']}, {h['cpus']} CPU cores"
              f"{', ' + h['version'] if h.get('version') else ''}: `{h['command']}`" for n, h in record["runs"].items()]
    lines += ["", "| mode | cache | total s | first step s | compile s | warm-up s | train s | eval s | "
              "steady step ms | graphs (backbone) | padding | AP | run |", "|---" * 13 + "|"]
    for r in sorted(record["rows"], key=lambda r: (ROWS.index(f"{r['mode']}:{r['cache']}"), r["run"])):
        warmup = f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-"  # rows measured before it was split off
        lines.append(f"| {r['mode']} | {r['cache']} | {r['total_s']:.1f} | {r['first_step_s']:.1f} | "
                     f"{r['compile_s']:.1f} | {warmup} | "
                     f"{r['train_s']:.1f} | {r['eval_s']:.1f} | {r['steady_step_ms']:.1f} | "
                     f"{r['graphs_compiled']} ({r['backbone_graphs']}) | {100 * r['padding_waste']:.0f}% | "
                     f"{r['ap']:.4f} | {r['run']} |")
    if record.get("pad128_waste") is not None:
        lines += ["", f"Padding of the same job's batches before size buckets (random batches padded to multiples "
                      f"of 128): {100 * record['pad128_waste']:.0f}%."]
    lines += ["", *(f"- {note}" for note in record.get("notes", []))]
    lines += ["", "| target | met | figure |", "|---|---|---|"]
    lines += [f"| {t} | {'yes' if met else 'no'} | {fig} |" for t, met, fig in targets(record)]
    (out / "ttr_h200.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_ttr"))
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-val", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=640, help="the synthetic images' long side")
    parser.add_argument("--num-workers", type=int, default=4, help="data loader workers (experiment=coco_gpu's)")
    parser.add_argument("--version", default="", help="what this run measures, for the report (a commit, a change)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip a row that would not end within this many seconds of the start")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch

    from datasets.json_file import write_json

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    saved = args.out / "ttr_h200.json"
    record = json.loads(saved.read_text()) if saved.exists() else {"rows": [], "runs": {}}
    run = str(max(map(int, record["runs"]), default=0) + 1)
    record["runs"][run] = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
                           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                           "triton": __import__("triton").__version__, "python": platform.python_version(),
                           "cpus": len(os.sched_getaffinity(0)), "command": "python " + " ".join(sys.argv),
                           "version": args.version,
                           "job": f"{args.steps} steps of batch 2 on {args.num_train} images, evaluation of "
                                  f"{args.num_val} at 800"}
    data = write_data(args.work, args)
    record["pad128_waste"] = pad128_waste(data, args)
    record["runs"][run]["prime_s"] = prime()
    done = {}
    for name in args.rows:
        mode, cache = name.split(":")
        cold = done.get(f"{mode}:cold")
        # A warm compiled run skips most of its cold run's compilation.
        expected = GUESS_S[mode] if cold is None else \
            cold["process_s"] - (0.7 * cold["compile_s"] if cache == "warm" else 0)
        if args.deadline_s is not None and time.perf_counter() - t0 + expected > args.deadline_s:
            print(f"ttr {name}: skipped, about {expected:.0f} s would pass the deadline", flush=True)
            continue
        try:
            row = run_row(args, args.work, data, mode, cache)
        except RuntimeError as error:  # the other rows are still measured; the log says what went wrong
            log = args.work / f"{mode}_{cache}.log"
            print(f"ttr {name}: FAILED: {error}\n" + "\n".join(log.read_text().splitlines()[-40:]), flush=True)
            continue
        done[name] = row
        record["rows"].append({**row, "run": int(run)})
        write_json(saved, record, indent=1)  # whole: the file holds every earlier run's rows too
        write_report(args.out, record)
        print(f"ttr {name}: total {row['total_s']:.1f} s (first step {row['first_step_s']:.1f}, compile "
              f"{row['compile_s']:.1f}, train {row['train_s']:.1f}, eval {row['eval_s']:.1f}), steady step "
              f"{row['steady_step_ms']:.1f} ms, {row['graphs_compiled']} graphs ({row['backbone_graphs']} backbone), "
              f"padding {100 * row['padding_waste']:.0f}%, AP {row['ap']:.4f}", flush=True)
    write_report(args.out, record)


if __name__ == "__main__":
    main()
