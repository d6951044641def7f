"""CUDA graphs of the eager model, nothing compiled: ``compile.mode=graphs``, and ``auto``'s choice on a GPU for
runs too short to repay Inductor's compilation (engine/compile.py).

The eager step is host-bound: Python issues thousands of small kernels per step while the GPU waits. A CUDA
graph records one step's kernels once and replays them with one launch, so the GPU runs the same eager
kernels back to back. Recording a size takes a few eager steps and about a second, where Inductor's first
compilation takes minutes.

What is recorded, per input size (batch, height, width) and precision:
- training: ``forward`` (backbone, transformer, heads), its forward and its backward, through
  ``torch.cuda.make_graphed_callables``. The Hungarian matching, the losses and the optimizer stay eager: the
  matching reads its cost matrices on the host.
- evaluation: ``detect`` as one forward graph.

All graphs share one memory pool. That is safe because every replay's outputs are used up before the next
replay starts (the step turns them into losses and gradients, evaluation into detections on the host): a
graph's outputs live in memory another size's replay may write. A caller must not keep a replay's outputs
past the next call. Capture needs a model that reads nothing back from the GPU and copies nothing from the
host while it runs (models/deformable_attention.py keeps its level sizes on the device) and autocast without
its weight cache (engine/precision.py): a cached cast would freeze the weights a graph saw when it was
recorded.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .compile_log import CAPTURE_PREFIX, CompileClock

log = logging.getLogger(__name__)

# Sizes recorded per method; a size past them runs eagerly (logged once). Size buckets keep a run to a few
# (datasets/size_buckets.py); with buckets off every image size would record graphs and keep their memory.
MAX_SIZES = 32
# Eager runs before recording: the first call of a size autotunes and loads kernels, which must not happen in
# the recording.
WARMUP_CALLS = 2


class _FlatOutputs(nn.Module):
    """One method of ``model`` as a module returning a flat tuple of tensors, what capture takes; its parameters
    are the model's, so that the backward graph produces their gradients."""

    def __init__(self, model: nn.Module, method):
        super().__init__()
        self.model = model
        self.method = method
        self.spec = None

    def forward(self, images: torch.Tensor, mask: torch.Tensor):
        flat, self.spec = tree_flatten(self.method(self.model, images, mask))
        return tuple(flat)


class GraphedMethod:
    """``method`` of ``model`` (the class's function, e.g. ``DeformableDETR.forward``) replayed as CUDA graphs,
    one recording per input size.

    backward  True: forward and backward recorded (training; called with gradients on and the model training,
              else it runs eagerly); False: a forward graph, for calls without gradients
    pool      the memory pool every graph of the model shares (module docstring)
    """

    def __init__(self, model: nn.Module, method, *, backward: bool, pool):
        self.model, self.method, self.backward, self.pool = model, method, backward, pool
        self.name = CAPTURE_PREFIX + method.__name__  # apart from the Dynamo-compiled functions of that name
        self._graphs: dict[tuple, object] = {}
        self._told_full = False

    def __call__(self, images: torch.Tensor, mask: torch.Tensor | None = None):
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        if not self._applies(images):
            return self.method(self.model, images, mask)
        key = (tuple(images.shape), images.dtype, tuple(mask.shape), torch.is_autocast_enabled("cuda"),
               torch.get_autocast_dtype("cuda"))
        replay = self._graphs.get(key)
        if replay is None:
            if len(self._graphs) >= MAX_SIZES:
                if not self._told_full:
                    self._told_full = True
                    log.warning("%s: %d sizes recorded as CUDA graphs, the most kept; new sizes run eagerly "
                                "(dataset.size_buckets bounds the sizes a run meets)", self.name, MAX_SIZES)
                return self.method(self.model, images, mask)
            replay = self._graphs[key] = self._record(images, mask)
        return replay(images, mask)

    def _applies(self, images: torch.Tensor) -> bool:
        if not images.is_cuda:
            return False
        if self.backward:
            return torch.is_grad_enabled() and self.model.training
        return not torch.is_grad_enabled()

    def _record(self, images: torch.Tensor, mask: torch.Tensor):
        if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
            raise RuntimeError("CUDA graphs need autocast without its weight cache (torch.autocast(..., "
                               "cache_enabled=False), as engine.precision.Precision.autocast does)")
        started = time.perf_counter()
        flat = _FlatOutputs(self.model, self.method)
        static = (images.clone(), mask.clone())
        replay = self._record_training(flat, static) if self.backward else self._record_inference(flat, static)
        torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - started
        CompileClock.get().record_capture(self.name, seconds)
        log.info("%s: recorded the CUDA graphs of size %s in %.1f s", self.name, "x".join(map(str, images.shape)),
                 seconds)
        return replay

    def _record_training(self, flat: _FlatOutputs, static: tuple):
        graphed = torch.cuda.make_graphed_callables(flat, static, num_warmup_iters=WARMUP_CALLS,
                                                    allow_unused_input=True, pool=self.pool)

        def replay(images, mask):
            return tree_unflatten(list(graphed(images, mask)), flat.spec)

        return replay

    def _record_inference(self, flat: _FlatOutputs, static: tuple):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                flat(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = flat(*static)

        def replay(images, mask):
            static[0].copy_(images)
            static[1].copy_(mask)
            graph.replay()
            return tree_unflatten(list(outputs), flat.spec)

        return replay


def graph_model(model: nn.Module, *, evaluation: bool = True) -> nn.Module:
    """Replay the regions ``model`` declares for recording (``compile_regions(graphs=True)``: its training ``forward``
    and, with ``evaluation``, its ``detect``) as CUDA graphs, in place (per instance, through ``use_compiled``:
    parameters, state_dict keys and checkpoints are unchanged); returns the model."""
    pool = torch.cuda.graph_pool_handle()
    for region in model.compile_regions(graphs=True, evaluation=evaluation):
        method = getattr(type(model), region.name)
        model.use_compiled(region.name, GraphedMethod(model, method, backward=region.training, pool=pool))
    return model
