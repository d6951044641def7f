"""The COCO recipe on several GPUs: does total batch 32 on N GPUs train N times as many images per second as one?

    python bench/ddp.py                 # every visible GPU against one: bench/results/ddp_h200.{json,md}
    python bench/ddp.py --gpus 2

Both rows are bench/throughput.py's: ``train.py experiment=coco_gpu`` (total_batch_size=32, each GPU's share in
one pass) on the same generated COCO-like JPEG files, the N-GPU one under torchrun. The target is a speed-up of at
least 0.95 N (1.9x on two GPUs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import RESULTS, header_lines, run_header, table, write_report
from bench.throughput import run_row, write_coco_like

SCALING_TARGET = 0.95  # of linear


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the multi-GPU row (default: all visible)")
    parser.add_argument("--batch", type=int, default=32, help="total batch per optimizer step")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per row")
    parser.add_argument("--val-images", type=int, default=64)
    parser.add_argument("--overrides", nargs="*", default=[], help="more train.py overrides for both rows")
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_ddp"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="ddp_h200")
    parser.add_argument(
        "--traces", type=Path, default=None, help="also keep each row's profiler trace (rank 0's) here, gzipped"
    )
    return parser


def main() -> None:
    import torch

    args = build_parser().parse_args()
    args.smoke, args.names_used = False, set()  # what throughput.py's run_row reads beside these options
    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 2:
        sys.exit(f"bench/ddp.py needs at least 2 GPUs; {torch.cuda.device_count()} visible")
    write_coco_like(args.work / "coco", train=args.batch * (args.steps + 8), val=args.val_images)
    one, many = (run_row(args, "coco_gpu", args.batch, args.steps, gpus=n) for n in (1, gpus))
    header = run_header(gpus=gpus)
    lines = header_lines(
        f"Total batch {args.batch} on 1 and {gpus} GPUs",
        header,
        "Images per second of the same recipe through train.py on one GPU and under torchrun; the "
        f"speed-up is their ratio, against {SCALING_TARGET:.2f} x linear.",
    )
    rows = [
        [r["gpus"], r["per_gpu_batch"], f"{r['img_s']:.1f}", f"{r['step_ms']:.0f}"]
        + [f"{r['gpu_busy'] or 0:.0%}", f"{r['data_wait_share']:.1%}", f"{r['peak_gib'] or 0:.1f}"]
        for r in (one, many)
        if "error" not in r
    ]
    lines += table(["GPUs", "per GPU", "img/s", "step ms", "GPU busy", "loader wait", "peak GiB"], rows)
    if "error" not in one and "error" not in many:
        speed_up = many["img_s"] / one["img_s"]
        ok = speed_up >= SCALING_TARGET * gpus
        lines += [
            "",
            f"Speed-up {speed_up:.2f}x on {gpus} GPUs: {'met' if ok else 'MISSED'} (>= {SCALING_TARGET * gpus:.2f}x)",
        ]
    write_report(args.name, {**header, "rows": [one, many]}, lines, out=args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
