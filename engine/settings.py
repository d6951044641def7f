"""Checks of the run settings in configs/train.yaml, so a bad override fails at once with its name.

Hydra accepts any value for an untyped key (``epochs=abc``); without this the run would fail minutes later
with an unrelated TypeError, or after writing a dataset to disk.
"""

from __future__ import annotations

from omegaconf import DictConfig

from .precision import AMP_DTYPES

# key -> smallest allowed value, for integer settings
INTEGER_SETTINGS = {"seed": 0, "epochs": 1, "batch_size": 1, "num_workers": 0, "eval_every": 1,
                    "checkpoint_every": 1, "log_every": 1}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_run_settings(cfg: DictConfig) -> None:
    """Raise ValueError naming every run setting whose value is out of range or of the wrong type."""
    problems = []
    for key, low in INTEGER_SETTINGS.items():
        value = cfg.get(key)
        if not _is_int(value) or value < low:
            problems.append(f"{key} must be an integer >= {low}, got {value!r}")
    max_steps = cfg.get("max_steps")
    if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
        problems.append(f"max_steps must be null or an integer >= 1, got {max_steps!r}")
    if cfg.get("amp") not in AMP_DTYPES:
        problems.append(f"amp must be one of {', '.join(AMP_DTYPES)}, got {cfg.get('amp')!r}")
    for key in ("eval_only", "find_unused_parameters", "compile"):
        if not isinstance(cfg.get(key), bool):
            problems.append(f"{key} must be true or false, got {cfg.get(key)!r}")
    if not isinstance(cfg.get("compile_backend"), str) or not cfg.get("compile_backend"):
        problems.append(f"compile_backend must be a torch.compile backend name, got {cfg.get('compile_backend')!r}")
    resume = cfg.get("resume")
    if resume is not None and not isinstance(resume, str):
        problems.append(f"resume must be null, auto or a path, got {resume!r}")
    if problems:
        raise ValueError("bad run settings (configs/train.yaml; fix the override): " + "; ".join(problems))
