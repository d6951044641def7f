"""The schemas registered with Hydra (``register_configs``, before any compose) under the names the yaml files'
defaults use, so that a bad value is refused at composition naming its key; ``check_config`` runs the other rules."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import time

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from datasets import DATASET_SCHEMAS

from .export_schema import ExportConfig, export_directory
from .predict_schema import PredictConfig
from .train_schema import TrainConfig


def dated_directory(parent: str, output_dir: str | None) -> str:
    """Hydra's run (parent outputs) or ``-m`` sweep (multirun) directory: ``output_dir``, else parent/<date>/<time>."""
    return output_dir or time.strftime(f"{parent}/%Y-%m-%d/%H-%M-%S")


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore and register the run directories' resolvers (idempotent)."""
    for name, parent in (("run_dir", "outputs"), ("sweep_dir", "multirun")):
        if not OmegaConf.has_resolver(name):  # cached: one directory per process
            OmegaConf.register_new_resolver(name, functools.partial(dated_directory, parent), use_cache=True)
    if not OmegaConf.has_resolver("export_dir"):
        OmegaConf.register_new_resolver("export_dir", export_directory)
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(name="predict_schema", node=PredictConfig)
    store.store(name="export_schema", node=ExportConfig)
    for name, schema in DATASET_SCHEMAS.items():
        store.store(group="schema/dataset", name=str(name), node=schema)


def check_config(cfg: DictConfig, schema: type | None = None) -> DictConfig:
    """``cfg`` after the rules OmegaConf could not apply (ranges, rules between keys, unknown keys): ValueError naming
    the key; TypeError if ``cfg`` was composed without ``schema`` (default TrainConfig), its types then unchecked."""
    _checked(cfg, schema)
    return cfg


def check_and_freeze(cfg: DictConfig, schema: type | None = None):
    """A settled config's one check (``check_config``), then read-only: the typed object the check built (a
    ``schema`` instance, TrainConfig by default), whose parts the run builds from without checking them again."""
    checked = _checked(cfg, schema)
    OmegaConf.set_readonly(cfg, True)
    return checked


def _checked(cfg: DictConfig, schema: type | None):
    if OmegaConf.get_type(cfg) is not (schema or TrainConfig):
        raise TypeError(
            "the config was composed without its schemas: call engine.config.registry.register_configs() "
            "before hydra.compose / @hydra.main (train.py, predict.py and export.py do this on import)"
        )
    if unknown := unknown_keys(cfg):
        raise ValueError("unknown settings (an override with '+' adds a key that nothing reads): " + "; ".join(unknown))
    return OmegaConf.to_object(cfg)  # builds every dataclass, which runs its __post_init__ rules


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """The keys of ``node`` and its groups that their schema lacks (added with ``+key=``), with the closest names."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    known = [f.name for f in dataclasses.fields(schema)]
    problems = []
    for key in node:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            problems.append(f"{prefix}{key} is not a setting{hint}")
        elif isinstance(node._get_node(key), DictConfig):
            problems += unknown_keys(node[key], f"{prefix}{key}.")
    return problems


def plain_config(cfg: DictConfig) -> dict:
    """The config as plain Python, enumerations as strings (torch.load(weights_only=True) refuses our Enums)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
