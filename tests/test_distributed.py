"""engine.runtime.distributed: a rank that never joins a collective makes the others' wait an error naming them;
GradientAllReduce averages gradients of several dtypes, a parameter unused on one rank included; ranks
whose models differ, or an unknown gradient sync, are errors that say so.

Two gloo processes with a 3-second timeout: rank 1 leaves without joining; rank 0's barrier must fail
with CollectiveError ("rank 0 of 2: barrier ...") instead of hanging.
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.errors import CollectiveError
from engine.runtime.distributed import DistContext, GradientAllReduce, barrier, broadcast_object, data_parallel

TIMEOUT_S = 3.0


def _rank_main(rank: int, work: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work}/store",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), timeout_s=TIMEOUT_S)
    assert broadcast_object("from rank 0" if rank == 0 else None, ctx) == "from rank 0"  # both still here
    if rank == 1:
        time.sleep(2 * TIMEOUT_S)  # stays alive but never joins the barrier: the hang a lost rank causes
        return
    started = time.perf_counter()
    try:
        barrier(ctx)
        outcome = "no error"
    except CollectiveError as error:
        outcome = str(error)
    with open(f"{work}/rank0.txt", "w") as f:
        f.write(f"{time.perf_counter() - started:.1f}\n{outcome}")


def test_a_missing_rank_is_an_error_naming_the_waiting_rank(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=2)
    waited, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert message.startswith("rank 0 of 2: barrier failed or timed out (dist_timeout_s=3)"), message
    assert float(waited) < 10 * TIMEOUT_S


def test_an_unknown_gradient_sync_is_an_error_naming_it():
    one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="gradient_sync must be one of allreduce, ddp, got 'nccl'"):
        data_parallel(torch.nn.Linear(2, 2), one, gradient_sync="nccl")


def _mismatched_rank_main(rank: int, work: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{work}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    model = torch.nn.Linear(4, 3 if rank == 0 else 5)  # another model on rank 1
    try:
        GradientAllReduce(model, ctx)
        outcome = "no error"
    except ValueError as error:
        outcome = str(error)
    finally:
        dist.destroy_process_group()
    with open(f"{work}/rank{rank}.txt", "w") as f:
        f.write(outcome)


def test_ranks_with_different_models_are_an_error_on_every_rank(tmp_path):
    mp.spawn(_mismatched_rank_main, args=(str(tmp_path),), nprocs=2)
    own_weight = {0: "(3, 4)", 1: "(5, 4)"}
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        expected = f"rank {rank}: the model differs between ranks (('weight', {own_weight[rank]}"
        assert message.startswith(expected), message


class _TwoDtypes(torch.nn.Module):
    """A float32 and a float64 layer (two flat buffers), a channels_last convolution (as a GPU run's backbone),
    and a layer only rank 0's batch uses."""

    def __init__(self):
        super().__init__()
        self.fp32 = torch.nn.Linear(3, 2)
        self.fp64 = torch.nn.Linear(3, 2).double()
        self.conv = torch.nn.Conv2d(3, 4, 2).to(memory_format=torch.channels_last)
        self.rank0_only = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        pixels = x[:, :, None, None] * torch.arange(1.0, 10.0).view(3, 3)
        pixels = pixels.contiguous(memory_format=torch.channels_last)
        out = self.fp32(x).sum() + self.fp64(x.double()).float().sum() + self.conv(pixels).square().sum()
        return out + self.rank0_only(x).pow(2).sum() if rank == 0 else out


def _average_rank_main(rank: int, work: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{work}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    torch.manual_seed(rank)  # other weights on rank 1: the sync starts both from rank 0's
    model = _TwoDtypes()
    sync = GradientAllReduce(model, ctx).sync
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + rank))  # each rank its own batch
    model(x, rank).backward()
    own = {name: p.grad.clone() if p.grad is not None else None for name, p in model.named_parameters()}
    sync()
    torch.save(
        {"own": own, "synced": {name: p.grad for name, p in model.named_parameters()}, "weights": model.state_dict()},
        f"{work}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_gradients_of_two_dtypes_and_layouts_are_averaged_and_an_unused_parameter_counts_as_zero(tmp_path):
    mp.spawn(_average_rank_main, args=(str(tmp_path),), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), f"{name} differs between ranks"
    assert ranks[1]["own"]["rank0_only.weight"] is None  # unused by rank 1's batch
    for name, grad in ranks[0]["synced"].items():
        owns = [r["own"][name] if r["own"][name] is not None else torch.zeros_like(grad) for r in ranks]
        mean = (owns[0] + owns[1]) / 2
        assert grad.dtype == ranks[0]["weights"][name].dtype, name
        assert grad.stride() == ranks[0]["weights"][name].stride(), f"{name}: laid out unlike its parameter"
        for r in ranks:
            torch.testing.assert_close(r["synced"][name], mean, msg=f"{name}")
