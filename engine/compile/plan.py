"""The ``compile`` settings as a plan for this device (``resolve_compile``), applied to the regions a model declares
(``compile_model``; ``CompilePlan.describe`` names them); configs/train.yaml explains each setting. Training regions
have symbolic sizes unless the backbone is static. State_dict keys are unchanged: checkpoints load anywhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch._dynamo.config
import torch._inductor.config  # hasattr below
import torch.fx.experimental._config  # use_duck_shape, set below

from engine.config.choices import (
    COMPILE_MODES,
    DEFAULT_REGIONS,
    INDUCTOR_KEYS,
    INDUCTOR_MODES,
    REGION_CHOICES,
    TRAIN_BACKBONE_CHOICES,
)
from models.compiled_regions import Region

log = logging.getLogger(__name__)

# compile.mode=auto on a GPU compiles with Inductor from this many training steps per process: below, its compilation
# costs more than it saves over the eager model's CUDA graphs (bench/results/ttr_h200.md).
STEPS_TO_COMPILE = 35000
# compile.regions=null compiles the transformer a layer at a time (quicker to compile) from this many images per
# forward pass; below, the GPU would wait for each compiled call's hundreds of microseconds on the host: one graph.
LAYERS_FROM_BATCH = 16
# Dynamo's recompile limit (graphs per function before it falls back to eager; cache_size_limit before torch renamed
# it), raised process-wide for the per-size graphs of a static backbone and of evaluation.
STATIC_BACKBONE_GRAPHS = 64
RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
# compile.evaluation=null compiles evaluation from this many evaluation batches per process in the run: a graph costs
# tens of seconds per evaluation size to compile and saves milliseconds per batch.
EVALUATION_BATCHES_TO_COMPILE = 1000


@dataclass(frozen=True)
class CompilePlan:
    """What this run compiles, the ``compile`` settings resolved for its device (``resolve_compile``)."""

    mode: str = "reduce-overhead"  # one of COMPILE_MODES
    regions: str = DEFAULT_REGIONS  # one of REGION_CHOICES
    backbone: str = "dynamic"  # one of TRAIN_BACKBONE_CHOICES
    backend: str = "inductor"  # torch.compile's backend, or a backend callable (tests)
    evaluation: bool = False  # DeformableDETR.detect compiled, one graph per evaluation size

    @property
    def cuda_graphs(self) -> bool:
        return self.mode in ("reduce-overhead", "graphs")

    @property
    def inductor(self) -> bool:
        return self.mode in INDUCTOR_MODES

    def per_size_work(self, *, training: bool = True) -> str | None:
        """What this plan builds again for each new input size (None: nothing), which the size buckets bound and a
        run without them (dataset.size_buckets=0) pays for every padded size it meets."""
        if not self.inductor:
            return "records CUDA graphs" if training or self.evaluation else None
        compiled = self.compiled_per_size(training=training)
        work = [f"compiles {' and '.join(compiled)}"] if compiled else []
        if self.cuda_graphs and (training or self.evaluation):  # the CUDA-graph trees record each size they meet
            work.append("records CUDA graphs")
        return " and ".join(work) or None

    def compiled_per_size(self, *, training: bool = True) -> list[str]:
        """The regions Inductor compiles again for each new input size."""
        return (["the backbone"] if training and self.backbone == "static" else []) + (
            ["evaluation's graph"] if self.evaluation else []
        )

    def describe(self, *, losses: bool = True) -> str:
        if not self.inductor:
            return (
                "CUDA graphs of the eager model (training"
                + (", the losses" if losses else "")
                + (", evaluation" if self.evaluation else "")
                + "), recorded once per size; nothing compiled"
            )
        parts = [
            "the transformer's layers and the heads" if self.regions == "layers" else "the transformer with its heads",
            "the position encoding",
        ]
        backbone = {"dynamic": ["the backbone"], "static": ["the backbone (a graph per size)"], "eager": []}
        parts += backbone[self.backbone]
        if losses:
            parts.append("the losses")
        if self.evaluation:
            parts.append("evaluation (a graph per size)")
        graphs = ", replayed as CUDA graphs" if self.cuda_graphs else ""
        return f"torch.compile ({self.backend}{graphs}) of {', '.join(parts)}"


def resolve_compile(
    cfg_compile, *, device: torch.device, evaluation_batches: int = 0, training_steps: int = 0, pass_batch: int = 0
) -> CompilePlan | None:
    """The plan for the ``compile`` group on ``device``, or None for eager; ValueError naming the keys of settings
    that cannot work on this device. This process's ``evaluation_batches`` decide compile.evaluation=null, its
    ``training_steps`` auto's choice on a GPU, and the images of one training pass (``pass_batch``) regions=null."""
    mode = str(cfg_compile.mode)
    if mode == "eager":
        return None
    inductor_keys = [
        f"compile.{key}={getattr(cfg_compile, key)}" for key in INDUCTOR_KEYS if getattr(cfg_compile, key) is not None
    ]
    if mode == "auto":
        if device.type != "cuda":
            chosen = inductor_keys + (
                [f"compile.evaluation={cfg_compile.evaluation}"] if cfg_compile.evaluation is not None else []
            )
            if chosen:
                raise ValueError(
                    f"{', '.join(chosen)} does nothing here: compile.mode=auto compiles on a GPU only "
                    f"and this run is on {device}; set compile.mode=default to compile on the CPU"
                )
            return None
        mode = "reduce-overhead" if inductor_keys or training_steps >= STEPS_TO_COMPILE else "graphs"
    if mode in ("reduce-overhead", "graphs") and device.type != "cuda":
        raise ValueError(
            f"compile.mode={mode} replays CUDA graphs and needs a GPU, but this run is on "
            f"{device}; set compile.mode=default (or device=cuda)"
        )
    evaluation = cfg_compile.evaluation
    if mode == "graphs":  # recording an evaluation size costs about a second: always worth it
        return CompilePlan(mode=mode, evaluation=True if evaluation is None else bool(evaluation))
    if evaluation is None:
        evaluation = evaluation_batches >= EVALUATION_BATCHES_TO_COMPILE
    regions = cfg_compile.regions or ("layers" if pass_batch >= LAYERS_FROM_BATCH else DEFAULT_REGIONS)
    return CompilePlan(
        mode=mode,
        regions=str(regions),
        backbone=str(cfg_compile.backbone or "dynamic"),
        backend=cfg_compile.backend or "inductor",
        evaluation=bool(evaluation),
    )


def compile_model(model: torch.nn.Module, plan: CompilePlan, *, criterion: torch.nn.Module | None = None):
    """Compile in place the regions ``model`` (a DeformableDETR) and ``criterion`` (training) declare; returns model."""
    if plan.mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {plan.mode!r}")
    if plan.mode == "graphs":
        from .cuda_graphs import graph_regions

        graph_regions(model, model.compile_regions(graphs=True, evaluation=plan.evaluation), pool_per_region=False)
        if criterion is not None:
            graph_regions(criterion, criterion.compile_regions(graphs=True), pool_per_region=True)
        log.info("%s", plan.describe(losses=criterion is not None))
        return model
    if plan.cuda_graphs and plan.backend != "inductor":
        raise ValueError(f"compile mode {plan.mode!r} needs the inductor backend, got backend {plan.backend!r}")
    if plan.backbone not in TRAIN_BACKBONE_CHOICES:
        raise ValueError(f"backbone must be one of {TRAIN_BACKBONE_CHOICES}, got {plan.backbone!r}")
    if plan.regions not in REGION_CHOICES:
        raise ValueError(f"regions must be one of {REGION_CHOICES}, got {plan.regions!r}")
    if plan.cuda_graphs:
        model.register_forward_pre_hook(_new_cuda_graph_step)
    # Sizes equal at the transformer's first compile (a square image's sides) must stay separate symbols, or the next
    # size recompiles it; per-layer graphs keep torch's default, which compiles faster. Process-wide.
    torch.fx.experimental._config.use_duck_shape = plan.regions == "layers"
    # The model's floats (dropout rates, epsilons) as graph constants: symbolic, they were specialized mid-compile,
    # which traced the transformer twice. Process-wide.
    torch._dynamo.config.specialize_float = True
    limit = getattr(torch._dynamo.config, RECOMPILE_LIMIT)
    if (plan.backbone == "static" or plan.evaluation) and limit < STATIC_BACKBONE_GRAPHS:
        setattr(torch._dynamo.config, RECOMPILE_LIMIT, STATIC_BACKBONE_GRAPHS)
    for region in model.compile_regions(regions=plan.regions, backbone=plan.backbone, evaluation=plan.evaluation):
        _compile_region(model, region, plan)
    if criterion is not None:
        for region in criterion.compile_regions():
            _compile_region(criterion, region, plan)
    compiling_steps = (
        "the first step of each new size"
        if plan.compiled_per_size(training=criterion is not None)
        else "the first step"
    )
    log.info("%s; %s includes its compilation", plan.describe(losses=criterion is not None), compiling_steps)
    return model


def _compile_region(owner: torch.nn.Module, region: Region, plan: CompilePlan) -> None:
    options = _options(region, plan)
    if not region.method:
        owner.get_submodule(region.name).compile(**options)
        return
    compiled = torch.compile(getattr(owner, region.name), **options)
    if region.starts_step and plan.cuda_graphs:
        compiled = _starting_a_step(compiled)
    owner.use_compiled(region.name, compiled)


def _options(region: Region, plan: CompilePlan) -> dict:
    """torch.compile's arguments for one region (Inductor takes a mode or options, not both). With symbolic sizes,
    the tiling coalescing analysis is off for a whole graph (it can fail an assertion on its size hints), and
    mixed-order reduction fusion skips its size thresholds, whose guards on the token count would recompile."""
    options = {"backend": plan.backend, "dynamic": not region.static_sizes, "fullgraph": region.whole}
    inductor = {}
    triton_options = torch._inductor.config.triton
    if plan.backend == "inductor" and not region.static_sizes:
        if region.whole and hasattr(triton_options, "coalesce_tiling_analysis"):
            inductor["triton.coalesce_tiling_analysis"] = False
        if hasattr(triton_options, "mix_order_reduction_non_strict_mode"):
            inductor["triton.mix_order_reduction_non_strict_mode"] = True
        if inductor and plan.cuda_graphs:
            inductor["triton.cudagraphs"] = True
    if inductor:
        options["options"] = inductor
    elif plan.cuda_graphs:
        options["mode"] = "reduce-overhead"
    return options


def _starting_a_step(compiled):
    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return call


def _new_cuda_graph_step(module, args) -> None:
    # The graph trees reuse a replay's outputs' memory at the next step: marking the step's start lets a region
    # replay several times per model call (the layers) without overwriting a live output.
    torch.compiler.cudagraph_mark_step_begin()
