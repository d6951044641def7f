"""Throughput of the COCO recipe through train.py itself: images/s at each batch on one GPU, on JPEG files.

The question: how many images per second does ``python train.py experiment=coco_gpu`` train on one GPU at each
batch, with the real loader, size buckets and step on COCO-like JPEG files at the recipe's sizes and augmentation;
how busy is the GPU, how long does the step wait for the loader, how much memory does it take, what share of the
GPU's bf16 peak is that, and so how many hours does the 50-epoch recipe take?

    python bench/throughput.py                                  # coco_gpu, mixed, hybrid at 32: results/throughput_h200
    python bench/throughput.py --rows coco_gpu:16 --out /tmp/tp  # one row
    python bench/throughput.py --baseline /tmp/base             # and coco_gpu from another commit's checkout, first
    python bench/throughput.py --smoke                          # the whole script on the CPU, tiny: outputs/bench/

Each row is one ``python train.py experiment=RECIPE dataset.root=<the set> total_batch_size=B batch_size=B
max_steps=N compile.mode=reduce-overhead ...``, RECIPE coco_gpu (the published recipe), mixed or hybrid (the 12-epoch
recipes with one-to-many supervision and model EMA): compiled as the long recipes are (compile.mode=auto compiles a
run of STEPS_TO_COMPILE steps or more, and a row's few hundred would get CUDA graphs of the eager model instead). The
rows share one compile cache, empty before the first row: the first row's first step is a cold start, the later
rows find the graphs an earlier row compiled with the same plan (those with symbolic sizes serve every batch).
``--baseline`` (a checkout of another commit, e.g. ``git worktree add /tmp/base COMMIT``) runs each coco_gpu row of the
recipe's compile.mode from that checkout too, before the others and with a compile cache of its own, so that a
change is measured as a ratio of two runs on the same machine in the same call. From
its timing.json: the steady steps (the second half of the warm steps that compiled nothing), their images/s, the
share of their wall time the loop waited for the loader, the padded pixels per image, peak memory and the first
step's time. GPU busy: the share of the row's last PROFILED_STEPS steps' (fewer in a --smoke run) wall time
in which the GPU ran a kernel, copy or memset, from torch.profiler recording the GPU's activity alone (train.py's
profile_steps; the profiled steps are left out of the steady figures), and from the same trace the GPU time per step
by part of the step (bench/step_profile.py's gpu_time_by_part). Beside it, NVML's utilization
counter over the steady window, sampled every 50 ms: a coarse figure (it reads 49% and 81% in two runs of the same
row at the same step time).
Model FLOPs per image: torch.utils.flop_counter over one forward and backward of the model at two image sizes,
interpolated to the row's mean padded pixels (the attention's sampling is not a counted op; it adds little).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, cell, header_lines, out_dir, run_header, table, write_report
from bench.step_profile import PARTS, gpu_time_by_part
from bench.train_runs import compose_config, environment_without_cache_choice, run_train_py
from engine.train.hooks.profiling import compiled_inside

COCO_TRAIN_IMAGES = 118_287
# The recipes' epochs (configs/experiment/), for the hours each takes on COCO at a row's rate.
RECIPE_EPOCHS = {"coco_gpu": 50, "mixed": 12, "hybrid": 12}
# Dense bf16 peak by GPU name (the vendors' datasheets), for MFU.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
# COCO-like images: the long side 640, the short one as COCO's mostly are, 70% landscape; about 7 objects over
# COCO's 80 categories; noise on a smooth scene so that a JPEG at quality 90 weighs 100-200 kB, as a photo does.
SHORT_SIDES = (360, 400, 427, 480, 480, 480, 512, 640)
NOISE_SIGMA = 14.0
# What compile.mode=auto picks for the 50-epoch recipe (at least STEPS_TO_COMPILE steps at any batch up to 32).
RECIPE_COMPILE_MODE = "reduce-overhead"
# A row may take another compile.mode: graphs (CUDA graphs of the eager model, recorded in a second) measures a
# recipe's step against another's without minutes of Inductor compilation each.
ROW_COMPILE_MODES = (RECIPE_COMPILE_MODE, "graphs", "eager")
# The first step's compile cache, as its table cell says it: empty, or holding what the earlier rows compiled
# (graphs that do not depend on the batch are found there; a row whose plan differs compiles its own).
FIRST_STEP_CACHE = {"cold": "cold", "warm": "earlier rows' cache"}
# Steps per row: the steady steps are the second half of those after the last graph compiled
# (engine/train/hooks/timing.py).
ROW_STEPS = 400
# The steps at each row's end that train.py profiles (profile_steps) for the GPU's busy share: several sizes' worth.
PROFILED_STEPS = 20
TARGETS = {"img_s": 200.0, "gpu_busy": 0.95, "data_wait_share": 0.05, "speedup": 1.25, "mixed_step_cost": 1.10}
# The rows' recipes: configs/experiment/ of that name.
RECIPES = tuple(RECIPE_EPOCHS)
# What --smoke's tiny model runs for each recipe (the experiments' full model does not fit a CPU run).
SMOKE_RECIPE_KEYS = {
    "coco_gpu": [],
    "mixed": ["model.one_to_many=mixed", "model.cross_attention_first=true", "ema.decay=0.9998"],
    "hybrid": ["model.one_to_many=hybrid", "ema.decay=0.9998"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="throughput.py", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--rows",
        type=row_spec,
        nargs="+",
        default=[(recipe, 32, RECIPE_COMPILE_MODE) for recipe in RECIPES],
        help=f"RECIPE:BATCH[:MODE], one row each: the experiment ({', '.join(RECIPES)}), its total batch per "
        f"optimizer step (one GPU: the whole batch in one pass) and its compile.mode (default {RECIPE_COMPILE_MODE})",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help=f"a checkout of the commit to compare with: each coco_gpu row at compile.mode={RECIPE_COMPILE_MODE} "
        "runs from it too, first",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps per row (default: {ROW_STEPS}; 16 with --smoke)"
    )
    parser.add_argument("--val-images", type=int, default=64, help="validation images (the run's final evaluation)")
    parser.add_argument("--overrides", nargs="*", default=[], help="more train.py overrides for every row")
    parser.add_argument("--row-timeout", type=float, default=900.0, help="seconds a row may take before it is stopped")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_throughput"), help="the set and the runs")
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; smoke: outputs/bench)")
    parser.add_argument("--name", default="throughput_h200", help="the report's file name, without extension")
    parser.add_argument("--smoke", action="store_true", help="the CPU, a tiny model and set: checks the script only")
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="also keep each row's profiler trace here, gzipped (the runs' folders are --work's)",
    )
    return parser


def row_spec(text: str) -> tuple[str, int, str]:
    recipe, batch, mode = (text.split(":") + [RECIPE_COMPILE_MODE])[:3]
    if recipe not in RECIPES or not batch.isdigit() or int(batch) < 1 or mode not in ROW_COMPILE_MODES:
        raise argparse.ArgumentTypeError(
            f"expected RECIPE:BATCH[:MODE] with RECIPE one of {', '.join(RECIPES)} and MODE one of "
            f"{', '.join(ROW_COMPILE_MODES)} (default {RECIPE_COMPILE_MODE}), got {text!r}"
        )
    return recipe, int(batch), mode


# ------------------------------------------------------------------------------------------------ the set
def _write_image(job: tuple) -> dict:
    """One COCO-like JPEG and its image and annotation entries."""
    from PIL import Image, ImageDraw

    from datasets.coco_categories import COCO_CATEGORY_NAMES

    folder, image_id, seed, side = job
    rng = np.random.default_rng([seed, image_id])
    short = round(int(rng.choice(SHORT_SIDES)) * side / 640)
    height, width = (short, side) if rng.random() < 0.7 else (side, short)
    scene = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    texture = Image.fromarray(rng.integers(0, 256, (height // 24 + 1, width // 24 + 1, 3), dtype=np.uint8))
    image = Image.blend(scene, texture.resize((width, height), Image.BICUBIC), 0.35)
    draw, annotations = ImageDraw.Draw(image), []
    categories = sorted(COCO_CATEGORY_NAMES)
    for k in range(int(np.clip(rng.poisson(7), 1, 20))):
        w, h = (rng.uniform(0.05, 0.5, 2) * (width, height)).astype(int) + 8
        x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x, y, x + w, y + h], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        annotations.append(
            {
                "id": image_id * 100 + k,
                "image_id": image_id,
                "iscrowd": 0,
                "area": float(w * h),
                "bbox": [x, y, int(w), int(h)],
                "category_id": int(rng.choice(categories)),
            }
        )
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, NOISE_SIGMA, (height, width, 3))
    name = f"{image_id:012d}.jpg"
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / name, "JPEG", quality=90)
    return {"image": {"id": image_id, "file_name": name, "width": width, "height": height}, "annotations": annotations}


def write_coco_like(root: Path, *, train: int, val: int, seed: int = 0, side: int = 640) -> Path:
    """A COCO 2017 layout of generated JPEG files under ``root`` (kept and reused when complete)."""
    from datasets.coco_categories import COCO_CATEGORY_NAMES

    done = root / "complete.json"
    wanted = {"train": train, "val": val, "seed": seed, "side": side, "sigma": NOISE_SIGMA}
    if done.is_file() and json.loads(done.read_text()) == wanted:
        return root
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    categories = [{"id": i, "name": n, "supercategory": "object"} for i, n in COCO_CATEGORY_NAMES.items()]
    with multiprocessing.Pool(min(32, os.cpu_count() or 1)) as pool:
        for split, count in (("train", train), ("val", val)):
            folder = root / f"{split}2017"
            folder.mkdir(exist_ok=True)
            first = 1 if split == "train" else 10_000_000
            entries = pool.map(_write_image, [(folder, first + i, seed, side) for i in range(count)], chunksize=16)
            coco = {
                "images": [e["image"] for e in entries],
                "categories": categories,
                "annotations": [a for e in entries for a in e["annotations"]],
            }
            (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(coco))
    done.write_text(json.dumps(wanted))
    return root


# ------------------------------------------------------------------------------------------------ GPU busy
class BusySampler:
    """NVML's utilization of GPU 0 (percent of time a kernel ran), sampled every 50 ms with its time.time()."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception:  # no NVML (the CPU): no busy share
            self._read = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BusySampler:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), self._read() / 100.0))

    def share(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else None


# ------------------------------------------------------------------------------------------------ the rows
def profiled_steps(steps: int) -> int:
    return min(PROFILED_STEPS, max(1, steps // 4))


def row_overrides(
    args, recipe: str, batch: int, run: Path, steps: int, cache: str = "cache", mode: str = RECIPE_COMPILE_MODE
) -> list[str]:
    common = [
        f"dataset.root={args.work / 'coco'}",
        f"total_batch_size={batch}",
        f"batch_size={batch}",
        f"max_steps={steps}",
        "epochs=1",
        f"output_dir={run}",
        f"compile.cache_dir={args.work / cache}",
        "log_every=10",
        "eval_images=0",
        f"profile_steps=[{max(1, steps - profiled_steps(steps) + 1)},{steps}]",
    ]
    if args.smoke:
        return [
            "dataset=coco",
            "model=tiny",
            "device=cpu",
            *SMOKE_RECIPE_KEYS[recipe],
            "dataset.train_scales=[128]",
            "dataset.max_size=160",
            "dataset.val_size=128",
            "dataset.crop=false",
            "num_workers=2",
            *common,
            *args.overrides,
        ]
    return [
        f"experiment={recipe}",
        "model.pretrained=none",
        f"compile.mode={mode}",
        *common,
        *args.overrides,
    ]


def run_row(args, recipe: str, batch: int, steps: int, gpus=1, baseline=False, mode=RECIPE_COMPILE_MODE) -> dict:
    """One train.py run of ``recipe`` at total batch ``batch`` on ``gpus`` GPUs (torchrun when more than one) with
    compile.mode ``mode``, of this checkout or, with ``baseline``, of ``args.baseline``'s."""
    base = (
        f"{recipe}_batch{batch}"
        + (f"_gpus{gpus}" if gpus > 1 else "")
        + (f"_{mode}" if mode != RECIPE_COMPILE_MODE else "")
        + ("_baseline" if baseline else "")
    )
    name = base if base not in args.names_used else f"{base}_{len(args.names_used)}"  # a row again: its warm cache
    args.names_used.add(name)
    run = args.work / name
    subprocess.run(["rm", "-rf", str(run)], check=True)
    cache = "cache_baseline" if baseline else "cache"
    overrides = row_overrides(args, recipe, batch, run, steps, cache=cache, mode=mode)
    checkout = args.baseline if baseline else ROOT
    print(f"== {recipe} at batch {batch} on {gpus} GPU(s): {checkout}/train.py {' '.join(overrides)}", flush=True)
    log = args.work / f"{name}.log"
    env = environment_without_cache_choice()
    row = {"recipe": recipe, "batch": batch, "code": args.baseline_commit if baseline else "this", "compile_mode": mode}
    with BusySampler() as busy:
        returncode = run_train_py(overrides, log=log, env=env, gpus=gpus, timeout=args.row_timeout, checkout=checkout)
    output = log.read_text()
    if returncode != 0:
        print(output[-4000:])
        stopped = f"stopped after --row-timeout {args.row_timeout:g} s" if returncode is None else returncode
        return {**row, "error": f"train.py: exit {stopped}"}
    timing = json.loads((run / "timing.json").read_text())
    steady = timing["steady"]
    if steady is None:
        return {**row, "error": "no steady step: every step compiled or warmed up a size (raise --steps)"}
    img_s = steady["images_per_s"] * gpus  # timing.json counts rank 0's images
    profile = timing.get("profile") or {}
    parts = None
    if profile.get("trace"):
        parts = gpu_time_by_part(json.loads((run / profile["trace"]).read_text()), steps=profile["steps"])
        if args.traces is not None:
            keep_trace(run / profile["trace"], args.traces / f"{name}_{profile['trace']}.gz")
    return {
        **row,
        "name": name,
        "per_gpu_batch": batch // gpus,
        "parts_ms": parts,
        "gpus": gpus,
        "through": "train.py",
        "data": "jpeg",
        "sizes": "coco-recipe",
        "img_s": img_s,
        "step_ms": steady["step_ms"],
        "gpu_busy": profile.get("gpu_busy"),
        "gpu_busy_nvml": busy.share(*steady["window"]),
        "profile": profile,
        "data_wait_share": steady["data_wait_share"],
        "peak_gib": timing["peak_memory_gib"],
        "pixels_per_image": steady["pixels_per_image"],
        "first_step_s": timing["first_step_s"],
        "steady_steps": steady["steps"],
        "steps": timing["steps"],
        "steady_from_step": steady["first_step"],
        "recipe_epochs": RECIPE_EPOCHS[recipe],
        "recipe_hours": COCO_TRAIN_IMAGES * RECIPE_EPOCHS[recipe] / img_s / 3600,
        "accumulate_grad_warnings": output.count("AccumulateGrad node's stream"),
        "transformer": transformer_graphs(output),
    }


def keep_trace(trace: Path, kept: Path) -> None:
    kept.parent.mkdir(parents=True, exist_ok=True)
    with open(trace, "rb") as source, gzip.open(kept, "wb") as target:
        shutil.copyfileobj(source, target)


def transformer_graphs(output: str) -> str | None:
    """How the row's plan compiled the transformer, from its log's plan line: "per layer" or "one graph"."""
    plan = re.search(r"torch\.compile \([^)]*\) of (the transformer[^,]*)", output)
    if plan is None:
        return None
    return "per layer" if "layers" in plan.group(1) else "one graph"


def checkout_commit(checkout: Path) -> str:
    """The commit a --baseline checkout holds: git's, or the COMMIT file an exported tree (git archive) carries."""
    if (checkout / "COMMIT").is_file():
        return (checkout / "COMMIT").read_text().strip()
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else "unknown"


# ------------------------------------------------------------------------------------------------ FLOPs
def flops_per_pixel_line(args) -> tuple[float, float] | None:
    """(FLOPs of one image's forward and backward at zero pixels, FLOPs per padded pixel), fitted through two
    sizes; None on the CPU."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models import build_model

    if not torch.cuda.is_available():
        return None
    cfg = compose_config(row_overrides(args, "coco_gpu", 2, args.work / "flops", steps=1))
    model, criterion, _ = build_model(cfg.model)
    model.cuda().train()
    criterion.cuda()
    counts = []
    for height, width in ((512, 672), (800, 1088)):
        images = torch.randn(1, 3, height, width, device="cuda")
        masks = torch.zeros(1, height, width, dtype=torch.bool, device="cuda")
        targets = [{"labels": torch.arange(1, 8, device="cuda"), "boxes": torch.rand(7, 4, device="cuda") * 0.4 + 0.2}]
        with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
            losses = criterion(model(images, masks), targets)
            sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses).backward()
        counts.append((height * width, counter.get_total_flops()))
    (p0, f0), (p1, f1) = counts
    per_pixel = (f1 - f0) / (p1 - p0)
    return f0 - per_pixel * p0, per_pixel


# ------------------------------------------------------------------------------------------------ report
def how_to_read() -> str:
    return (
        "Each row is one `python train.py experiment=RECIPE compile.mode=reduce-overhead` run (compiled as the "
        "long recipes are) on generated COCO-like JPEG files at the recipe's sizes and augmentation, one GPU, the"
        " batch in one pass; the rows share a compile cache, empty before the first (a baseline commit's rows "
        "have their own). mixed and hybrid are the 12-epoch recipes: Deformable-DETR++'s training changes, one-"
        "to-many supervision (mixed: MS-DETR's, on the model's own queries; hybrid: H-DETR's 1,500 extra queries)"
        " and model EMA. img/s, step and loader wait come from the run's steady steps (its timing.json); GPU busy"
        f" is the share of the run's last {PROFILED_STEPS} steps (fewer in a --smoke run) in which the GPU ran a "
        "kernel, copy or memset (train.py's profile_steps: torch.profiler recording the GPU's activity alone); "
        "GPU work / step is the GPU's busy time per profiled step over the steady step's wall time, what the "
        "steady steps' busy share is if they do the same work (it counts no wait of the profiled steps: those of "
        "a CUDA graph's recording, marked *, whose start synchronizes and empties the device's and the pinned-"
        "memory caches); NVML is the GPU's utilization counter over the steady steps (coarse: sampled); MFU "
        "counts the model's matmul and convolution FLOPs (forward and backward) against the GPU's dense bf16 "
        "peak; hours are the recipe's epochs of COCO (118,287 images each) at that rate; the first step is from "
        "the process's start, compilation included (cold: into the empty cache). A row marked [MODE] ran another "
        "compile.mode (graphs: the eager model's CUDA graphs, no Inductor; eager: neither) and is compared only "
        "with rows of the same mode."
    )


def work_per_steady_step(r: dict) -> float | None:
    """The GPU's busy time per profiled step over the steady step's wall time, or None without a GPU profile."""
    work = (r.get("profile") or {}).get("gpu_work_ms")
    return None if work is None else work / r["step_ms"]


def row_name(r: dict) -> str:
    """A row's recipe, its compile.mode where that is not the recipe's, and its commit where that is another's."""
    mode = r.get("compile_mode", RECIPE_COMPILE_MODE)
    return (
        r["recipe"]
        + (f" [{mode}]" if mode != RECIPE_COMPILE_MODE else "")
        + (f" (baseline {r['code']})" if r.get("code", "this") != "this" else "")
    )


def first_step_note(r: dict) -> str:
    """What the row's first step compiled from: Inductor's cache as it found it, or no Inductor at all."""
    mode = r.get("compile_mode", RECIPE_COMPILE_MODE)
    return FIRST_STEP_CACHE[r["compile_cache"]] if mode == RECIPE_COMPILE_MODE else f"{mode}: no Inductor"


def same_kind(a: dict, b: dict) -> bool:
    """Whether two rows ran at the same batch and compile.mode: a ratio of their steps means something."""
    mode = RECIPE_COMPILE_MODE
    return a["batch"] == b["batch"] and a.get("compile_mode", mode) == b.get("compile_mode", mode)


def report_lines(header: dict, rows: list[dict]) -> list[str]:
    lines = header_lines("Throughput of the COCO recipes through train.py", header, how_to_read())
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([row_name(r), r["batch"], r["error"], *[""] * 11])
            continue
        speed = [f"{r['img_s']:.1f}", f"{r['step_ms']:.0f}"]
        busy = [
            cell(r["gpu_busy"], ".0%") + ("*" if compiled_inside(r["profile"]) else ""),
            cell(work_per_steady_step(r), ".0%"),
            cell(r.get("gpu_busy_nvml"), ".0%"),
            f"{r['data_wait_share']:.1%}",
        ]
        resources = [cell(r["peak_gib"]), cell(r.get("gflops_per_image"), ".0f"), cell(r.get("mfu"), ".1%")]
        hours = f"{r['recipe_hours']:.1f} ({r['recipe_epochs']} epochs)"
        first, steady = f"{r['first_step_s']:.0f} ({first_step_note(r)})", f"from step {r['steady_from_step']}"
        cells.append([row_name(r), r["batch"], *speed, *busy, *resources, hours, first, steady])
    lines += table(
        "recipe | batch | img/s | step ms | GPU busy | GPU work / step | NVML | loader wait | peak GiB | GFLOPs/img "
        "| MFU | COCO recipe (h) | first step (s) | steady steps",
        cells,
    )
    done = [r for r in rows if "error" not in r]
    recorded = [
        f"{row_name(r)} {r['profile'].get('compile_s', 0.0):.1f} s" for r in done if compiled_inside(r["profile"])
    ]
    if recorded:
        lines += [
            "",
            f"* The profiled steps compiled or recorded graphs ({', '.join(recorded)}): their idle time, and the "
            "idle part below, include those waits, which steady steps do not have.",
        ]
    broken_down = [r for r in done if r.get("parts_ms")]
    if broken_down:
        lines += [
            "",
            f"GPU time per step (ms) by part, from the profile of the row's last {PROFILED_STEPS} steps "
            "(bench/step_profile.py, gpu_time_by_part: each kernel, copy or memset charged to the part of the "
            "step it belongs to; idle: the profiled wall time in which the GPU ran nothing):",
            "",
        ]
        parts = [[f"{r['parts_ms'].get(part, 0.0):.1f}" for part in PARTS] for r in broken_down]
        cells = [[row_name(r), r["batch"], *ms, f"{r['profile']['step_ms']:.1f}"] for r, ms in zip(broken_down, parts)]
        lines += table(["recipe", "batch", *PARTS, "profiled step"], cells)
    if done:
        lines += ["", "Targets:", ""] + [f"- {VERDICT[ok]}: {text}" for text, ok in targets(done)]
    if header.get("notes"):
        lines += ["", header["notes"]]
    return lines


VERDICT = {True: "met", False: "MISSED", None: "reported"}


def targets(done: list[dict]) -> list[tuple[str, bool | None]]:
    """(what, met) of each of the bench's targets that the rows measured; met None for a figure with no target."""
    plain = [r for r in done if r["recipe"] == "coco_gpu" and r.get("code", "this") == "this"]
    baseline = [r for r in done if r["recipe"] == "coco_gpu" and r.get("code", "this") != "this"]
    checks = []
    if plain:
        best = max(plain, key=lambda r: r["img_s"])
        busy, wait = cell(best["gpu_busy"], ".0%"), best["data_wait_share"]
        note = " (unknown: no GPU activity profiled)" if best["gpu_busy"] is None else ""
        if best["gpu_busy"] is not None and compiled_inside(best["profile"]):
            note = (
                f" (its profiled steps recorded graphs for {best['profile'].get('compile_s', 0.0):.1f} s; the GPU's "
                f"work is {work_per_steady_step(best):.0%} of a steady step)"
            )
        checks += [
            (
                f"coco_gpu: best {best['img_s']:.1f} img/s (batch {best['batch']}) >= {TARGETS['img_s']:.0f}",
                best["img_s"] >= TARGETS["img_s"],
            ),
            (
                f"coco_gpu: GPU busy {busy} at the best batch >= {TARGETS['gpu_busy']:.0%}{note}",
                (best["gpu_busy"] or 0) >= TARGETS["gpu_busy"],
            ),
            (
                f"coco_gpu: loader wait {wait:.1%} at the best batch <= {TARGETS['data_wait_share']:.0%}",
                wait <= TARGETS["data_wait_share"],
            ),
        ]
    for old in baseline:
        new = next((r for r in plain if same_kind(r, old)), None)
        if new is not None:
            speedup = old["step_ms"] / new["step_ms"]
            text = f"{row_name(new)} at batch {old['batch']}: {speedup:.2f}x the step of baseline {old['code']}"
            checks.append((f"{text} >= {TARGETS['speedup']:.2f}x", speedup >= TARGETS["speedup"]))
    for row in (r for r in done if r["recipe"] != "coco_gpu"):
        twin = next((r for r in plain if same_kind(r, row)), None)
        if twin is None:
            continue
        cost = row["step_ms"] / twin["step_ms"]
        text = f"{row_name(row)} with EMA at batch {row['batch']}: {cost:.2f}x {row_name(twin)}'s step"
        if row["recipe"] == "mixed":
            checks.append((f"{text} <= {TARGETS['mixed_step_cost']:.2f}x", cost <= TARGETS["mixed_step_cost"]))
        else:  # reported, no target: hybrid's extra queries are its method
            checks.append((text, None))
    warnings = sum(r["accumulate_grad_warnings"] for r in done)
    checks.append((f"AccumulateGrad stream warnings in the runs' output: {warnings}", warnings == 0))
    return checks


def main() -> None:
    args = build_parser().parse_args()
    args.out = out_dir(args.out, args.smoke)  # a smoke run's figures mean nothing: never over the report
    args.work.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (16 if args.smoke else ROW_STEPS)
    train_images = max(b for _, b, _ in args.rows) * (steps + 8)  # one epoch holds every row's steps
    args.names_used = set()
    if args.smoke:
        args.val_images = min(args.val_images, 8)  # the tiny set's training images are as many as the rows need
    started = time.perf_counter()
    write_coco_like(args.work / "coco", train=train_images, val=args.val_images, side=160 if args.smoke else 640)
    seconds = time.perf_counter() - started
    print(f"== the set: {train_images} + {args.val_images} JPEG files in {seconds:.0f} s", flush=True)
    subprocess.run(["rm", "-rf", str(args.work / "cache")], check=True)  # the first row starts cold
    header = run_header(train_images=train_images, val_images=args.val_images, steps=steps)
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()  # train.py runs with the checkout as its working directory
        args.baseline_commit = checkout_commit(args.baseline)
        header["baseline"] = {"checkout": str(args.baseline), "commit": args.baseline_commit}
        subprocess.run(["rm", "-rf", str(args.work / "cache_baseline")], check=True)
    compared = [row for row in args.rows if row[0] == "coco_gpu" and row[2] == RECIPE_COMPILE_MODE]
    with_baseline = [(*row, True) for row in compared] if args.baseline is not None else []
    rows = []
    for recipe, b, mode, baseline in with_baseline + [(*row, False) for row in args.rows]:
        cache = args.work / ("cache_baseline" if baseline else "cache")
        warm = cache.is_dir() and any(p.is_file() for p in cache.rglob("*"))  # an earlier row compiled into it
        row = run_row(args, recipe, b, steps, baseline=baseline, mode=mode)
        rows.append({**row, "compile_cache": "warm" if warm else "cold"})
        # The rows so far, so that a bench stopped part-way (a machine's time limit) still leaves its figures.
        write_report(args.name, {**header, "rows": rows}, report_lines(header, rows), out=args.out)
    line = flops_per_pixel_line(args)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = next((v for k, v in BF16_PEAK_FLOPS.items() if k in gpu), None)
    for r in (r for r in rows if "error" not in r):
        gflops = None if line is None else (line[0] + line[1] * r["pixels_per_image"]) / 1e9
        r.update(gflops_per_image=gflops, mfu=r["img_s"] * gflops * 1e9 / peak if gflops and peak else None)
    header.update(bf16_peak_flops=peak, flops_per_image_line=line)
    lines = report_lines(header, rows)
    json_path, md_path = write_report(args.name, {**header, "rows": rows}, lines, out=args.out)
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
