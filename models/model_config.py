"""Reading the model config (configs/model/*.yaml) at the edge, for build_model and build_criterion."""

from __future__ import annotations


def model_config_value(cfg, key: str, optional: dict | None = None):
    """cfg.key from a DictConfig, a dict or any object with attributes; ``optional`` gives defaults.

    A key that is neither present nor optional is a ValueError naming it, rather than an AttributeError
    from deep inside a constructor.
    """
    if hasattr(cfg, key):
        return getattr(cfg, key)
    try:
        return cfg[key]
    except (KeyError, TypeError):
        if optional and key in optional:
            return optional[key]
        raise ValueError(f"model config is missing key {key!r} (see configs/model/deformable_detr.yaml)") from None
