"""Process group set-up for torchrun (env://) and the few collectives the trainer needs.

The only module that calls torch.distributed: the criterion takes num_boxes from the step, the data
loader takes rank and world size, and the COCO evaluator exchanges detections through ``Ranks``.
A plain ``python train.py`` is a world of one: every helper here then degrades to a no-op, so the
trainer has a single code path for one and many processes.

Every collective has a timeout (``dist_timeout_s``, set when the group is made): a rank that stops or
falls behind turns the others' wait into an error naming the rank that waited and the collective,
instead of a hang. (On NCCL the gradient all-reduce does not block the host, and with gradient_sync=ddp it
runs inside backward: there the same timeout ends the run through torch's watchdog, whose message starts
with the rank.)
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
from engine.errors import CollectiveError
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


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    """This process's rank as the launcher set it (0 outside torchrun); readable before init."""
    return int(os.environ.get("RANK", "0"))


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``auto`` picks CUDA when present; under torchrun each process takes GPU ``local_rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda was asked for but torch.cuda.is_available() is False; use device=cpu")
        return torch.device("cuda", local_rank)
    if name != "cpu" and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return torch.device(name)


def init_distributed(*, device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes (env://), or return a world of one.

    NCCL on CUDA, gloo on CPU. Safe to call when a group already exists (tests spawn their own).
    """
    if not launched_by_torchrun():
        return DistContext(rank=0, world_size=1, local_rank=0, device=resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank=local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                       owns_group=owns_group, timeout_s=timeout_s)


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _collective(name: str, ctx: DistContext, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as error:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise CollectiveError(
            f"rank {ctx.rank} of {ctx.world_size}: {name} failed or timed out (dist_timeout_s={ctx.timeout_s:g}); "
            f"another rank stopped, crashed or fell behind: look for its error above. ({error})") from error


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
    """Starts the mean of ``t`` over ranks, summing into ``t`` itself; returns a function that gives the mean.

    On NCCL the sum runs on the collectives' stream from this call on, and the function makes the caller's
    stream wait for it: the GPU waits, not the host (gloo's wait blocks the host).
    """
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


def data_parallel(model: torch.nn.Module, ctx: DistContext, *, gradient_sync: str = "allreduce",
                  find_unused_parameters: bool = False) -> tuple[torch.nn.Module, Callable[[], None] | None]:
    """(the module to train, what to call after backward) for ``model`` on this run's processes: the pair
    engine.train.step.OptimizerStep takes as ``model`` and ``sync_gradients``.

    gradient_sync  allreduce: ``model`` itself and GradientAllReduce(model).sync (one all-reduce after
                   backward); ddp: ``model`` in DistributedDataParallel, which syncs during backward, and None.
    A world of one: ``model`` and None.
    """
    if gradient_sync not in GRADIENT_SYNCS:
        raise ValueError(f"gradient_sync must be one of {', '.join(GRADIENT_SYNCS)}, got {gradient_sync!r}")
    if not ctx.distributed:
        return model, None
    if gradient_sync == "allreduce":
        return model, GradientAllReduce(model, ctx).sync
    return distributed_data_parallel(model, ctx, find_unused_parameters=find_unused_parameters), None


def distributed_data_parallel(model: torch.nn.Module, ctx: DistContext, *, find_unused_parameters: bool = False):
    """``model`` in DistributedDataParallel.

    Gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view): no copy of every
    gradient into its bucket after backward, which on a host-bound step is one launch per parameter.
    Buffers are synced once, when DDP is built, and not broadcast before every forward: the model's only
    buffers are the backbone's frozen batch-norm statistics and the input's normalization constants, never
    updated, and a broadcast would cost a collective per step and void the former's cached affine
    (models.frozen_batch_norm).
    """
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel

    # Inside DDP, Dynamo cuts each compiled graph where DDP's buckets would end, so that a piece's all-reduce can
    # start during the graph's backward. engine.compile's per-layer graphs are smaller than a bucket: the cuts would
    # double the CUDA-graph replays and their host cost, while DDP's hooks already start each bucket's all-reduce
    # between layers. Read when a graph is compiled, at the first step.
    torch._dynamo.config.optimize_ddp = False

    return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                   find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=True,
                                   **_no_forward_buffer_sync(DistributedDataParallel))


class GradientAllReduce:
    """Data parallelism without DDP's hooks: ``sync()`` after backward averages every gradient over the ranks in
    one all-reduce per dtype, and the parameters and buffers start as rank 0's (as DDP's constructor makes them).

    Why not DistributedDataParallel: its reducer runs a hook per parameter inside backward (mark ready, copy
    into the bucket, launch the bucket's all-reduce when full). On a host-bound step that per-parameter host
    work lands on the critical path; a 2-GPU CUDA-graph step's trace showed 298 AccumulateGrad nodes at about
    37 us each under DDP. Here the gradients are gathered into one flat buffer (a few batched copy kernels),
    averaged by one collective on NCCL's stream (the host does not wait for it) and handed back as views of
    that buffer. What is given up is overlapping the all-reduce with backward: about 160 MB over NVLink.

    A parameter with no gradient on a rank (not used by its batch) counts as a zero gradient there, so every
    rank's buffer has the same layout and the same collective: after the sync it has the mean, as with DDP's
    find_unused_parameters=True. One unused on every rank ends with a zero gradient rather than none, so AdamW
    still decays it; every variant of the model uses all of its parameters. A world of one: ``sync()`` does
    nothing.
    """

    def __init__(self, model: torch.nn.Module, ctx: DistContext):
        self.ctx = ctx
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for name, p in named:  # the gradients become views of one flat buffer, each laid out as its parameter
            if not _dense(p):
                raise ValueError(f"gradient_sync=allreduce needs parameters that fill their memory (contiguous in "
                                 f"some order of their dimensions); {name} does not (use gradient_sync=ddp)")
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
            # Divided before the sum, as DDP does (no overflow in a half-precision sum); gloo has no AVG. On NCCL
            # the caller's stream waits for the sum; the host does not.
            flat.div_(self.ctx.world_size)
            _collective("gradient all_reduce", self.ctx, dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            for p, grad in zip(group, _views(flat, group)):
                p.grad = grad


def _check_same_layout(model: torch.nn.Module, ctx: DistContext) -> None:
    """Every rank must hold the same parameters and buffers, in the same order, shapes, dtypes and layouts: the flat
    collectives would otherwise pair up unrelated values (or, on NCCL, wait forever for a longer buffer)."""
    # Strides too: the flat buffers hold each tensor in its memory order.
    layout = [(name, tuple(t.shape), str(t.dtype), t.stride())
              for name, t in [*model.named_parameters(), *model.named_buffers()]]
    for rank, other in enumerate(all_gather_object(layout, ctx)):
        if other != layout:
            first = next((f"{mine} here, {theirs} on rank {rank}" for mine, theirs in zip(layout, other)
                          if mine != theirs), f"{len(layout)} tensors here, {len(other)} on rank {rank}")
            raise ValueError(f"rank {ctx.rank}: the model differs between ranks ({first}); every process must "
                             "build the same model")


def _by_dtype(tensors) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill numel() consecutive places of its storage, in some order of its dimensions
    (contiguous, channels_last, ...)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense ``t``'s elements as one dimension, in the order they sit in memory (a view; a copy if not dense)."""
    if t.is_contiguous():
        return t.reshape(-1)
    if not _dense(t):
        t = t.contiguous()
    return t.as_strided((t.numel(),), (1,))


def _laid_out_as(grad: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """``grad`` (zeros when None) with the strides of its parameter ``p``, which the flat buffer's views take."""
    if grad is None:
        return torch.zeros_like(p)
    return grad if grad.stride() == p.stride() else torch.empty_like(p).copy_(grad)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped and laid out as ``like``'s (dense), in order (views, no copy)."""
    return [piece.as_strided(t.shape, t.stride()) if _dense(t) else piece.view(t.shape)
            for piece, t in zip(flat.split([t.numel() for t in like]), like)]


def _no_forward_buffer_sync(ddp_class) -> dict:
    """DDP's argument for "sync buffers at construction only". Newer torch names it forward_sync_buffers and
    deprecates broadcast_buffers; older torch has only broadcast_buffers=False, which also skips the sync at
    construction (harmless here: every rank loads the same statistics)."""
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def average_over_processes(value: float, ctx: DistContext) -> Callable[[], float | torch.Tensor]:
    """Starts the mean of a per-process number over ranks; returns a function that gives it, at least 1, as a
    device tensor (no host read).

    The criterion divides every loss by the number of target boxes averaged this way, as the original.
    A world of one gives a float. The step starts it before the forward and the criterion asks for the value
    after the matching, so on NCCL the matching's host sync waits for this rank's forward only, not for every
    rank to have reached its losses (each such meeting point costs the slowest rank's delay); see
    start_all_reduce_mean.
    """
    if not ctx.distributed:
        return lambda: max(1.0, value)
    count = to_device_async(torch.tensor([value], dtype=torch.float32), ctx.device)  # nothing waits for the GPU
    mean = start_all_reduce_mean(count, ctx)  # the fresh copy is summed in place: no clone
    return lambda: mean().clamp(min=1.0)[0]


def argv_for_rank(argv: list[str], rank: int) -> list[str]:
    """Hydra command line for this process.

    Hydra names the run directory after the clock at start-up, and torchrun's processes do not start in the
    same second, so each would make its own directory. Only rank 0 keeps Hydra's directory; the others point
    Hydra at the working directory with no ``.hydra/`` and no log file, and take rank 0's directory by
    broadcast once the process group exists (see ``train.resolve_output_dir``).
    """
    if rank == 0:
        return list(argv)
    own = ("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=", "hydra.job_logging=")
    kept = [a for a in argv[1:] if not a.lstrip("+~").startswith(own)]
    return [argv[0], *kept, "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none"]
