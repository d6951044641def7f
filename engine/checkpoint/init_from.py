"""``model.init_from=PATH``: start a new run (epoch 0, fresh optimizer) from the weights of one of our checkpoints
or an official one. Tensors of matching name and shape are loaded; the class heads (``class_embed.*``) keep their
fresh initialization when num_classes differs; any other shape difference is a CheckpointError. Before
``build_model``, ``prepare_init_from(cfg.model)`` reads the file and puts its variant into cfg.model; after it,
``InitFrom.load_into(model)`` loads what fits and logs what was loaded, re-initialized and skipped."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import CheckpointError

from .contents import averaged_weights, model_config_for_checkpoint, model_state_dict, recorded_model_config
from .io import load_checkpoint

log = logging.getLogger(__name__)

# The variant decides which parameters exist and what the decoder computes, so it is taken from the checkpoint (as
# eval_only does).
VARIANT_KEYS = ("with_box_refine", "two_stage", "mixed_selection", "cross_attention_first")
# The sizes stay the config's: a checkpoint that does not fit them is an error, with these as the hint.
SIZE_KEYS = (
    "backbone",
    "dilation",
    "hidden_dim",
    "nheads",
    "enc_layers",
    "dec_layers",
    "dim_feedforward",
    "num_feature_levels",
    "enc_n_points",
    "dec_n_points",
    "num_queries",
    "num_queries_one2many",
    "position_embedding",
)
# Per-class outputs: class_embed.<layer>.{weight (num_classes, C), bias (num_classes,)}.
CLASS_HEAD = re.compile(r"(^|\.)class_embed\.\d+\.(weight|bias)$")
NAMES_SHOWN = 5


@dataclass
class InitReport:
    """Names of the model's tensors by what init_from did with them, and of the checkpoint's left unused."""

    loaded: list[str] = field(default_factory=list)
    reinitialized: list[str] = field(default_factory=list)  # class heads, num_classes differs
    not_in_checkpoint: list[str] = field(default_factory=list)  # keep their fresh initialization
    skipped: list[str] = field(default_factory=list)  # checkpoint tensors this model has no place for
    num_classes: tuple[int, int] | None = None  # (checkpoint's, model's) when the class heads were re-initialized


@dataclass
class InitFrom:
    """The weights read for ``model.init_from``; ``path`` None means model.init_from is not set."""

    path: Path | None = None
    state: dict | None = None  # the checkpoint's model state dict (optimizer and the rest are dropped at once)
    size_hint: str = ""  # the checkpoint's recorded sizes that differ from the config, for error messages

    def load_into(self, model: torch.nn.Module) -> InitReport | None:
        """Copy every tensor of matching name and shape into ``model`` (see the module docstring); None when
        model.init_from is not set."""
        if self.path is None:
            return None
        if self.state is None:
            raise RuntimeError(f"model.init_from={self.path}: load_into was already called (it loads once)")
        state, path = self.state, self.path
        own = model.state_dict()
        report = InitReport()
        matching, mismatched = {}, []
        for name, tensor in own.items():
            if name not in state:
                report.not_in_checkpoint.append(name)
            elif tuple(state[name].shape) == tuple(tensor.shape):
                matching[name] = state[name]
                report.loaded.append(name)
            elif CLASS_HEAD.search(name) and tuple(state[name].shape[1:]) == tuple(tensor.shape[1:]):
                report.reinitialized.append(name)  # only the class count differs
                report.num_classes = (int(state[name].shape[0]), int(tensor.shape[0]))
            else:
                mismatched.append(f"{name} {_shape(state[name])} in the checkpoint, {_shape(tensor)} in the model")
        report.skipped = [name for name in state if name not in own]
        if mismatched:
            raise CheckpointError(
                f"model.init_from={path}: {len(mismatched)} parameters have other shapes than this model's "
                f"({'; '.join(mismatched[:NAMES_SHOWN])}{'; ...' if len(mismatched) > NAMES_SHOWN else ''}). Only "
                f"the classification heads may differ (num_classes); set the model sizes (model.hidden_dim, "
                f"model.num_queries, ... or model=...) to the checkpoint's{self.size_hint}"
            )
        if not report.loaded:
            raise CheckpointError(
                f"model.init_from={path}: none of its {len(state)} tensors has a name of this "
                f"model (e.g. {list(state)[:3]}); expected a Deformable DETR checkpoint"
            )
        model.load_state_dict(matching, strict=False)
        self.state = None  # the model holds the weights now; do not keep a second copy for the whole run
        log.info(describe(report, path=path))
        return report


def prepare_init_from(cfg_model, *, weights: str = "ema") -> InitFrom:
    """Read ``cfg_model.init_from`` (None/empty: nothing to do) and set, in place so that the run's checkpoints record
    the model trained, the checkpoint's variant (recorded, else from its parameter names) and ``pretrained``=none
    where it holds a backbone. ``weights`` ("ema" or "raw", checkpoint_weights): a checkpoint's model EMA, where it
    holds one, or its trained weights."""
    path = cfg_model.get("init_from")
    if not path:
        return InitFrom()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"model.init_from must be null or the path of a checkpoint, got {path!r}")
    path = Path(path)
    ckpt = load_checkpoint(path)
    current = {k: cfg_model.get(k) for k in (*VARIANT_KEYS, *SIZE_KEYS, "pretrained")}
    wanted = model_config_for_checkpoint(current, ckpt, path=path, keys=VARIANT_KEYS)
    recorded = recorded_model_config(ckpt)
    state = model_state_dict(ckpt)
    averaged = averaged_weights(ckpt) if str(weights) == "ema" else None
    if averaged is not None:
        log.info("model.init_from=%s: the model EMA's weights (checkpoint_weights=raw for its trained ones)", path)
        state = {**state, **averaged}
    from_names = {
        "with_box_refine": any(k.startswith("transformer.decoder.bbox_embed.") for k in state),
        "two_stage": any(k.startswith("transformer.enc_output.") for k in state),
    }
    # Two-stage with a query embedding: its content (mixed query selection).
    from_names["mixed_selection"] = from_names["two_stage"] and "query_embed.weight" in state
    for key, value in from_names.items():
        if key not in recorded and wanted[key] != value:
            log.info("model.%s=%r from the parameter names in %s (config said %r)", key, value, path, wanted[key])
            wanted[key] = value
    if not any(k.startswith("backbone.") for k in state):
        wanted["pretrained"] = current["pretrained"]  # nothing replaces the configured backbone weights
    for key in (*VARIANT_KEYS, "pretrained"):
        if key in cfg_model:
            cfg_model[key] = wanted[key]
    differing = [
        f"{k}={recorded[k]!r} (config: {current[k]!r})"
        for k in SIZE_KEYS
        if k in recorded and recorded[k] != current[k]
    ]
    hint = f"; the checkpoint records {', '.join(differing)}" if differing else ""
    return InitFrom(path=path, state=state, size_hint=hint)


def describe(report: InitReport, *, path: Path) -> str:
    """One log line: what was loaded (per top-level module), re-initialized and skipped."""
    by_module = Counter(name.split(".")[0] for name in report.loaded)
    line = (
        f"init_from {path}: loaded {len(report.loaded)} tensors ({', '.join(f'{m} {n}' for m, n in by_module.items())})"
    )
    if report.reinitialized:
        line += (
            f"; re-initialized {len(report.reinitialized)} class-head tensors, num_classes "
            f"{report.num_classes[0]} -> {report.num_classes[1]} ({_names(report.reinitialized)})"
        )
    if report.not_in_checkpoint:
        line += (
            f"; {len(report.not_in_checkpoint)} model tensors not in the checkpoint keep their initialization "
            f"({_names(report.not_in_checkpoint)})"
        )
    line += f"; skipped {len(report.skipped)} checkpoint tensors not in this model"
    if report.skipped:
        line += f" ({_names(report.skipped)})"
    return line


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > NAMES_SHOWN else "")


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(str(d) for d in tensor.shape) or "scalar"
