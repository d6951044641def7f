"""The allowed values of the run settings, as tuples for the code that acts on them and as the schemas' enumerations.
Its imports stay light: the standard library and datasets' list of COCOeval backends."""

from __future__ import annotations

import re
from enum import StrEnum

from datasets.cocoeval_backend import BACKENDS as COCOEVAL_BACKENDS

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
AMP_CHOICES = ("none", "bf16", "fp16")  # autocast dtypes (engine/runtime/precision.py maps them to torch dtypes)
# Inductor's modes that a compiled run may use: plain kernels, or the same kernels replayed as CUDA graphs.
INDUCTOR_MODES = ("default", "reduce-overhead")
# Every mode that changes how the model runs: the eager model's CUDA graphs (engine/compile/cuda_graphs.py) or Inductor.
COMPILE_MODES = ("graphs", *INDUCTOR_MODES)
INDUCTOR_KEYS = ("regions", "backbone", "backend")  # the compile settings that only Inductor reads
# What one compiled graph spans (DeformableDETR.compile_regions).
REGION_CHOICES = ("layers", "transformer")
DEFAULT_REGIONS = "transformer"
# The backbone compiled as one graph for every size ("dynamic"), as one graph per size ("static"), or left eager.
TRAIN_BACKBONE_CHOICES = ("dynamic", "static", "eager")
GRADIENT_SYNCS = ("allreduce", "ddp")  # how gradients are averaged over processes (engine/runtime/distributed.py)
# The weights evaluation, predict.py and export.py take from a checkpoint (engine/checkpoint/trained_model.py).
CHECKPOINT_WEIGHTS = ("ema", "raw")

Amp = StrEnum("Amp", {name: name for name in AMP_CHOICES})
CompileMode = StrEnum("CompileMode", {name: name for name in ("auto", "eager", *COMPILE_MODES)})
CompileRegions = StrEnum("CompileRegions", {name: name for name in REGION_CHOICES})
CompileBackbone = StrEnum("CompileBackbone", {name: name for name in TRAIN_BACKBONE_CHOICES})
EvalBackend = StrEnum("EvalBackend", {name: name for name in COCOEVAL_BACKENDS})
GradientSync = StrEnum("GradientSync", {name: name for name in GRADIENT_SYNCS})
CheckpointWeights = StrEnum("CheckpointWeights", {name: name for name in CHECKPOINT_WEIGHTS})
