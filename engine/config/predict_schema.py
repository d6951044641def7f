"""The typed config of predict.py (configs/predict.yaml): which checkpoint, which images, what to write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from models.model_config import ModelConfig

from .choices import DEVICE, Amp, CheckpointWeights, EvalBackend


@dataclass
class PredictConfig:
    """Settings of ``python predict.py`` (configs/predict.yaml explains each)."""

    model: ModelConfig = MISSING
    checkpoint: str = MISSING
    checkpoint_weights: CheckpointWeights = CheckpointWeights.ema
    images: str = MISSING
    annotations: Optional[str] = None
    output_dir: Optional[str] = None
    score_threshold: float = 0.3
    max_detections: int = 100
    image_size: Optional[int] = None
    max_size: Optional[int] = None
    draw: bool = True
    batch_size: int = 4
    num_workers: int = 2
    device: str = "auto"
    amp: Amp = Amp.bf16
    eval_backend: EvalBackend = EvalBackend.auto

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.score_threshold <= 1:
            problems.append(f"score_threshold must be a number in [0, 1], got {self.score_threshold!r}")
        for key, low in (("max_detections", 1), ("batch_size", 1), ("num_workers", 0)):
            if getattr(self, key) < low:
                problems.append(f"{key} must be an integer >= {low}, got {getattr(self, key)!r}")
        for key in ("image_size", "max_size"):
            value = getattr(self, key)
            if value is not None and value < 32:
                problems.append(f"{key} must be null (the checkpoint's) or an integer >= 32, got {value!r}")
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if problems:
            raise ValueError("bad predict settings (configs/predict.yaml; fix the override): " + "; ".join(problems))
