"""The typed config: run settings and optimizer schemas, their registration with Hydra, and the check.

configs/train.yaml starts its defaults list with ``train_schema`` (TrainConfig below), and each dataset
yaml with its own schema (``/schema/dataset@dataset: NAME``), so Hydra composes into typed nodes and
rejects a bad value at composition, naming the key: ``epochs=abc``, ``optim.lr=fast``, ``amp=fp8``,
``model.msda=cuda``, an unknown key. ``register_configs()`` must run before composing (train.py calls it
on import, tests/conftest.py for the tests, bench/ before its compose).

What OmegaConf cannot check (ranges, rules between keys) is in the schemas' ``__post_init__`` methods,
beside each schema: models/model_config.py, datasets/dataset_config.py and here. ``check_config`` runs
all of them at once; train(cfg) and evaluate(cfg) call it before doing anything else.

Each setting has a role for a resumed run, in its field's metadata (``{"role": ...}``, here and in the
model and dataset schemas; a group's role covers its keys): ``how_to_run`` (device, precision, compilation,
loading, intervals, model.msda: a resume may change them and a checkpoint never imposes them), ``length``
(epochs, max_steps: a resume may extend them), ``invocation`` (resume, output_dir ...: about this command,
never compared), and, by default, what was trained (another value is another experiment).
``keys_with_role`` reads them: engine/resume.py and engine/checkpoint.py derive their lists from it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from datasets import DATASET_SCHEMAS, DatasetConfig
from datasets.cocoeval_backend import BACKENDS as COCOEVAL_BACKENDS
from models.model_config import ModelConfig

from .compile import COMPILE_MODES, INDUCTOR_KEYS, REGION_CHOICES, TRAIN_BACKBONE_CHOICES
from .distributed import GRADIENT_SYNCS
from .precision import AMP_DTYPES

Amp = StrEnum("Amp", {name: name for name in AMP_DTYPES})  # none | bf16 | fp16, as engine/precision.py knows
# auto | eager, then the modes engine/compile.py knows
CompileMode = StrEnum("CompileMode", {name: name for name in ("auto", "eager", *COMPILE_MODES)})
CompileRegions = StrEnum("CompileRegions", {name: name for name in REGION_CHOICES})  # as engine/compile.py knows
CompileBackbone = StrEnum("CompileBackbone", {name: name for name in TRAIN_BACKBONE_CHOICES})  # as engine/compile.py
EvalBackend = StrEnum("EvalBackend", {name: name for name in COCOEVAL_BACKENDS})  # as datasets/cocoeval_backend.py
GradientSync = StrEnum("GradientSync", {name: name for name in GRADIENT_SYNCS})  # as engine/distributed.py knows
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

# Roles of settings (the module docstring); the default role is what was trained.
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
            problems.append(f"optim.lr_drop must be an integer >= 1 (epochs before the lr is multiplied by "
                            f"lr_gamma; more than epochs never drops it), got {self.lr_drop!r}")
        if not (math.isfinite(self.lr_gamma) and self.lr_gamma > 0):
            problems.append(f"optim.lr_gamma must be a finite number > 0, got {self.lr_gamma!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class CompileConfig:
    """configs/train.yaml's ``compile`` group: torch.compile of the model (engine/compile.py).

    mode        auto: on a GPU the eager model's CUDA graphs for a short run, compiled with CUDA graphs for a long
                one (engine.compile.STEPS_TO_COMPILE); eager on the CPU | eager | graphs (the eager model
                recorded as CUDA graphs, nothing compiled) | default (compiled, no CUDA graphs) | reduce-overhead
                (compiled, replayed as CUDA graphs)
    regions     what one graph spans: transformer (the whole transformer with its heads) | layers
    backbone    static (the backbone compiled too, a graph per size bucket) | eager
    backend     torch.compile's backend (aot_eager: trace only, for debugging)
    evaluation  whether evaluation runs a compiled graph (one per evaluation size); null: when the run evaluates
                enough batches to repay the compilation (engine.compile.EVALUATION_BATCHES_TO_COMPILE)
    cache_dir   where compiled kernels and graphs are kept between runs (Inductor's, AOTAutograd's and Triton's
                caches), so that a second run or a resume skips most of the compilation
    regions, backbone and backend are null for "the mode's default" (transformer, static, inductor), and
    must stay null with mode=eager.
    """

    mode: CompileMode = CompileMode.auto
    regions: Optional[CompileRegions] = None
    backbone: Optional[CompileBackbone] = None
    backend: Optional[str] = None
    evaluation: Optional[bool] = None
    cache_dir: str = "~/.cache/deformable_detr/compile"

    def __post_init__(self) -> None:
        problems = []
        chosen = {key: getattr(self, key) for key in (*INDUCTOR_KEYS, "evaluation")
                  if getattr(self, key) is not None}
        if self.mode == CompileMode.eager and chosen:
            problems += [f"compile.{key}={value} does nothing with compile.mode=eager (drop it, or choose a compiled "
                         f"mode: compile.mode=auto|default|reduce-overhead)" for key, value in chosen.items()]
        if self.mode == CompileMode.graphs:
            problems += [f"compile.{key}={value} does nothing with compile.mode=graphs, which compiles nothing (drop "
                         f"it, or compile: compile.mode=reduce-overhead)" for key, value in chosen.items()
                         if key in INDUCTOR_KEYS]
        if self.mode in (CompileMode.auto, CompileMode["reduce-overhead"]) and self.backend not in (None, "inductor"):
            problems.append(f"compile.mode={self.mode} replays CUDA graphs, which need compile.backend=inductor; got "
                            f"compile.backend={self.backend} (set compile.mode=default to use another backend)")
        if not self.cache_dir:
            problems.append("compile.cache_dir must be a directory path")
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
    device: str = _role(HOW_TO_RUN, MISSING)
    epochs: int = _role(LENGTH, MISSING)
    max_steps: Optional[int] = _role(LENGTH, None)
    batch_size: int = MISSING
    num_workers: int = _role(HOW_TO_RUN, MISSING)
    amp: Amp = _role(HOW_TO_RUN, MISSING)
    compile: CompileConfig = _role(HOW_TO_RUN, default_factory=CompileConfig)
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
    output_dir: Optional[str] = _role(INVOCATION, None)
    resume: Optional[str] = _role(INVOCATION, None)
    eval_only: bool = _role(INVOCATION, False)
    checkpoint: Optional[str] = _role(INVOCATION, None)

    def __post_init__(self) -> None:
        problems = [f"{key} must be an integer >= {low}, got {getattr(self, key)!r}"
                    for key, low in _INTEGER_MINIMUM.items() if getattr(self, key) < low]
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be null or an integer >= 1, got {self.max_steps!r}")
        if not 0 <= self.eval_images_min_score <= 1:
            problems.append(f"eval_images_min_score must be a number in [0, 1] (the lowest score of a detection "
                            f"drawn), got {self.eval_images_min_score!r}")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            problems.append(f"checkpoint_minutes must be > 0 or null (only at epoch ends), got "
                            f"{self.checkpoint_minutes!r}")
        if not self.dist_timeout_s > 0:
            problems.append(f"dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s!r}")
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if problems:
            raise ValueError("bad run settings (configs/train.yaml; fix the override): " + "; ".join(problems))


def run_directory(output_dir: str | None) -> str:
    """Hydra's run directory (configs/train.yaml, hydra.run.dir): ``output_dir`` when set, so that it holds the
    run's train.log and .hydra/ too, else outputs/<date>/<time>."""
    return output_dir or time.strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore under the names the yaml files use, and the run directory's
    resolver (idempotent)."""
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_directory, use_cache=True)  # one directory per process
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    from .export_config import ExportConfig  # these build on this module's types
    from .predict_config import PredictConfig

    store.store(name="predict_schema", node=PredictConfig)
    store.store(name="export_schema", node=ExportConfig)
    for name, schema in DATASET_SCHEMAS.items():
        store.store(group="schema/dataset", name=str(name), node=schema)


def check_config(cfg: DictConfig, schema: type | None = None) -> DictConfig:
    """Apply every rule OmegaConf could not (ranges, rules between keys), raising ValueError naming the key;
    return the run's own copy of ``cfg`` (the trainer fills in what the data decides, e.g. num_classes).
    ``schema``: the schema ``cfg`` was composed with (default TrainConfig; PredictConfig for predict.py).

    Types and allowed values were checked when the config was composed; a config composed without the
    schemas would have skipped that, so it is refused here rather than half-checked.
    """
    if OmegaConf.get_type(cfg) is not (schema or TrainConfig):
        raise TypeError("the config was composed without its schemas: call engine.config.register_configs() "
                        "before hydra.compose / @hydra.main (train.py and predict.py do this on import)")
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError("unknown settings (an override with '+' adds a key that nothing reads): " + "; ".join(unknown))
    OmegaConf.to_object(cfg)  # builds every dataclass, which runs its __post_init__ rules
    return copy.deepcopy(cfg)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """The keys of ``node`` and its groups that their schema does not have, each with the closest known name.

    Hydra refuses a misspelt key, but ``+key=value`` adds one to a typed group, where nothing would read it.
    """
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    known = [f.name for f in dataclasses.fields(schema)]
    problems = []
    for key in node.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            problems.append(f"{prefix}{key} is not a setting{hint}")
        elif isinstance(node._get_node(key), DictConfig):
            problems += unknown_keys(node[key], f"{prefix}{key}.")
    return problems


def plain_config(cfg: DictConfig) -> dict:
    """The config as plain Python (strings for the enumerations), for checkpoints and json.

    A checkpoint is read back with torch.load(weights_only=True), which refuses our Enum classes.
    """
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def role_of(key: str, schema: type = None) -> str:
    """The role (module docstring) of the dotted setting ``key``, e.g. "compile.mode" or "model.msda": that of
    its nearest field with one, walking down from TrainConfig; IDENTITY where none has one, or the key is
    unknown (a checkpoint's key this version does not have)."""
    schema = TrainConfig if schema is None else schema
    head, _, rest = key.partition(".")
    spec = {f.name: f for f in dataclasses.fields(schema)}.get(head)
    if spec is None:
        return IDENTITY
    if "role" in spec.metadata:
        return spec.metadata["role"]
    inner = get_type_hints(schema).get(head)
    return role_of(rest, inner) if rest and dataclasses.is_dataclass(inner) else IDENTITY


# Top-level keys of the compile settings before they became the ``compile`` group, as checkpoints recorded them.
LEGACY_COMPILE_KEYS = {"compile_mode": "mode", "compile_regions": "regions", "compile_backbone": "backbone",
                       "compile_backend": "backend"}


def upgrade_recorded_config(recorded: dict) -> dict:
    """A checkpoint's recorded config in this version's layout: the compile settings of older versions
    (``compile: bool`` and compile_mode, compile_regions, compile_backbone, compile_backend) become the
    ``compile`` group, so that a resume compares like with like."""
    if not isinstance(recorded, dict) or isinstance(recorded.get("compile"), dict):
        return recorded
    upgraded = {k: v for k, v in recorded.items() if k != "compile" and k not in LEGACY_COMPILE_KEYS}
    group = {"mode": "eager"}
    if recorded.get("compile"):
        group = {new: recorded[old] for old, new in LEGACY_COMPILE_KEYS.items() if old in recorded}
        group.setdefault("mode", "default")
    upgraded["compile"] = group
    return upgraded
