"""Converged mAP parity in one command: the synthetic default run (`python train.py`: model=tiny, 24 epochs) with
several seeds for each way of running the model, run side by side on one GPU.

    python bench/parity.py --out bench/results                 # on a GPU: 12 runs at once
    python bench/parity.py --quick --out /tmp/parity           # CPU smoke run: 2 pytorch runs of 20 steps

Configurations (each `python train.py seed=N device=... num_workers=... output_dir=...` plus):

    triton-eager     model.msda=triton compile.mode=eager
    triton-graphs    model.msda=triton compile.mode=graphs (the GPU's default for this run: the eager model
                     replayed as CUDA graphs)
    triton-compiled  model.msda=triton compile.mode=reduce-overhead (Inductor with CUDA graphs: auto's choice for
                     long runs; the results of 2026-12-01 ran it as compile.mode=auto, then the GPU's default)
    pytorch-eager    model.msda=pytorch compile.mode=eager

Every run writes its usual run directory under --work/runs (train.log, eval_epoch*.json, tensorboard/; removed at
the start of the next call), the compiled ones share --work/compile_cache (kept). The report
takes each run's last evaluation (AP, AP50), each configuration's mean and spread (max - min over its seeds),
and the pass criterion: for triton-eager against pytorch-eager, and for triton-graphs and triton-compiled against
triton-eager,
|difference of the mean APs| <= the larger of the two configurations' spreads, i.e. within the seed-to-seed
variation that either configuration shows by itself. Beside it, the target of a mean AP >= 0.25 for each
configuration. The loss and AP curves of all runs (read back from their TensorBoard events) go into one figure
(parity_h200.png, when matplotlib is installed). Writes parity_h200.json, parity_h200.md and the figure to --out;
--replot rewrites the report and the figure from the json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {"triton-eager": ["model.msda=triton", "compile.mode=eager"],
           "triton-compiled": ["model.msda=triton", "compile.mode=reduce-overhead"],
           "triton-graphs": ["model.msda=triton", "compile.mode=graphs"],
           "pytorch-eager": ["model.msda=pytorch", "compile.mode=eager"]}
# (configuration, its reference): the pairs the pass criterion compares.
COMPARISONS = (("triton-eager", "pytorch-eager"), ("triton-compiled", "triton-eager"),
               ("triton-graphs", "triton-eager"))
AP_TARGET = 0.25
# What --quick runs: one configuration that needs no GPU and no Triton interpreter, two seeds, 20 steps.
QUICK = {"configs": ["pytorch-eager"], "seeds": [0, 1], "overrides": ["epochs=1", "max_steps=20"]}


class Children:
    """The train.py processes this script started, so that stopping the script (Ctrl-C, a time limit's SIGTERM)
    stops them too instead of leaving them running on the GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[subprocess.Popen] = []
        self.stopping = False

    def run(self, cmd: list[str], **kwargs) -> int:
        with self._lock:
            if self.stopping:
                return -int(signal.SIGTERM)
            proc = subprocess.Popen(cmd, **kwargs)
            self._running.append(proc)
        return proc.wait()

    def stop(self) -> None:
        """SIGTERM to every run still going: train.py saves its step and exits (143)."""
        with self._lock:
            self.stopping = True
            for proc in self._running:
                if proc.poll() is None:
                    proc.terminate()


CHILDREN = Children()


def run_one(args, config: str, seed: int) -> dict:
    """One `python train.py` of ``config`` and ``seed``; its figures and curves, or why it failed."""
    run_dir = args.work / "runs" / f"{config}_seed{seed}"
    overrides = [*CONFIGS[config], f"seed={seed}", f"device={args.device}", f"num_workers={args.num_workers}",
                 f"compile.cache_dir={args.work / 'compile_cache'}", f"output_dir={run_dir}", *args.overrides]
    env = dict(os.environ)
    # The runs share the host's cores: each gets its part, rather than every process starting a thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // args.parallel)))
    row = {"config": config, "seed": seed, "run_dir": str(run_dir), "command": "python train.py " + " ".join(overrides)}
    started = time.perf_counter()
    log = args.work / "runs" / f"{config}_seed{seed}.log"
    with open(log, "w") as out:
        returncode = CHILDREN.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    row["wall_s"] = time.perf_counter() - started
    evaluations = sorted(run_dir.glob("eval_epoch*.json"))
    if returncode != 0 or not evaluations:
        row["failed"] = f"exit {returncode}, {len(evaluations)} evaluations; see {log}"
        print(f"parity {config} seed {seed}: FAILED ({row['failed']})", flush=True)
        return row
    final = json.loads(evaluations[-1].read_text())
    row.update(ap=final["AP"], ap50=final["AP50"], epoch=final.get("epoch"), step=final.get("step"),
               loss=tensorboard_scalar(run_dir, "train/loss"), ap_curve=tensorboard_scalar(run_dir, "eval/AP"))
    print(f"parity {config} seed {seed}: AP {row['ap']:.4f} AP50 {row['ap50']:.4f} after step {row['step']} "
          f"({row['wall_s']:.0f} s)", flush=True)
    return row


def tensorboard_scalar(run_dir: Path, tag: str) -> dict[str, list]:
    """{"steps", "values"} of one scalar from a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: every point
    events.Reload()
    scalars = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    return {"steps": [e.step for e in scalars], "values": [e.value for e in scalars]}


def summarize(rows: list[dict]) -> dict:
    """Per configuration: runs, mean and spread of AP and AP50; then the criterion for each comparison."""
    per_config = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        done = [r for r in rows if r["config"] == config and "failed" not in r]
        aps, ap50s = [r["ap"] for r in done], [r["ap50"] for r in done]
        per_config[config] = {"runs": len(done), "failed": sum(1 for r in rows if r["config"] == config) - len(done),
                              "mean_ap": statistics.fmean(aps) if aps else None,
                              "spread_ap": max(aps) - min(aps) if aps else None,
                              "mean_ap50": statistics.fmean(ap50s) if ap50s else None,
                              "spread_ap50": max(ap50s) - min(ap50s) if ap50s else None,
                              "meets_ap_target": bool(aps) and statistics.fmean(aps) >= AP_TARGET}
    comparisons = []
    for config, reference in COMPARISONS:
        a, b = per_config.get(config), per_config.get(reference)
        if not a or not b or a["runs"] < 2 or b["runs"] < 2:
            comparisons.append({"config": config, "reference": reference, "passed": None,
                                "why": "not run, or fewer than 2 finished seeds for one of them: no spread"})
            continue
        difference = abs(a["mean_ap"] - b["mean_ap"])
        allowed = max(a["spread_ap"], b["spread_ap"])
        comparisons.append({"config": config, "reference": reference, "difference": difference,
                            "allowed": allowed, "passed": difference <= allowed})
    return {"per_config": per_config, "comparisons": comparisons}


def write_report(out: Path, record: dict) -> None:
    h, rows, summary = record["header"], record["rows"], record["summary"]
    lines = [f"# Converged mAP parity on {h['gpu']}", "",
             f"{h['date']}, torch {h['torch']}, triton {h['triton']}, {h['cpus']} CPU cores, {h['parallel']} runs at "
             f"once, {h['wall_s']:.0f} s in all: `{h['command']}`", "",
             "Each run is `python train.py` (the synthetic default: model=tiny, 24 epochs unless overridden) with the "
             f"configuration's overrides and `{' '.join(h['common'])}`; AP and AP50 are its last evaluation's.", "",
             "| configuration | seed | AP | AP50 | step | wall s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['config']} | {r['seed']} | failed: {r['failed']} | | | {r['wall_s']:.0f} |")
        else:
            lines.append(f"| {r['config']} | {r['seed']} | {r['ap']:.4f} | {r['ap50']:.4f} | {r['step']} | "
                         f"{r['wall_s']:.0f} |")
    lines += ["", f"| configuration | runs | mean AP | AP spread (max-min) | mean AP50 | AP50 spread | mean AP >= "
                  f"{AP_TARGET} |", "|---|---|---|---|---|---|---|"]

    def number(value) -> str:
        return "-" if value is None else f"{value:.4f}"

    for config, c in summary["per_config"].items():
        failed = f" ({c['failed']} failed)" if c["failed"] else ""
        lines.append(f"| {config} | {c['runs']}{failed} | {number(c['mean_ap'])} | {number(c['spread_ap'])} | "
                     f"{number(c['mean_ap50'])} | {number(c['spread_ap50'])} | {'yes' if c['meets_ap_target'] else 'no'} |")
    lines += ["", "Pass criterion, per comparison: |mean AP of the configuration - mean AP of its reference| <= the "
                  "larger of the two AP spreads (max - min over each one's seeds).", "",
              "| comparison | abs. difference of mean AP | allowed (larger spread) | passed |", "|---|---|---|---|"]
    for c in summary["comparisons"]:
        if c["passed"] is None:
            lines.append(f"| {c['config']} vs {c['reference']} | - | - | n/a: {c['why']} |")
        else:
            lines.append(f"| {c['config']} vs {c['reference']} | {c['difference']:.4f} | {c['allowed']:.4f} | "
                         f"{'yes' if c['passed'] else 'NO'} |")
    if record.get("figure"):
        lines += ["", f"![loss and AP curves]({record['figure']})"]
    (out / "parity_h200.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, record: dict) -> str | None:
    """parity_h200.png: the loss and AP curves of every run; None (and a note) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("parity: matplotlib is not installed; no figure (pip install matplotlib, then --replot)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(CONFIGS, ("tab:orange", "tab:red", "tab:green", "tab:blue")))
    fig, (loss_ax, ap_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in record["rows"]:
        if "failed" in r:
            continue
        style = {"color": colours[r["config"]], "linestyle": ("-", "--", ":", "-.")[r["seed"] % 4], "linewidth": 0.9,
                 "label": f"{r['config']} seed {r['seed']}"}
        loss_ax.plot(r["loss"]["steps"], r["loss"]["values"], **style)
        ap_ax.plot(r["ap_curve"]["steps"], r["ap_curve"]["values"], marker="o", markersize=3, **style)
    loss_ax.set(xlabel="step", ylabel="train/loss", yscale="log", title="training loss")
    ap_ax.set(xlabel="step", ylabel="eval/AP", title="AP (IoU .50:.95)")
    ap_ax.axhline(AP_TARGET, color="grey", linewidth=0.6, linestyle="--")
    ap_ax.legend(fontsize=7)
    h = record["header"]
    fig.suptitle(f"Converged mAP parity, synthetic default: {h['gpu']}, {h['date']}")
    fig.tight_layout()
    fig.savefig(out / "parity_h200.png", dpi=120)
    plt.close(fig)
    return "parity_h200.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_parity"))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                        help="configurations to run (all four; quick: pytorch-eager)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of each (0 1 2; quick: 0 1)")
    parser.add_argument("--parallel", type=int, default=None, help="runs at once (all of them)")
    parser.add_argument("--device", default=None, help="device= of the runs (cuda; quick: cpu)")
    parser.add_argument("--num-workers", type=int, default=0, help="num_workers= of the runs (the synthetic set's 0)")
    parser.add_argument("--overrides", nargs="*", default=None,
                        help="more train.py overrides for every run (quick: epochs=1 max_steps=20)")
    parser.add_argument("--quick", action="store_true",
                        help="a CPU smoke run: pytorch-eager, seeds 0 and 1, epochs=1 max_steps=20, device=cpu")
    parser.add_argument("--replot", action="store_true", help="only rewrite the report and figure from --out's json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "parity_h200.json"
    if args.replot:
        record = json.loads(saved.read_text())
        record["figure"] = plot(args.out, record)
        write_report(args.out, record)
        return
    args.configs = args.configs or (QUICK["configs"] if args.quick else list(CONFIGS))
    args.seeds = args.seeds if args.seeds is not None else (QUICK["seeds"] if args.quick else [0, 1, 2])
    args.overrides = args.overrides if args.overrides is not None else (QUICK["overrides"] if args.quick else [])
    args.device = args.device or ("cpu" if args.quick else "cuda")
    if args.device == "cpu" and any(c.startswith("triton") for c in args.configs):
        # Possible under TRITON_INTERPRET=1, but at about 90 s per step of the tiny model on 2 cores.
        parser.error(f"--configs {' '.join(args.configs)}: the triton configurations need a GPU (--device cuda); "
                     "on the CPU run --configs pytorch-eager")
    runs = [(config, seed) for config in args.configs for seed in args.seeds]
    args.parallel = args.parallel or len(runs)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    import shutil

    import torch

    # A reused run directory would resume, or mix old events into the curves; the compile cache is kept.
    shutil.rmtree(args.work / "runs", ignore_errors=True)
    (args.work / "runs").mkdir(parents=True)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a time limit: stop the runs too
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        try:
            rows = list(pool.map(lambda run: run_one(args, *run), runs))
        except BaseException:
            CHILDREN.stop()
            raise
    header = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "python": platform.python_version(),
              "cpus": len(os.sched_getaffinity(0)), "command": "python " + " ".join(sys.argv),
              "parallel": args.parallel, "wall_s": time.perf_counter() - started,
              "common": [f"device={args.device}", f"num_workers={args.num_workers}", *args.overrides]}
    record = {"header": header, "rows": rows, "summary": summarize(rows)}
    saved.write_text(json.dumps(record, indent=1))
    record["figure"] = plot(args.out, record)
    saved.write_text(json.dumps(record, indent=1))
    write_report(args.out, record)
    for c in record["summary"]["comparisons"]:
        verdict = "n/a" if c["passed"] is None else ("passed" if c["passed"] else "FAILED")
        print(f"parity {c['config']} vs {c['reference']}: {verdict}", flush=True)
    print(f"parity: wrote {saved}, {args.out / 'parity_h200.md'}", flush=True)


if __name__ == "__main__":
    main()
