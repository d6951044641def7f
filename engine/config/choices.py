"""The allowed values of the run settings, as tuples and as the schemas' enumerations. Keep its imports light."""

from __future__ import annotations

import re
from enum import StrEnum

from datasets.cocoeval_backend import BACKENDS as COCOEVAL_BACKENDS

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
AMP_CHOICES = ("none", "bf16", "fp16")  # autocast dtypes (engine/runtime/precision.py maps them to torch dtypes)
INDUCTOR_MODES = ("default", "reduce-overhead")  # Inductor's plain kernels, or the same replayed as CUDA graphs
COMPILE_MODES = ("graphs", *INDUCTOR_MODES)  # every mode but eager: the eager model's CUDA graphs, or Inductor
INDUCTOR_KEYS = ("regions", "backbone", "backend")  # the compile settings that only Inductor reads
REGION_CHOICES = ("layers", "transformer")  # what one compiled graph spans (DeformableDETR.compile_regions)
DEFAULT_REGIONS = "transformer"
TRAIN_BACKBONE_CHOICES = ("dynamic", "static", "eager")  # one graph for every size, a graph per size, or eager
GRADIENT_SYNCS = ("allreduce", "ddp")  # how gradients are averaged over processes (engine/runtime/distributed.py)
CHECKPOINT_WEIGHTS = ("ema", "raw")  # the checkpoint weights that evaluation, predict.py and export.py use

Amp = StrEnum("Amp", {name: name for name in AMP_CHOICES})
CompileMode = StrEnum("CompileMode", {name: name for name in ("auto", "eager", *COMPILE_MODES)})
CompileRegions = StrEnum("CompileRegions", {name: name for name in REGION_CHOICES})
CompileBackbone = StrEnum("CompileBackbone", {name: name for name in TRAIN_BACKBONE_CHOICES})
EvalBackend = StrEnum("EvalBackend", {name: name for name in COCOEVAL_BACKENDS})
GradientSync = StrEnum("GradientSync", {name: name for name in GRADIENT_SYNCS})
CheckpointWeights = StrEnum("CheckpointWeights", {name: name for name in CHECKPOINT_WEIGHTS})
