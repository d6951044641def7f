"""Evaluation time: inference, then COCOeval with each backend (faster-coco-eval and pycocotools) on the same
detections, and their total, for the default model on synthetic validation images read at 800.

    python bench/eval_time.py --out bench/results          # on a GPU: 5000 images, model=deformable_detr
    python bench/eval_time.py --quick --out /tmp/eval_time  # CPU smoke run: 32 images read at 256, model=tiny

The job: --num-val synthetic images (datasets.ensure_synthetic_dataset, long side --image-size), read as
`dataset=custom` reads them (short side resized to --val-size, 800, long side up to 5/3 of it: 1333; size
buckets), through the
default model with random weights (model.pretrained=none, 91 classes as COCO's head), batch --batch-size, with
engine.evaluation.coco.evaluate_coco as train.py evaluates: inference_s and its own COCOeval (auto: faster-coco-eval
when installed). Then COCOeval alone, each backend on the same detections (datasets.cocoeval_backend): those of
the model, and, because a random detector's boxes rarely meet the ground truth and so leave COCOeval little
matching to do, 100 detections per image made from the ground truth with noise, as a trained detector gives
(each object found again, jittered, some with the wrong class, then low-scoring boxes anywhere). Each COCOeval
figure is loadRes + evaluate + accumulate + summarize; total = inference + COCOeval.

Inference runs eagerly by default (--compile-mode eager); with --compile-mode auto as train.py runs it on a GPU
(the eager model's CUDA graphs, engine/compile/cuda_graphs.py), the first pass records a graph per size bucket,
reported as compile_s and included
in inference_s. Writes eval_time_h200.json and eval_time_h200.md into --out (the date, the GPU, torch, the
command).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BACKENDS = ("faster", "pycocotools")


def data_overrides(root: Path) -> list[str]:
    return ["dataset=custom", f"dataset.train_images={root / 'train2017'}",
            f"dataset.train_annotations={root / 'annotations' / 'instances_train2017.json'}",
            f"dataset.val_images={root / 'val2017'}",
            f"dataset.val_annotations={root / 'annotations' / 'instances_val2017.json'}"]


def noisy_ground_truth(coco, *, per_image: int, seed: int) -> list[dict]:
    """``per_image`` COCO results per image, as a trained detector's top detections look: every object found
    again (its box jittered by ~5% of its size, scores 0.5-1, the wrong class one time in ten), then boxes
    anywhere in the image with scores below 0.5 and any of the file's classes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    category_ids = sorted(coco.getCatIds())
    detections = []
    for image_id in sorted(coco.imgs):
        width, height = coco.imgs[image_id]["width"], coco.imgs[image_id]["height"]
        anns = [a for a in coco.imgToAnns[image_id] if not a.get("iscrowd", 0)][:per_image]
        for ann in anns:
            x, y, w, h = ann["bbox"]
            wrong = rng.random() < 0.1
            detections.append({"image_id": image_id, "score": float(rng.uniform(0.5, 1.0)),
                               "category_id": int(rng.choice(category_ids)) if wrong else ann["category_id"],
                               "bbox": [x + rng.normal(0, 0.05 * w), y + rng.normal(0, 0.05 * h),
                                        w * rng.uniform(0.9, 1.1), h * rng.uniform(0.9, 1.1)]})
        for _ in range(per_image - len(anns)):
            w, h = rng.uniform(8, width / 2), rng.uniform(8, height / 2)
            detections.append({"image_id": image_id, "category_id": int(rng.choice(category_ids)),
                               "score": float(rng.uniform(0.0, 0.5)),
                               "bbox": [rng.uniform(0, width - w), rng.uniform(0, height - h), w, h]})
    return detections


def time_cocoeval(coco, detections: list[dict], image_ids, backend: str) -> dict:
    """One backend's COCOeval of ``detections``: seconds, and the 12 summary numbers."""
    from datasets.cocoeval_backend import evaluated_cocoeval

    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines and table: the figures are kept below
        t0 = time.perf_counter()
        coco_eval = evaluated_cocoeval(coco, detections, image_ids=image_ids, backend=backend)
        seconds = time.perf_counter() - t0
    return {"backend": backend, "cocoeval_s": seconds, "stats": [float(v) for v in coco_eval.stats]}


def run(args) -> dict:
    from bench.e2e import compose_config
    from datasets import build_data_loader, build_dataset, build_size_buckets, ensure_synthetic_dataset
    from datasets.cocoeval_backend import PACKAGES
    from engine.compile.cache import use_compile_cache
    from engine.compile.clock import CompileClock
    from engine.evaluation.coco import evaluate_coco
    from engine.runtime.distributed import init_distributed
    from engine.runtime.precision import Precision
    from engine.train.build import build_evaluation

    t_data = time.perf_counter()
    root = ensure_synthetic_dataset(args.work / f"data_{args.image_size}_{args.num_val}", num_train=1,
                                    num_val=args.num_val, image_size=args.image_size, seed=0)
    data_s = time.perf_counter() - t_data
    overrides = [*data_overrides(root), f"dataset.val_size={args.val_size}",
                 f"dataset.max_size={round(args.val_size * 1333 / 800)}", f"model={args.model}",
                 "model.pretrained=none", "model.num_classes=91", f"device={args.device}", f"batch_size={args.batch_size}",
                 f"num_workers={args.num_workers}", f"compile.mode={args.compile_mode}",
                 f"compile.cache_dir={args.work / 'compile_cache'}"]
    cfg = compose_config(overrides)
    ctx = init_distributed(device=cfg.device)
    use_compile_cache(cfg.compile.cache_dir)
    clock = CompileClock.get()
    val_set = build_dataset("val", cfg.dataset, check=False)
    buckets = build_size_buckets(None, val_set, cfg.dataset, batch_size=cfg.batch_size, seed=cfg.seed)
    loader = build_data_loader(val_set, batch_size=cfg.batch_size, num_workers=cfg.num_workers, train=False,
                               buckets=buckets, seed=cfg.seed, pad_to_multiple=cfg.dataset.pad_to_multiple)
    model, postprocess, plan = build_evaluation(cfg.model, cfg, ctx=ctx, evaluation_batches=len(loader.batch_sampler))
    image_ids = sorted(val_set.coco.imgs)
    before = clock.totals()
    evaluation = evaluate_coco(model=model, postprocess=postprocess, loader=loader, coco_gt=val_set.coco,
                               device=ctx.device, precision=Precision(amp=cfg.amp, device=ctx.device),
                               keep_detections=image_ids, compiled=plan is not None and plan.evaluation,
                               backend="auto")
    compile_s = clock.totals().since(before).seconds
    print(f"eval_time: inference of {evaluation.num_images} images {evaluation.inference_s:.1f} s (compile "
          f"{compile_s:.1f} s), COCOeval in evaluate_coco {evaluation.cocoeval_s:.1f} s "
          f"({PACKAGES[evaluation.cocoeval_backend]})", flush=True)
    sets = {"model": lambda: [d for i in image_ids for d in evaluation.detections.get(i, [])],
            "noisy ground truth": lambda: noisy_ground_truth(val_set.coco, per_image=100, seed=0)}
    sets = {name: make() for name, make in sets.items() if SET_CHOICES[name] in args.sets}
    rows = []
    for name, detections in sets.items():
        for backend in BACKENDS:
            row = {"detections": name, "num_detections": len(detections),
                   **time_cocoeval(val_set.coco, detections, image_ids, backend)}
            rows.append(row)
            print(f"eval_time: COCOeval of {len(detections)} detections ({name}) with {PACKAGES[backend]}: "
                  f"{row['cocoeval_s']:.2f} s, AP {row['stats'][0]:.4f}", flush=True)
    return {"num_images": evaluation.num_images, "data_s": data_s, "inference_s": evaluation.inference_s,
            "compile_s": compile_s, "evaluate_coco_cocoeval_s": evaluation.cocoeval_s,
            "evaluate_coco_backend": evaluation.cocoeval_backend, "model_ap": evaluation.stats["AP"],
            "batches": len(loader.batch_sampler), "compiled": plan is not None and plan.evaluation,
            "mode": plan.mode if plan is not None and plan.evaluation else "eager",
            "overrides": overrides, "rows": rows, "agreement": agreement(rows)}


# --sets names of the detection sets.
SET_CHOICES = {"model": "model", "noisy ground truth": "noisy"}


def agreement(rows: list[dict]) -> dict[str, float]:
    """Detection set -> the largest difference of the 12 summary numbers between the backends."""
    by_set: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        by_set.setdefault(row["detections"], {})[row["backend"]] = row["stats"]
    return {name: max(abs(a - b) for a, b in zip(stats["faster"], stats["pycocotools"]))
            for name, stats in by_set.items() if len(stats) == 2}


def write_report(out: Path, record: dict) -> None:
    h, r = record["header"], record["result"]
    seconds = {(row["detections"], row["backend"]): row["cocoeval_s"] for row in r["rows"]}
    versions = (f"{h['date']}, torch {h['torch']}, triton {h['triton']}, faster-coco-eval {h['faster_coco_eval']}, "
                f"pycocotools {h['pycocotools']}, {h['cpus']} CPU cores: `{h['command']}`")
    if r.get("mode") == "graphs":
        how = (f"the eager model replayed as CUDA graphs, {r['compile_s']:.1f} s of it recording them (the first "
               "recording includes Triton compiling the attention's kernels)")
    else:
        how = f"compiled, {r['compile_s']:.1f} s of it compiling" if r["compiled"] else "eager"
    job = (f"The job: {h['job']}. Inference: {r['inference_s']:.1f} s for {r['num_images']} images "
           f"({r['num_images'] / max(r['inference_s'], 1e-9):.1f} img/s, {r['batches']} batches, {how}); "
           f"evaluate_coco's own COCOeval ({r['evaluate_coco_backend']}): {r['evaluate_coco_cocoeval_s']:.1f} s; "
           f"the evaluation's total: {r['inference_s'] + r['evaluate_coco_cocoeval_s']:.1f} s. "
           f"Model AP (random weights): {r['model_ap']:.4f}.")
    lines = [f"# Evaluation time on {h['gpu']}", "", versions, "", job, "",
             "| detections | count | COCOeval | COCOeval s | inference + COCOeval s | AP | AP50 |", "|---" * 7 + "|"]
    for row in r["rows"]:
        total = r["inference_s"] + row["cocoeval_s"]
        lines.append(f"| {row['detections']} | {row['num_detections']} | {row['backend']} | {row['cocoeval_s']:.2f} | "
                     f"{total:.1f} | {row['stats'][0]:.4f} | {row['stats'][1]:.4f} |")
    lines.append("")
    for name in dict.fromkeys(row["detections"] for row in r["rows"]):
        if (name, "faster") in seconds and (name, "pycocotools") in seconds:
            lines.append(f"- {name}: pycocotools / faster-coco-eval = "
                         f"{seconds[(name, 'pycocotools')] / max(seconds[(name, 'faster')], 1e-9):.1f}x; the 12 "
                         f"summary numbers differ by at most {r['agreement'][name]:.2e}")
    lines.append(f"- overrides: `{' '.join(r['overrides'])}`")
    (out / "eval_time_h200.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_eval_time"))
    parser.add_argument("--num-val", type=int, default=None, help="synthetic validation images (5000; quick: 32)")
    parser.add_argument("--image-size", type=int, default=640, help="the synthetic images' long side (read at 800)")
    parser.add_argument("--val-size", type=int, default=None, help="short side the images are read at (800; "
                        "quick: 256)")
    parser.add_argument("--model", default=None, help="configs/model/ name (deformable_detr; quick: tiny)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=None, help="data loader workers (8; quick: 2)")
    parser.add_argument("--compile-mode", default="eager", help="compile.mode of the inference (eager, auto, ...)")
    parser.add_argument("--sets", nargs="+", choices=list(SET_CHOICES.values()), default=list(SET_CHOICES.values()),
                        help="detection sets timed with each backend: the model's (a random detector's boxes over "
                             "91 classes: pycocotools is slowest there) and/or the noisy ground truth")
    parser.add_argument("--quick", action="store_true",
                        help="a CPU-sized smoke run: 32 images read at 256, model=tiny, 2 workers unless given")
    args = parser.parse_args()
    for key, full, quick in (("num_val", 5000, 32), ("val_size", 800, 256), ("model", "deformable_detr", "tiny"),
                             ("num_workers", 8, 2)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.num_val < 1:
        parser.error(f"--num-val must be at least 1, got {args.num_val}")
    import torch

    from engine.reporting.log_filter import keep_file_only_off_console

    # evaluate_coco's progress and closing lines on the console; COCOeval's own lines (FILE_ONLY) are left out.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    keep_file_only_off_console()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    header = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": installed("triton"), "faster_coco_eval": installed("faster-coco-eval"),
              "pycocotools": installed("pycocotools"), "python": platform.python_version(),
              "cpus": len(os.sched_getaffinity(0)), "command": "python " + " ".join(sys.argv),
              "job": f"{args.num_val} synthetic images (long side {args.image_size}) read at {args.val_size}, "
                     f"model={args.model} "
                     f"with random weights, batch {args.batch_size}, compile.mode={args.compile_mode}"}
    record = {"header": header, "result": run(args)}
    (args.out / "eval_time_h200.json").write_text(json.dumps(record, indent=1))
    write_report(args.out, record)
    print(f"eval_time: wrote {args.out / 'eval_time_h200.json'} and {args.out / 'eval_time_h200.md'}", flush=True)


if __name__ == "__main__":
    main()
