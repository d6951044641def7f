"""Hungarian matching of one training step: how long the host keeps the GPU waiting, on one thread and on several.

    python bench/matching.py                 # on the GPU machine: about 30 s
    python bench/matching.py --smoke         # the CPU, batch 2: checks the script only

The matcher's call as the criterion makes it for experiment=coco_gpu (the decoder's 6 layers and the two-stage
proposals, 300 queries each) and experiment=hybrid (the same, plus 6 layers of 1,500 one-to-many queries matched
to each image's targets repeated 6 times), for a batch of COCO-like target counts (mean 7.3 a image). Each call
is timed from its inputs on the device to its pairs on the host (the cost matrices, their one transfer and the
assignments) with the solver on one thread and as the matcher picks, and the pairs are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import models.matcher as matcher_module  # noqa: E402
from bench.report import header_lines, out_dir, run_header, table, write_report  # noqa: E402

NAME = "matching_h200"
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

    groups = [(*predictions(6, 300), targets), (*predictions(1, 300), proposal_targets)]
    if recipe == "hybrid":
        groups.append((*predictions(6, 1500), targets, 6))
    return groups


def timed_call(matcher, groups: list[tuple], threads: int | None, repeats: int) -> tuple[float, list, int]:
    """(median ms, the pairs, the threads used) of ``repeats`` calls, on ``threads`` or (None) as the matcher picks."""
    chosen, used = matcher_module._solver_threads, []

    def solver_threads(costs: int) -> int:
        used.append(chosen(costs) if threads is None else threads)
        return used[-1]

    matcher_module._solver_threads = solver_threads
    try:
        times = []
        for _ in range(repeats):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            pairs = matcher.match_groups(groups)
            times.append(time.perf_counter() - start)
    finally:
        matcher_module._solver_threads = chosen
    return statistics.median(times) * 1e3, pairs, max(1, used[-1])


def same_pairs(a: list, b: list) -> bool:
    return all(
        torch.equal(x, y)
        for ga, gb in zip(a, b)
        for la, lb in zip(ga, gb)
        for pa, pb in zip(la, lb)
        for x, y in zip(pa, pb)
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
    matcher = matcher_module.HungarianMatcher(cost_class=2, cost_bbox=5, cost_giou=2)
    rows, record, failed = [], [], False
    for batch in batches:
        for recipe in ("coco_gpu", "hybrid"):
            groups = recipe_groups(recipe, batch, torch.Generator().manual_seed(batch), device)
            timed_call(matcher, groups, None, 2)  # warm-up: the device's kernels and the host's pages
            one_ms, one_pairs, _ = timed_call(matcher, groups, 1, repeats)
            picked_ms, picked_pairs, threads = timed_call(matcher, groups, None, repeats)
            blocks = sum(g[0].shape[0] * batch for g in groups)
            same = same_pairs(one_pairs, picked_pairs)
            failed |= not same
            row = {"recipe": recipe, "batch": batch, "blocks": blocks, "threads": threads}
            record.append({**row, "one_thread_ms": one_ms, "picked_ms": picked_ms, "same_pairs": same})
            times = [f"{one_ms:.1f}", f"{picked_ms:.1f}", f"{one_ms / picked_ms:.2f}x"]
            rows.append([recipe, batch, blocks, threads, *times, "yes" if same else "NO (CHECK FAILED)"])
            print(rows[-1], flush=True)
    header = run_header(device=device)
    lines = header_lines(
        "Hungarian matching per training step: one thread and several", header, __doc__.split("\n\n", 2)[2].strip()
    )
    lines += table(
        ["recipe", "batch", "blocks", "threads", "one thread (ms)", "picked (ms)", "speed-up", "same pairs"], rows
    )
    json_path, md_path = write_report(NAME, {**header, "rows": record}, lines, out=out_dir(args.out, args.smoke))
    print(f"wrote {md_path} and {json_path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
