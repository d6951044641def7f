"""Training step time: how long does the trainer's step take, model.msda=triton against pytorch, per compile.mode?

    python bench/e2e.py                                      # on a GPU: eager and graphs, triton and pytorch
    python bench/e2e.py --impls triton --compile-modes reduce-overhead --compile-backbone eager static --repeats 2
    python bench/e2e.py --quick                              # CPU check of the script: tiny model, 128x128

The step is the trainer's own (engine.train.step.OptimizerStep: forward, matching and losses, backward, clipping,
fused AdamW) of the COCO recipe's model (dataset=coco: ResNet-50, random weights) at batch 2 in bf16, built by
engine.train.build.build_training as train.py builds it, for every compile.mode and model.msda given, on random
800x1333 batches. Per configuration:
    step ms          median wall time of a step, synchronized after each
    back to back ms  the same steps with no sync between them, as train.py runs them (step_profile.back_to_back_ms)
    GPU kernels ms   device time of the step's kernels (torch.profiler), launches and host syncs per step
    peak GiB         GPU memory allocated at most, warm-up and CUDA-graph recording included
    first step s     kernel compilation, CUDA-graph recording and, compiled, Inductor's compilation
    GPU idle         time the GPU waits per step, charged to what the host was doing (step_profile.idle_by_phase)
One size only: a run meets at most dataset.size_buckets sizes, and what meeting them costs is bench/ttr.py's.
The step is bound by the host, so its figure moves with the machine: compare rows of one run. --repeats N
measures every configuration N times, in alternating order (the report shows the median and the range);
--isolate measures each in a process of its own, free of what an earlier configuration left behind.
Writes e2e_h200.json and e2e_h200.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import cell, header_lines, out_dir, run_header, table, write_report  # noqa: E402
from bench.train_runs import compose_config  # noqa: E402
from engine.config.choices import COMPILE_MODES, INDUCTOR_MODES, REGION_CHOICES, TRAIN_BACKBONE_CHOICES  # noqa: E402

NAME = "e2e_h200"
ATTENTION_KERNELS = {"triton": ("msda_",), "pytorch": ("grid_sampler",)}
# --quick: the tests' tiny model on the CPU, small images, a few steps: a check of the script, not a measurement.
QUICK = {
    "overrides": ["model=tiny"],
    "impls": ["pytorch"],
    "compile_modes": ["eager"],
    "device": "cpu",
    "height": 128,
    "width": 128,
    "warmup": 1,
    "steps": 2,
}


def configurations(args) -> list[dict]:
    """Every (model.msda, compile.*) to measure; regions and backbone only where Inductor compiles."""
    return [
        {"impl": impl, "mode": mode, "regions": regions, "backbone": backbone}
        for mode in args.compile_modes
        for regions in (args.compile_regions if mode in INDUCTOR_MODES else [None])
        for backbone in (args.compile_backbone if mode in INDUCTOR_MODES else [None])
        for impl in args.impls
    ]


def overrides_of(args, config: dict) -> list[str]:
    compiled = (
        [f"compile.regions={config['regions']}", f"compile.backbone={config['backbone']}"]
        if config["mode"] in INDUCTOR_MODES
        else []
    )
    return [
        "dataset=coco",
        "model.pretrained=none",
        *args.overrides,
        f"model.msda={config['impl']}",
        f"amp={args.amp}",
        f"batch_size={args.batch}",
        f"device={args.device}",
        f"compile.mode={config['mode']}",
        *compiled,
    ]


def label(row: dict) -> str:
    """The compile settings of a row, as the config names them."""
    if row["mode"] not in INDUCTOR_MODES:
        return row["mode"]
    return f"{row['mode']}, regions={row['regions']}, backbone={row['backbone']}"


def random_batch(batch: int, height: int, width: int, num_classes: int, device, gen):
    """Random uint8 images of one size (no padding), as the loader hands them over, and 6 random boxes per image."""
    import torch

    images = torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, device=device, generator=gen)
    masks = torch.zeros(batch, height, width, dtype=torch.bool, device=device)
    targets = [
        {
            "labels": torch.randint(1, num_classes, (6,), device=device, generator=gen),
            "boxes": torch.cat(
                [
                    torch.rand(6, 2, device=device, generator=gen) * 0.6 + 0.2,
                    torch.rand(6, 2, device=device, generator=gen) * 0.3 + 0.05,
                ],
                -1,
            ),
        }
        for _ in range(batch)
    ]
    return images, masks, targets


def measure(args, config: dict) -> dict:
    """One configuration's row: the step built as train.py builds it, timed on fixed-size random batches."""
    import torch

    from bench.step_profile import back_to_back_ms, count_syncs, profile_steps
    from engine.runtime.distributed import init_distributed
    from engine.train.build import build_training

    cfg = compose_config(overrides_of(args, config))
    torch._dynamo.reset()  # also frees the CUDA-graph trees of an earlier configuration
    ctx = init_distributed(device=cfg.device)
    device, cuda = ctx.device, ctx.device.type == "cuda"  # a CPU run only checks the bench itself
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # peaks include warm-up: CUDA graphs take their memory there
    training = build_training(cfg, ctx=ctx)
    training.model.train()
    step = training.step
    gen = torch.Generator(device=device).manual_seed(0)
    batch = random_batch(cfg.batch_size, args.height, args.width, cfg.model.num_classes, device, gen)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed() -> float:
        t0 = time.perf_counter()
        step(*batch)
        sync()
        return (time.perf_counter() - t0) * 1e3

    first_ms = timed()
    for _ in range(args.warmup - 1):
        timed()
    times = [timed() for _ in range(args.steps)]
    row = {
        **config,
        "amp": args.amp,
        "batch": cfg.batch_size,
        "size": [args.height, args.width],
        "step_ms": statistics.median(times),
        "all_ms": times,
        "first_step_s": first_ms / 1e3,
        "back_to_back_ms": back_to_back_ms(lambda: step(*batch), sync, steps=args.steps),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "syncs_per_step": count_syncs(lambda: step(*batch)) if cuda else None,
        **profile_steps(lambda: step(*batch), sync, ATTENTION_KERNELS[config["impl"]], cuda=cuda),
    }
    print(
        f"e2e {row['impl']:<7} {label(row):<48} {row['step_ms']:.1f} ms (back to back {row['back_to_back_ms']:.1f}),"
        f" GPU kernels {row['gpu_kernel_ms']:.1f} ms, first step {row['first_step_s']:.1f} s",
        flush=True,
    )
    return row


def measure_in_child(args, config: dict) -> list[dict]:
    """The same configuration measured by this script in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--out",
            tmp,
            "--impls",
            config["impl"],
            "--compile-modes",
            config["mode"],
            "--amp",
            args.amp,
            "--batch",
            str(args.batch),
            "--device",
            args.device,
            "--height",
            str(args.height),
            "--width",
            str(args.width),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
            "--overrides",
            *args.overrides,
        ]
        if config["mode"] in INDUCTOR_MODES:
            cmd += ["--compile-regions", config["regions"], "--compile-backbone", config["backbone"]]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"e2e {label(config)} {config['impl']}: FAILED in its process: {' '.join(cmd)}", flush=True)
            return []
        return json.loads((Path(tmp) / f"{NAME}.json").read_text())["rows"]


def run(args, save) -> list[dict]:
    """Every configuration's rows, ``save(rows so far)`` after each, so that a stopped run keeps what it measured."""
    import torch

    rows, configs = [], configurations(args)
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            if args.isolate:
                new = measure_in_child(args, config)
            else:
                try:
                    new = [measure(args, config)]
                except Exception:  # one configuration's failure is reported; the others are still measured
                    print(f"e2e {label(config)} {config['impl']}: FAILED\n{traceback.format_exc()}", flush=True)
                    new = []
                finally:
                    # A compiled model is a reference cycle: collect it before the next configuration, whose peak
                    # memory would otherwise include this one's weights and gradients.
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            for row in new:
                row["repeat"] = repeat
            rows += new
            save(rows)
    return rows


def combined(rows: list[dict]) -> list[dict]:
    """One row per configuration: medians over its repeats, and the range of their step times."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["impl"], label(r)), []).append(r)
    result = []
    for group in groups.values():
        row = dict(group[0])
        for key in (
            "step_ms",
            "back_to_back_ms",
            "gpu_kernel_ms",
            "launches",
            "attention_share",
            "first_step_s",
            "gpu_idle_ms",
        ):
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for phase in row.get("gpu_idle_by_phase_ms", {}):
            row["gpu_idle_by_phase_ms"][phase] = statistics.median(r["gpu_idle_by_phase_ms"][phase] for r in group)
        row["peak_gib"] = max((r["peak_gib"] for r in group if r.get("peak_gib") is not None), default=None)
        row["step_range_ms"] = [min(r["step_ms"] for r in group), max(r["step_ms"] for r in group)]
        row["runs"] = len(group)
        result.append(row)
    return result


def report_lines(record: dict) -> list[str]:
    rows = combined(record["rows"])
    h, first = record["header"], rows[0] if rows else {"batch": "-", "amp": "-", "size": ["-", "-"]}
    lines = header_lines(
        "Training step time",
        h,
        f"The trainer's step (forward, matching and losses, backward, clipping, fused AdamW) of "
        f"{h.get('model', 'the COCO model (ResNet-50, random weights)')}, batch {first['batch']}, {first['amp']}, "
        f"random {first['size'][0]}x{first['size'][1]} batches. Step: median of the timed steps after warm-up, each "
        "synchronized; back to back: the same steps queued without a sync, as train.py runs them (the figure a run "
        "sees). GPU kernels: device time of the step's kernels (torch.profiler) and its share of the step; the rest "
        "is the GPU waiting on the host. First step: compilation and recording, which a run pays once per size. "
        "Speed-up: msda=pytorch's step over this row's, same compile settings. With several runs per "
        "configuration, the median and (range).",
    )

    def step_cell(r: dict) -> str:
        low, high = r["step_range_ms"]
        return f"{r['step_ms']:.1f}" + (f" ({low:.1f}-{high:.1f})" if r["runs"] > 1 else "")

    reference = {label(r): r for r in rows if r["impl"] == "pytorch"}
    lines += table(
        [
            "msda",
            "compile",
            "step ms",
            "back to back ms",
            "GPU kernels ms",
            "launches",
            "syncs",
            "peak GiB",
            "attention share",
            "first step s",
            "speed-up",
        ],
        [
            [
                r["impl"],
                label(r),
                step_cell(r),
                cell(r["back_to_back_ms"]),
                f"{cell(r['gpu_kernel_ms'])} ({100 * r['gpu_kernel_ms'] / r['step_ms']:.0f}%)",
                cell(r["launches"], ".0f"),
                cell(r.get("syncs_per_step"), "d"),
                cell(r.get("peak_gib"), ".2f"),
                cell(r["attention_share"], ".0%"),
                cell(r["first_step_s"]),
                f"{reference[label(r)]['step_ms'] / r['step_ms']:.2f}x" if label(r) in reference else "-",
            ]
            for r in rows
        ],
    )
    idle = [r for r in rows if r.get("gpu_idle_by_phase_ms")]
    if idle:
        phases = sorted({p for r in idle for p in r["gpu_idle_by_phase_ms"]})
        lines += [
            "",
            "GPU idle per step (ms), charged to the phase of engine.train.step the host was in:",
            "",
            *table(
                ["msda", "compile", "all", *(p.removeprefix("step.") for p in phases)],
                [
                    [
                        r["impl"],
                        label(r),
                        cell(r["gpu_idle_ms"]),
                        *(cell(r["gpu_idle_by_phase_ms"].get(p)) for p in phases),
                    ]
                    for r in idle
                ],
            ),
        ]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; quick: outputs/bench)")
    parser.add_argument(
        "--impls", nargs="+", default=["triton", "pytorch"], choices=["triton", "pytorch"], help="model.msda values"
    )
    parser.add_argument(
        "--compile-modes",
        nargs="+",
        default=["eager", "graphs"],
        choices=["eager", *COMPILE_MODES],
        help="compile.mode values (graphs: auto's choice on a GPU but for runs of 35,000 steps or "
        "more, which take reduce-overhead)",
    )
    parser.add_argument(
        "--compile-regions",
        nargs="+",
        default=["transformer"],
        choices=list(REGION_CHOICES),
        help="compile.regions of the Inductor modes; several: each is measured",
    )
    parser.add_argument(
        "--compile-backbone",
        nargs="+",
        default=["dynamic"],
        choices=list(TRAIN_BACKBONE_CHOICES),
        help="compile.backbone of the Inductor modes; several: each is measured",
    )
    parser.add_argument("--overrides", nargs="*", default=[], help="more train.py overrides for every configuration")
    parser.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "none"])
    parser.add_argument("--batch", type=int, default=2, help="batch_size")
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--width", type=int, default=1333)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps, the first one included")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--repeats", type=int, default=1, help="measure every configuration this many times, in alternating order"
    )
    parser.add_argument("--isolate", action="store_true", help="each configuration in a process of its own")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="check the script on the CPU: " + " ".join(f"{k}={v}" for k, v in QUICK.items()),
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.repeats < 1 or args.warmup < 1 or args.steps < 1:
        parser.error("--repeats, --warmup and --steps must be at least 1")
    out = out_dir(args.out, args.quick)
    header = run_header(**({"model": "the tiny model (--quick)"} if args.quick else {}))

    def save(rows: list[dict]) -> None:
        record = {"header": header, "rows": rows}
        write_report(NAME, record, report_lines(record), out=out)

    save(run(args, save))
    print(f"e2e: wrote {out / NAME}.md and .json", flush=True)


if __name__ == "__main__":
    main()
