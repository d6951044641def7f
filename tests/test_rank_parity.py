"""Rank parity: one global batch split over 2 ranks (gloo; NCCL on 2 GPUs) gives the loss and gradients of 1 process.

The loss is normalized by the number of boxes averaged over processes (engine.train.step.OptimizerStep with
engine.runtime.distributed.average_over_processes), and the gradients are averaged over ranks (by
engine.runtime.distributed.GradientAllReduce after backward, or by DDP inside it), so the mean of the per-rank
losses and the averaged gradients must equal what one process computes on the whole batch. Both sides
run the trainer's own step. Images share one size so that padding is the same either way. Rank 1 starts
from other weights: both ways of syncing must start every rank from rank 0's (the all-reduce also from its
batch-norm statistics).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import gradient_errors, tiny_cfg

from engine.compile.plan import CompilePlan, compile_model
from engine.runtime.distributed import DistContext, average_over_processes, data_parallel
from engine.runtime.precision import Precision
from engine.train.step import OptimizerStep
from models import build_model

WORLD = 2


def global_batch(counts: tuple[int, ...], device="cpu"):
    """Two 96x128 images with different numbers of targets (so the num_boxes averaging matters)."""
    gen = torch.Generator().manual_seed(3)
    images = torch.randn(WORLD, 3, 96, 128, generator=gen)
    masks = torch.zeros(WORLD, 96, 128, dtype=torch.bool)
    targets = []
    for n in counts:
        boxes = torch.cat(
            [torch.rand(n, 2, generator=gen) * 0.5 + 0.25, torch.rand(n, 2, generator=gen) * 0.3 + 0.1], 1
        )
        targets.append({"labels": torch.randint(1, 7, (n,), generator=gen), "boxes": boxes})
    targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
    return images.to(device), masks.to(device), targets


def loss_and_grads(model, criterion, images, masks, targets, ctx: DistContext, sync_gradients=None):
    """The trainer's step (no clipping, lr 0); returns its loss and the gradients it computed."""
    module = getattr(model, "module", model)  # the DDP-wrapped model's own parameters
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.0, fused=True)
    step = OptimizerStep(
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        precision=Precision(amp="none", device=ctx.device),
        clip_max_norm=0.0,
        average_num_boxes=lambda n: average_over_processes(n, ctx),
        sync_gradients=sync_gradients,
    )
    values = step(images, masks, targets)
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return values[0], grads


def _rank_main(rank: int, work: str, backend: str, counts: tuple[int, ...], regions: str | None, sync: str) -> None:
    dist.init_process_group(backend, init_method=f"file://{work}/store", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.manual_seed(0)
        model, criterion, _ = build_model(tiny_cfg(num_classes=7))
        if rank == 1:  # other weights (and statistics) than rank 0's, small enough to keep the loss finite
            # DDP of older torch syncs no buffers at all with forward buffer sync off: only the parameters then.
            buffers = [b for b in model.buffers() if b.is_floating_point()] if sync == "allreduce" else []
            with torch.no_grad():
                for t in [*model.parameters(), *buffers]:
                    t.add_(1e-2 * torch.rand_like(t))  # positive: running variances stay positive
        if regions:  # as train.py compiles before wrapping; aot_eager traces as inductor does, without codegen
            compile_model(
                model.to(device),
                CompilePlan(mode="default", regions=regions, backbone="eager", backend="aot_eager"),
                criterion=criterion,
            )
        ctx = DistContext(rank=rank, world_size=WORLD, local_rank=rank, device=device)
        model.to(device)
        trained, sync_gradients = data_parallel(model, ctx, gradient_sync=sync)  # as train.py does
        if sync == "ddp":
            assert not torch._dynamo.config.optimize_ddp, "data_parallel leaves compiled graphs uncut at DDP's buckets"
        images, masks, targets = global_batch(counts, device)
        loss, grads = loss_and_grads(
            trained, criterion, images[rank : rank + 1], masks[rank : rank + 1], [targets[rank]], ctx, sync_gradients
        )
        dist.all_reduce(loss)
        # A file, not a queue: tensors sent through a queue live in the sender's shared memory, gone at exit.
        torch.save(
            {"loss": (loss / WORLD).item(), "grads": {k: v.cpu() for k, v in grads.items()}}, f"{work}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),
    pytest.param(
        "nccl",
        id="nccl-2-gpus",
        marks=pytest.mark.skipif(
            torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (runs on the device machine)"
        ),
    ),
]


# (1, 4): the ranks' images hold different numbers of boxes; (0, 3): one rank's batch has none at all, which
# must neither hang (every rank still joins the num_boxes average and the gradient all-reduce) nor change
# the result. Compiled: the ranks' models compiled as train.py compiles them, the transformer as one graph
# with the all-reduce after backward (train.py's defaults), a graph per layer in DDP (two cases, not four: each
# costs a minute of CI); the one process stays eager. (In DDP: the tiny model's layers are below the 1 MiB that
# Dynamo's DDP cuts start at, so this checks the gradients of compiled layers in DDP, not the cuts themselves;
# each rank checks that they are off.)
@pytest.mark.parametrize(
    "counts,compiled",
    [((1, 4), False), ((0, 3), False), ((1, 4), True)],
    ids=["1-and-4-boxes", "no-boxes-on-rank-0", "1-and-4-boxes-compiled"],
)
@pytest.mark.parametrize("sync", ["allreduce", "ddp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_batch_over_two_ranks_equals_one_process(tmp_path, backend, counts, compiled, sync, full_fp32):
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    model, criterion, _ = build_model(tiny_cfg(num_classes=7))
    single = DistContext(rank=0, world_size=1, local_rank=0, device=device)
    loss_single, grads_single = loss_and_grads(model.to(device), criterion, *global_batch(counts, device), single)
    grads_single = {k: v.cpu() for k, v in grads_single.items()}

    regions = ("transformer" if sync == "allreduce" else "layers") if compiled else None
    mp.spawn(_rank_main, args=(str(tmp_path), backend, counts, regions, sync), nprocs=WORLD)

    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        loss, grads = result["loss"], result["grads"]
        assert abs(loss - loss_single.item()) <= 1e-5 * abs(loss_single.item()), f"rank {rank}"
        assert grads.keys() == grads_single.keys()
        for name, error in gradient_errors(grads, grads_single, floor=1e-3).items():
            assert error < 1e-4, f"rank {rank}: {name}"
