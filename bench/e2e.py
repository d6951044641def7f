"""End-to-end benchmark: whole training steps and detector parity, model.msda=triton against pytorch.

    python bench/e2e.py --out bench/results                      # on a GPU: everything below
    python bench/e2e.py --parts steptime --batches 2 4           # only the step-time table

steptime  Full training steps (forward, matching + losses, backward, clipping, AdamW) of the default
          Deformable DETR on random 800x1333 batches, bf16 autocast and fp32, triton and pytorch in the
          same process: median step time after warm-up, images/s, peak memory, and the share of GPU
          kernel time spent in the attention op (torch.profiler: Triton's msda kernels, or grid_sampler
          kernels for the reference).
parity    The real trainer (train.train) on the synthetic set: triton with seeds 0 and 1 and pytorch with
          seed 0, same steps; loss curves, final AP, and the seed-to-seed spread that the triton/pytorch
          difference is compared with. Then one checkpoint evaluated through both implementations: AP and
          per-image agreement of the detections. Plots train/step_time_ms read back from TensorBoard.
Writes e2e_h200.md, e2e_h200.json and PNG plots into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.e2e_report import plot, write_report  # noqa: E402
from engine.config import register_configs  # noqa: E402
from engine.optim import build_optimizer  # noqa: E402
from engine.precision import Precision  # noqa: E402
from models import build_model  # noqa: E402

ATTENTION_KERNELS = {"triton": ("msda_forward_kernel", "msda_backward_kernel"), "pytorch": ("grid_sampler",)}


def compose_config(overrides: list[str]):
    register_configs()  # the typed schemas configs/*.yaml name
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


# ----------------------------------------------------------------------------------------------------
# step time
# ----------------------------------------------------------------------------------------------------
def random_batch(batch: int, height: int, width: int, num_classes: int, device, gen):
    images = torch.randn(batch, 3, height, width, device=device, generator=gen)
    masks = torch.zeros(batch, height, width, dtype=torch.bool, device=device)
    targets = []
    for _ in range(batch):
        n = 6
        centres = torch.rand(n, 2, device=device, generator=gen) * 0.6 + 0.2
        sizes = torch.rand(n, 2, device=device, generator=gen) * 0.3 + 0.05
        labels = torch.randint(1, num_classes, (n,), device=device, generator=gen)
        targets.append({"labels": labels, "boxes": torch.cat([centres, sizes], -1)})
    return images, masks, targets


def _self_device_us(event) -> float:
    # The attribute was renamed from *cuda* to *device* across torch releases.
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_time_share(step, sync, names: tuple[str, ...]) -> float:
    """Share of GPU kernel time, over two steps, in kernels whose name contains one of ``names``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        sync()
    total, matched = 0.0, 0.0
    for event in prof.key_averages():
        if not str(event.device_type).endswith("CUDA"):
            continue
        us = _self_device_us(event)
        total += us
        if any(n in event.key for n in names):
            matched += us
    return matched / max(total, 1e-9)


def measure_steps(*, impl: str, batch: int, amp: str, height: int, width: int, warmup: int, steps: int,
                  device) -> dict:
    cfg = compose_config(["dataset=coco", f"model.msda={impl}", "model.pretrained=none"])
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg.model)
    model.to(device).train()
    criterion.to(device)
    optimizer = build_optimizer(model, cfg.optim)
    precision = Precision(amp=amp, device=device)
    weight_dict = criterion.weight_dict
    gen = torch.Generator(device=device).manual_seed(0)
    images, masks, targets = random_batch(batch, height, width, cfg.model.num_classes, device, gen)

    def step():
        with precision.autocast():
            outputs = model(images, masks)
        loss_dict = criterion(outputs, targets)
        loss = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_max_norm)
        optimizer.step()
        return loss

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else float("nan")
    attention_share = kernel_time_share(step, sync, ATTENTION_KERNELS[impl]) if cuda else float("nan")
    median = statistics.median(times)
    del model, optimizer, images, masks, targets
    torch.cuda.empty_cache()
    return {"impl": impl, "batch": batch, "amp": amp, "step_ms": median, "images_per_s": batch / median * 1e3,
            "peak_gib": peak, "attention_share": attention_share, "all_ms": times}


def run_steptime(args, device) -> list[dict]:
    rows = []
    for batch in args.batches:
        for amp in ("bf16", "none"):
            for impl in args.impls:
                row = measure_steps(impl=impl, batch=batch, amp=amp, height=args.height, width=args.width,
                                    warmup=args.warmup, steps=args.steps, device=device)
                rows.append(row)
                print(f"steptime batch {batch} {amp:<4} {impl:<7} {row['step_ms']:.1f} ms "
                      f"{row['images_per_s']:.1f} img/s peak {row['peak_gib']:.2f} GiB "
                      f"attention {100 * row['attention_share']:.1f}% of GPU time", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------
# parity on the synthetic set
# ----------------------------------------------------------------------------------------------------
def train_run(args, *, impl: str, seed: int, out_dir: Path) -> dict:
    from train import train

    overrides = [f"model.msda={impl}", f"seed={seed}", f"epochs={args.epochs}", f"output_dir={out_dir}",
                 f"dataset.root={args.data_root}", f"device={args.device}", f"amp={args.amp}",
                 f"eval_every={args.epochs}", f"checkpoint_every={args.epochs}", "log_every=5",
                 f"dataset.num_train={args.num_train}", f"dataset.num_val={args.num_val}",
                 f"batch_size={args.parity_batch}"]
    t0 = time.perf_counter()
    result = train(compose_config(overrides))
    result["wall_s"] = time.perf_counter() - t0
    print(f"parity train {impl} seed {seed}: {result['step']} steps in {result['wall_s']:.0f} s, "
          f"AP {result['eval']['AP']:.4f} AP50 {result['eval']['AP50']:.4f}", flush=True)
    return {"impl": impl, "seed": seed, "losses": result["losses"], "eval": result["eval"],
            "wall_s": result["wall_s"], "output_dir": str(out_dir)}


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import torchvision

    return torchvision.ops.box_iou(a, b)


@torch.no_grad()
def compare_implementations(args, checkpoint: Path, device) -> dict:
    """One checkpoint through both implementations: AP each, and how many detections agree per image."""
    from datasets import CocoEvaluator, build_data_loader, build_dataset
    from engine.checkpoint import load_checkpoint, load_model_weights

    cfg = compose_config([f"dataset.root={args.data_root}", f"device={args.device}",
                          f"dataset.num_train={args.num_train}", f"dataset.num_val={args.num_val}"])
    ckpt = load_checkpoint(checkpoint)
    val_set = build_dataset("val", cfg.dataset)
    loader = build_data_loader(val_set, batch_size=cfg.batch_size, num_workers=0, train=False, distributed=False)
    precision = Precision(amp=args.amp, device=device)
    detections, stats = {}, {}
    for impl in ("triton", "pytorch"):
        model_cfg = OmegaConf.merge(cfg.model, {"msda": impl})
        model, _, postprocess = build_model(model_cfg)
        load_model_weights(model, ckpt, path=checkpoint)
        model.to(device).eval()
        evaluator = CocoEvaluator(val_set.coco)
        per_image = {}
        for images, masks, targets in loader:
            with precision.autocast():
                outputs = model(images.to(device), masks.to(device))
            outputs = {k: v.float() for k, v in outputs.items() if k in ("pred_logits", "pred_boxes")}
            sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
            results = postprocess(outputs, sizes)
            batch = {int(t["image_id"]): r for t, r in zip(targets, results)}
            evaluator.update(batch)
            per_image.update({k: {n: v.cpu() for n, v in r.items()} for k, r in batch.items()})
        stats[impl] = evaluator.summarize()
        detections[impl] = per_image
    agree, counted, score_diffs = 0, 0, []
    for image_id, det in detections["triton"].items():
        other = detections["pytorch"][image_id]
        keep = det["scores"] > args.score_threshold
        for box, label, score in zip(det["boxes"][keep], det["labels"][keep], det["scores"][keep]):
            same = other["labels"] == label
            counted += 1
            if same.any():
                ious = box_iou(box[None], other["boxes"][same])[0]
                best = int(ious.argmax())
                if ious[best] > 0.95:
                    agree += 1
                    score_diffs.append(abs(float(score - other["scores"][same][best])))
    return {"checkpoint": str(checkpoint), "AP": stats, "detections_compared": counted,
            "detections_agreeing": agree, "agreement": agree / max(counted, 1),
            "max_score_diff": max(score_diffs, default=0.0),
            "mean_score_diff": statistics.fmean(score_diffs) if score_diffs else 0.0}


def tensorboard_scalar(run_dir: Path, tag: str) -> tuple[list[int], list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


def run_parity(args, device, work: Path) -> dict:
    if work.exists():  # a reused run directory would mix old TensorBoard events and checkpoints in
        shutil.rmtree(work)
    runs = [train_run(args, impl="triton", seed=0, out_dir=work / "triton_s0"),
            train_run(args, impl="pytorch", seed=0, out_dir=work / "pytorch_s0"),
            train_run(args, impl="triton", seed=1, out_dir=work / "triton_s1")]
    comparison = compare_implementations(args, work / "triton_s0" / "checkpoint.pth", device)
    print(f"parity eval: AP triton {comparison['AP']['triton']['AP']:.4f} pytorch "
          f"{comparison['AP']['pytorch']['AP']:.4f}; {100 * comparison['agreement']:.1f}% of "
          f"{comparison['detections_compared']} detections agree", flush=True)
    step_times = {f"{r['impl']} seed {r['seed']}": tensorboard_scalar(Path(r["output_dir"]), "train/step_time_ms")
                  for r in runs}
    return {"runs": runs, "comparison": comparison, "tensorboard_step_time_ms": step_times}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--parts", nargs="+", default=["steptime", "parity"], choices=["steptime", "parity"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impls", nargs="+", default=["triton", "pytorch"], choices=["triton", "pytorch"],
                        help="steptime: implementations to time")
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--width", type=int, default=1333)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=24, help="parity runs: epochs on the synthetic set")
    parser.add_argument("--amp", default="bf16", help="parity runs: bf16 | fp16 | none")
    parser.add_argument("--data-root", default="data/synthetic")
    parser.add_argument("--parity-batch", type=int, default=4, help="parity runs: images per step")
    parser.add_argument("--num-train", type=int, default=256, help="parity runs: synthetic training images")
    parser.add_argument("--num-val", type=int, default=64, help="parity runs: synthetic validation images")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_e2e"))
    parser.add_argument("--score-threshold", type=float, default=0.3)
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="only redraw the plots of a saved e2e_h200.json into --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved, args.out, f"{saved['header']['gpu']}, {saved['header']['date']}")
        return
    device = torch.device(args.device)
    header = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "python": platform.python_version(),
              "command": "python " + " ".join(sys.argv), "height": args.height, "width": args.width,
              "epochs": args.epochs, "amp": args.amp, "parity_batch": args.parity_batch, "score_threshold": args.score_threshold}
    results = {"header": header}

    def save():
        (args.out / "e2e_h200.json").write_text(json.dumps(results, indent=1, default=str))
        write_report(results, args.out, header)

    if "steptime" in args.parts:
        results["steptime"] = run_steptime(args, device)
        save()
    if "parity" in args.parts:
        results["parity"] = run_parity(args, device, args.work)
        save()
    plot(results, args.out, f"{header['gpu']}, {header['date']}")


if __name__ == "__main__":
    main()
