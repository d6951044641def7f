"""Hungarian matching of one training step: solved on the host, where the GPU waits for it, or on the GPU.

    python bench/matching.py                 # on the GPU machine: about 30 s
    python bench/matching.py --smoke         # the CPU, batch 2 (the device solve under Triton's interpreter)

The matcher's call as the criterion makes it for experiment=coco_gpu (the decoder's 6 layers and the two-stage
proposals, 300 queries each) and experiment=hybrid (the same, plus 6 layers of 1,500 one-to-many queries matched
to each image's targets repeated 6 times), for a batch of COCO-like target counts (mean 7.3 a image). The host
solve is timed from its inputs on the device to the criterion's matches on the device (the cost matrices, their
one transfer, scipy's assignments on one thread and on the threads the matcher picks, the pairs' copy back); the
device solve (models/assignment.py, what a GPU run uses) over the same span, ended by a synchronization. The
matches of all three are checked equal, index for index.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--smoke" in sys.argv:
    # The device solve's kernel runs on the CPU under the interpreter, which must be on before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import models.matcher as matcher_module  # noqa: E402
from bench.report import header_lines, out_dir, run_header, table, write_report  # noqa: E402
from models.criterion import matched  # noqa: E402

NAME = "matching_h200"
SOLVERS = ("host", "device")
CLASSES = 91


def coco_like_targets(batch: int, gen: torch.Generator, device: str) -> list[dict]:
    # COCO train2017: 7.3 boxes a image on average, a long tail to a few dozen.
    sizes = (torch.empty(batch).exponential_(1 / 7.3, generator=gen).ceil().clamp(1, 60)).int().tolist()
    return [
        {
            "labels": torch.randint(0, CLASSES, (n,), generator=gen).to(device),
            "boxes": (torch.rand(n, 4, generator=gen) * 0.5 + 0.25).to(device),
        }
        for n in sizes
    ]


def recipe_groups(recipe: str, batch: int, gen: torch.Generator, device: str) -> list[tuple]:
    targets = coco_like_targets(batch, gen, device)
    proposal_targets = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]

    def predictions(layers: int, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randn(layers, batch, queries, CLASSES, generator=gen).to(device),
            torch.rand(layers, batch, queries, 4, generator=gen).to(device),
        )

    groups = [(*predictions(6, 300), targets, 1), (*predictions(1, 300), proposal_targets, 1)]
    if recipe == "hybrid":
        groups.append((*predictions(6, 1500), targets, 6))
    return groups


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_call(call, threads: int | None, repeats: int) -> tuple[float, list, int]:
    """(median ms, the matches, the host threads used) of ``repeats`` calls of ``call()``, the host solve on
    ``threads`` or (None) as the matcher picks."""
    chosen, used = matcher_module._solver_threads, []

    def solver_threads(costs: int) -> int:
        used.append(chosen(costs) if threads is None else threads)
        return used[-1]

    matcher_module._solver_threads = solver_threads
    try:
        times = []
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            matches = call()
            synchronize()
            times.append(time.perf_counter() - start)
    finally:
        matcher_module._solver_threads = chosen
    return statistics.median(times) * 1e3, matches, max(1, used[-1]) if used else 0


def same_matches(a: list, b: list) -> bool:
    return all(
        (x.per_layer, x.slots) == (y.per_layer, y.slots)
        and all(torch.equal(getattr(x, name), getattr(y, name)) for name in ("layer", "batch", "query", "target"))
        for x, y in zip(a, b, strict=True)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32], help="images a step")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per row (the median is reported)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (bench/results; smoke: outputs/bench)")
    parser.add_argument("--smoke", action="store_true", help="the CPU, batch 2, 2 calls: checks the script only")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    batches, repeats = ([2], 2) if args.smoke else (args.batches, args.repeats)
    host, on_gpu = (matcher_module.HungarianMatcher(solver=s, cost_class=2, cost_bbox=5, cost_giou=2) for s in SOLVERS)
    rows, record, failed = [], [], False
    for batch in batches:
        for recipe in ("coco_gpu", "hybrid"):
            groups = recipe_groups(recipe, batch, torch.Generator().manual_seed(batch), device)
            on_host, on_device = (lambda: matched(host, groups)[0]), (lambda: matched(on_gpu, groups)[0])
            timed_call(on_host, None, 2)  # warm-up: the device's kernels and the host's pages
            timed_call(on_device, None, 1)  # and the solve's kernel compiled
            one_ms, one_matches, _ = timed_call(on_host, 1, repeats)
            host_ms, host_matches, threads = timed_call(on_host, None, repeats)
            device_ms, device_matches, _ = timed_call(on_device, None, repeats)
            blocks = sum(g[0].shape[0] * batch for g in groups)
            same = same_matches(one_matches, host_matches) and same_matches(one_matches, device_matches)
            failed |= not same
            row = {"recipe": recipe, "batch": batch, "blocks": blocks, "threads": threads}
            times = {"one_thread_ms": one_ms, "host_ms": host_ms, "device_ms": device_ms}
            record.append({**row, **times, "same_matches": same})
            cells = [f"{one_ms:.1f}", f"{host_ms:.1f}", f"{device_ms:.1f}", f"{host_ms / device_ms:.2f}x"]
            rows.append([recipe, batch, blocks, threads, *cells, "yes" if same else "NO (CHECK FAILED)"])
            print(rows[-1], flush=True)
    header = run_header(device=device)
    lines = header_lines(
        "Hungarian matching per training step: on the host and on the GPU", header, __doc__.split("\n\n", 2)[2].strip()
    )
    headings = ["recipe", "batch", "blocks", "host threads", "host, one thread (ms)", "host (ms)", "device (ms)"]
    lines += table([*headings, "host / device", "same matches"], rows)
    json_path, md_path = write_report(NAME, {**header, "rows": record}, lines, out=out_dir(args.out, args.smoke))
    print(f"wrote {md_path} and {json_path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
