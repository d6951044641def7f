"""The typed config: run settings and optimizer schemas, their registration with Hydra, and the check.

configs/train.yaml starts its defaults list with ``train_schema`` (TrainConfig below), and each dataset
yaml with its own schema (``/schema/dataset@dataset: NAME``), so Hydra composes into typed nodes and
rejects a bad value at composition, naming the key: ``epochs=abc``, ``optim.lr=fast``, ``amp=fp8``,
``model.msda=cuda``, an unknown key. ``register_configs()`` must run before composing (train.py calls it
on import, tests/conftest.py for the tests, bench/ before its compose).

What OmegaConf cannot check (ranges, rules between keys) is in the schemas' ``__post_init__`` methods,
beside each schema: models/model_config.py, datasets/dataset_config.py and here. ``check_config`` runs
all of them at once; train(cfg) and evaluate(cfg) call it before doing anything else.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from datasets import DATASET_SCHEMAS, DatasetConfig
from models.model_config import ModelConfig

from .compile import COMPILE_MODES, DEFAULT_REGIONS, REGION_CHOICES, TRAIN_BACKBONE_CHOICES
from .distributed import GRADIENT_SYNCS
from .precision import AMP_DTYPES

Amp = StrEnum("Amp", {name: name for name in AMP_DTYPES})  # none | bf16 | fp16, as engine/precision.py knows
CompileMode = StrEnum("CompileMode", {name: name for name in COMPILE_MODES})  # as engine/compile.py knows
CompileRegions = StrEnum("CompileRegions", {name: name for name in REGION_CHOICES})  # as engine/compile.py knows
CompileBackbone = StrEnum("CompileBackbone", {name: name for name in TRAIN_BACKBONE_CHOICES})  # as engine/compile.py
GradientSync = StrEnum("GradientSync", {name: name for name in GRADIENT_SYNCS})  # as engine/distributed.py knows
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class OptimConfig:
    """configs/optim/adamw.yaml: AdamW with the published parameter groups, StepLR, gradient clipping."""

    lr: float = MISSING
    lr_backbone: float = MISSING
    lr_backbone_names: list[str] = field(default_factory=lambda: ["backbone.0"])
    lr_linear_proj_mult: float = MISSING
    lr_linear_proj_names: list[str] = field(default_factory=lambda: ["reference_points", "sampling_offsets"])
    weight_decay: float = MISSING
    lr_drop: int = MISSING
    lr_gamma: float = MISSING
    clip_max_norm: float = MISSING

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"optim.lr must be a finite number > 0, got {self.lr!r}")
        for key in ("lr_backbone", "lr_linear_proj_mult", "weight_decay", "clip_max_norm"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"optim.{key} must be a finite number >= 0, got {value!r}")
        if self.lr_drop < 1:
            problems.append(f"optim.lr_drop must be an integer >= 1 (epochs before the lr is multiplied by "
                            f"lr_gamma; more than epochs never drops it), got {self.lr_drop!r}")
        if not (math.isfinite(self.lr_gamma) and self.lr_gamma > 0):
            problems.append(f"optim.lr_gamma must be a finite number > 0, got {self.lr_gamma!r}")
        if problems:
            raise ValueError("; ".join(problems))


# Run setting -> smallest allowed value, for the integer ones.
_INTEGER_MINIMUM = {"seed": 0, "epochs": 1, "batch_size": 1, "num_workers": 0, "eval_every": 1,
                    "checkpoint_every": 1, "log_every": 1, "eval_images": 0}


@dataclass
class TrainConfig:
    """configs/train.yaml: the run settings, and the typed groups under model, optim and dataset.

    ``dataset`` is typed by the chosen set's own schema (a subclass of DatasetConfig), which its yaml pulls in.
    """

    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    dataset: DatasetConfig = MISSING
    seed: int = MISSING
    device: str = MISSING
    epochs: int = MISSING
    max_steps: Optional[int] = None
    batch_size: int = MISSING
    num_workers: int = MISSING
    amp: Amp = MISSING
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: CompileMode = CompileMode.default
    compile_regions: CompileRegions = CompileRegions[DEFAULT_REGIONS]
    compile_backbone: CompileBackbone = CompileBackbone.eager
    eval_every: int = MISSING
    checkpoint_every: int = MISSING
    log_every: int = MISSING
    eval_images: int = 4
    eval_images_min_score: float = 0.3
    gradient_sync: GradientSync = GradientSync.allreduce
    find_unused_parameters: bool = False
    dist_timeout_s: float = 1800.0
    output_dir: Optional[str] = None
    resume: Optional[str] = None
    eval_only: bool = False
    checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        problems = [f"{key} must be an integer >= {low}, got {getattr(self, key)!r}"
                    for key, low in _INTEGER_MINIMUM.items() if getattr(self, key) < low]
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be null or an integer >= 1, got {self.max_steps!r}")
        if not 0 <= self.eval_images_min_score <= 1:
            problems.append(f"eval_images_min_score must be a number in [0, 1] (the lowest score of a detection "
                            f"drawn), got {self.eval_images_min_score!r}")
        if not self.dist_timeout_s > 0:
            problems.append(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s!r}")
        if self.compile_mode != CompileMode.default and self.compile_backend != "inductor":
            problems.append(f"compile_mode={self.compile_mode} needs compile_backend=inductor, got "
                            f"{self.compile_backend!r}")
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if problems:
            raise ValueError("bad run settings (configs/train.yaml; fix the override): " + "; ".join(problems))


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore under the names the yaml files use (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for name, schema in DATASET_SCHEMAS.items():
        store.store(group="schema/dataset", name=str(name), node=schema)


def check_config(cfg: DictConfig) -> DictConfig:
    """Apply every rule OmegaConf could not (ranges, rules between keys), raising ValueError naming the key;
    return the run's own copy of ``cfg`` (the trainer fills in what the data decides, e.g. num_classes).

    Types and allowed values were checked when the config was composed; a config composed without the
    schemas would have skipped that, so it is refused here rather than half-checked.
    """
    if OmegaConf.get_type(cfg) is not TrainConfig:
        raise TypeError("the config was composed without its schemas: call engine.config.register_configs() "
                        "before hydra.compose / @hydra.main (train.py does this on import)")
    OmegaConf.to_object(cfg)  # builds every dataclass, which runs its __post_init__ rules
    return copy.deepcopy(cfg)


def plain_config(cfg: DictConfig) -> dict:
    """The config as plain Python (strings for the enumerations), for checkpoints and json.

    A checkpoint is read back with torch.load(weights_only=True), which refuses our Enum classes.
    """
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
