"""CUDA graphs of the eager model, nothing compiled (``compile.mode=graphs``, and ``auto``'s choice for short runs on
a GPU): one launch replays a host-bound step's thousands of small eager kernels. The matching (it reads its costs on
the host) and the optimizer stay eager.

The model's graphs share one memory pool, so a caller must be done with a replay's outputs before the next call; the
criterion's replay between the model's forward and backward, so each has a pool of its own. Capture needs a model
that neither reads back from the GPU nor copies from the host, and autocast without its weight cache, which would
freeze the weights seen at recording. A training recording lets go of its autograd graph, whose gradient accumulators
would otherwise meet the step's backward on another stream (PyTorch's AccumulateGrad stream warning). A backward
replay's gradients are copies: a parameter may keep its ``.grad``, which the next replay would overwrite."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .clock import CAPTURE_PREFIX, CompileClock

log = logging.getLogger(__name__)

# Sizes recorded per method (each keeps its memory); later sizes run eagerly. Size buckets keep a run to a few.
MAX_SIZES = 32
# No size is recorded once this share of the GPU's memory is taken: the rest is for the eager steps of later sizes.
GRAPH_MEMORY_SHARE = 0.5
# Eager calls before recording: a size's first call autotunes and loads kernels, which must not be recorded.
WARMUP_CALLS = 2
# Another thread's CUDA calls (the loader's pin-memory thread) must not void a recording: check only this thread's.
CAPTURE_ERROR_MODE = "thread_local"
_capture_streams: dict[int, torch.cuda.Stream] = {}


def warmed_up_stream(call) -> torch.cuda.Stream:
    """The device's capture stream after WARMUP_CALLS of ``call()`` on it. One for every recording: the allocator
    reuses a pool's free blocks only on the stream that made them, so sizes on different streams could not share."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream()
    stream = _capture_streams[device]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    return stream


class _FlatOutputs(nn.Module):
    """One method of ``owner`` returning a flat tuple of tensors; its parameters (the owner's) get the gradients."""

    def __init__(self, owner: nn.Module, method):
        super().__init__()
        self.owner, self.method, self.spec = owner, method, None

    def forward(self, *args: torch.Tensor):
        flat, self.spec = tree_flatten(self.method(self.owner, *args))
        return tuple(flat)


class GraphedMethod:
    """``method`` (the class's function) of ``owner`` replayed as CUDA graphs in ``pool``, one recording per size (the
    arguments' shapes, dtypes and requires_grad, and autocast): forward and backward for training calls (``backward``),
    else forward only for calls without gradients. Other calls, and those with a non-tensor argument, run eagerly."""

    def __init__(self, owner: nn.Module, method, *, backward: bool, pool):
        self.owner, self.method, self.backward, self.pool = owner, method, backward, pool
        self.name = CAPTURE_PREFIX + method.__name__  # apart from the Dynamo-compiled functions of that name
        self._trains_parameters = any(p.requires_grad for p in owner.parameters())
        self._graphs: dict[tuple, object] = {}
        self._told_full = False

    def __call__(self, *args):
        if not self._applies(args):
            return self.method(self.owner, *args)
        key = (
            tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
        )
        replay = self._graphs.get(key)
        if replay is None:
            if full := self._full(args[0].device):
                if not self._told_full:
                    self._told_full = True
                    log.warning(
                        "%s: %s; new sizes run eagerly (fewer dataset.size_buckets, or a smaller "
                        "batch_size, let every size be recorded)",
                        self.name,
                        full,
                    )
                return self.method(self.owner, *args)
            replay = self._graphs[key] = self._record(args)
        return replay(*args)

    def _full(self, device: torch.device) -> str | None:
        """Why no further size may be recorded (each keeps its memory for the run), or None."""
        if len(self._graphs) >= MAX_SIZES:
            return f"{MAX_SIZES} sizes recorded as CUDA graphs, the most kept"
        total = torch.cuda.get_device_properties(device).total_memory
        if torch.cuda.memory_reserved(device) > GRAPH_MEMORY_SHARE * total:
            return (
                f"{torch.cuda.memory_reserved(device) / 2**30:.0f} of the GPU's {total / 2**30:.0f} GiB are "
                f"taken, more than {GRAPH_MEMORY_SHARE:.0%}"
            )
        return None

    def _applies(self, args) -> bool:
        if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return False
        if self.backward:
            return (
                torch.is_grad_enabled()
                and self.owner.training
                and (self._trains_parameters or any(a.requires_grad for a in args))
            )
        return not torch.is_grad_enabled()

    def _record(self, args: tuple):
        if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
            raise RuntimeError(
                "CUDA graphs need autocast without its weight cache (torch.autocast(..., "
                "cache_enabled=False), as engine.runtime.precision.Precision.autocast does)"
            )
        started = time.perf_counter()
        flat = _FlatOutputs(self.owner, self.method)
        # The graphs' own inputs, leaves: recording must not reach the autograd graph the arguments came from.
        static = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        replay = (
            _TrainingRecording(flat, static, pool=self.pool) if self.backward else self._record_inference(flat, static)
        )
        torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - started
        CompileClock.get().record_capture(self.name, seconds)
        log.info(
            "%s: recorded the CUDA graphs of size %s in %.1f s",
            self.name,
            " ".join("x".join(map(str, a.shape)) or "1" for a in args),
            seconds,
        )
        return replay

    def _record_inference(self, flat: _FlatOutputs, static: tuple):
        stream = warmed_up_stream(lambda: flat(*static))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
            outputs = flat(*static)

        def replay(*args):
            for into, value in zip(static, args):
                into.copy_(value)
            graph.replay()
            return tree_unflatten(list(outputs), flat.spec)

        return replay


class _TrainingRecording:
    """The forward and backward graphs of ``flat`` at the size of ``static`` (its inputs, leaves), and the buffers
    they read and write; called, a replay inside the caller's autograd graph."""

    def __init__(self, flat: _FlatOutputs, static: tuple, *, pool):
        self.flat, self.static = flat, static
        self.params = tuple(p for p in flat.parameters() if p.requires_grad)
        surface = [a for a in static if a.requires_grad] + list(self.params)  # what gradients are taken for

        def warm_up():  # the backward too: its first calls autotune and load kernels as well
            outputs = [o for o in flat(*static) if o.requires_grad]
            torch.autograd.grad(
                outputs, surface, grad_outputs=[torch.empty_like(o) for o in outputs], allow_unused=True
            )

        stream = warmed_up_stream(warm_up)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
            outputs = flat(*static)
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
        with torch.cuda.graph(self.backward_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
            grads = torch.autograd.grad(
                [o for o in outputs if o.requires_grad],
                surface,
                grad_outputs=[g for g in self.grad_outputs if g is not None],
                allow_unused=True,
            )
        self.outputs = tuple(o.detach() for o in outputs)  # the recording's autograd graph goes with ``outputs``
        given = iter(grads)
        # One gradient buffer (or None) per input of _Replay after the recording: the arguments, then parameters.
        self.grads = tuple(next(given) if a.requires_grad else None for a in static) + tuple(given)

    def __call__(self, *args):
        return tree_unflatten(list(_Replay.apply(self, *args, *self.params)), self.flat.spec)


class _Replay(torch.autograd.Function):
    """A training recording replayed inside a step's autograd graph: ``apply(recording, *args, *parameters)``."""

    @staticmethod
    def forward(ctx, recording: _TrainingRecording, *inputs):
        ctx.recording = recording
        for into, value in zip(recording.static, inputs):  # the arguments; parameters are passed for autograd only
            if into.data_ptr() != value.data_ptr():
                into.copy_(value)
        recording.forward_graph.replay()
        return tuple(o.detach() for o in recording.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        recording = ctx.recording
        for into, value in zip(recording.grad_outputs, grad_outputs):
            if into is not None and value is not None:
                into.copy_(value)
        recording.backward_graph.replay()
        return (None, *(g.clone() if g is not None else None for g in recording.grads))


def graph_regions(owner: nn.Module, regions, *, pool_per_region: bool) -> None:
    """Replay ``regions`` of ``owner`` (its ``compile_regions(graphs=True)``) as CUDA graphs through ``use_compiled``,
    all in one new memory pool or, ``pool_per_region`` (regions whose replays interleave), each in a new pool."""
    shared = torch.cuda.graph_pool_handle()
    for region in regions:
        method = getattr(type(owner), region.name)
        pool = torch.cuda.graph_pool_handle() if pool_per_region else shared
        owner.use_compiled(region.name, GraphedMethod(owner, method, backward=region.training, pool=pool))
