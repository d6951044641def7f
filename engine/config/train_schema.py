"""The schema of configs/train.yaml, with the rules OmegaConf cannot check in ``__post_init__``. A setting's role for
a resume is its field's ``metadata["role"]`` (here and in the model and dataset schemas; a group's covers its keys),
read by ``role_of``: HOW_TO_RUN (a resume may change it and a checkpoint never imposes it), LENGTH (a resume may
extend it), INVOCATION (never compared), and by default IDENTITY (another value is another experiment)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, get_type_hints

from omegaconf import MISSING

from datasets import DatasetConfig
from models.model_config import ModelConfig

from .choices import (
    DEVICE,
    INDUCTOR_KEYS,
    Amp,
    CheckpointWeights,
    CompileBackbone,
    CompileMode,
    CompileRegions,
    EvalBackend,
    GradientSync,
)

HOW_TO_RUN, LENGTH, INVOCATION, IDENTITY = "how_to_run", "length", "invocation", "identity"


def _role(role: str, default: Any = dataclasses.MISSING, **kwargs) -> Any:
    return field(default=default, metadata={"role": role}, **kwargs)


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
            problems.append(
                f"optim.lr_drop must be an integer >= 1 (epochs before the lr is multiplied by "
                f"lr_gamma; more than epochs never drops it), got {self.lr_drop!r}"
            )
        if not (math.isfinite(self.lr_gamma) and self.lr_gamma > 0):
            problems.append(f"optim.lr_gamma must be a finite number > 0, got {self.lr_gamma!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class CompileConfig:
    """configs/train.yaml's ``compile`` group (engine/compile/plan.py applies it); null: the mode's default."""

    mode: CompileMode = CompileMode.auto
    regions: Optional[CompileRegions] = None
    backbone: Optional[CompileBackbone] = None
    backend: Optional[str] = None
    evaluation: Optional[bool] = None
    cache_dir: str = "~/.cache/deformable_detr/compile"

    def __post_init__(self) -> None:
        problems = []
        chosen = {key: getattr(self, key) for key in (*INDUCTOR_KEYS, "evaluation") if getattr(self, key) is not None}
        if self.mode == CompileMode.eager and chosen:
            problems += [
                f"compile.{key}={value} does nothing with compile.mode=eager (drop it, or choose a compiled "
                f"mode: compile.mode=auto|default|reduce-overhead)"
                for key, value in chosen.items()
            ]
        if self.mode == CompileMode.graphs:
            problems += [
                f"compile.{key}={value} does nothing with compile.mode=graphs, which compiles nothing (drop "
                f"it, or compile: compile.mode=reduce-overhead)"
                for key, value in chosen.items()
                if key in INDUCTOR_KEYS
            ]
        if self.mode in (CompileMode.auto, CompileMode["reduce-overhead"]) and self.backend not in (None, "inductor"):
            problems.append(
                f"compile.mode={self.mode} replays CUDA graphs, which need compile.backend=inductor; got "
                f"compile.backend={self.backend} (set compile.mode=default to use another backend)"
            )
        if not self.cache_dir:
            problems.append("compile.cache_dir must be a directory path")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class EmaConfig:
    """configs/train.yaml's ``ema`` group, explained there: model EMA (engine/train/hooks/ema.py)."""

    decay: Optional[float] = None
    warmup_steps: int = 2000

    def __post_init__(self) -> None:
        problems = []
        if self.decay is not None and not 0 < self.decay < 1:
            problems.append(f"ema.decay must be null (no EMA) or a number in (0, 1), e.g. 0.9998, got {self.decay!r}")
        if self.warmup_steps < 1:
            problems.append(f"ema.warmup_steps must be an integer >= 1, got {self.warmup_steps!r}")
        if problems:
            raise ValueError("; ".join(problems))


# Run setting -> smallest allowed value, for the integer ones.
_INTEGER_MINIMUM = {
    "seed": 0,
    "epochs": 1,
    "batch_size": 1,
    "num_workers": 0,
    "eval_every": 1,
    "checkpoint_every": 1,
    "log_every": 1,
    "eval_images": 0,
}


@dataclass
class TrainConfig:
    """configs/train.yaml; ``dataset`` is typed by the chosen set's schema (a DatasetConfig) that its yaml pulls in."""

    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    dataset: DatasetConfig = MISSING
    seed: int = MISSING
    device: str = _role(HOW_TO_RUN, MISSING)
    epochs: int = _role(LENGTH, MISSING)
    max_steps: Optional[int] = _role(LENGTH, None)
    batch_size: int = MISSING
    total_batch_size: Optional[int] = None
    num_workers: int = _role(HOW_TO_RUN, MISSING)
    amp: Amp = _role(HOW_TO_RUN, MISSING)
    compile: CompileConfig = _role(HOW_TO_RUN, default_factory=CompileConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    eval_every: int = _role(HOW_TO_RUN, MISSING)
    checkpoint_every: int = _role(HOW_TO_RUN, MISSING)
    checkpoint_minutes: Optional[float] = _role(HOW_TO_RUN, 30.0)
    log_every: int = _role(HOW_TO_RUN, MISSING)
    eval_images: int = _role(HOW_TO_RUN, 4)
    eval_images_min_score: float = _role(HOW_TO_RUN, 0.3)
    eval_backend: EvalBackend = _role(HOW_TO_RUN, EvalBackend.auto)
    gradient_sync: GradientSync = _role(HOW_TO_RUN, GradientSync.allreduce)
    find_unused_parameters: bool = _role(HOW_TO_RUN, False)
    dist_timeout_s: float = _role(HOW_TO_RUN, 1800.0)
    profile_steps: Optional[list[int]] = _role(HOW_TO_RUN, None)
    output_dir: Optional[str] = _role(INVOCATION, None)
    resume: Optional[str] = _role(INVOCATION, None)
    eval_only: bool = _role(INVOCATION, False)
    checkpoint: Optional[str] = _role(INVOCATION, None)
    checkpoint_weights: CheckpointWeights = _role(INVOCATION, CheckpointWeights.ema)

    def __post_init__(self) -> None:
        problems = [
            f"{key} must be an integer >= {low}, got {getattr(self, key)!r}"
            for key, low in _INTEGER_MINIMUM.items()
            if getattr(self, key) < low
        ]
        if self.total_batch_size is not None and self.total_batch_size < 1:
            problems.append(
                f"total_batch_size must be null (batch_size per process) or an integer >= 1, got "
                f"{self.total_batch_size!r}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be null or an integer >= 1, got {self.max_steps!r}")
        if not 0 <= self.eval_images_min_score <= 1:
            problems.append(
                f"eval_images_min_score must be a number in [0, 1] (the lowest score of a detection "
                f"drawn), got {self.eval_images_min_score!r}"
            )
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            problems.append(
                f"checkpoint_minutes must be > 0 or null (only at epoch ends), got {self.checkpoint_minutes!r}"
            )
        if not self.dist_timeout_s > 0:
            problems.append(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s!r}")
        if self.profile_steps is not None and not (
            len(self.profile_steps) == 2 and 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            problems.append(
                f"profile_steps must be null or [FIRST,LAST], optimizer steps counted from 1 with "
                f"FIRST <= LAST, got {self.profile_steps!r}"
            )
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if problems:
            raise ValueError("bad run settings (configs/train.yaml; fix the override): " + "; ".join(problems))


def role_of(key: str, schema: type = TrainConfig) -> str:
    """The role of the dotted setting ``key`` (e.g. "compile.mode"): that of its nearest field with one, from
    TrainConfig down; IDENTITY where none has one, or the key is unknown (a checkpoint's from another version)."""
    head, _, rest = key.partition(".")
    spec = {f.name: f for f in dataclasses.fields(schema)}.get(head)
    if spec is None:
        return IDENTITY
    if "role" in spec.metadata:
        return spec.metadata["role"]
    inner = get_type_hints(schema).get(head)
    return role_of(rest, inner) if rest and dataclasses.is_dataclass(inner) else IDENTITY


# Top-level keys of the compile settings before they became the ``compile`` group, as checkpoints recorded them.
LEGACY_COMPILE_KEYS = {
    "compile_mode": "mode",
    "compile_regions": "regions",
    "compile_backbone": "backbone",
    "compile_backend": "backend",
}


# Model settings added since checkpoints first recorded their config, with the value a recorded model had: off.
MODEL_KEYS_ADDED_OFF = {
    "mixed_selection": False,
    "look_forward_twice": False,
    "cross_attention_first": False,
    "cls_loss_coef_one2many": None,
}


def upgrade_recorded_config(recorded: dict) -> dict:
    """A checkpoint's recorded config in this version's layout, so a resume compares like with like: old compile
    settings (``compile: bool``, LEGACY_COMPILE_KEYS) as the ``compile`` group; model.hybrid_matching (true: hybrid)
    as model.one_to_many, none if absent; the model keys added since (MODEL_KEYS_ADDED_OFF) off if absent."""
    if not isinstance(recorded, dict):
        return recorded
    upgraded = dict(recorded)
    model = recorded.get("model")
    if isinstance(model, dict):
        model = {**MODEL_KEYS_ADDED_OFF, **model}
        if "one_to_many" not in model:
            model["one_to_many"] = "hybrid" if model.get("hybrid_matching") else "none"
        model.pop("hybrid_matching", None)
        upgraded["model"] = model
    if isinstance(recorded.get("compile"), dict):
        return upgraded
    upgraded = {k: v for k, v in upgraded.items() if k != "compile" and k not in LEGACY_COMPILE_KEYS}
    group = {"mode": "eager"}
    if recorded.get("compile"):
        group = {new: recorded[old] for old, new in LEGACY_COMPILE_KEYS.items() if old in recorded}
        group.setdefault("mode", "default")
    upgraded["compile"] = group
    return upgraded
