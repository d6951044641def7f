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

from engine.optim import build_optimizer  # noqa: E402
from engine.precision import Precision  # noqa: E402
from models import build_model  # noqa: E402

ATTENTION_KERNELS = {"triton": ("msda_forward_kernel", "msda_backward_kernel"), "pytorch": ("grid_sampler",)}


def compose_config(overrides: list[str]):
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


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------
def write_report(results: dict, out: Path, header: dict) -> None:
    lines = [f"# End-to-end training on {header['gpu']}: model.msda=triton vs pytorch", "",
             f"Date {header['date']}; torch {header['torch']}, triton {header['triton']}, Python {header['python']}.",
             f"Command: `{header['command']}`", ""]
    rows = results.get("steptime", [])
    if rows:
        lines += [f"## Training step, default model, random {header['height']}x{header['width']} batches", "",
                  "Median of the timed steps after warm-up (forward, matching and losses, backward, clipping, "
                  "AdamW); peak = max GPU memory allocated; attention = share of GPU kernel time in the "
                  "attention op (Triton msda kernels, or grid_sampler kernels for the reference).", "",
                  "| batch | precision | msda | step ms | images/s | peak GiB | attention share | speed-up | memory ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        ref = {(r["batch"], r["amp"]): r for r in rows if r["impl"] == "pytorch"}
        for r in rows:
            base = ref.get((r["batch"], r["amp"]))
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            mem = r["peak_gib"] / base["peak_gib"] if base else float("nan")
            lines.append(f"| {r['batch']} | {r['amp'].replace('none', 'fp32')} | {r['impl']} | {r['step_ms']:.1f} | "
                         f"{r['images_per_s']:.1f} | {r['peak_gib']:.2f} | {100 * r['attention_share']:.1f}% "
                         f"| {speed:.2f}x | {mem:.2f} |")
    parity = results.get("parity")
    if parity:
        c = parity["comparison"]
        lines += ["", "## Parity on the synthetic set", "",
                  f"`train.train` with the synthetic defaults ({header['epochs']} epochs, batch {header['parity_batch']}, "
                  f"amp={header['amp']}); "
                  "every run from scratch.", "",
                  "| msda | seed | steps | final loss | AP | AP50 | wall s |", "|---|---|---|---|---|---|---|"]
        for r in parity["runs"]:
            lines.append(f"| {r['impl']} | {r['seed']} | {len(r['losses'])} | {r['losses'][-1]:.4f} | "
                         f"{r['eval']['AP']:.4f} | {r['eval']['AP50']:.4f} | {r['wall_s']:.0f} |")
        by = {(r["impl"], r["seed"]): r["eval"]["AP"] for r in parity["runs"]}
        spread = abs(by[("triton", 0)] - by[("triton", 1)])
        diff = abs(by[("triton", 0)] - by[("pytorch", 0)])
        lines += ["", f"Seed-to-seed spread of triton's AP: {spread:.4f}; triton vs pytorch at seed 0: {diff:.4f} "
                  f"({'within' if diff <= spread else 'outside'} the spread).", "",
                  f"One checkpoint (triton, seed 0) evaluated through each implementation: AP triton "
                  f"{c['AP']['triton']['AP']:.4f}, pytorch {c['AP']['pytorch']['AP']:.4f} (difference "
                  f"{abs(c['AP']['triton']['AP'] - c['AP']['pytorch']['AP']):.4f}); of the "
                  f"{c['detections_compared']} triton detections scoring above {header['score_threshold']}, "
                  f"{100 * c['agreement']:.1f}% have a pytorch detection of the same class with IoU > 0.95 "
                  f"(score difference mean {c['mean_score_diff']:.2e}, max {c['max_score_diff']:.2e})."]
    (out / "e2e_h200.md").write_text("\n".join(lines) + "\n")


def split_runs(steps: list[int], values: list[float]) -> list[tuple[list[int], list[float]]]:
    """Cut a scalar series where its step goes back: two runs that wrote into one TensorBoard directory."""
    runs, start = [], 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or steps[i] <= steps[i - 1]:
            runs.append((steps[start:i], values[start:i]))
            start = i
    return sorted(runs, key=lambda r: len(r[0]))  # the shorter, this bench's own run first


def plot(results: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parity = results.get("parity")
    if parity:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in parity["runs"]:
            ax.plot(r["losses"], label=f"{r['impl']} seed {r['seed']}", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (weighted sum)")
        ax.set_yscale("log")
        ax.set_title(f"Loss curves, synthetic set: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_loss_curves.png", dpi=110)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, (steps, values) in parity["tensorboard_step_time_ms"].items():
            for i, (run_steps, run_values) in enumerate(split_runs(steps, values)):
                ax.plot(run_steps, run_values, label=name if i == 0 else f"{name} (an earlier run in the same directory)",
                        linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("train/step_time_ms (TensorBoard)")
        ax.set_title(f"Step time as TensorBoard shows it: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_tensorboard_step_time.png", dpi=110)
    rows = results.get("steptime")
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = sorted({(r["batch"], r["amp"]) for r in rows})
        for offset, impl in ((-0.2, "triton"), (0.2, "pytorch")):
            ms = [next((r["step_ms"] for r in rows if (r["batch"], r["amp"]) == key and r["impl"] == impl), 0.0)
                  for key in labels]
            ax.bar([i + offset for i in range(len(labels))], ms, width=0.4, label=f"msda={impl}")
        ax.set_xticks(range(len(labels)), [f"batch {b}\n{a.replace('none', 'fp32')}" for b, a in labels])
        ax.set_ylabel("median training step (ms)")
        ax.set_title(f"Training step, 800x1333: {title}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "e2e_step_time.png", dpi=110)


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
