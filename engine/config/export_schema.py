"""The typed config of export.py (configs/export.yaml explains each setting, ``msda_node`` per format among them);
``ExportConfig.__post_init__`` refuses the combinations that cannot work."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from models.model_config import ModelConfig

from .choices import DEVICE, CheckpointWeights
from .run_files import named_checkpoint

ExportFormat = StrEnum("ExportFormat", {name: name for name in ("onnx", "aoti")})
ExportDtype = StrEnum("ExportDtype", {name: name for name in ("fp32", "fp16", "bf16")})
MsdaNode = StrEnum("MsdaNode", {name: name for name in ("reference", "triton", "tensorrt")})

MIN_OPSET = 17  # the first opset with LayerNormalization; GridSample needs 16
DEFAULT_OPSET = 18  # the opset torch.onnx's exporter builds the graph at; others are converted from it
# The newest opset torch.onnx declares it exports (torch.onnx._constants.ONNX_MAX_OPSET), and the newest tested: every
# opset from MIN_OPSET to here writes a file that onnx's checker and onnxruntime take (tests/test_export.py).
MAX_OPSET = 23
SIDE_MULTIPLE = 32  # the backbone's largest stride: padded batches' and exported graphs' sides are multiples of it
SUFFIXES = {ExportFormat.onnx: ".onnx", ExportFormat.aoti: ".pt2"}


@dataclass
class ToleranceConfig:
    """The largest absolute differences the parity check accepts (null: engine/export/parity.py's dtype default);
    ``boxes`` in normalized coordinates, for raw and post-processed outputs alike."""

    logits: Optional[float] = None
    boxes: Optional[float] = None


@dataclass
class ExportConfig:
    """Settings of ``python export.py`` (configs/export.yaml explains each)."""

    model: ModelConfig = MISSING
    checkpoint: str = MISSING
    checkpoint_weights: CheckpointWeights = CheckpointWeights.ema
    format: ExportFormat = ExportFormat.onnx
    output: Optional[str] = None
    device: str = "auto"
    dtype: ExportDtype = ExportDtype.fp32
    image_size: Optional[list[int]] = None
    batch_size: int = 2
    dynamic: bool = True
    postprocess: bool = False
    max_detections: int = 100
    opset: int = DEFAULT_OPSET
    msda_node: Optional[MsdaNode] = None
    tolerance: ToleranceConfig = field(default_factory=ToleranceConfig)
    quick_compile: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.image_size is not None and (
            len(self.image_size) != 2 or any(side < SIDE_MULTIPLE or side % SIDE_MULTIPLE for side in self.image_size)
        ):
            problems.append(
                f"image_size must be null (the checkpoint's evaluation size) or [height, width], "
                f"each a multiple of {SIDE_MULTIPLE}, got {list(self.image_size)!r}"
            )
        if self.batch_size < 1:
            problems.append(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        elif self.dynamic and self.batch_size < 2:
            problems.append(
                "batch_size must be >= 2 with dynamic=true: torch.export fixes a dimension traced at "
                f"size 1, so a sample batch of 1 would export a graph for batches of 1 only (got "
                f"{self.batch_size}; dynamic=false exports one fixed batch size)"
            )
        if self.max_detections < 1:
            problems.append(f"max_detections must be an integer >= 1, got {self.max_detections!r}")
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            problems.append(
                f"opset must be from {MIN_OPSET} to {MAX_OPSET} (the ONNX opsets this export writes and "
                f"checks; {DEFAULT_OPSET} by default), got {self.opset!r}"
            )
        for key in ("logits", "boxes"):
            value = getattr(self.tolerance, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"tolerance.{key} must be null (the dtype's default) or a number > 0, got {value!r}")
        if not DEVICE.fullmatch(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        onnx = self.format == ExportFormat.onnx
        if onnx and self.msda_node == MsdaNode.triton:
            problems.append(
                "msda_node=triton is for format=aoti (the package calls the Triton op); an ONNX file "
                "takes msda_node=reference (any runtime) or msda_node=tensorrt (TensorRT's plugin)"
            )
        if not onnx and self.msda_node == MsdaNode.tensorrt:
            problems.append(
                "msda_node=tensorrt is for format=onnx (a node for TensorRT's plugin); an AOTInductor "
                "package takes msda_node=reference or msda_node=triton"
            )
        if onnx and self.dtype == ExportDtype.bf16:
            problems.append(
                "dtype=bf16 is for format=aoti: onnxruntime has few bfloat16 kernels and TensorRT's "
                "attention plugin takes float32 or float16; use dtype=fp16 or fp32 for ONNX"
            )
        if onnx and self.quick_compile:
            problems.append(
                "quick_compile=true is for format=aoti (it compiles the package's kernels quicker); "
                "an ONNX export compiles nothing"
            )
        if problems:
            raise ValueError("bad export settings (configs/export.yaml; fix the override): " + "; ".join(problems))


def default_output(
    *,
    checkpoint: str | Path,
    format: str,
    dtype: str = "fp32",
    msda_node: str | None = None,
    postprocess: bool = False,
    dynamic: bool = True,
    weights: str = "ema",
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Where an export goes when ``output`` is null: beside the checkpoint, named after it and tagged with each
    non-default setting, so that variants do not overwrite each other (checkpoint.fp16.tensorrt.onnx)."""
    path = named_checkpoint(checkpoint)
    tags = [
        tag
        for tag, differs in (
            (str(dtype), str(dtype) != "fp32"),
            (str(msda_node), msda_node is not None and str(msda_node) != "reference"),
            ("postprocess", postprocess),
            ("static", not dynamic),
            ("raw", str(weights) == "raw"),
            (f"opset{opset}", str(format) == "onnx" and opset != DEFAULT_OPSET),
        )
        if differs
    ]
    return path.with_name(".".join([path.stem, *tags]) + SUFFIXES[ExportFormat(str(format))])


def output_path(cfg) -> Path:
    """``cfg.output`` or, when null, default_output of its settings."""
    return Path(cfg.output) if cfg.output else default_output_of(cfg)


def default_output_of(cfg) -> Path:
    """default_output of an export config's settings."""
    return default_output(
        checkpoint=cfg.checkpoint,
        format=cfg.format,
        dtype=cfg.dtype,
        msda_node=cfg.msda_node,
        postprocess=cfg.postprocess,
        dynamic=cfg.dynamic,
        weights=cfg.checkpoint_weights,
        opset=cfg.opset,
    )


def export_directory(output: str | None, checkpoint: str) -> str:
    """configs/export.yaml's hydra.run.dir (export.log's folder): the output's folder, else the checkpoint's when it
    exists, else the temporary folder, so that a mistyped path leaves no folder behind."""
    folder = (Path(output).expanduser() if output else named_checkpoint(checkpoint)).resolve().parent
    if output or folder.is_dir():
        return str(folder)
    return str(Path(tempfile.gettempdir()) / "deformable_detr_export")
