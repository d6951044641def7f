"""The step's batch (engine/train/run_plan.py) and its exactness: one process at batch 8, four processes at
batch 2 (gloo, averaged as train.py averages them) and one process accumulating 4 passes of 2 compute the same
losses and the same gradients, to 1e-5 relative, in fp32 on the CPU.

Every loss is divided by the step's box count over all processes (SetCriterion with the trainer's num_boxes), so
the images of one step may be split anyhow; the images share one size, as a size bucket's batch does, so that
padding is the same every way. The images hold 0 to 5 boxes: the passes' and processes' counts differ.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import gradient_errors, tiny_cfg

from engine.runtime.distributed import DistContext, average_over_processes, data_parallel
from engine.runtime.precision import Precision
from engine.train.run_plan import StepBatch, step_batch
from engine.train.step import OptimizerStep
from models import build_model

BOXES = (3, 0, 5, 1, 2, 4, 1, 2)  # per image of the step
PROCESSES = 4


@pytest.mark.parametrize(
    "total, batch_size, world, expected",
    [
        (None, 2, 1, StepBatch(total=2, per_process=2, passes=1)),
        (None, 2, 8, StepBatch(total=16, per_process=2, passes=1)),
        (32, 32, 1, StepBatch(total=32, per_process=32, passes=1)),
        (32, 32, 2, StepBatch(total=32, per_process=16, passes=1)),
        (32, 32, 8, StepBatch(total=32, per_process=4, passes=1)),
        (32, 8, 1, StepBatch(total=32, per_process=32, passes=4)),
        (32, 12, 1, StepBatch(total=32, per_process=32, passes=4)),  # passes of 8: 32 in 3 would not be equal
        (30, 4, 1, StepBatch(total=30, per_process=30, passes=10)),
        (8, 2, 2, StepBatch(total=8, per_process=4, passes=2)),
    ],
)
def test_the_step_batch_follows_from_the_total_and_the_world_size(total, batch_size, world, expected):
    batch = step_batch(total_batch_size=total, batch_size=batch_size, world_size=world)
    assert batch == expected
    assert batch.per_pass * batch.passes == batch.per_process and batch.per_pass <= batch_size


def test_a_total_the_processes_cannot_share_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"total_batch_size=32 cannot be shared equally by 3 processes"):
        step_batch(total_batch_size=32, batch_size=32, world_size=3)


def test_the_step_batch_says_the_total_and_the_share():
    assert step_batch(total_batch_size=32, batch_size=8, world_size=2).describe(2) == (
        "batch 32 per optimizer step (16 per process x 2 processes, 2 passes of 8 accumulated)"
    )
    assert step_batch(total_batch_size=None, batch_size=2, world_size=1).describe(1) == (
        "batch 2 per optimizer step (2 per process x 1 process, 1 pass of 2)"
    )


def step_batch_data():
    """Eight 96x128 images and their targets."""
    gen = torch.Generator().manual_seed(7)
    images = torch.randn(len(BOXES), 3, 96, 128, generator=gen)
    masks = torch.zeros(len(BOXES), 96, 128, dtype=torch.bool)
    targets = []
    for n in BOXES:
        centres, sizes = torch.rand(n, 2, generator=gen) * 0.5 + 0.25, torch.rand(n, 2, generator=gen) * 0.3 + 0.1
        boxes = torch.cat([centres, sizes], 1)
        targets.append({"labels": torch.randint(1, 7, (n,), generator=gen), "boxes": boxes})
    return images, masks, targets


def run_step(model, criterion, images, masks, targets, ctx: DistContext, *, sync_gradients=None, images_per_pass=None):
    """The trainer's step (lr 0, no clipping: the weights stay); its value vector, the gradients it left and the
    vector's names."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    step = OptimizerStep(
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        precision=Precision(amp="none", device=ctx.device),
        clip_max_norm=0.0,
        average_num_boxes=lambda n: average_over_processes(n, ctx),
        sync_gradients=sync_gradients,
        images_per_pass=images_per_pass,
    )
    values = step(images, masks, targets)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return values, grads, step.value_names


def fresh_model(hybrid: bool = False):
    """The tiny model and its criterion; ``hybrid``: with hybrid matching, whose one-to-many losses are divided by the
    repeated targets' count over all processes."""
    torch.manual_seed(0)
    cfg = tiny_cfg(num_classes=7)
    cfg.one_to_many = "hybrid" if hybrid else "none"
    return build_model(cfg)[:2]


def _process_main(rank: int, work: str, hybrid: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=PROCESSES)
    try:
        torch.set_num_threads(1)
        ctx = DistContext(rank=rank, world_size=PROCESSES, local_rank=rank, device=torch.device("cpu"))
        model, criterion = fresh_model(hybrid)
        trained, sync_gradients = data_parallel(model, ctx, gradient_sync="allreduce")  # as train.py does
        images, masks, targets = step_batch_data()
        share = slice(2 * rank, 2 * rank + 2)
        values, grads, _ = run_step(
            trained, criterion, images[share], masks[share], targets[share], ctx, sync_gradients=sync_gradients
        )
        dist.all_reduce(values)  # the log interval's mean over processes (engine/train/hooks/interval_report.py)
        torch.save({"values": values / PROCESSES, "grads": grads}, f"{work}/process{rank}.pt")
    finally:
        dist.destroy_process_group()


def assert_same(values, grads, expected_values, expected_grads, what: str, *, skip: tuple[int, ...] = ()) -> None:
    # Every entry of the value vector (total loss, gradient norm, each loss and logged metric) but ``skip`` to 1e-5
    # relative; each gradient tensor to 1e-5 of its largest entry (gradient_errors: of a share of the largest
    # gradient, for a tensor whose true gradient is zero).
    kept = [i for i in range(len(values)) if i not in skip]
    torch.testing.assert_close(values[kept], expected_values[kept], rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")
    assert grads.keys() == expected_grads.keys()
    for name, error in gradient_errors(grads, expected_grads, floor=1e-3).items():
        assert error <= 1e-5, f"{what}: {name}"


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid_matching"])
def test_one_process_four_processes_and_four_accumulated_passes_give_the_same_step(tmp_path, hybrid):
    one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model, criterion = fresh_model(hybrid)
    values, grads, names = run_step(model, criterion, *step_batch_data(), one)
    assert torch.isfinite(values).all() and values[0] > 0
    assert ("loss_ce_one2many" in names) == hybrid
    # class_error, an accuracy logged only, is averaged over processes as the original averages it (a mean of
    # the processes' accuracies, not of their boxes'); within one process the passes weigh it by their boxes.
    class_errors = tuple(i for i, name in enumerate(names) if name.startswith("class_error"))

    model, criterion = fresh_model(hybrid)
    accumulated_values, accumulated_grads, _ = run_step(model, criterion, *step_batch_data(), one, images_per_pass=2)
    assert_same(accumulated_values, accumulated_grads, values, grads, "4 passes of 2")

    mp.spawn(_process_main, args=(str(tmp_path), hybrid), nprocs=PROCESSES)
    for rank in range(PROCESSES):
        result = torch.load(tmp_path / f"process{rank}.pt")
        assert_same(result["values"], result["grads"], values, grads, f"process {rank} of 4", skip=class_errors)
