"""``compile=true``: the transformer and the heads through torch.compile, for training and evaluation.

``compile_regions=transformer`` (the default) compiles ``DeformableDETR.predict`` (the encoder, the decoder,
the glue between their layers and the heads) as one graph, and the position encoding as a second. That is
where the step's thousands of small launches are (attention projections, softmax, layer norms, feed-forward,
the deformable attention op itself, which is a registered operator and traced with no break), and one graph
means few compiled calls per step, each of which costs the host time. Regional compilation
(``compile_regions=layers``) compiles each encoder and decoder layer in place (``nn.Module.compile``), layers
of one kind sharing one graph, and the heads of all decoder layers (``DeformableDETR.heads``) as one more:
about a third of the warm-up, more host time per step. The ResNet backbone stays eager unless
``compile_backbone=static`` (BACKBONE_CHOICES below): compiled, it is one graph per image size, since its
stride-2 size arithmetic would make a graph with symbolic sizes specialize on the parity of the image size.

Dynamic shapes from the first call: the COCO recipe feeds a different padded image size almost every
batch (short side 480-800, long side up to 1333), and a graph with symbolic sizes serves them all (but for a
guard Inductor may add on a size, for a fusion decision: one recompilation of the transformer's graph was
seen on the COCO sizes).
Recompilations are logged (torch's "recompiles" log), so a shape that does force one shows in train.log.
Module names and state_dict keys are unchanged: checkpoints of a compiled run load anywhere.

In training the losses after the Hungarian matching are compiled too (``SetCriterion.stacked_losses``),
always without CUDA graphs: the number of matched pairs changes with every batch.

``compile_mode=reduce-overhead`` replays the compiled regions' kernels as CUDA graphs (Inductor's CUDA-graph trees),
which takes their launch cost off the host. A size is run once, recorded at its second step and replayed
from its third, so this mode pays with few sizes: fixed-size batches, or the COCO recipe padded to
``dataset.pad_to_multiple=128`` (24 sizes in an epoch). Each model call starts a new step of the graph
trees (a forward pre-hook), so a step's outputs stay valid until the next call.
"""

from __future__ import annotations

import logging

import torch
import torch._dynamo.config
import torch._inductor.config  # noqa: F401  (hasattr below)
import torch.fx.experimental._config  # noqa: F401  (use_duck_shape, set below)

log = logging.getLogger(__name__)


# Inductor's modes that this setting offers: plain kernels, or the same kernels replayed as CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead")


# What compiled modes do with ``DeformableDETR.features`` (the ResNet, the input projections, the masks and the
# position encoding): "eager", train.py's default; "static", one graph per image size (and batch size), in the run's
# mode, so with compile_mode=reduce-overhead the backbone is replayed as CUDA graphs too: its few hundred launches
# forward and backward were most of the host time the step still spent while the GPU waited. Each new size costs
# a compilation of the backbone (tens of seconds on the H200) and, with CUDA graphs, a recording: it pays where
# sizes repeat, fixed-size batches or dataset.pad_to_multiple=128 (24 sizes in a COCO epoch); or "dynamic", an
# experiment of the benches: one graph with symbolic sizes, never replayed as CUDA graphs (with dynamic shapes
# and CUDA graphs the compiled backbone killed the process on the H200 in its first step, in both trials made).
# "dynamic" left the GPU's kernel time as it was and the step within its spread between runs
# (bench/results/e2e_h200.md), and torch 2.11's max-pool guards on the parity of its input size.
BACKBONE_CHOICES = ("eager", "static", "dynamic")
# Those a run may choose (compile_backbone in configs/train.yaml).
TRAIN_BACKBONE_CHOICES = ("eager", "static")
# Graphs Dynamo keeps per compiled function before it falls back to eager ones (its recompile limit), raised for
# "static", whose graphs are one per image size: the COCO recipe padded to 128 meets 24 sizes in training, and
# evaluation (no gradients, so graphs of its own) and a smaller last batch add their own sizes. Process-wide: the
# limit of the other compiled regions rises with it (they compile once or twice per run).
STATIC_BACKBONE_GRAPHS = 64
# The name of Dynamo's recompile limit in this torch (renamed from cache_size_limit).
RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

# What one compiled graph spans: "layers", each encoder and decoder layer (layers of one kind share a graph) and
# the heads; or "transformer", the whole of ``DeformableDETR.predict`` (the encoder, the decoder, the glue
# between their layers and the heads) and the position encoding. Fewer graphs mean fewer calls through
# Dynamo's guards, AOTAutograd's wrappers and, with CUDA graphs, the graph trees' input copies: each costs the
# host a few hundred microseconds per call, forward and backward, while the GPU waits.
REGION_CHOICES = ("layers", "transformer")
# train.py's (compile_regions): the faster step. Its price is the first step's compilation, about three times
# the per-layer graphs' (bench/results/e2e_h200.md).
DEFAULT_REGIONS = "transformer"


def compile_regions(model: torch.nn.Module, *, criterion: torch.nn.Module | None = None, backend="inductor",
                    mode: str = "default", backbone: str = "eager", regions: str = DEFAULT_REGIONS) -> torch.nn.Module:
    """Compile ``model``'s (a DeformableDETR) transformer and heads in place, as ``regions`` says; returns it.

    criterion  a SetCriterion whose losses after the matching are compiled too (training), in the default
               mode whatever ``mode`` says: their sizes follow the matched pairs, new in every batch, and
               a CUDA graph would be recorded for each
    backend    "inductor", another torch.compile backend's name, or a backend callable (tests)
    mode       one of COMPILE_MODES; a mode other than "default" needs the inductor backend
    backbone   one of BACKBONE_CHOICES (see there)
    regions    one of REGION_CHOICES (see there)
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode != "default" and backend != "inductor":
        raise ValueError(f"compile mode {mode!r} needs the inductor backend, got backend {backend!r}")
    if backbone not in BACKBONE_CHOICES:
        raise ValueError(f"backbone must be one of {BACKBONE_CHOICES}, got {backbone!r}")
    if regions not in REGION_CHOICES:
        raise ValueError(f"regions must be one of {REGION_CHOICES}, got {regions!r}")
    torch._logging.set_logs(recompiles=True)
    if mode == "reduce-overhead":
        model.register_forward_pre_hook(_new_cuda_graph_step)
    options = dict(dynamic=True, backend=backend, **({"mode": str(mode)} if mode != "default" else {}))
    if regions == "layers":
        for layer in (*model.transformer.encoder.layers, *model.transformer.decoder.layers):
            layer.compile(**options)
        # The prediction heads of all decoder layers: a few hundred small launches forward and backward, one
        # graph. An instance attribute over the method, so parameters and state_dict keys stay where they are.
        model.heads = torch.compile(model.heads, **options)
    else:
        # fullgraph: a break would bring back the per-call host cost this choice exists to remove.
        model.predict = torch.compile(model.predict, fullgraph=True, **_transformer_options(options))
        model.backbone[1].compile(**options)  # the position encoding, once per level
    # The graph of "transformer" takes every level's maps: sizes of different levels that happen to be equal
    # when it is first compiled (a square image's levels, the batch size and a small level's height) must stay
    # separate symbols, or the next size that breaks the coincidence recompiles the whole transformer; so must a
    # square image's height and width for the compiled backbone. Read when a graph is compiled, at its first
    # call; process-wide, so set here for every choice (per-layer graphs with an eager backbone keep torch's
    # default).
    torch.fx.experimental._config.use_duck_shape = regions == "layers" and backbone != "dynamic"
    if backbone == "static":
        model.features = torch.compile(model.features, **{**options, "dynamic": False})
        _allow_graphs_per_function(STATIC_BACKBONE_GRAPHS)
    elif backbone == "dynamic":
        # Without the mode: its kernels launched by Inductor's wrapper, not recorded (see BACKBONE_CHOICES).
        model.features = torch.compile(model.features, dynamic=True, backend=backend)
    if criterion is not None:
        # Five hundred small launches forward and backward, between the matching and the backward: with
        # the GPU waiting on the matching's host sync there, their host time is the step's.
        criterion.stacked_losses = torch.compile(criterion.stacked_losses, dynamic=True, backend=backend)
    log.info("torch.compile (backend %s, mode %s, dynamic shapes) of %s%s%s; the first steps of training "
             "and of evaluation include the compilation", backend, mode,
             "the transformer's layers and the prediction heads" if regions == "layers"
             else "the transformer with its prediction heads, the position encoding",
             ", the losses" if criterion is not None else "",
             {"eager": "", "static": ", the backbone with its projections (one graph per image size)",
              "dynamic": ", the backbone with its projections (no CUDA graphs)"}[backbone])
    return model


def size_warning(mode: str, pad_to_multiple: int, backbone: str = "eager") -> str | None:
    """Why a multi-scale recipe's image sizes would defeat ``mode`` or ``backbone``, or None."""
    problems = []
    if backbone == "static" and pad_to_multiple < 128:
        # COCO, batch 2: 242 padded sizes per epoch at 32, 66 at 64, 24 at 128 (bench/e2e_steptime.shapes_per_epoch).
        problems.append(
            f"compile_backbone=static with dataset.pad_to_multiple={pad_to_multiple}: unless every image has the same "
            "size, the multi-scale recipe meets many sizes (a COCO epoch: 66 at 64, 242 at 32), and each new size "
            f"compiles the backbone again (about 20 s on an H200; after {STATIC_BACKBONE_GRAPHS} sizes it runs eager). "
            "Set dataset.pad_to_multiple=128 (24 sizes in a COCO epoch) or compile_backbone=eager")
    if mode == "reduce-overhead" and pad_to_multiple < 32:
        problems.append(
            f"compile_mode=reduce-overhead with dataset.pad_to_multiple={pad_to_multiple}: almost every batch of the "
            "multi-scale recipe has a new size, and each new size costs a warm-up step and a CUDA-graph recording. "
            "Set dataset.pad_to_multiple=128 (24 sizes in a COCO epoch) or compile_mode=default")
    return "; ".join(problems) or None


def _allow_graphs_per_function(graphs: int) -> None:
    """Dynamo's recompile limit (process-wide) raised to at least ``graphs``."""
    if getattr(torch._dynamo.config, RECOMPILE_LIMIT) < graphs:
        setattr(torch._dynamo.config, RECOMPILE_LIMIT, graphs)


def _transformer_options(options: dict) -> dict:
    """torch.compile's arguments for the whole transformer: with Inductor, its tiling coalescing analysis off,
    for this graph only. Meant for static shapes, it failed an assertion comparing two size hints of one fused
    node on this graph (torch 2.11), and the compile died. Inductor takes a mode or options, not both:
    reduce-overhead is its CUDA-graph option."""
    if options["backend"] != "inductor" or not hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"):
        return options
    inductor = {"triton.coalesce_tiling_analysis": False}
    if options.get("mode") == "reduce-overhead":
        inductor["triton.cudagraphs"] = True
    return {**{k: v for k, v in options.items() if k != "mode"}, "options": inductor}


def _new_cuda_graph_step(module, args) -> None:
    # The graph trees reuse a replay's output memory at the next step; telling them where a step starts
    # lets each compiled region be replayed several times per model call (the layers, the position encoding
    # once per level) without a live output being overwritten.
    torch.compiler.cudagraph_mark_step_begin()
