"""The matching solved on the device (models/assignment.py): scipy's pairs, ties included, from the Triton kernel
(under the interpreter on the CPU), the criterion's matches and losses those of the host solve, and on a GPU no
read back to the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import RAND_CLASSES, make_criterion, rand_boxes, rand_outputs, rand_targets
from scipy.optimize import linear_sum_assignment

from models import assignment
from models.criterion import matched
from models.matcher import HungarianMatcher

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on the CPU (tests/conftest.py)
K = RAND_CLASSES


def random_costs(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    if kind == "continuous":
        return rng.standard_normal((rows, cols)).astype(np.float32) * 3
    if kind == "small integers":  # ties everywhere
        return rng.integers(0, 3, (rows, cols)).astype(np.float32)
    if kind == "repeated rows":  # hybrid matching's copies of each target
        n = max(1, rows // 3)
        return np.tile(rng.random((n, cols)).astype(np.float32), (-(-rows // n), 1))[:rows]
    return np.zeros((rows, cols), dtype=np.float32)


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator of fresh problems each run, and its seed, which a failure names so that it can be rerun."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


@pytest.mark.parametrize(
    "kind, most_cols",
    [("continuous", 37), ("small integers", 37), ("repeated rows", 37), ("constant", 37), ("continuous", 2100)],
    ids=["continuous", "small integers", "repeated rows", "constant", "wide"],  # wide: the kernel's widest blocks
)
def test_the_kernel_gives_scipys_pairs_ties_included(kind, most_cols):
    rng, seed = fresh_rng()
    blocks, problems, offset = [], [], 0
    for _ in range(12 if most_cols < 100 else 2):
        rows = int(rng.integers(1, 14 if most_cols < 100 else 5))
        cols = int(rng.integers(rows, most_cols))
        block = random_costs(rng, rows, cols, kind)
        blocks.append(block)
        problems.append((offset, rows, cols, rows, cols, cols, 1))
        offset += block.size
    costs = torch.from_numpy(np.concatenate([b.ravel() for b in blocks])).to(DEVICE)
    table = torch.tensor(problems, dtype=torch.int64, device=DEVICE)
    solved = assignment.solve(costs, table, max_rows=max(p[1] for p in problems), max_cols=max(p[2] for p in problems))
    for block, columns in zip(blocks, solved.cpu()):
        rows, expected = linear_sum_assignment(block)
        assert columns[: len(rows)].tolist() == expected.tolist(), f"seed {seed}: {block}"
        assert (columns[len(rows) :] == -1).all()


def test_the_kernel_sums_the_costs_in_scipys_order():
    """Costs far apart in size: float64 sums in another order round differently, and scipy's pairs here are only
    those of its order (((min_val + cost) - u) - v)."""
    block = np.array(
        [[1e8, 1e8, 1e8, 0.2], [3e38, 1e8, 3e38, 0.1], [1e8, 0.3, 0.7, 0.3], [0.1, 0.3, 0.1, 0.2]], dtype=np.float32
    )
    table = torch.tensor([[0, 4, 4, 4, 4, 4, 1]], device=DEVICE)
    solved = assignment.solve(torch.from_numpy(block.ravel()).to(DEVICE), table, max_rows=4, max_cols=4)
    assert solved[0, :4].tolist() == linear_sum_assignment(block)[1].tolist() == [2, 3, 1, 0]


def test_the_kernel_reads_a_strided_block_with_wrapped_rows_and_columns():
    """A (targets, queries) block read transposed, its targets repeated by wrapping the target index: the problem
    of hybrid matching's images with more repeated targets than queries."""
    rng, seed = fresh_rng()
    targets, queries, repeats = 3, 7, 4
    block = rng.standard_normal((targets, queries)).astype(np.float32)
    padding = rng.standard_normal(5).astype(np.float32)  # the block starts past other costs
    costs = torch.from_numpy(np.concatenate([padding, block.ravel()])).to(DEVICE)
    table = torch.tensor([[5, queries, targets * repeats, queries, 1, targets, queries]], device=DEVICE)
    solved = assignment.solve(costs, table, max_rows=queries, max_cols=targets * repeats)
    _, expected = linear_sum_assignment(np.tile(block, (repeats, 1)).T)
    assert solved[0, :queries].tolist() == expected.tolist(), f"seed {seed}"


def test_solve_refuses_what_it_cannot_solve():
    costs = torch.zeros(4)
    table = torch.tensor([[0, 2, 2, 2, 2, 2, 1]])
    with pytest.raises(ValueError, match=r"costs must be a flat float32 tensor, got torch.float64"):
        assignment.solve(costs.double(), table, max_rows=2, max_cols=2)
    with pytest.raises(ValueError, match=r"problems must be \(P, 7\) int64, got torch.int32"):
        assignment.solve(costs, table.int(), max_rows=2, max_cols=2)
    with pytest.raises(ValueError, match=r"each problem needs rows <= cols, got max_rows 3 > 2"):
        assignment.solve(costs, table, max_rows=3, max_cols=2)
    with pytest.raises(ValueError, match=r"solver must be one of auto, device, host, got 'gpu'"):
        HungarianMatcher(solver="gpu")


def groups_of(gen: torch.Generator, sizes: list[int], shapes) -> list[tuple]:
    """Groups (logits, boxes, targets, repeats) of random predictions, one per (G, Q, r) in ``shapes``; the second
    layer of each has every query predicting the same (ties everywhere)."""
    targets = rand_targets(sizes, gen)
    groups = []
    for G, Q, r in shapes:
        logits = torch.randn(G, len(sizes), Q, K, generator=gen)
        boxes = rand_boxes(G * len(sizes) * Q, gen).view(G, len(sizes), Q, 4)
        if G > 1:
            logits[1, :, 1:] = logits[1, :, :1]
            boxes[1, :, 1:] = boxes[1, :, :1]
        groups.append((logits.to(DEVICE), boxes.to(DEVICE), move(targets), r))
    return groups


@pytest.mark.parametrize(
    "sizes, shapes",
    [
        ([3, 0, 5], [(2, 8, 1), (2, 12, 3)]),  # an image without targets; hybrid's repeated targets
        ([6, 2], [(2, 4, 1), (2, 4, 2)]),  # more targets than queries, repeated or not
        ([5, 5], [(3, 5, 1)]),  # as many targets as queries
        ([0, 0], [(2, 6, 1), (2, 9, 3)]),  # no target in the batch
        ([1, 9, 4, 2], [(3, 16, 1), (3, 30, 4)]),
        ([], [(2, 6, 1), (2, 9, 3)]),  # an empty batch
        ([4, 7], [(2, 8, 1), (1, 300, 1)]),  # a group far wider than the other, as the two-stage proposals are
    ],
)
def test_the_device_solve_gives_the_criterions_matches_of_the_host_solve(sizes, shapes):
    """The pairs stay the same: the device solve's matches, index for index and in the same order, are those the
    criterion makes from scipy's pairs."""
    gen = torch.Generator().manual_seed(sum(sizes) + len(shapes))
    groups = groups_of(gen, sizes, shapes)
    expected, expected_lengths = matched(HungarianMatcher(solver="host"), groups)
    matches, lengths = matched(HungarianMatcher(solver="device"), groups)
    assert lengths.tolist() == expected_lengths.tolist() == sizes
    for want, got in zip(expected, matches, strict=True):
        assert (got.per_layer, got.slots) == (want.per_layer, want.slots)
        for name in ("layer", "batch", "query", "target"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


def test_each_group_is_solved_in_a_block_of_its_own_size():
    """A group of many queries (the two-stage proposals) does not widen the other groups' launch: each group's
    assignment has the rows of its own largest problem, rounded up to a power of two."""
    gen = torch.Generator().manual_seed(11)
    groups = groups_of(gen, [4, 7], [(2, 8, 1), (1, 300, 1), (2, 12, 3)])
    solved = HungarianMatcher(solver="device").match_groups_on_device(groups)
    # Largest rows: 7 targets; 7 targets; 12 queries (fewer than the 12 and 21 repeated targets).
    assert [group.shape for group, _ in solved] == [(2, 2, 8), (1, 2, 8), (2, 2, 16)]


@pytest.mark.parametrize("one_to_many", ["none", "hybrid"])
def test_the_criterion_gives_the_same_losses_with_either_solver(one_to_many):
    gen = torch.Generator().manual_seed(7)
    hybrid = {"one_to_many": "hybrid", "k_one2many": 3} if one_to_many == "hybrid" else {}
    outputs = decoder_outputs(3, 10, gen)
    if hybrid:
        outputs["one2many_outputs"] = decoder_outputs(3, 14, gen)
    outputs = move(outputs)
    targets = move(rand_targets([4, 0, 6], gen))
    losses = {}
    for solver in ("host", "device"):
        criterion = make_criterion(dec_layers=3, **hybrid).to(DEVICE)
        criterion.matcher.solver = solver
        losses[solver] = criterion(outputs, targets)
    assert losses["host"].keys() == losses["device"].keys()
    for name, value in losses["host"].items():
        assert torch.equal(losses["device"][name], value), name


def decoder_outputs(B: int, Q: int, gen: torch.Generator) -> dict:
    """Random outputs of a decoder of 3 layers: the last layer's, and the other two as aux_outputs."""
    return {**rand_outputs(B, Q, gen), "aux_outputs": [rand_outputs(B, Q, gen) for _ in range(2)]}


def move(value):
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE)
    if isinstance(value, dict):
        return {k: move(v) for k, v in value.items()}
    if isinstance(value, list):
        return [move(v) for v in value]
    return value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_the_criterion_on_a_gpu_matches_with_no_read_back_to_the_host():
    """torch's sync debug mode raises at any call that waits for the GPU, as a read of a device value does."""
    gen = torch.Generator().manual_seed(5)
    outputs = decoder_outputs(4, 30, gen)
    outputs["one2many_outputs"] = decoder_outputs(4, 60, gen)
    outputs = move(outputs)
    for value in (outputs["pred_logits"], outputs["one2many_outputs"]["pred_logits"]):
        value.requires_grad_(True)
    targets = move(rand_targets([4, 0, 9, 25], gen))
    criterion = make_criterion(dec_layers=3, one_to_many="hybrid", k_one2many=3).cuda()
    assert criterion.matcher.solves_on(torch.device("cuda"))
    criterion(outputs, targets)  # warm-up: Triton compiles the kernel, the allocators fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = criterion(outputs, targets)
        sum(losses.values()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(v).item() for v in losses.values())
