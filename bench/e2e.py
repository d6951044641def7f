"""End-to-end benchmark: whole training steps and detector parity, model.msda=triton against pytorch.

    python bench/e2e.py --out bench/results                           # on a GPU: everything below
    python bench/e2e.py --parts steptime --compile-modes eager reduce-overhead   # only the step-time table

steptime  The trainer's own step (engine.train.step.OptimizerStep: forward, matching + losses, backward, clipping,
          fused AdamW) of the default Deformable DETR, built as train.py builds it (engine.train.build), for each
          compile.mode given (eager, default, reduce-overhead), triton and pytorch, in the
          same process (--isolate: one process each; --repeats N: N times, in alternating order): on random
          800x1333 batches (median step, GPU kernel time, launches and host syncs per
          step, peak memory, attention share) and on batches of the COCO recipe's sizes (median, distinct
          shapes, recompilations). See bench/e2e_steptime.py.
trainpy   A real `python train.py` run (the default model on synthetic images resized as the COCO recipe
          does) and its train/step_time_ms as TensorBoard shows it, beside the steptime figure.
parity    The real trainer (train.train) on the synthetic set: triton with seeds 0 and 1 and pytorch with
          seed 0, same steps; loss curves, final AP, and the seed-to-seed spread that the triton/pytorch
          difference is compared with. Then one checkpoint evaluated through both implementations: AP and
          per-image agreement of the detections. Plots train/step_time_ms read back from TensorBoard.
Writes e2e_h200.md, e2e_h200_steptime.json (one record per step-time row), e2e_h200.json and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.e2e_report import bench_row_for_trainpy, combine_repeats, mode_label, plot, trainpy_runs, write_report  # noqa: E402
from engine.config.choices import COMPILE_MODES, DEFAULT_REGIONS, INDUCTOR_MODES, REGION_CHOICES, TRAIN_BACKBONE_CHOICES  # noqa: E402
from engine.config.registry import register_configs  # noqa: E402
from engine.runtime.precision import Precision  # noqa: E402
from models import build_model  # noqa: E402

# compile.mode values a bench measures: eager, or a compiled mode of engine.compile.
BENCH_MODES = ("eager", *COMPILE_MODES)
RUN_KEYS = ("gpu", "date", "torch", "triton", "command")  # what a step-time row takes from its run's header


def compile_overrides(mode: str, regions: str | None = None, backbone: str | None = None) -> list[str]:
    """The config overrides of a compile.mode (and, compiled, compile.regions and compile.backbone)."""
    if mode not in INDUCTOR_MODES:  # nothing compiled: no regions, no backbone choice
        return [f"compile.mode={mode}"]
    return [f"compile.mode={mode}", f"compile.regions={regions or DEFAULT_REGIONS}",
            f"compile.backbone={backbone or 'static'}"]


def compose_config(overrides: list[str]):
    register_configs()  # the typed schemas configs/*.yaml name
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


# ----------------------------------------------------------------------------------------------------
# step time
# ----------------------------------------------------------------------------------------------------
def run_steptime(args, device, save_rows) -> list[dict]:
    """Every configuration's rows; save_rows(rows so far) after each, so a stopped run keeps what it measured.

    The step is bound by the host, so its figure moves with whatever else the process and the machine do:
    --isolate measures each configuration in a fresh process, and --repeats N measures the whole list N
    times, in alternating order, so that no configuration always comes first or last (the report shows the
    median and the range over the repeats).
    """
    configs = [(batch, amp, mode, regions, backbone, impl) for batch in args.batches for amp in args.amps
               for mode in args.compile_modes
               # The regions' and backbone's settings only mean something where the model is compiled.
               for regions in (args.compile_regions if mode in INDUCTOR_MODES else [None])
               for backbone in (args.compile_backbone if mode in INDUCTOR_MODES else ["eager"])
               for impl in args.impls]
    rows = []
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            new = (_measure_in_child if args.isolate else _measure_here)(args, device, *config)
            for row in new:
                if args.repeats > 1:
                    row["repeat"] = repeat
                if args.isolate:
                    continue  # the child printed its rows
                print(f"steptime batch {row['batch']} {row['amp']:<4} {row['impl']:<7} {mode_label(row):<24} "
                      f"{row['shapes']:<18} {row['step_ms']:.1f} ms, GPU kernels "
                      f"{row.get('gpu_kernel_ms') or float('nan'):.1f} ms, GPU idle by phase "
                      f"{row.get('gpu_idle_by_phase_ms', '-')}, {row.get('syncs_per_step', '-')} "
                      f"syncs, {row['peak_gib']:.2f} GiB, first step {row.get('first_step_s', 0):.1f} s, "
                      f"recompiles {row.get('recompiles', '-')}", flush=True)
            rows.extend(new)
            save_rows(rows)
    return rows


def _measure_here(args, device, batch, amp, mode, regions, backbone, impl) -> list[dict]:
    from bench.e2e_steptime import measure

    cfg = compose_config(["dataset=coco", f"model.msda={impl}", "model.pretrained=none", f"amp={amp}",
                          f"batch_size={batch}", f"device={device}", *compile_overrides(mode, regions, backbone)])
    try:
        return measure(cfg=cfg, height=args.height, width=args.width, warmup=args.warmup, steps=args.steps,
                       multishape_steps=args.multishape_steps, pad_multiples=args.pad_multiples,
                       profile_shapes=args.profile_shapes, profile_fixed=args.profile_fixed)
    except Exception:  # one configuration's failure is reported; the others are still measured
        print(f"steptime batch {batch} {amp} {impl} {mode} {regions} backbone {backbone} FAILED:\n"
              f"{traceback.format_exc()}", flush=True)
        return []
    finally:
        # A compiled model is a reference cycle (its compiled heads hold its bound method): collect it before the
        # next configuration, whose peak memory would otherwise include this one's weights and gradients.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure_in_child(args, device, batch, amp, mode, regions, backbone, impl) -> list[dict]:
    """The same configuration measured by this script in a process of its own; its rows."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", tmp, "--parts", "steptime",
               "--device", str(device), "--batches", str(batch), "--amps", amp, "--compile-modes", mode,
               "--compile-regions", regions or DEFAULT_REGIONS, "--impls", impl,
               "--height", str(args.height),
               "--width", str(args.width), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--multishape-steps", str(args.multishape_steps), "--pad-multiples", *map(str, args.pad_multiples),
               "--profile-shapes", str(args.profile_shapes), "--profile-fixed", str(args.profile_fixed),
               "--compile-backbone", backbone]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"steptime batch {batch} {amp} {impl} {mode} {regions} backbone {backbone} FAILED in its process: "
                  f"{' '.join(cmd)}", flush=True)
            return []
        rows = json.loads((Path(tmp) / "e2e_h200_steptime.json").read_text())
    # This run's header (date, GPU, command) replaces the child's.
    return [{k: v for k, v in row.items() if k not in (*RUN_KEYS, "note")} for row in rows]


# ----------------------------------------------------------------------------------------------------
# a real train.py run, as TensorBoard shows it
# ----------------------------------------------------------------------------------------------------
def run_trainpy(args, work: Path) -> dict:
    """`python train.py` on synthetic 1067-pixel images with the COCO recipe's resizing; its step times."""
    import subprocess

    mode = args.trainpy_mode
    run_dir = work / f"trainpy_{mode}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    scales = "[" + ",".join(str(s) for s in range(480, 801, 32)) + "]"
    cmd = [sys.executable, str(ROOT / "train.py"), "model=deformable_detr", "model.pretrained=none",
           "model.msda=triton", *compile_overrides(mode, args.trainpy_regions), "amp=bf16", "batch_size=2",
           f"dataset.root={work / 'synthetic_coco_sizes'}", "dataset.image_size=1067", f"dataset.train_scales={scales}",
           "dataset.max_size=1333", "dataset.val_size=800", f"dataset.num_train={2 * args.trainpy_steps}",
           "dataset.num_val=8", f"dataset.pad_to_multiple={args.trainpy_pad}", "dataset.size_buckets=0",
           "num_workers=4", "epochs=1",
           f"max_steps={args.trainpy_steps}", "log_every=10",
           f"output_dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps, values = tensorboard_scalar(run_dir, "train/step_time_ms")
    settled = values[1:]  # the first interval holds the kernels' compilation (and the model's, compiled)
    result = {"command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t0, "steps": steps, "step_time_ms": values,
              "median_step_time_ms": statistics.median(settled) if settled else float("nan"),
              # Once most sizes have been met (with CUDA graphs: recorded), as a long run spends its time.
              "late_step_time_ms": statistics.median(values[-max(1, len(values) // 3):]) if values else float("nan"),
              "compile": mode != "eager", "compile_mode": None if mode == "eager" else mode,
              "pad_to_multiple": args.trainpy_pad, **({"compile_regions": args.trainpy_regions} if mode != "eager" else {})}
    print(f"trainpy: train/step_time_ms in TensorBoard {result['median_step_time_ms']:.1f} ms (median of "
          f"{len(settled)} intervals after the first)", flush=True)
    return result


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
    from engine.checkpoint.contents import load_model_weights
    from engine.checkpoint.io import load_checkpoint

    cfg = compose_config([f"dataset.root={args.data_root}", f"device={args.device}",
                          f"dataset.num_train={args.num_train}", f"dataset.num_val={args.num_val}"])
    ckpt = load_checkpoint(checkpoint)
    val_set = build_dataset("val", cfg.dataset)
    loader = build_data_loader(val_set, batch_size=cfg.batch_size, num_workers=0, train=False)
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
    parser.add_argument("--parts", nargs="+", default=["steptime", "trainpy", "parity"],
                        choices=["steptime", "trainpy", "parity"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[2])
    parser.add_argument("--amps", nargs="+", default=["bf16"], choices=["bf16", "fp16", "none"])
    parser.add_argument("--compile-modes", nargs="+", default=["eager", "reduce-overhead"], choices=list(BENCH_MODES),
                        help="steptime: compile.mode values (eager; default: compiled; reduce-overhead: CUDA graphs, "
                             "the GPU's default)")
    parser.add_argument("--isolate", action="store_true",
                        help="steptime: each configuration in a process of its own")
    parser.add_argument("--repeats", type=int, default=1,
                        help="steptime: measure every configuration this many times, in alternating order")
    parser.add_argument("--multishape-steps", type=int, default=40,
                        help="steptime: steps on batches of the COCO recipe's sizes after the fixed-size ones, "
                             "run twice, three times with CUDA graphs (0: none)")
    parser.add_argument("--pad-multiples", type=int, nargs="+", default=[1, 128],
                        help="steptime: dataset.pad_to_multiple values of the COCO-sizes rows")
    parser.add_argument("--profile-shapes", type=int, default=0, metavar="STEPS",
                        help="steptime: after the COCO-sizes steps, profile this many more on the host (top ops)")
    parser.add_argument("--compile-backbone", nargs="+", default=["static"], choices=list(TRAIN_BACKBONE_CHOICES),
                        help="steptime: compile.backbone of the compiled modes; "
                             "several: each is measured")
    parser.add_argument("--compile-regions", nargs="+", default=[DEFAULT_REGIONS], choices=list(REGION_CHOICES),
                        help="steptime: what one compiled graph spans (engine.config.choices.REGION_CHOICES); several: "
                             "each is measured")
    parser.add_argument("--profile-fixed", type=int, default=0, metavar="STEPS",
                        help="steptime: after the fixed-size steps, profile this many more with cProfile (Python)")
    parser.add_argument("--trainpy-steps", type=int, default=80)
    parser.add_argument("--trainpy-mode", default="eager", choices=list(BENCH_MODES), help="trainpy: compile.mode")
    parser.add_argument("--trainpy-pad", type=int, default=1, help="trainpy: dataset.pad_to_multiple")
    parser.add_argument("--trainpy-regions", default=DEFAULT_REGIONS, choices=list(REGION_CHOICES),
                        help="trainpy, compiled modes: compile.regions")
    parser.add_argument("--impls", nargs="+", default=["triton", "pytorch"], choices=["triton", "pytorch"],
                        help="steptime: implementations to time")
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--width", type=int, default=1333)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=24, help="parity runs: epochs on the synthetic set")
    parser.add_argument("--amp", default="bf16", help="parity runs: bf16 | fp16 | none")
    parser.add_argument("--data-root", default="data/synthetic")
    parser.add_argument("--parity-batch", type=int, default=4, help="parity runs: images per step")
    parser.add_argument("--num-train", type=int, default=256, help="parity runs: synthetic training images")
    parser.add_argument("--num-val", type=int, default=64, help="parity runs: synthetic validation images")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_e2e"))
    parser.add_argument("--score-threshold", type=float, default=0.3)
    parser.add_argument("--replot", action="store_true", help="only rewrite e2e_h200.md and the plots from --out")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.replot:
        run_parts(args)
    write_report(args.out)
    plot(args.out)


def _row_key(row: dict) -> tuple:
    """A row replaces the earlier row of the same configuration measured by the same command."""
    return (row["command"], row["impl"], row["amp"], mode_label(row), row["batch"], row["shapes"],
            row.get("repeat", 0))


def run_parts(args) -> None:
    """Each part saves its own json as soon as it ends, so a later failure keeps what was measured."""
    device = torch.device(args.device)
    header = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "python": platform.python_version(),
              "command": "python " + " ".join(sys.argv), "height": args.height, "width": args.width,
              "epochs": args.epochs, "amp": args.amp, "parity_batch": args.parity_batch,
              "score_threshold": args.score_threshold}

    def save(part: str, value) -> None:
        (args.out / f"e2e_h200_{part}.json").write_text(json.dumps(value, indent=1, default=str))
        write_report(args.out)

    if "steptime" in args.parts:
        # Rows of an earlier run (other modes) stay unless this run measures the same configuration.
        saved = args.out / "e2e_h200_steptime.json"
        earlier = json.loads(saved.read_text()) if saved.exists() else []

        def save_rows(rows):
            rows = [{**{k: header[k] for k in RUN_KEYS}, **row} for row in rows]
            keys = {_row_key(r) for r in rows}
            save("steptime", rows + [r for r in earlier if _row_key(r) not in keys])  # newest run first

        steptime_rows = run_steptime(args, device, save_rows)
    if "trainpy" in args.parts:
        result = run_trainpy(args, args.work)
        bench = bench_row_for_trainpy(result, combine_repeats(steptime_rows) if "steptime" in args.parts else [])
        if bench:  # the figures of this run, kept beside the TensorBoard ones
            result["bench_step_ms"] = bench.get("first_pass_ms", bench["step_ms"])
            result["bench_steady_ms"] = bench["step_ms"]
        # Runs of other commands stay, newest first.
        saved = args.out / "e2e_h200_trainpy.json"
        earlier = trainpy_runs(json.loads(saved.read_text())) if saved.exists() else []
        save("trainpy", [{"header": header, **result}]
             + [r for r in earlier if r["header"]["command"] != header["command"]])
    if "parity" in args.parts:
        save("parity", {"header": header, "parity": run_parity(args, device, args.work)})


if __name__ == "__main__":
    main()
