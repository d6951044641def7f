"""Time to an AP, not epochs: do Deformable-DETR++'s training changes, mixed supervision and hybrid matching reach
the baseline's AP in fewer training seconds, on a set where one-to-many supervision has work to do?

    python bench/recipe.py                     # the CPU run: 4 configurations x 3 seeds (hours on 2 cores)
    python bench/recipe.py --ema               # the same, each with model EMA
    python bench/recipe.py --quick             # a smoke run: 2 steps of each configuration, one seed

Each run is `python train.py dataset=synthetic_dense` (the built-in set at COCO-like density: 2-20 objects an image of
24 classes, small and overlapping; the tiny model) on a 12-epoch schedule, with a seed and one configuration, each
built on two-stage Deformable DETR with box refinement (the model these recipes train):

    baseline     the paper's training
    plus         Deformable-DETR++'s training changes: dropout 0 (the tiny model's already), twice the FFN width,
                 mixed query selection, look forward twice
    mixed        plus, with mixed supervision (MS-DETR: cross-attention first, its loss weights)
    hybrid       plus, with hybrid matching (H-DETR: the tiny model's 150 one-to-many queries)

Every run evaluates after every epoch; each evaluation records the wall time of the run's training steps so far
(eval json's steps_s). The report gives, per configuration, the mean AP over the seeds after each epoch with its
spread (max - min) and its mean training seconds, the step's cost against the baseline's measured in the same run,
and a plot of AP against training seconds; it checks the targets: a mixed step costs at most 1.10x the baseline's,
and mixed reaches the baseline's final mean AP in at most 60% of its training seconds, or ends above it by more than
the larger seed spread. Writes recipe_cpu.json, .md and .png.
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

from bench.report import cell, header_lines, out_dir, pyplot, run_header, table, write_report  # noqa: E402
from bench.train_runs import run_all, train_run  # noqa: E402

NAME = "recipe_cpu"
TWO_STAGE = ["model.with_box_refine=true", "model.two_stage=true"]
# Deformable-DETR++'s changes at the tiny model's size: its FFN doubled as 1024 -> 2048 in the COCO recipes.
PLUS = ["model.dropout=0.0", "model.dim_feedforward=512", "model.mixed_selection=true", "model.look_forward_twice=true"]
# In this order, two at a time, seed by seed: each target compares mixed with the baseline, which run side by side.
CONFIGS = {
    "baseline": TWO_STAGE,
    "mixed": [
        *TWO_STAGE,
        *PLUS,
        "model.cross_attention_first=true",
        "model.one_to_many=mixed",
        "model.cls_loss_coef=1",
        "model.cls_loss_coef_one2many=2",
    ],
    "plus": [*TWO_STAGE, *PLUS],
    "hybrid": [*TWO_STAGE, *PLUS, "model.one_to_many=hybrid"],
}
COLOURS = {"baseline": "tab:grey", "mixed": "tab:red", "plus": "tab:blue", "hybrid": "tab:green"}
# The synthetic runs are short (64 steps an epoch): the average follows about the last 100 steps, warmed up over 100.
EMA = ["ema.decay=0.99", "ema.warmup_steps=100"]
# A 12-epoch schedule with its lr drop near the end, as the 12-epoch recipes (drop after 11 of 12).
SCHEDULE = ["dataset=synthetic_dense", "epochs=12", "optim.lr_drop=10", "eval_every=1", "checkpoint_every=12"]
QUICK = ["epochs=1", "max_steps=2", "dataset.num_train=16", "dataset.num_val=8"]
SECONDS_SHARE = 0.6  # the target: the baseline's final AP in at most this share of its training seconds
STEP_COST = 1.10  # the target: a mixed step at most this many times the baseline's


def run_one(args, config: str, seed: int) -> dict:
    overrides = [
        *CONFIGS[config],
        *(EMA if args.ema else []),
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
    evaluations = row.pop("evaluations")
    row["ap"] = {e["epoch"]: e["AP"] for e in evaluations}
    row["seconds"] = {e["epoch"]: e["steps_s"] for e in evaluations}
    row["steps"] = {e["epoch"]: e["step"] for e in evaluations}
    final = max(row["ap"])
    print(f"recipe {config} seed {seed}: final AP {row['ap'][final]:.4f} ({row['wall_s']:.0f} s)", flush=True)
    return row


def summarize(rows: list[dict]) -> dict:
    """Per configuration, over its seeds: the mean AP after each epoch, its spread, the mean training seconds to it,
    the seconds a step took; the step cost against the baseline's (the mean over seeds of the two runs' ratio: the
    baseline of the same seed ran beside mixed, just before plus and hybrid); the targets."""
    per_config = {}
    for config in CONFIGS:
        done = [r for r in rows if r["config"] == config and "failed" not in r]
        epochs = sorted(set.intersection(*(set(r["ap"]) for r in done))) if done else []
        last = epochs[-1] if epochs else None
        per_config[config] = {
            "runs": len(done),
            "mean_ap": {e: statistics.fmean(r["ap"][e] for r in done) for e in epochs},
            "spread_ap": {e: max(r["ap"][e] for r in done) - min(r["ap"][e] for r in done) for e in epochs},
            "mean_seconds": {e: statistics.fmean(r["seconds"][e] for r in done) for e in epochs},
            "step_s": {r["seed"]: r["seconds"][last] / r["steps"][last] for r in done},
        }
    base_step = per_config["baseline"]["step_s"]
    for c in per_config.values():
        ratios = [s / base_step[seed] for seed, s in c["step_s"].items() if seed in base_step]
        c["step_cost"] = statistics.fmean(ratios) if ratios else None
    return {"per_config": per_config, "target": target(per_config)}


def ap_at(curve: dict, seconds: dict, at: float) -> float | None:
    """The mean AP curve at ``at`` training seconds, linear between evaluations; None past its last one."""
    points = sorted((seconds[e], curve[e]) for e in curve)
    previous = (0.0, 0.0)
    for s, ap in points:
        if at <= s:
            (s0, ap0), span = previous, s - previous[0]
            return ap0 + (ap - ap0) * (at - s0) / span if span > 0 else ap
        previous = (s, ap)
    return None


def target(per_config: dict) -> dict:
    base, mixed = per_config["baseline"], per_config["mixed"]
    if not base["mean_ap"] or not mixed["mean_ap"]:
        return {"met": None, "why": "the baseline or mixed has no finished run"}
    last = max(base["mean_ap"])
    final_ap, final_s = base["mean_ap"][last], base["mean_seconds"][last]
    reached = next((e for e in sorted(mixed["mean_ap"]) if mixed["mean_ap"][e] >= final_ap), None)
    reached_s = mixed["mean_seconds"][reached] if reached is not None else None
    sooner = reached_s is not None and reached_s <= SECONDS_SHARE * final_s
    at_equal = ap_at(mixed["mean_ap"], mixed["mean_seconds"], final_s)
    margin = None if at_equal is None else at_equal - final_ap
    # A spread needs two seeds: with one, ending above the baseline by any margin would count.
    several = min(base["runs"], mixed["runs"]) >= 2
    allowed = max(base["spread_ap"][last], mixed["spread_ap"][max(mixed["spread_ap"])]) if several else None
    cost = mixed["step_cost"]
    return {
        "met": sooner or (margin is not None and allowed is not None and margin > allowed),
        "baseline_final_ap": final_ap,
        "baseline_seconds": final_s,
        "reached_at_epoch": reached,
        "reached_seconds": reached_s,
        "margin_at_equal_seconds": margin,
        "seed_spread": allowed,
        "step_cost": cost,
        "step_cost_met": cost is not None and cost <= STEP_COST,
    }


def report_lines(record: dict) -> list[str]:
    h, summary = record["header"], record["summary"]
    lines = header_lines(
        "Time to an AP: Deformable-DETR++'s changes, mixed supervision and hybrid matching on the dense synthetic set",
        h,
        f"Each run is `python train.py` with `{' '.join(h['schedule'])}`, its configuration's overrides "
        f"{'and model EMA ' if h['ema'] else ''}and a seed, {h['parallel']} runs started together on {h['cpus']} "
        f"cores, each pair ended before the next (in the table's order, seed by seed: the baseline beside mixed; "
        f"{h['wall_s']:.0f} s in all). The step cost is the mean over the seeds of the step's time against the same "
        "seed's baseline. AP is COCO's AP (IoU .50:.95) on the 64 validation images after each epoch"
        f"{' (the average' + chr(39) + 's)' if h['ema'] else ''}; seconds are the wall time of a run's training steps "
        "up to that evaluation (evaluation and checkpoints left out). Each cell is the mean over the seeds, its spread "
        "(max - min) in brackets, and the mean training seconds.",
    )
    per_config = {
        config: {
            **c,
            **{key: {int(e): v for e, v in c[key].items()} for key in ("mean_ap", "spread_ap", "mean_seconds")},
        }
        for config, c in summary["per_config"].items()
    }
    epochs = sorted({e for c in per_config.values() for e in c["mean_ap"]})
    cells = [
        [
            config,
            c["runs"],
            cell(c["step_cost"], ".2f") + "x",
            *(
                f"{c['mean_ap'][e]:.4f} ({c['spread_ap'][e]:.4f}) {c['mean_seconds'][e]:.0f} s"
                if e in c["mean_ap"]
                else "-"
                for e in epochs
            ),
        ]
        for config, c in per_config.items()
    ]
    lines += table(["configuration", "seeds", "step cost", *(f"epoch {e}" for e in epochs)], cells)
    t = summary["target"]
    if t["met"] is None:
        lines += ["", f"Targets: not checked: {t['why']}."]
    else:
        reached = (
            f"reached the baseline's final mean AP ({t['baseline_final_ap']:.4f}, at {t['baseline_seconds']:.0f} s) "
            f"at epoch {t['reached_at_epoch']}, after {t['reached_seconds']:.0f} s"
            if t["reached_at_epoch"] is not None
            else f"never reached the baseline's final mean AP ({t['baseline_final_ap']:.4f})"
        )
        margin = t["margin_at_equal_seconds"]
        lines += [
            "",
            f"Target, time: {'met' if t['met'] else 'MISSED'}: mixed {reached} (target: at most "
            f"{SECONDS_SHARE:.0%} of the baseline's seconds), and at the baseline's seconds it stood "
            f"{cell(margin, '+.4f')} from it (the larger seed spread: {cell(t['seed_spread'], '.4f')}).",
            f"Target, step cost: {'met' if t['step_cost_met'] else 'MISSED'}: a mixed step costs "
            f"{cell(t['step_cost'], '.2f')}x the baseline's (target: at most {STEP_COST:.2f}x); hybrid's: "
            f"{cell(per_config['hybrid']['step_cost'], '.2f')}x.",
        ]
    if record.get("figure"):
        lines += ["", f"![AP against training seconds]({record['figure']})"]
    if record.get("notes"):
        lines += ["", record["notes"]]
    return lines


def plot(out: Path, record: dict) -> str | None:
    """recipe_cpu.png: each configuration's mean AP against its mean training seconds, every seed's faint beside it;
    None (and a note) without matplotlib."""
    plt = pyplot("recipe")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in record["rows"]:
        if "failed" not in r:
            epochs = sorted(r["ap"])
            ax.plot(
                [r["seconds"][e] for e in epochs], [r["ap"][e] for e in epochs], color=COLOURS[r["config"]], alpha=0.25
            )
    for config, c in record["summary"]["per_config"].items():
        epochs = sorted(c["mean_ap"])
        ax.plot(
            [c["mean_seconds"][e] for e in epochs],
            [c["mean_ap"][e] for e in epochs],
            marker="o",
            markersize=3,
            color=COLOURS[config],
            label=config,
        )
    ax.set(xlabel="training seconds (the steps' wall time)", ylabel="AP (IoU .50:.95)")
    ax.legend()
    h = record["header"]
    ax.set_title(f"AP against training seconds, dense synthetic set, {h['cpus']}-core CPU, {h['date']}")
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(fig)
    return f"{NAME}.png"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; quick: outputs/bench)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_recipe"))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of each (0 1 2; quick: 0)")
    parser.add_argument("--ema", action="store_true", help="every configuration with model EMA (decay 0.99)")
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
    runs = [(config, seed) for seed in args.seeds for config in CONFIGS if config in args.configs]
    started = time.perf_counter()
    rows = run_all(lambda *run: run_one(args, *run), runs, parallel=args.parallel, lockstep=True)
    header = run_header(
        cpus=len(os.sched_getaffinity(0)),
        parallel=args.parallel,
        wall_s=time.perf_counter() - started,
        schedule=args.schedule,
        ema=args.ema,
    )
    record = {"header": header, "rows": rows, "summary": summarize(rows), "notes": args.notes}
    out.mkdir(parents=True, exist_ok=True)
    record["figure"] = plot(out, record)
    json_path, md_path = write_report(NAME, record, report_lines(record), out=out)
    print(f"recipe: targets {record['summary']['target']}; wrote {json_path}, {md_path}", flush=True)


if __name__ == "__main__":
    main()
