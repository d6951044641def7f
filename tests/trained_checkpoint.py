"""A checkpoint as train.py writes one, of a tiny model with non-trivial weights, made without training: for
the tests of what runs a trained model (predict.py, export.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from engine.config.registry import plain_config
from models import build_model
from models.deformable_attention import MSDeformAttn

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = {1: "circle", 2: "square", 3: "triangle"}
TINY_MODEL = [
    "model=tiny",
    "model.hidden_dim=32",
    "model.nheads=2",
    "model.enc_layers=1",
    "model.dec_layers=2",
    "model.dim_feedforward=64",
    "model.num_queries=12",
    "model.num_feature_levels=3",
    "model.num_classes=4",
    "model.msda=pytorch",
    "dataset.val_size=96",
    "dataset.max_size=128",
]


def write_checkpoint(path: Path, *, seed: int = 0, extra: tuple[str, ...] = ()) -> Path:
    """A tiny model's checkpoint at ``path``: its config, CATEGORIES and weights drawn from ``seed`` with
    sampling offsets and class biases spread as in a trained model, so that detections vary between images."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*TINY_MODEL, *extra])
    torch.manual_seed(seed)
    model, _, _ = build_model(cfg.model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MSDeformAttn):
                module.sampling_offsets.weight.normal_(0, 0.05)
                module.attention_weights.weight.normal_(0, 0.05)
        for head in model.class_embed:
            head.bias.normal_(0, 1.0)
    torch.save(
        {
            "model": model.state_dict(),
            "config": plain_config(cfg),
            "categories": dict(CATEGORIES),
            "epoch": 1,
            "step": 10,
        },
        path,
    )
    return path
