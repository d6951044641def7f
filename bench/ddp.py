"""Several GPUs of one host: scaling of the training step over NCCL, and a short synthetic run's AP.

    python bench/ddp.py --out bench/results                 # every part, on a machine with 2+ GPUs
    python bench/ddp.py --parts scaling --gpus 1 2 --steps 30

scaling  torchrun with 1 and N processes (one GPU each, the same batch per GPU), eager and compiled: the
         trainer's OptimizerStep on random 800x1333 batches of the default model (bf16, msda=triton), its
         gradients averaged as train.py's gradient_sync setting does it (--gradient-sync): during backward
         by DistributedDataParallel, or after it by engine.runtime.distributed.GradientAllReduce. images/s =
         processes x batch / median step; efficiency = images/s over N x the 1-GPU figure.
ap       The synthetic set's default schedule, shortened (--epochs), through `python train.py` on 1 GPU
         (seeds 0 and 1: the seed-to-seed spread) and `torchrun --nproc_per_node=N train.py` (seed 0).
Rank parity on NCCL is a test: tests/test_rank_parity.py runs it when 2 GPUs are visible.
Writes ddp_<gpu>.json and ddp_<gpu>.md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import BENCH_MODES, compile_overrides  # noqa: E402
from bench.e2e_report import annotation_caveat, back_to_back_how, mode_label, ms_cell  # noqa: E402
from bench.e2e_steptime import COCO_TRAIN_IMAGES  # noqa: E402
from engine.config.choices import (  # noqa: E402
    DEFAULT_REGIONS,
    GRADIENT_SYNCS,  # noqa: E402
    INDUCTOR_MODES,
    REGION_CHOICES,
    TRAIN_BACKBONE_CHOICES,
)

# NVLink multicast stays off on shared machines (it can take the host's GPUs down): children inherit this.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, **SAFE_ENV, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); last lines of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))


# ----------------------------------------------------------------------------------------------------
# scaling: the worker runs in every torchrun process
# ----------------------------------------------------------------------------------------------------
def scaling_worker(args) -> None:
    from torch._dynamo.utils import counters as dynamo_counters

    from bench.e2e import compose_config
    from bench.e2e_steptime import (
        ATTENTION_KERNELS,
        back_to_back_blocks_ms,
        back_to_back_keys,
        count_syncs,
        host_conditions,
        profile_steps,
        python_profile,
        random_batch,
    )
    from engine.runtime.distributed import init_distributed, shutdown_distributed
    from engine.train.build import build_training

    ctx = init_distributed(device="cuda", timeout_s=600)
    try:
        cuts = args.ddp_graph_cuts == ["dynamo"]  # the worker is given one of each
        (gradient_sync,) = args.gradient_sync
        cfg = compose_config(["dataset=coco", "model.msda=triton", "model.pretrained=none", "amp=bf16", "seed=0",
                              f"batch_size={args.batch}", f"gradient_sync={gradient_sync}",
                              *compile_overrides(args.compile_mode, args.compile_regions, args.compile_backbone)])
        training = build_training(cfg, ctx=ctx)
        training.model.train()
        if gradient_sync == "ddp":  # data_parallel turns Dynamo's cuts at DDP's buckets off; back on to compare
            torch._dynamo.config.optimize_ddp = cuts
        step = training.step
        compiled = args.compile_mode in INDUCTOR_MODES
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
        batch = random_batch([(800, 1333)] * args.batch, cfg.model.num_classes, ctx.device, gen)
        host_before = host_conditions()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step(*batch)
        torch.cuda.synchronize(ctx.device)
        warmup_s = time.perf_counter() - t0
        times, host_times = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            step(*batch)
            host_times.append((time.perf_counter() - t) * 1e3)  # until the host has queued the whole step
            torch.cuda.synchronize(ctx.device)
            times.append((time.perf_counter() - t) * 1e3)
        # Every rank runs the same steps from here: the collectives inside need all of them.
        sync = lambda: torch.cuda.synchronize(ctx.device)  # noqa: E731
        # As train.py runs: a rank's host may run ahead of its GPU, and the ranks meet only where the step makes
        # them (the gradient all-reduce, through the matching's host sync of the next step).
        back_to_back = back_to_back_keys(back_to_back_blocks_ms(lambda: step(*batch), sync, steps=args.steps))
        syncs = count_syncs(lambda: step(*batch))
        trace = (Path(args.trace_dir) / f"trace_{ctx.world_size}gpu_{args.compile_mode}_"
                 f"{gradient_sync}_rank{ctx.rank}.json.gz") if args.trace_dir and ctx.is_main else None
        kernels = profile_steps(lambda: step(*batch), sync, ATTENTION_KERNELS["triton"], cuda=True, trace=trace)
        # Every rank profiles its host (the steps' collectives need them all); rank 0's profile is kept.
        host_cprofile = (python_profile(lambda: step(*batch), sync, steps=args.profile_fixed)
                         if args.profile_fixed else None)
        if ctx.is_main:
            median = statistics.median(times)
            Path(args.result).write_text(json.dumps({
                "gpus": ctx.world_size, "compile": compiled, "compile_mode": args.compile_mode if compiled else None,
                "batch_per_gpu": args.batch, "step_ms": median, "host_ms": statistics.median(host_times),
                "images_per_s": ctx.world_size * args.batch / median * 1e3, "warmup_s": warmup_s, "all_ms": times,
                **back_to_back,
                "back_to_back_images_per_s": ctx.world_size * args.batch / back_to_back["back_to_back_ms"] * 1e3,
                "peak_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30, "syncs_per_step": syncs,
                "host": {"before": host_before, "after": host_conditions()},
                **kernels, "kernel_share": kernels["gpu_kernel_ms"] / median,
                "inductor_counters": dict(dynamo_counters["inductor"]),
                **({"gradient_sync": gradient_sync} if ctx.distributed else {}),
                **({"ddp_graph_split": True} if compiled and cuts and ctx.distributed else {}),
                **({"host_cprofile": host_cprofile} if host_cprofile else {}),
                **({"compile_regions": args.compile_regions} if compiled else {}),
                **({"backbone_compiled": args.compile_backbone} if compiled and args.compile_backbone != "eager"
                   else {})}))
    finally:
        shutdown_distributed(ctx)


def scaling_runs(args) -> list[tuple[str, int, str, str]]:
    """(mode, GPUs, gradient sync, DDP graph cuts) of each torchrun, in order: each gradient sync only on several
    GPUs, each variant of the cuts only where it exists (DDP in a compiled mode)."""
    return [(mode, gpus, sync, cuts) for mode in args.compile_modes for gpus in args.gpus
            for sync in (args.gradient_sync if gpus > 1 else args.gradient_sync[:1])  # 1 GPU syncs nothing
            for cuts in (args.ddp_graph_cuts if mode != "eager" and gpus > 1 and sync == "ddp" else ["off"])]


def run_scaling(args, work: Path, save) -> list[dict]:
    rows = []
    for mode, gpus, sync, cuts in scaling_runs(args):
        name = f"scaling_{gpus}_{mode}_{args.compile_backbone}_{args.compile_regions}_{sync}_{cuts}"
        result = work / f"{name}.json"
        cmd = torchrun(gpus, str(Path(__file__)), "--worker", "scaling", "--result", str(result),
                       "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--compile-mode", mode, "--ddp-graph-cuts", cuts,
                       "--gradient-sync", sync,
                       "--compile-backbone", args.compile_backbone, "--compile-regions", args.compile_regions,
                       "--profile-fixed", str(args.profile_fixed),
                       *(["--trace-dir", str(args.trace_dir)] if args.trace_dir else []))
        run(cmd, work / f"{name}.log")
        row = json.loads(result.read_text())
        one = one_gpu_row(rows, row)
        row["efficiency"] = row["images_per_s"] / (gpus * one["images_per_s"]) if one else None
        row["back_to_back_efficiency"] = (row["back_to_back_images_per_s"] / (gpus * one["back_to_back_images_per_s"])
                                          if one else None)
        rows.append(row)
        save(rows)
        print(f"scaling {gpus} GPU(s) {mode_label(row)}: {row['step_ms']:.1f} ms/step (host {row['host_ms']:.1f}, "
              f"GPU kernels {row['gpu_kernel_ms']:.1f}, NCCL {row['nccl_kernel_ms']:.1f}, {row['syncs_per_step']} "
              f"syncs; GPU idle by phase {row.get('gpu_idle_by_phase_ms')}), {row['images_per_s']:.1f} images/s, "
              f"efficiency {row['efficiency']}; back to back {row['back_to_back_ms']:.1f} ms/step, efficiency "
              f"{row['back_to_back_efficiency']} (blocks {[round(ms, 1) for ms in row['back_to_back_blocks_ms']]}); "
              f"inductor counters {row['inductor_counters']}\n  host top ms/step: {row.get('host_top_ms')}", flush=True)
    return rows


def one_gpu_row(rows: list[dict], row: dict) -> dict | None:
    """The 1-GPU row of ``row``'s mode: it syncs nothing, so it is the baseline of every N-GPU variant."""
    return next((r for r in rows if r["gpus"] == 1 and mode_label(r) == mode_label(row, gradient_sync=False)), None)


# ----------------------------------------------------------------------------------------------------
# a short synthetic run, 1 GPU (two seeds) and N GPUs
# ----------------------------------------------------------------------------------------------------
def run_ap(args, work: Path, save) -> list[dict]:
    runs = []
    for gpus, seed in [(g, s) for g in args.ap_gpus for s in (args.ap_seeds if g == 1 else args.ap_seeds[:1])]:
        out = work / f"ap_{gpus}gpu_seed{seed}"
        overrides = [f"output_dir={out}", f"seed={seed}", f"epochs={args.epochs}", f"optim.lr_drop={args.epochs - 2}",
                     f"eval_every={args.epochs}", f"checkpoint_every={args.epochs}", f"device={args.device}", "log_every=50",
                     f"dataset.root={work / 'synthetic'}"]
        train_py = str(ROOT / "train.py")
        cmd = [sys.executable, train_py, *overrides] if gpus == 1 else torchrun(gpus, train_py, *overrides)
        t0 = time.perf_counter()
        run(cmd, work / f"ap_{gpus}gpu_seed{seed}.log")
        evaluation = json.loads((out / f"eval_epoch{args.epochs:04d}.json").read_text())
        runs.append({"gpus": gpus, "seed": seed, "AP": evaluation["AP"], "AP50": evaluation["AP50"],
                     "wall_s": time.perf_counter() - t0, "command": " ".join(cmd[1:])})
        save(runs)
        print(f"ap {gpus} GPU(s) seed {seed}: AP {evaluation['AP']:.4f} AP50 {evaluation['AP50']:.4f} in "
              f"{runs[-1]['wall_s']:.0f} s", flush=True)
    return runs


def coco_epoch_estimate(scaling: list[dict], gpus: int = 8) -> list[str]:
    """What a COCO epoch on ``gpus`` GPUs of one host should take, per mode, from its 1- and 2-GPU rows: their
    back-to-back figures where measured (the pace train.py runs at), else their synced steps."""
    lines = []
    for two in (r for r in scaling if r["gpus"] == 2):
        base = one_gpu_row(scaling, two)
        if base is None:
            continue
        back = two.get("back_to_back_efficiency") is not None
        one = base["back_to_back_images_per_s" if back else "images_per_s"]
        # The two ways of timing a step differ by run noise, which can even put a 2-GPU run above twice the 1-GPU
        # one: the lower of the two efficiencies is assumed, and never more than linear scaling.
        timings = {"synced steps": two["efficiency"], **({"back to back": two["back_to_back_efficiency"]} if back else {})}
        which = min(timings, key=timings.get)
        efficiency = min(1.0, timings[which])
        images_per_s = gpus * one * efficiency
        lines.append(f"- {mode_label(two)}: {gpus} x {one:.1f} images/s x {100 * efficiency:.1f}% "
                     f"({which}) = {images_per_s:.0f} images/s: about "
                     f"{COCO_TRAIN_IMAGES / images_per_s / 60:.0f} minutes per epoch, "
                     f"{50 * COCO_TRAIN_IMAGES / images_per_s / 3600:.1f} hours for the 50-epoch schedule.")
    if not lines:
        return []
    return ["", f"**A COCO epoch ({COCO_TRAIN_IMAGES:,} images) on {gpus} GPUs (the paper's {gpus} x 2 images), "
            "estimated** from the 1-GPU images/s (back to back where measured) and the lower of the 2-GPU "
            "efficiencies of synced and back-to-back steps (at most 100%), assumed to hold on one "
            "host's NVLink:", "", *lines, "",
            "Assumes 800x1333-like batches with known sizes (dataset.pad_to_multiple=128) and data loading that "
            "keeps up with the 1-GPU images/s per GPU; not measured on 8 GPUs."]


def _percent(fraction: float | None) -> str:
    return f"{100 * fraction:.1f}%" if fraction else "-"


def write_report(results: dict, out: Path, name: str) -> None:
    h = results["header"]
    runs = results.get("runs") or [f"{h['date']}: `{h['command']}`"]
    lines = [f"# Several GPUs: {h['gpu']}", "", f"torch {h['torch']}, triton {h['triton']}. The figures below come "
             "from these runs (each a fresh machine of this kind; the rows of one part come from one run unless "
             "said otherwise):", "", *[f"- {run}" for run in runs], ""]
    if results.get("scaling"):
        lines += ["## Training step over NCCL", "",
                  "Default model, random 800x1333 batches, bf16, msda=triton, the same batch per GPU; median step "
                  "after warm-up. Efficiency: images/s over the number of GPUs times the 1-GPU images/s.", "",
                  "| GPUs | mode | batch per GPU | step ms | host ms | GPU kernels ms | NCCL kernels ms | syncs "
                  "| images/s | efficiency | back to back ms | back to back images/s | efficiency | peak GiB "
                  "| warm-up s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["scaling"]:
            timing = " | ".join(ms_cell(r.get(key)) for key in ("host_ms", "gpu_kernel_ms", "nccl_kernel_ms"))
            back = r.get("back_to_back_ms")
            back_cells = (f"{back:.1f} | {r['back_to_back_images_per_s']:.1f} | "
                          f"{_percent(r['back_to_back_efficiency'])}" if back else "- | - | -")
            lines.append(f"| {r['gpus']} | {mode_label(r)} | {r['batch_per_gpu']} | {r['step_ms']:.1f} | {timing} | "
                         f"{r.get('syncs_per_step', '-')} | {r['images_per_s']:.1f} | {_percent(r['efficiency'])} | "
                         f"{back_cells} | {r['peak_gib']:.2f} | {r['warmup_s']:.0f} |")
        lines += ["", "Host ms: until the step call returns, the wait at the matching's host sync included; step ms "
                  "minus host ms is the GPU work still queued then, so a gap near 0 means the host, not the GPU, "
                  "sets the pace after the matching. Back to back: the same number of steps again with no sync "
                  "between them, as train.py runs them (one sync after the last), wall time per step on rank 0, "
                  f"{back_to_back_how(results['scaling'])}. GPU "
                  "kernels: device time of one step's CUDA kernels, NCCL's included (torch.profiler, rank 0); NCCL "
                  "kernels: theirs alone, waiting for the other rank included; they run on a stream of their own, "
                  "beside the compute (the box-count all-reduce waits for the other rank during the forward), so on "
                  "several GPUs the kernel time can exceed the step. Syncs: host syncs in one step. "
                  "Rows without these columns come from runs that did not measure them."]
        lines += annotation_caveat(results["scaling"])
        lines += coco_epoch_estimate(results["scaling"])
    if results.get("ap"):
        lines += ["", "## A short synthetic run on 1 and several GPUs", "",
                  "| GPUs | seed | AP | AP50 | wall s |", "|---|---|---|---|---|"]
        lines += [f"| {r['gpus']} | {r['seed']} | {r['AP']:.4f} | {r['AP50']:.4f} | {r['wall_s']:.0f} |"
                  for r in results["ap"]]
        one = [r["AP"] for r in results["ap"] if r["gpus"] == 1]
        many = [r["AP"] for r in results["ap"] if r["gpus"] > 1]
        if len(one) == 2 and many:
            spread, low, high = abs(one[0] - one[1]), min(one), max(one)
            lines += ["", f"1-GPU seed-to-seed range [{low:.4f}, {high:.4f}] (spread {spread:.4f}); the multi-GPU "
                      f"run's AP {many[0]:.4f} is {'inside' if low - spread <= many[0] <= high + spread else 'outside'} "
                      "that range widened by the spread. With the same batch per GPU and the same schedule, it takes "
                      "1/N of the optimizer steps of a 1-GPU run, at the same learning rate."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--parts", nargs="+", default=["scaling", "ap"], choices=["scaling", "ap"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--compile-modes", nargs="+", default=["eager", "reduce-overhead"], choices=list(BENCH_MODES),
                        help="scaling: compile.mode values (eager; default: compiled; reduce-overhead: CUDA graphs)")
    parser.add_argument("--batch", type=int, default=2, help="images per GPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=12, help="ap: epochs of the synthetic schedule")
    parser.add_argument("--ap-gpus", type=int, nargs="+", default=[1, 2],
                        help="ap: 1 runs every --ap-seeds on one GPU, N > 1 runs the first seed on N GPUs")
    parser.add_argument("--ap-seeds", type=int, nargs="+", default=[0, 1],
                        help="ap: seeds of the 1-GPU runs (their spread is what the N-GPU run is compared with)")
    parser.add_argument("--device", default="cuda", help="ap: where train.py runs (cpu: a check of this script)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_ddp"))
    parser.add_argument("--worker", choices=["scaling"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--compile-mode", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--compile-backbone", default="static", choices=list(TRAIN_BACKBONE_CHOICES),
                        help="scaling: compile.backbone of the compiled modes")
    parser.add_argument("--compile-regions", default=DEFAULT_REGIONS, choices=list(REGION_CHOICES),
                        help="scaling: compile.regions of the compiled modes")
    parser.add_argument("--gradient-sync", nargs="+", default=["allreduce"], choices=list(GRADIENT_SYNCS),
                        help="scaling on several GPUs: allreduce (engine.runtime.distributed.GradientAllReduce after "
                        "backward, train.py's default) or ddp (DistributedDataParallel's hooks during backward); "
                        "both: each is run")
    parser.add_argument("--ddp-graph-cuts", nargs="+", default=["off"], choices=["off", "dynamo"],
                        help="scaling, compiled modes with --gradient-sync ddp: off (one graph per compiled layer) "
                        "or dynamo (Dynamo's cuts at DDP's bucket boundaries, optimize_ddp=True); both: each is run")
    parser.add_argument("--profile-fixed", type=int, default=0,
                        help="scaling: cProfile of rank 0's host over this many more steps, kept in the json")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="scaling: write rank 0's profiled steps there as gzipped Chrome traces")
    args = parser.parse_args()
    if args.worker == "scaling":
        scaling_worker(args)
        return
    os.environ.update(SAFE_ENV)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    name = "ddp_" + gpu.split()[-1].lower()
    saved = args.out / f"{name}.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}  # parts of earlier runs are merged
    results["header"] = {"gpu": f"{torch.cuda.device_count()} x {gpu}", "date": datetime.date.today().isoformat(),
                         "torch": torch.__version__, "triton": __import__("triton").__version__,
                         "python": platform.python_version(), "command": "python " + " ".join(sys.argv)}
    this_run = f"{results['header']['date']}: `{results['header']['command']}`"
    results["runs"] = [run for run in results.get("runs", []) if run != this_run] + [this_run]
    for part, fn in (("scaling", run_scaling), ("ap", run_ap)):
        if part in args.parts:
            earlier = results.get(part, [])

            def save(new, part=part, earlier=earlier):
                def key(r):
                    return r["gpus"], r.get("seed"), mode_label(r) if "compile" in r else None

                keys = {key(r) for r in new}
                results[part] = [r for r in earlier if key(r) not in keys] + new
                (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
                write_report(results, args.out, name)

            fn(args, args.work, save)


if __name__ == "__main__":
    main()
