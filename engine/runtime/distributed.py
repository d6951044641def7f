"""Process group set-up for torchrun (env://) and the few collectives the trainer needs; the only module that
calls torch.distributed. In a world of one (plain ``python train.py``) every helper is a no-op. A collective that
fails or outlasts ``dist_timeout_s`` raises a CollectiveError naming the rank and the collective instead of hanging
(NCCL's non-blocking all-reduces time out through torch's watchdog instead).
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config.choices import GRADIENT_SYNCS
from engine.errors import CollectiveError, SettingsError
from models.host_copy import to_device_async


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank among world_size processes and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False  # this call created the process group, so it also destroys it
    timeout_s: float = 1800.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_rank() -> int:
    """This process's rank as the launcher set it (0 outside torchrun); readable before init."""
    return int(os.environ.get("RANK", "0"))


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``auto`` picks CUDA when present; under torchrun each process takes GPU ``local_rank``. A GPU this machine
    does not have is a SettingsError naming ``device`` and the fix."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and name != "cuda" and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index >= found:
        has = "no GPU that torch can use" if not found else f"{found} GPU{'s' if found > 1 else ''} (cuda:0..)"
        raise SettingsError(
            f"device={name} (from the command line, or an experiment for GPUs such as experiment=coco_gpu): this "
            f"machine has {has}{f', not {device}' if found else ''}. Set device=cpu, or device=auto (the GPU where "
            f"there is one, else the CPU)"
        )
    return device


def init_distributed(*, device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes (env://; NCCL on CUDA, gloo on CPU), or return a world of one.
    Safe to call when a group already exists (tests make their own)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # not launched by torchrun
        return DistContext(rank=0, world_size=1, local_rank=0, device=resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank=local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        owns_group=owns_group,
        timeout_s=timeout_s,
    )


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _collective(name: str, ctx: DistContext, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as error:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise CollectiveError(
            f"rank {ctx.rank} of {ctx.world_size}: {name} failed or timed out (dist_timeout_s={ctx.timeout_s:g}); "
            f"another rank stopped, crashed or fell behind: look for its error above. ({error})"
        ) from error


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        _collective("barrier", ctx, dist.barrier)


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    _collective("broadcast_object", ctx, dist.broadcast_object_list, box, src=0)
    return box[0]


def all_gather_object(obj, ctx: DistContext) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    parts: list = [None] * ctx.world_size
    _collective("all_gather_object", ctx, dist.all_gather_object, parts, obj)
    return parts


def all_reduce_mean(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Mean of ``t`` over ranks (a NaN on any rank makes the mean NaN on all of them)."""
    if not ctx.distributed:
        return t
    return start_all_reduce_mean(t.clone(), ctx)()


def any_process(flag: bool, ctx: DistContext) -> bool:
    """Whether ``flag`` is true on any rank (the same answer on every rank)."""
    if not ctx.distributed:
        return flag
    return all_reduce_mean(torch.tensor([float(flag)], device=ctx.device), ctx).item() > 0


def start_all_reduce_mean(t: torch.Tensor, ctx: DistContext) -> Callable[[], torch.Tensor]:
    """Start the mean of ``t`` over ranks, summing into ``t`` itself; returns a function that gives the mean.
    On NCCL that function makes the caller's stream wait, not the host (gloo's blocks the host)."""
    if not ctx.distributed:
        return lambda: t
    work = _collective("all_reduce", ctx, dist.all_reduce, t, op=dist.ReduceOp.SUM, async_op=True)

    def mean() -> torch.Tensor:
        _collective("all_reduce", ctx, work.wait)
        return t / ctx.world_size

    return mean


@dataclass(frozen=True)
class Ranks:
    """The exchange the COCO evaluator needs (datasets.evaluation.RankExchange) over this run's ranks."""

    ctx: DistContext

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def all_gather_object(self, obj) -> list:
        return all_gather_object(obj, self.ctx)

    def broadcast_object(self, obj):
        return broadcast_object(obj, self.ctx)


def data_parallel(
    model: torch.nn.Module, ctx: DistContext, *, gradient_sync: str = "allreduce", find_unused_parameters: bool = False
) -> tuple[torch.nn.Module, Callable[[], None] | None]:
    """(module to train, what to call after backward): engine.train.step.OptimizerStep's ``model`` and
    ``sync_gradients``. allreduce: (``model``, GradientAllReduce(model).sync); ddp: (``model`` in
    DistributedDataParallel, None); a world of one: (``model``, None).

    DDP's gradients are views of its buckets (no copy per parameter) and its buffers are synced at construction
    only: they are never updated, and a broadcast per forward would cost a collective per step and void the frozen
    batch norm's cached affine (models.frozen_batch_norm). Older torch lacks forward_sync_buffers; its
    broadcast_buffers=False skips the construction sync too, harmless as every rank loads the same statistics."""
    if gradient_sync not in GRADIENT_SYNCS:
        raise ValueError(f"gradient_sync must be one of {', '.join(GRADIENT_SYNCS)}, got {gradient_sync!r}")
    if not ctx.distributed:
        return model, None
    if gradient_sync == "allreduce":
        return model, GradientAllReduce(model, ctx).sync
    from torch._dynamo import config as dynamo_config
    from torch.nn.parallel import DistributedDataParallel

    # Dynamo would cut compiled graphs at DDP's bucket ends; the per-layer graphs are smaller than a bucket, so the
    # cuts would only add CUDA-graph replays. Read when a graph is compiled.
    dynamo_config.optimize_ddp = False
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,
        **({"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}),
    )
    return ddp, None


class GradientAllReduce:
    """Data parallelism without DDP's per-parameter hooks, which put host work on a host-bound step's critical
    path: ``sync()`` after backward averages every gradient in one all-reduce per dtype over a flat buffer and
    hands them back as views of it (a no-op in a world of one); parameters and buffers start as rank 0's. A missing
    gradient counts as zero, so every rank runs the same collective, and one unused everywhere still decays."""

    def __init__(self, model: torch.nn.Module, ctx: DistContext):
        self.ctx = ctx
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for name, p in named:  # the gradients become views of one flat buffer, each laid out as its parameter
            if not _dense(p):
                raise ValueError(
                    f"gradient_sync=allreduce needs parameters that fill their memory (contiguous in "
                    f"some order of their dimensions); {name} does not (use gradient_sync=ddp)"
                )
        self._groups = list(_by_dtype(p for _, p in named).values())
        if ctx.distributed:
            _check_same_layout(model, ctx)
            with torch.no_grad():
                for group in _by_dtype([*model.parameters(), *model.buffers()]).values():
                    flat = torch.cat([_in_memory_order(t.detach()) for t in group])
                    _collective("broadcast of the initial parameters", ctx, dist.broadcast, flat, src=0)
                    torch._foreach_copy_(group, _views(flat, group))

    @torch.no_grad()
    def sync(self) -> None:
        if not self.ctx.distributed:
            return
        for group in self._groups:
            flat = torch.cat([_in_memory_order(_laid_out_as(p.grad, p)) for p in group])
            # Divided before the sum, as DDP does: no half-precision overflow, and gloo has no AVG.
            flat.div_(self.ctx.world_size)
            _collective("gradient all_reduce", self.ctx, dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            for p, grad in zip(group, _views(flat, group)):
                p.grad = grad


def _check_same_layout(model: torch.nn.Module, ctx: DistContext) -> None:
    """ValueError unless every rank holds the same parameters and buffers (order, shapes, dtypes, strides): the
    flat collectives would otherwise pair unrelated values, or on NCCL wait forever."""
    layout = [
        (name, tuple(t.shape), str(t.dtype), t.stride())
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    for rank, other in enumerate(all_gather_object(layout, ctx)):
        if other != layout:
            first = next(
                (f"{mine} here, {theirs} on rank {rank}" for mine, theirs in zip(layout, other) if mine != theirs),
                f"{len(layout)} tensors here, {len(other)} on rank {rank}",
            )
            raise ValueError(
                f"rank {ctx.rank}: the model differs between ranks ({first}); every process must build the same model"
            )


def _by_dtype(tensors) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills numel() consecutive places of its storage in some order of its dims (as channels_last)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension: a dense ``t`` in the order it sits in memory (a view), any other in index order."""
    if not t.is_contiguous() and _dense(t):
        return t.as_strided((t.numel(),), (1,))
    return t.reshape(-1)


def _laid_out_as(grad: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """``grad`` (zeros when None) with the strides of its parameter ``p``, which the flat buffer's views take."""
    if grad is None:
        return torch.zeros_like(p)
    return grad if grad.stride() == p.stride() else torch.empty_like(p).copy_(grad)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped and laid out as ``like``'s (dense), in order (views, no copy)."""
    return [
        piece.as_strided(t.shape, t.stride()) if _dense(t) else piece.view(t.shape)
        for piece, t in zip(flat.split([t.numel() for t in like]), like)
    ]


def average_over_processes(value: float, ctx: DistContext) -> Callable[[], float | torch.Tensor]:
    """Start the mean over ranks of a per-process number (the criterion's target box count); returns a function
    giving it, at least 1, as a device tensor (a float in a world of one). Started before the forward, so the
    matching's host sync waits for this rank's forward only, not for every rank."""
    if not ctx.distributed:
        return lambda: max(1.0, value)
    count = to_device_async(torch.tensor([value], dtype=torch.float32), ctx.device)  # nothing waits for the GPU
    mean = start_all_reduce_mean(count, ctx)  # the fresh copy is summed in place: no clone
    return lambda: mean().clamp(min=1.0)[0]


def argv_for_rank(argv: list[str], rank: int) -> list[str]:
    """Hydra command line for this process. Ranks would each make a directory named after their start time, so
    ranks > 0 run Hydra in the working directory without .hydra/ or a log file, and take rank 0's directory by
    broadcast later (``train.resolve_output_dir``)."""
    if rank == 0:
        return list(argv)
    own = ("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=", "hydra.job_logging=")
    kept = [a for a in argv[1:] if not a.lstrip("+~").startswith(own)]
    return [argv[0], *kept, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none"]
