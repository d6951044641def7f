"""Fewer epochs to the same AP: do hybrid matching and model EMA reach the baseline's AP sooner on our own data?

    python bench/recipe.py                     # the CPU run: 4 configurations x 3 seeds, about an hour on 2 cores
    python bench/recipe.py --quick             # a smoke run: 2 steps of each configuration, one seed

Each run is the synthetic default (`python train.py`: model=tiny, the built-in set) on a shorter schedule, with a
seed and one configuration:

    baseline     the published recipe's model and loss
    ema          model EMA (ema.decay; the evaluations are the average's)
    hybrid       hybrid matching (model.hybrid_matching: the one-to-many queries and their loss)
    hybrid-ema   both

Every run evaluates after every epoch. The report gives, per configuration, the mean AP over the seeds after each
epoch and its spread (max - min), and checks the target: hybrid-ema reaches the baseline's final mean AP in at most
60% of the baseline's epochs, or ends higher than it by more than the larger of the two seed spreads.
Writes recipe_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import cell, header_lines, out_dir, run_header, table, write_report  # noqa: E402
from bench.train_runs import run_all, train_run  # noqa: E402

NAME = "recipe_cpu"
# The synthetic runs are short (63 steps an epoch): the average follows about the last 100 steps, warmed up over 100.
EMA = ["ema.decay=0.99", "ema.warmup_steps=100"]
CONFIGS = {
    "baseline": [],
    "ema": EMA,
    "hybrid": ["model.hybrid_matching=true"],
    "hybrid-ema": ["model.hybrid_matching=true", *EMA],
}
# A 12-epoch schedule with its lr drop near the end, as H-DETR's 12-epoch recipe (drop after 11 of 12).
SCHEDULE = ["epochs=12", "optim.lr_drop=10", "eval_every=1", "checkpoint_every=12"]
QUICK = ["epochs=1", "max_steps=2", "dataset.num_train=16", "dataset.num_val=8"]
EPOCHS_SHARE = 0.6  # the target: the baseline's final AP in at most this share of its epochs


def run_one(args, config: str, seed: int) -> dict:
    overrides = [
        *CONFIGS[config],
        *args.schedule,
        f"seed={seed}",
        "device=cpu",
        "num_workers=0",
        f"dataset.root={args.work / 'data'}",
        "eval_images=0",
    ]
    row = {
        "config": config,
        "seed": seed,
        **train_run(overrides, run_dir=args.work / "runs" / f"{config}_seed{seed}", parallel=args.parallel),
    }
    if "failed" in row:
        print(f"recipe {config} seed {seed}: FAILED ({row['failed']})", flush=True)
        return row
    row["ap"] = {e["epoch"]: e["AP"] for e in row.pop("evaluations")}
    final = row["ap"][max(row["ap"])]
    print(f"recipe {config} seed {seed}: final AP {final:.4f} ({row['wall_s']:.0f} s)", flush=True)
    return row


def summarize(rows: list[dict]) -> dict:
    """Per configuration: the mean AP over its seeds after each epoch, its spread, the final ones; the target."""
    per_config = {}
    for config in CONFIGS:
        done = [r for r in rows if r["config"] == config and "failed" not in r]
        epochs = sorted(set.intersection(*(set(r["ap"]) for r in done))) if done else []
        mean = {e: statistics.fmean(r["ap"][e] for r in done) for e in epochs}
        spread = {e: max(r["ap"][e] for r in done) - min(r["ap"][e] for r in done) for e in epochs}
        per_config[config] = {
            "runs": len(done),
            "mean_ap": mean,
            "spread_ap": spread,
            "final_mean_ap": mean[epochs[-1]] if epochs else None,
            "final_spread_ap": spread[epochs[-1]] if epochs else None,
        }
    return {"per_config": per_config, "target": target(per_config)}


def target(per_config: dict) -> dict:
    base, best = per_config["baseline"], per_config["hybrid-ema"]
    if not base["mean_ap"] or not best["mean_ap"]:
        return {"met": None, "why": "the baseline or hybrid-ema has no finished run"}
    epochs = max(base["mean_ap"])
    reached = next((e for e in sorted(best["mean_ap"]) if best["mean_ap"][e] >= base["final_mean_ap"]), None)
    sooner = reached is not None and reached <= EPOCHS_SHARE * epochs
    margin = best["final_mean_ap"] - base["final_mean_ap"]
    allowed = max(base["final_spread_ap"], best["final_spread_ap"])
    return {
        "met": sooner or margin > allowed,
        "epochs": epochs,
        "reached_baseline_at": reached,
        "final_margin": margin,
        "seed_spread": allowed,
    }


def report_lines(record: dict) -> list[str]:
    h, summary = record["header"], record["summary"]
    lines = header_lines(
        "Fewer epochs to the same AP: hybrid matching and model EMA on the synthetic set",
        h,
        f"Each run is `python train.py` (the synthetic default: model=tiny, 256 training images of 1-5 objects) with "
        f"`{' '.join(h['schedule'])}`, its configuration's overrides and a seed, {h['parallel']} runs at once "
        f"({h['wall_s']:.0f} s in all). AP is COCO's AP (IoU .50:.95) on the 64 validation images after each epoch; "
        "with EMA it is the average's. Each cell is the mean over the seeds and, in brackets, its spread (max - min).",
    )
    # Epochs as numbers also in a record read back from its json (whose keys are strings).
    per_config = {
        config: {**c, **{key: {int(e): v for e, v in c[key].items()} for key in ("mean_ap", "spread_ap")}}
        for config, c in summary["per_config"].items()
    }
    epochs = sorted({e for c in per_config.values() for e in c["mean_ap"]})
    cells = [
        [
            config,
            c["runs"],
            *(f"{c['mean_ap'][e]:.4f} ({c['spread_ap'][e]:.4f})" if e in c["mean_ap"] else "-" for e in epochs),
        ]
        for config, c in per_config.items()
    ]
    lines += table(["configuration", "seeds", *(f"epoch {e}" for e in epochs)], cells)
    t = summary["target"]
    if t["met"] is None:
        verdict = f"not checked: {t['why']}"
    else:
        reached = (
            f"reached the baseline's final mean AP at epoch {t['reached_baseline_at']} of {t['epochs']}"
            if t["reached_baseline_at"] is not None
            else "never reached the baseline's final mean AP"
        )
        verdict = (
            f"{'met' if t['met'] else 'MISSED'}: hybrid-ema {reached} (target: at most "
            f"{EPOCHS_SHARE:.0%} of the epochs), and ended {cell(t['final_margin'], '+.4f')} from it "
            f"(the larger seed spread: {cell(t['seed_spread'], '.4f')})"
        )
    lines += ["", f"Target: {verdict}."]
    if record.get("notes"):
        lines += ["", record["notes"]]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; quick: outputs/bench)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_recipe"))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of each (0 1 2; quick: 0)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (2: one per core of a 2-core CPU)")
    parser.add_argument("--notes", default="", help="a paragraph for the report (what the figures show, and why)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps of each configuration, seed 0")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    out = out_dir(args.out, args.quick)
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    args.schedule = [*SCHEDULE, *(QUICK if args.quick else [])]
    # A reused run directory would resume; the data is kept.
    shutil.rmtree(args.work / "runs", ignore_errors=True)
    (args.work / "runs").mkdir(parents=True)
    runs = [(config, seed) for seed in args.seeds for config in args.configs]
    started = time.perf_counter()
    rows = run_all(lambda *run: run_one(args, *run), runs, parallel=args.parallel)
    header = run_header(
        cpus=len(os.sched_getaffinity(0)),
        parallel=args.parallel,
        wall_s=time.perf_counter() - started,
        schedule=args.schedule,
    )
    record = {"header": header, "rows": rows, "summary": summarize(rows), "notes": args.notes}
    json_path, md_path = write_report(NAME, record, report_lines(record), out=out)
    print(f"recipe: target {record['summary']['target']}; wrote {json_path}, {md_path}", flush=True)


if __name__ == "__main__":
    main()
