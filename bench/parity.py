"""Converged mAP parity: do the Triton kernels and the compiled paths train to the same AP as the PyTorch reference?

    python bench/parity.py                    # on a GPU: 4 configurations x 3 seeds, all at once
    python bench/parity.py --quick            # CPU smoke run: 2 pytorch-eager runs of 20 steps

Each run is the synthetic default (`python train.py`: model=tiny, 24 epochs) with a seed and a configuration:

    triton-eager     model.msda=triton compile.mode=eager
    triton-graphs    model.msda=triton compile.mode=graphs (the GPU's default for this run: the eager model
                     replayed as CUDA graphs)
    triton-compiled  model.msda=triton compile.mode=reduce-overhead (Inductor with CUDA graphs: auto's choice for
                     long runs)
    pytorch-eager    model.msda=pytorch compile.mode=eager

Every run writes its usual run directory under --work/runs (removed at the start of the next call); the compiled
ones share --work/compile_cache (kept). The verdict (bench/parity_verdict.py) takes each run's last evaluation.
Writes parity_h200.json, .md and, with matplotlib, parity_h200.png (the loss and AP curves of every run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.parity_verdict import AP_TARGET, summarize  # noqa: E402
from bench.report import cell, header_lines, out_dir, pyplot, run_header, table, write_report  # noqa: E402
from bench.train_runs import run_all, train_run  # noqa: E402

CONFIGS = {
    "triton-eager": ["model.msda=triton", "compile.mode=eager"],
    "triton-graphs": ["model.msda=triton", "compile.mode=graphs"],
    "triton-compiled": ["model.msda=triton", "compile.mode=reduce-overhead"],
    "pytorch-eager": ["model.msda=pytorch", "compile.mode=eager"],
}
# What --quick runs: one configuration that needs no GPU and no Triton interpreter, two seeds, 20 steps.
QUICK = {"configs": ["pytorch-eager"], "seeds": [0, 1], "overrides": ["epochs=1", "max_steps=20"]}
NAME = "parity_h200"


def run_one(args, config: str, seed: int) -> dict:
    """One `python train.py` of ``config`` and ``seed``; its figures and curves, or why it failed."""
    overrides = [
        *CONFIGS[config],
        f"seed={seed}",
        f"device={args.device}",
        f"num_workers={args.num_workers}",
        f"compile.cache_dir={args.work / 'compile_cache'}",
        *args.overrides,
    ]
    done = train_run(overrides, run_dir=args.work / "runs" / f"{config}_seed{seed}", parallel=args.parallel)
    row = {"config": config, "overrides": " ".join(CONFIGS[config]), "seed": seed, **done}
    if "failed" in row:
        print(f"parity {config} seed {seed}: FAILED ({row['failed']})", flush=True)
        return row
    final = row.pop("evaluations")[-1]
    row.update(ap=final["AP"], ap50=final["AP50"], step=final.get("step"))
    print(
        f"parity {config} seed {seed}: AP {row['ap']:.4f} AP50 {row['ap50']:.4f} after step {row['step']} "
        f"({row['wall_s']:.0f} s)",
        flush=True,
    )
    return row


def report_lines(record: dict) -> list[str]:
    h, rows, summary = record["header"], record["rows"], record["summary"]
    lines = header_lines(
        "Converged mAP parity",
        h,
        f"Each run is `python train.py` (the synthetic default unless overridden: model=tiny, 24 epochs) with its "
        f"configuration's overrides, a seed and `{' '.join(h['common'])}`, {h['parallel']} runs at once "
        f"({h['wall_s']:.0f} s in all); AP is its last evaluation's. A configuration matches its reference when "
        "the difference of their mean APs is within the larger of the two seed spreads (max - min over the seeds).",
    )
    per_config = []
    for config, c in summary["per_config"].items():
        done = [r for r in rows if r["config"] == config and "failed" not in r]
        per_seed = ", ".join(f"{r['ap']:.4f}" for r in done) + (f" ({c['failed']} failed)" if c["failed"] else "")
        per_config.append(
            [
                config,
                f"`{done[0]['overrides'] if done else ''}`",
                per_seed,
                cell(c["mean_ap"], ".4f"),
                cell(c["spread_ap"], ".4f"),
                cell(c["mean_ap50"], ".4f"),
                "yes" if c["meets_ap_target"] else "no",
            ]
        )
    lines += table(
        ["configuration", "overrides", "AP per seed", "mean AP", "spread", "mean AP50", f"mean AP >= {AP_TARGET}"],
        per_config,
    )
    compared = [c for c in summary["comparisons"] if c["passed"] is not None]
    cells = [
        [c["config"], c["reference"], f"{c['difference']:.4f}", f"{c['allowed']:.4f}", "yes" if c["passed"] else "NO"]
        for c in compared
    ]
    columns = "configuration | reference | difference of mean AP | allowed (larger spread) | matches"
    lines += [""] + (
        table(columns, cells) if compared else ["No comparison: none had two finished seeds on both sides."]
    )
    if record.get("figure"):
        lines += ["", f"![loss and AP curves]({record['figure']})"]
    return lines


def plot(out: Path, record: dict) -> str | None:
    """parity_h200.png: the loss and AP curves of every run; None (and a note) without matplotlib."""
    plt = pyplot("parity")
    if plt is None:
        return None
    colours = dict(zip(CONFIGS, ("tab:orange", "tab:green", "tab:red", "tab:blue")))
    fig, (loss_ax, ap_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in record["rows"]:
        if "failed" in r:
            continue
        style = {
            "color": colours[r["config"]],
            "linestyle": ("-", "--", ":", "-.")[r["seed"] % 4],
            "linewidth": 0.9,
            "label": f"{r['config']} seed {r['seed']}",
        }
        loss_ax.plot(r["loss"]["steps"], r["loss"]["values"], **style)
        ap_ax.plot(r["ap_curve"]["steps"], r["ap_curve"]["values"], marker="o", markersize=3, **style)
    loss_ax.set(xlabel="step", ylabel="train/loss", yscale="log", title="training loss")
    ap_ax.set(xlabel="step", ylabel="eval/AP", title="AP (IoU .50:.95)")
    ap_ax.axhline(AP_TARGET, color="grey", linewidth=0.6, linestyle="--")
    ap_ax.legend(fontsize=7)
    h = record["header"]
    fig.suptitle(f"Converged mAP parity, synthetic default: {h['gpu']}, {h['date']}")
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(fig)
    return f"{NAME}.png"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; quick: outputs/bench)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_parity"))
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=None,
        help="configurations to run (all four; quick: pytorch-eager)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of each (0 1 2; quick: 0 1)")
    parser.add_argument("--parallel", type=int, default=None, help="runs at once (all of them)")
    parser.add_argument("--device", default=None, help="device= of the runs (cuda; quick: cpu)")
    parser.add_argument("--num-workers", type=int, default=0, help="num_workers= of the runs (the synthetic set's 0)")
    parser.add_argument(
        "--overrides",
        nargs="*",
        default=None,
        help="more train.py overrides for every run (quick: epochs=1 max_steps=20)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a CPU smoke run: pytorch-eager, seeds 0 and 1, epochs=1 max_steps=20, device=cpu",
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    out = out_dir(args.out, args.quick)
    args.configs = args.configs or (QUICK["configs"] if args.quick else list(CONFIGS))
    args.seeds = args.seeds if args.seeds is not None else (QUICK["seeds"] if args.quick else [0, 1, 2])
    args.overrides = args.overrides if args.overrides is not None else (QUICK["overrides"] if args.quick else [])
    args.device = args.device or ("cpu" if args.quick else "cuda")
    if args.device == "cpu" and any(c.startswith("triton") for c in args.configs):
        # Possible under TRITON_INTERPRET=1, but at about 90 s per step of the tiny model on 2 cores.
        parser.error("the triton configurations need a GPU (--device cuda); on the CPU run --configs pytorch-eager")
    runs = [(config, seed) for config in args.configs for seed in args.seeds]
    args.parallel = args.parallel or len(runs)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    import shutil

    # A reused run directory would resume, or mix old events into the curves; the compile cache is kept.
    shutil.rmtree(args.work / "runs", ignore_errors=True)
    (args.work / "runs").mkdir(parents=True)
    started = time.perf_counter()
    rows = run_all(lambda *run: run_one(args, *run), runs, parallel=args.parallel)
    header = run_header(
        cpus=len(os.sched_getaffinity(0)),
        parallel=args.parallel,
        wall_s=time.perf_counter() - started,
        common=[f"device={args.device}", f"num_workers={args.num_workers}", *args.overrides],
    )
    record = {"header": header, "rows": rows, "summary": summarize(rows)}
    out.mkdir(parents=True, exist_ok=True)
    record["figure"] = plot(out, record)
    json_path, md_path = write_report(NAME, record, report_lines(record), out=out)
    for c in record["summary"]["comparisons"]:
        verdict = "n/a" if c["passed"] is None else ("passed" if c["passed"] else "FAILED")
        print(f"parity {c['config']} vs {c['reference']}: {verdict}", flush=True)
    print(f"parity: wrote {json_path}, {md_path}", flush=True)


if __name__ == "__main__":
    main()
